package edge_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/aether"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// TestEgressMirror: a container sandbox allowed pypi gets pip's variables
// pointing at the node's mirror, and busybox wget of a file through the
// mirror (through the agent's relay and the edge's proxy, which answers
// the mirror's name itself) twice reaches the HTTPS upstream once.
func TestEgressMirror(t *testing.T) {
	w := newWorld(t)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), DNSNames: []string{"files.pythonhosted.org"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	body := strings.Repeat("wheel bytes ", 20000)
	var hits atomic.Int32
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/packages/aa/demo-1.0-py3-none-any.whl" {
			http.NotFound(rw, r)
			return
		}
		hits.Add(1)
		rw.Write([]byte(body))
	}))
	up.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	up.StartTLS()
	defer up.Close()
	port := up.Listener.Addr().(*net.TCPAddr).Port
	n := w.startNode(t, "mirror", func(c *edge.Config) {
		c.Hosts = map[string][]netip.Addr{"files.pythonhosted.org": {netip.MustParseAddr("127.0.0.1")}}
		c.Mirror = aether.MirrorConfig{PyPIFiles: "https://files.pythonhosted.org:" + strconv.Itoa(port), RootCAs: pool}
	})
	alice := tenant("alice")
	sb := n.mustCreate(t, alice, &dsecv1.SandboxSpec{Image: baseImage, Network: &dsecv1.NetworkPolicy{Allow: []string{"pypi"}}})
	defer n.destroy(t, alice, sb.Id)

	res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Argv: []string{"sh", "-c", "echo $PIP_INDEX_URL $PIP_TRUSTED_HOST $npm_config_registry"}})
	if err != nil || strings.TrimSpace(string(res.Stdout)) != "http://mirror.dsec.internal/pypi/simple/ mirror.dsec.internal" {
		t.Fatalf("mirror variables: %q %v", res.GetStdout(), err)
	}
	wget := &dsecv1.ExecRequest{Argv: []string{"wget", "-q", "-O", "-", "http://mirror.dsec.internal/pypi/files/packages/aa/demo-1.0-py3-none-any.whl"}}
	for i := 0; i < 2; i++ {
		res, err = n.exec(t, alice, sb.Id, wget)
		if err != nil || res.ExitCode != 0 || string(res.Stdout) != body {
			t.Fatalf("wget %d through the mirror: exit %v, %d bytes, %q %v", i, res.GetExitCode(), len(res.GetStdout()), res.GetStderr(), err)
		}
	}
	if h := hits.Load(); h != 1 {
		t.Fatalf("upstream served the file %d times for two downloads", h)
	}
	// A policy without npm: the mirror's /npm/ is refused, and recorded.
	res, err = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Argv: []string{"wget", "-q", "-O", "-", "http://mirror.dsec.internal/npm/demo"}})
	if err != nil || res.ExitCode == 0 {
		t.Fatalf("npm through the mirror without the rule: exit %v %v", res.GetExitCode(), err)
	}
	var mirrored, refused int
	deadline := time.Now().Add(30 * time.Second)
	for {
		lines, _ := n.trajectory(t, alice, sb.Id, 0)
		mirrored, refused = 0, 0
		for _, r := range verifyLines(t, lines) {
			if r.Kind != trajectory.KindEgress || r.Egress == nil || r.Egress.Host != aether.MirrorHost {
				continue
			}
			if r.Egress.Allowed && r.Egress.Rule == "allow pypi (mirror)" && r.Egress.BytesIn >= int64(len(body)) {
				mirrored++
			} else if !r.Egress.Allowed && strings.HasPrefix(r.Egress.Rule, "mirror /npm/: ") {
				refused++
			}
		}
		if mirrored == 2 && refused == 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if mirrored != 2 || refused != 1 {
		t.Fatalf("trajectory holds %d mirrored and %d refused mirror records, want 2 and 1", mirrored, refused)
	}
	fams, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		if strings.HasPrefix(f.GetName(), "dsec_edge_mirror_") {
			got[f.GetName()] = f.Metric[0].GetCounter().GetValue()
		}
	}
	if got["dsec_edge_mirror_hits_total"] != 1 || got["dsec_edge_mirror_misses_total"] != 1 ||
		got["dsec_edge_mirror_upstream_bytes_total"] != float64(len(body)) || got["dsec_edge_mirror_served_bytes_total"] != 2*float64(len(body)) {
		t.Fatalf("mirror metrics %v", got)
	}
}
