package edge_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// TestEgress drives a sandbox's egress through the real path: busybox
// wget inside a container uses the proxy variables every exec gets, the
// agent relays the connection, the edge resolves the name from its hosts
// map, decides and dials an HTTP server on the host's loopback (which the
// sandbox's own network namespace cannot reach). Policy changes take
// effect on the next connection; decisions are on the trajectory.
func TestEgress(t *testing.T) {
	w := newWorld(t)
	up := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(rw, "hello from upstream %s", r.URL.Path)
	}))
	defer up.Close()
	port := up.Listener.Addr().(*net.TCPAddr).Port
	lo := []netip.Addr{netip.MustParseAddr("127.0.0.1")}
	n := w.startNode(t, "egress", func(c *edge.Config) {
		c.Hosts = map[string][]netip.Addr{"pkgs.example.org": lo, "other.example.org": lo}
	})
	alice := tenant("alice")
	url := fmt.Sprintf("http://pkgs.example.org:%d/simple/", port)
	wget := &dsecv1.ExecRequest{Argv: []string{"wget", "-q", "-O", "-", url}}

	sb := n.mustCreate(t, alice, &dsecv1.SandboxSpec{Image: baseImage,
		Network: &dsecv1.NetworkPolicy{Allow: []string{"pkgs.example.org", "PyPI"}}})
	defer n.destroy(t, alice, sb.Id)
	if got := sb.GetSpec().GetNetwork().GetAllow(); strings.Join(got, ",") != "pkgs.example.org,pypi" {
		t.Fatalf("spec.network.allow = %v, want the canonical rules", got)
	}

	res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Argv: []string{"sh", "-c", "echo $http_proxy $HTTPS_PROXY $no_proxy"}})
	if err != nil || strings.TrimSpace(string(res.Stdout)) != "http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1,::1" {
		t.Fatalf("proxy variables: %q %v", res.GetStdout(), err)
	}
	res, err = n.exec(t, alice, sb.Id, wget)
	if err != nil || res.ExitCode != 0 || string(res.Stdout) != "hello from upstream /simple/" {
		t.Fatalf("allowed wget: %v %q %q %v", res.GetExitCode(), res.GetStdout(), res.GetStderr(), err)
	}
	// Without the proxy the host's loopback is not the sandbox's.
	res, err = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Argv: []string{"wget", "-q", "-T", "5", "-O", "-", "-Y", "off",
		fmt.Sprintf("http://127.0.0.1:%d/", port)}})
	if err != nil || res.ExitCode == 0 {
		t.Fatalf("direct connection to the host's loopback: exit %v %q %v", res.GetExitCode(), res.GetStdout(), err)
	}
	// A name the policy does not name.
	res, err = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Argv: []string{"wget", "-q", "-O", "-", fmt.Sprintf("http://other.example.org:%d/", port)}})
	if err != nil || res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "403") {
		t.Fatalf("unlisted host: exit %v %q %v", res.GetExitCode(), res.GetStderr(), err)
	}

	// Deny it while the sandbox runs: the next connection is refused.
	set := func(r *dsecv1.SetNetworkRequest) *dsecv1.SetNetworkResponse {
		t.Helper()
		r.SandboxId = sb.Id
		resp, err := n.client.SetNetworkOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSetNetworkRequest{Caller: alice, Request: r}))
		if err != nil {
			t.Fatalf("set network %v: %v", r, err)
		}
		return resp.Msg
	}
	got := set(&dsecv1.SetNetworkRequest{Deny: []string{"pkgs.example.org"}})
	if strings.Join(got.Network.Allow, ",") != "pypi" || strings.Join(got.Network.Deny, ",") != "pkgs.example.org" {
		t.Fatalf("policy after deny: %v", got.Network)
	}
	res, err = n.exec(t, alice, sb.Id, wget)
	if err != nil || res.ExitCode == 0 {
		t.Fatalf("wget after deny: exit %v %q %v", res.GetExitCode(), res.GetStdout(), err)
	}
	set(&dsecv1.SetNetworkRequest{Allow: []string{"pkgs.example.org"}})
	if res, err = n.exec(t, alice, sb.Id, wget); err != nil || res.ExitCode != 0 {
		t.Fatalf("wget after allow again: exit %v %q %v", res.GetExitCode(), res.GetStderr(), err)
	}
	// No rules: reads the policy.
	if got := set(&dsecv1.SetNetworkRequest{}); strings.Join(got.Network.Allow, ",") != "pypi,pkgs.example.org" {
		t.Fatalf("policy read: %v", got.Network)
	}
	// Replace with nothing: default deny.
	if got := set(&dsecv1.SetNetworkRequest{Replace: true}); got.Network != nil {
		t.Fatalf("policy after replace with nothing: %v", got.Network)
	}
	if res, err = n.exec(t, alice, sb.Id, wget); err != nil || res.ExitCode == 0 {
		t.Fatalf("wget under an empty policy: exit %v %v", res.GetExitCode(), err)
	}

	// Bad input names the field; another tenant cannot see the sandbox.
	_, err = n.client.SetNetworkOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSetNetworkRequest{Caller: alice,
		Request: &dsecv1.SetNetworkRequest{SandboxId: sb.Id, Allow: []string{"pypi", "exa mple.org"}}}))
	wantCode(t, err, connect.CodeInvalidArgument, "request.allow[1]")
	_, err = n.client.SetNetworkOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSetNetworkRequest{Caller: tenant("mallory"),
		Request: &dsecv1.SetNetworkRequest{SandboxId: sb.Id, Allow: []string{"pypi"}}}))
	wantCode(t, err, connect.CodeNotFound, sb.Id)
	_, err = n.create(t, alice, &dsecv1.SandboxSpec{Image: baseImage, Network: &dsecv1.NetworkPolicy{Deny: []string{"npmm"}}})
	wantCode(t, err, connect.CodeInvalidArgument, "spec.network.deny[0]")

	// Every decision is an event on the trajectory.
	var allowed, denied int
	deadline := time.Now().Add(30 * time.Second)
	for {
		lines, _ := n.trajectory(t, alice, sb.Id, 0)
		allowed, denied = 0, 0
		for _, r := range verifyLines(t, lines) {
			if r.Kind != trajectory.KindEgress {
				continue
			}
			if r.Egress == nil || r.Egress.Host == "" && r.Egress.Allowed {
				t.Fatalf("egress record without its decision: %+v", r)
			}
			if r.Egress.Allowed {
				allowed++
				if r.Egress.Rule != "allow pkgs.example.org" || r.Egress.BytesIn == 0 || r.Egress.Addr != fmt.Sprintf("127.0.0.1:%d", port) {
					t.Fatalf("allowed record %+v", r.Egress)
				}
			} else {
				denied++
			}
		}
		if allowed == 2 && denied == 3 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if allowed != 2 || denied != 3 {
		t.Fatalf("trajectory holds %d allowed and %d denied egress records, want 2 and 3", allowed, denied)
	}
	if v := metricValue(t, n.reg, "dsec_edge_egress_connections_total", "decision", "allowed"); v != 2 {
		t.Fatalf("allowed connections metric %v, want 2", v)
	}
}
