package aether

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// upstreamNames are the public names the test upstream answers to, through
// the resolver's hosts map, with a certificate for them from a test CA.
var upstreamNames = []string{"pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "deb.debian.org"}

// testCert makes a self-signed certificate for names and the pool that
// trusts it.
func testCert(t testing.TB, names []string) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "dsec test upstream"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		DNSNames: names, IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert}, pool
}

// upstream is a local HTTPS server standing in for pypi.org,
// files.pythonhosted.org, registry.npmjs.org and deb.debian.org.
type upstream struct {
	srv  *httptest.Server
	base string // https://NAME:PORT with NAME replaced per host
	pool *x509.CertPool
	port string

	mu    sync.Mutex
	files map[string][]byte // path → bytes
	pages map[string]string // path → body
	hits  map[string]int
	// gate, if set, holds every file request until it is closed.
	gate chan struct{}
	// rate, if set, is the bytes per second all file downloads share
	// (the node's uplink, for the benchmark); next is when the next
	// chunk may go.
	rate int64
	next time.Time
}

// pace waits until n more bytes may go at the shared rate.
func (u *upstream) pace(n int) {
	u.mu.Lock()
	now := time.Now()
	if u.next.Before(now) {
		u.next = now
	}
	u.next = u.next.Add(time.Duration(int64(n) * int64(time.Second) / u.rate))
	wait := u.next.Sub(now)
	u.mu.Unlock()
	time.Sleep(wait)
}

func newUpstream(t testing.TB) *upstream {
	t.Helper()
	u := &upstream{files: map[string][]byte{}, pages: map[string]string{}, hits: map[string]int{}}
	cert, pool := testCert(t, upstreamNames)
	u.pool = pool
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.hits[r.URL.Path]++
		f, isFile := u.files[r.URL.Path]
		pg, isPage := u.pages[r.URL.Path]
		gate := u.gate
		u.mu.Unlock()
		switch {
		case isFile:
			if gate != nil {
				<-gate
			}
			w.Header().Set("Content-Length", fmt.Sprint(len(f)))
			if u.rate == 0 {
				w.Write(f)
				return
			}
			for off := 0; off < len(f); off += 256 << 10 {
				end := min(off+256<<10, len(f))
				u.pace(end - off)
				if _, err := w.Write(f[off:end]); err != nil {
					return
				}
			}
		case isPage:
			fmt.Fprint(w, pg)
		default:
			http.NotFound(w, r)
		}
	}))
	u.srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	u.srv.StartTLS()
	t.Cleanup(u.srv.Close)
	u.port = fmt.Sprint(u.srv.Listener.Addr().(*net.TCPAddr).Port)
	return u
}

func (u *upstream) url(name string) string { return "https://" + name + ":" + u.port }

func (u *upstream) hitsOf(path string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hits[path]
}

func (u *upstream) hosts() map[string][]netip.Addr {
	m := map[string][]netip.Addr{}
	for _, n := range upstreamNames {
		m[n] = []netip.Addr{netip.MustParseAddr("127.0.0.1")}
	}
	return m
}

// mirrorHarness is a proxy with a mirror over a real blob store, serving
// one sandbox on a loopback listener (a TCP connection stands in for the
// agent's relay, as in harness).
type mirrorHarness struct {
	t      testing.TB
	up     *upstream
	m      *Mirror
	store  *blobstore.Dir
	sb     *Sandbox
	proxy  string
	mu     sync.Mutex
	events []Event
}

func newMirrorHarness(t testing.TB, up *upstream, policy Policy) *mirrorHarness {
	t.Helper()
	store, err := blobstore.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	h := &mirrorHarness{t: t, up: up, store: store}
	res := NewResolver(up.hosts())
	h.m = NewMirror(MirrorConfig{
		Store: store, Resolver: res, RootCAs: up.pool,
		PyPI: up.url("pypi.org"), PyPIFiles: up.url("files.pythonhosted.org"),
		NPM: up.url("registry.npmjs.org"), Debian: up.url("deb.debian.org") + "/debian",
	})
	p := New(Config{Resolver: res, Mirror: h.m, MaxConns: 256, Record: func(_ string, e Event) {
		h.mu.Lock()
		h.events = append(h.events, e)
		h.mu.Unlock()
	}})
	h.sb = p.Sandbox("sb-m", policy)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.proxy = ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.sb.Run(ctx, func(ctx context.Context) (Conn, error) {
			c, err := ln.Accept()
			if err != nil {
				return nil, err
			}
			return c.(*net.TCPConn), nil
		})
	}()
	t.Cleanup(func() {
		cancel()
		ln.Close()
		h.sb.Close()
		<-done
	})
	return h
}

// client is a workload's tool with http_proxy and https_proxy set.
func (h *mirrorHarness) client() *http.Client {
	u, _ := url.Parse("http://" + h.proxy)
	return &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{
		Proxy:             http.ProxyURL(u),
		TLSClientConfig:   &tls.Config{RootCAs: h.up.pool},
		DisableKeepAlives: true,
	}}
}

func (h *mirrorHarness) get(u string) (int, []byte, error) {
	resp, err := h.client().Get(u)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// eventsFor waits for n events of requests for host (recorded when each
// connection ends, after the client has its answer) and returns them.
func (h *mirrorHarness) eventsFor(host string, n int) []Event {
	deadline := time.Now().Add(20 * time.Second)
	for {
		h.mu.Lock()
		var out []Event
		for _, e := range h.events {
			if e.Host == host {
				out = append(out, e)
			}
		}
		h.mu.Unlock()
		if len(out) >= n || time.Now().After(deadline) {
			return out
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// content is n pseudo-random bytes: no chunk of it repeats another, so a
// chunk sent twice or out of order shows.
func content(n int, seed byte) []byte {
	r := mrand.New(mrand.NewPCG(uint64(seed), 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func hexSHA256(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// pypiFixture puts a project "demo" on the upstream: a good wheel and one
// whose bytes do not match the index's hash.
func pypiFixture(up *upstream) (good, bad []byte) {
	good, bad = content(300<<10, 1), content(200<<10, 2)
	files := up.url("files.pythonhosted.org")
	up.files["/packages/aa/demo-1.0-py3-none-any.whl"] = good
	up.files["/packages/bb/demo-0.9.tar.gz"] = bad
	up.pages["/simple/demo/"] = fmt.Sprintf(`<!DOCTYPE html><html><body>
<a href="%s/packages/aa/demo-1.0-py3-none-any.whl#sha256=%s" data-requires-python="&gt;=3.8">demo-1.0-py3-none-any.whl</a>
<a href="%s/packages/bb/demo-0.9.tar.gz#sha256=%s">demo-0.9.tar.gz</a>
</body></html>`, files, hexSHA256(good), files, hexSHA256([]byte("something else")))
	return good, bad
}

var hrefRe = func(s string) []string {
	var out []string
	for _, part := range strings.Split(s, `href="`)[1:] {
		out = append(out, part[:strings.IndexByte(part, '"')])
	}
	return out
}

func TestMirrorPyPI(t *testing.T) {
	up := newUpstream(t)
	good, _ := pypiFixture(up)
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"pypi"}, nil))

	code, body, err := h.get("http://" + MirrorHost + "/pypi/simple/demo/")
	if err != nil || code != 200 {
		t.Fatalf("index: %d %v %s", code, err, body)
	}
	links := hrefRe(string(body))
	wantGood := "http://mirror.dsec.internal/pypi/files/sha256/" + hexSHA256(good) + "/packages/aa/demo-1.0-py3-none-any.whl#sha256=" + hexSHA256(good)
	if len(links) != 2 || links[0] != wantGood || !strings.HasPrefix(links[1], "http://mirror.dsec.internal/pypi/files/sha256/") {
		t.Fatalf("index links not rewritten to the mirror: %q", links)
	}
	if e := h.eventsFor(MirrorHost, 1); len(e) == 0 || !e[len(e)-1].Allowed || e[len(e)-1].Rule != "allow pypi (mirror)" || e[len(e)-1].Addr != "mirror" {
		t.Fatalf("mirror decision not recorded as allowed: %+v", e)
	}

	wheel := strings.TrimSuffix(links[0], "#sha256="+hexSHA256(good))
	code, got, err := h.get(wheel)
	if err != nil || code != 200 || string(got) != string(good) {
		t.Fatalf("wheel: %d %v, %d bytes (want %d)", code, err, len(got), len(good))
	}
	if n := up.hitsOf("/packages/aa/demo-1.0-py3-none-any.whl"); n != 1 {
		t.Fatalf("upstream served the wheel %d times", n)
	}

	t.Run("hash mismatch refused, not stored", func(t *testing.T) {
		bad := strings.Split(links[1], "#")[0]
		for i := 1; i <= 2; i++ {
			code, got, err := h.get(bad)
			if err == nil && code == 200 && len(got) == 200<<10 {
				t.Fatalf("a file whose hash differs from the index's was served whole")
			}
			// Refused each time: nothing was kept to serve the second.
			if n := up.hitsOf("/packages/bb/demo-0.9.tar.gz"); n != i {
				t.Fatalf("upstream asked %d times after %d requests", n, i)
			}
		}
	})

	t.Run("served from the blob store with the upstream stopped", func(t *testing.T) {
		up.srv.Close()
		before := h.m.Stats()
		code, got, err := h.get(wheel)
		if err != nil || code != 200 || string(got) != string(good) {
			t.Fatalf("wheel again: %d %v, %d bytes", code, err, len(got))
		}
		code, _, err = h.get("http://" + MirrorHost + "/pypi/simple/demo/")
		if err != nil || code != 200 {
			t.Fatalf("index again (cached for the TTL): %d %v", code, err)
		}
		after := h.m.Stats()
		if after.Hits != before.Hits+2 || after.Misses != before.Misses || after.BytesUpstream != before.BytesUpstream ||
			after.BytesServed < before.BytesServed+int64(len(good)) {
			t.Fatalf("stats %+v → %+v", before, after)
		}
		// The bytes served are the blob store's, by their digest.
		d, err := h.store.Refs().Get(context.Background(), refName(up.url("files.pythonhosted.org")+"/packages/aa/demo-1.0-py3-none-any.whl",
			&check{algo: "sha256", sum: mustHex(hexSHA256(good))}))
		if err != nil || d != "sha256:"+hexSHA256(good) {
			t.Fatalf("ref %q %v", d, err)
		}
	})
}

func mustHex(s string) []byte { b, _ := hex.DecodeString(s); return b }

func TestMirrorPolicy(t *testing.T) {
	up := newUpstream(t)
	pypiFixture(up)
	up.pages["/demo"] = `{"name":"demo","versions":{}}`
	// npm allowed, pypi not; npm's registry directly still allowed
	// through the proxy (a host rule: the test upstream is on no
	// standard port).
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"npm", "registry.npmjs.org"}, nil))
	code, body, err := h.get("http://" + MirrorHost + "/pypi/simple/demo/")
	if err != nil || code != http.StatusForbidden {
		t.Fatalf("pypi through the mirror without the rule: %d %v %s", code, err, body)
	}
	ev := h.eventsFor(MirrorHost, 1)
	if len(ev) != 1 || ev[0].Allowed || ev[0].Rule != "mirror /pypi/: default deny" {
		t.Fatalf("refusal not recorded: %+v", ev)
	}
	if n := up.hitsOf("/simple/demo/"); n != 0 {
		t.Fatalf("upstream asked %d times for a refused request", n)
	}
	if code, _, err := h.get("http://" + MirrorHost + "/npm/demo"); err != nil || code != 200 {
		t.Fatalf("npm through the mirror with the rule: %d %v", code, err)
	}
	if code, body, err := h.get(up.url("registry.npmjs.org") + "/demo"); err != nil || code != 200 || !strings.Contains(string(body), "demo") {
		t.Fatalf("npm's registry directly: %d %v", code, err)
	}
	// A deny wins over the allow, for the mirror as for the hosts.
	h.sb.SetPolicy(mustPolicy(t, []string{"npm"}, []string{"registry.npmjs.org"}))
	if code, _, _ := h.get("http://" + MirrorHost + "/npm/demo"); code != http.StatusForbidden {
		t.Fatalf("npm through the mirror under a deny: %d", code)
	}
	if env := MirrorEnv(mustPolicy(t, []string{"pypi"}, nil)); strings.Join(env, " ") !=
		"PIP_INDEX_URL=http://mirror.dsec.internal/pypi/simple/ PIP_TRUSTED_HOST=mirror.dsec.internal UV_DEFAULT_INDEX=http://mirror.dsec.internal/pypi/simple/ UV_INSECURE_HOST=mirror.dsec.internal" {
		t.Fatalf("MirrorEnv(pypi) = %q", env)
	}
	if env := MirrorEnv(mustPolicy(t, []string{"npm"}, nil)); len(env) != 1 || env[0] != "npm_config_registry=http://mirror.dsec.internal/npm/" {
		t.Fatalf("MirrorEnv(npm) = %q", env)
	}
	if env := MirrorEnv(Policy{}); len(env) != 0 {
		t.Fatalf("MirrorEnv(deny all) = %q", env)
	}
}

func TestMirrorNPM(t *testing.T) {
	up := newUpstream(t)
	good, bad := content(150<<10, 3), content(100<<10, 4)
	sum := sha512.Sum512(good)
	other := sha512.Sum512([]byte("other"))
	reg := up.url("registry.npmjs.org")
	up.files["/demo/-/demo-1.0.0.tgz"] = good
	up.files["/demo/-/demo-2.0.0.tgz"] = bad
	up.pages["/demo"] = fmt.Sprintf(`{"name":"demo","dist-tags":{"latest":"2.0.0"},"versions":{
 "1.0.0":{"name":"demo","version":"1.0.0","dist":{"tarball":"%s/demo/-/demo-1.0.0.tgz","integrity":"sha512-%s","shasum":"x"}},
 "2.0.0":{"name":"demo","version":"2.0.0","dist":{"tarball":"%s/demo/-/demo-2.0.0.tgz","integrity":"sha512-%s"}}}}`,
		reg, base64.StdEncoding.EncodeToString(sum[:]), reg, base64.StdEncoding.EncodeToString(other[:]))
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"npm"}, nil))

	code, body, err := h.get("http://" + MirrorHost + "/npm/demo")
	if err != nil || code != 200 {
		t.Fatalf("document: %d %v %s", code, err, body)
	}
	var doc struct {
		Versions map[string]struct {
			Dist struct{ Tarball, Integrity string }
		}
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatal(err)
	}
	t1, t2 := doc.Versions["1.0.0"].Dist.Tarball, doc.Versions["2.0.0"].Dist.Tarball
	if t1 != "http://mirror.dsec.internal/npm/~tarball/sha512/"+hex.EncodeToString(sum[:])+"/demo/-/demo-1.0.0.tgz" ||
		doc.Versions["1.0.0"].Dist.Integrity != "sha512-"+base64.StdEncoding.EncodeToString(sum[:]) {
		t.Fatalf("tarball not rewritten to the mirror: %q", t1)
	}
	code, got, err := h.get(t1)
	if err != nil || code != 200 || string(got) != string(good) {
		t.Fatalf("tarball: %d %v %d bytes", code, err, len(got))
	}
	if code, got, err := h.get(t2); err == nil && code == 200 && len(got) == len(bad) {
		t.Fatal("a tarball whose integrity differs from the document's was served whole")
	}
	up.srv.Close()
	code, got, err = h.get(t1)
	if err != nil || code != 200 || string(got) != string(good) {
		t.Fatalf("tarball with the upstream stopped: %d %v %d bytes", code, err, len(got))
	}
	if n := up.hitsOf("/demo/-/demo-1.0.0.tgz"); n != 1 {
		t.Fatalf("upstream served the tarball %d times", n)
	}
}

func TestMirrorConcurrentFetchOnce(t *testing.T) {
	up := newUpstream(t)
	good, _ := pypiFixture(up)
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"pypi"}, nil))
	up.gate = make(chan struct{})
	wheel := "http://" + MirrorHost + "/pypi/files/sha256/" + hexSHA256(good) + "/packages/aa/demo-1.0-py3-none-any.whl"
	const n = 20
	var wg sync.WaitGroup
	var ok atomic.Int32
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, got, err := h.get(wheel)
			if err == nil && code == 200 && string(got) == string(good) {
				ok.Add(1)
			} else {
				t.Errorf("client: %d %v %d bytes", code, err, len(got))
			}
		}()
	}
	// Hold the upstream until the 19 others wait on the first one's fetch.
	deadline := time.Now().Add(30 * time.Second)
	for {
		h.m.mu.Lock()
		w := 0
		for _, f := range h.m.flights {
			w += f.waiters
		}
		h.m.mu.Unlock()
		if w == n-1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests waiting on the fetch, want %d", w, n-1)
		}
		time.Sleep(2 * time.Millisecond)
	}
	close(up.gate)
	wg.Wait()
	if ok.Load() != n {
		t.Fatalf("%d of %d clients got the wheel", ok.Load(), n)
	}
	if got := up.hitsOf("/packages/aa/demo-1.0-py3-none-any.whl"); got != 1 {
		t.Fatalf("upstream served the wheel %d times to %d concurrent clients", got, n)
	}
	if s := h.m.Stats(); s.Misses != 1 || s.Hits != n-1 || s.BytesUpstream != int64(len(good)) || s.BytesServed != n*int64(len(good)) {
		t.Fatalf("stats %+v", s)
	}
}

// apt's sources name http://deb.debian.org/debian and it honours
// http_proxy: the proxy answers those requests from the mirror.
func TestMirrorApt(t *testing.T) {
	up := newUpstream(t)
	deb := content(120<<10, 5)
	up.files["/debian/pool/main/d/demo/demo_1.0_amd64.deb"] = deb
	up.pages["/debian/dists/bookworm/InRelease"] = "release v1"
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"debian"}, nil))
	for i := 0; i < 2; i++ {
		code, got, err := h.get("http://deb.debian.org/debian/pool/main/d/demo/demo_1.0_amd64.deb")
		if err != nil || code != 200 || string(got) != string(deb) {
			t.Fatalf("deb: %d %v %d bytes", code, err, len(got))
		}
		code, got, err = h.get("http://deb.debian.org/debian/dists/bookworm/InRelease")
		if err != nil || code != 200 || string(got) != "release v1" {
			t.Fatalf("InRelease: %d %v %q", code, err, got)
		}
	}
	if a, b := up.hitsOf("/debian/pool/main/d/demo/demo_1.0_amd64.deb"), up.hitsOf("/debian/dists/bookworm/InRelease"); a != 1 || b != 1 {
		t.Fatalf("upstream asked %d times for the .deb, %d for InRelease", a, b)
	}
	ev := h.eventsFor("deb.debian.org", 4)
	if len(ev) != 4 || !ev[0].Allowed || ev[0].Rule != "allow debian (mirror)" || ev[0].Addr != "mirror" {
		t.Fatalf("events %+v", ev)
	}
}

// A stored copy that no longer matches its digest is not served whole,
// and the next request fetches the file again.
func TestMirrorCorruptBlob(t *testing.T) {
	up := newUpstream(t)
	good, _ := pypiFixture(up)
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"pypi"}, nil))
	wheel := "http://" + MirrorHost + "/pypi/files/sha256/" + hexSHA256(good) + "/packages/aa/demo-1.0-py3-none-any.whl"
	if code, got, err := h.get(wheel); err != nil || code != 200 || string(got) != string(good) {
		t.Fatalf("first: %d %v", code, err)
	}
	p, err := h.store.Path("sha256:" + hexSHA256(good))
	if err != nil {
		t.Fatal(err)
	}
	bad := append([]byte(nil), good...)
	bad[len(bad)/2] ^= 0xff
	if err := os.Chmod(p, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, bad, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.get(wheel); err == nil {
		t.Fatal("a corrupt stored copy was served as a complete response")
	}
	if n := up.hitsOf("/packages/aa/demo-1.0-py3-none-any.whl"); n != 1 {
		t.Fatalf("upstream asked %d times before the corruption showed", n)
	}
	// The ref was dropped: fetched again, and right.
	if code, got, err := h.get(wheel); err != nil || code != 200 || string(got) != string(good) {
		t.Fatalf("after corruption: %d %v", code, err)
	}
	if n := up.hitsOf("/packages/aa/demo-1.0-py3-none-any.whl"); n != 2 {
		t.Fatalf("upstream asked %d times, want 2", n)
	}
}

// A response the mirror is serving is cut when the policy stops allowing
// its ecosystem, as an open tunnel is.
func TestMirrorPolicyChange(t *testing.T) {
	up := newUpstream(t)
	good, _ := pypiFixture(up)
	h := newMirrorHarness(t, up, mustPolicy(t, []string{"pypi"}, nil))
	up.gate = make(chan struct{})
	wheel := "http://" + MirrorHost + "/pypi/files/sha256/" + hexSHA256(good) + "/packages/aa/demo-1.0-py3-none-any.whl"
	res := make(chan error, 1)
	go func() {
		_, _, err := h.get(wheel)
		res <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		h.m.mu.Lock()
		n := len(h.m.flights)
		h.m.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the download never started")
		}
		time.Sleep(2 * time.Millisecond)
	}
	if n := h.sb.SetPolicy(mustPolicy(t, nil, []string{"pypi"})); n != 1 {
		t.Fatalf("SetPolicy closed %d connections, want the mirror's 1", n)
	}
	if err := <-res; err == nil {
		t.Fatal("the download went on after the policy denied pypi")
	}
	close(up.gate)
	ev := h.eventsFor(MirrorHost, 1)
	if len(ev) != 1 || ev[0].Ended != "policy changed: deny pypi" {
		t.Fatalf("events %+v", ev)
	}
}
