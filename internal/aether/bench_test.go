package aether_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/aether"
	"github.com/dsec-dev/dsec/internal/agent"
)

// The egress path without a sandbox around it: the real agent (Serve, in
// process, over a socket pair as the container backend's channel), its
// relay listener on loopback, the edge's proxy, and an HTTP upstream on
// loopback. What a workload's download pays for the proxy is the relay's
// frames and the extra hops, which this measures against a direct GET.

func startRelay(tb testing.TB, policy aether.Policy) (proxyURL *url.URL, sb *aether.Sandbox, c *agent.Client) {
	tb.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	a, e := os.NewFile(uintptr(fds[0]), "agent"), os.NewFile(uintptr(fds[1]), "edge")
	done := make(chan struct{})
	go func() {
		defer close(done)
		agent.Serve(context.Background(), a, agent.Options{})
	}()
	c = agent.NewClient(e)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	listen := ln.Addr().String()
	ln.Close()
	p := aether.New(aether.Config{Resolver: aether.NewResolver(map[string][]netip.Addr{
		"up.example.org": {netip.MustParseAddr("127.0.0.1")}})})
	sb = p.Sandbox("bench", policy)
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() {
		defer close(runDone)
		sb.Run(ctx, func(ctx context.Context) (aether.Conn, error) { return c.AcceptEgress(ctx, listen) })
	}()
	tb.Cleanup(func() {
		cancel()
		sb.Close()
		<-runDone
		c.Close()
		<-done
	})
	// The agent listens from the first EgressAccept on (in a sandbox, the
	// edge sends it as the sandbox starts): wait until the port is taken.
	for {
		l, err := net.Listen("tcp", listen)
		if err != nil {
			break
		}
		l.Close()
		time.Sleep(time.Millisecond)
	}
	u, _ := url.Parse("http://" + listen)
	return u, sb, c
}

// BenchmarkDownload10MB: a 10 MB GET direct on loopback against the same
// GET through the agent's relay and the edge's proxy (plain HTTP: the
// proxy forwards the request; a CONNECT tunnel relays the same bytes).
func BenchmarkDownload10MB(b *testing.B) {
	body := make([]byte, 10<<20)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(body) }))
	defer up.Close()
	port := up.Listener.Addr().(*net.TCPAddr).Port
	pol, err := aether.ParsePolicy([]string{"up.example.org"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	proxy, _, _ := startRelay(b, pol)
	get := func(b *testing.B, c *http.Client, u string) {
		resp, err := c.Get(u)
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || n != int64(len(body)) {
			b.Fatalf("read %d of %d: %v", n, len(body), err)
		}
	}
	var direct, proxied time.Duration
	b.Run("direct", func(b *testing.B) {
		c := &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
		b.SetBytes(int64(len(body)))
		start := time.Now()
		for b.Loop() {
			get(b, c, fmt.Sprintf("http://127.0.0.1:%d/", port))
		}
		direct = time.Since(start) / time.Duration(b.N)
	})
	b.Run("proxy", func(b *testing.B) {
		c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy), DisableKeepAlives: true}}
		b.SetBytes(int64(len(body)))
		start := time.Now()
		for b.Loop() {
			get(b, c, fmt.Sprintf("http://up.example.org:%d/", port))
		}
		proxied = time.Since(start) / time.Duration(b.N)
		if direct > 0 {
			b.ReportMetric(float64(proxied)/float64(direct), "x-direct")
		}
	})
}

// BenchmarkPolicyChange: from SetPolicy's call to a new connection's
// refusal by the new policy (the change is synchronous: the next
// connection is decided by it).
func BenchmarkPolicyChange(b *testing.B) {
	allow, _ := aether.ParsePolicy([]string{"up.example.org"}, nil)
	deny, _ := aether.ParsePolicy(nil, []string{"up.example.org"})
	proxy, sb, _ := startRelay(b, allow)
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy), DisableKeepAlives: true}}
	for b.Loop() {
		sb.SetPolicy(deny)
		resp, err := c.Get("http://up.example.org:1/")
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			b.Fatalf("status %d after deny", resp.StatusCode)
		}
		sb.SetPolicy(allow)
	}
}

// BenchmarkIdleSandboxes: what 1,000 sandboxes holding policies cost the
// node while nothing connects: per sandbox the edge's relay loop with its
// pending EgressAccept stream and the agent's listener (here all in one
// process; in a node the agent's part is in each sandbox).
func BenchmarkIdleSandboxes(b *testing.B) {
	const n = 1000
	pol, _ := aether.ParsePolicy([]string{"pypi", "npm", "github", "*.example.org"}, []string{"10.0.0.0/8"})
	for b.Loop() {
		b.StopTimer()
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		g0 := runtime.NumGoroutine()
		b.StartTimer()
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			b.Fatal(err)
		}
		a, e := os.NewFile(uintptr(fds[0]), "agent"), os.NewFile(uintptr(fds[1]), "edge")
		go agent.Serve(context.Background(), a, agent.Options{})
		c := agent.NewClient(e)
		p := aether.New(aether.Config{})
		ctx, cancel := context.WithCancel(context.Background())
		for i := range n {
			sb := p.Sandbox(fmt.Sprint("sb", i), pol)
			listen := fmt.Sprintf("127.0.0.%d:%d", 2+i/200, 20000+i%200)
			go sb.Run(ctx, func(ctx context.Context) (aether.Conn, error) { return c.AcceptEgress(ctx, listen) })
		}
		// Until every listener is up.
		for i := range n {
			addr := fmt.Sprintf("127.0.0.%d:%d", 2+i/200, 20000+i%200)
			// Taken (EADDRINUSE) once the agent listens there; no
			// connection is made, so nothing is relayed.
			for {
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					break
				}
				ln.Close()
				time.Sleep(time.Millisecond)
			}
		}
		b.StopTimer()
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapInuse-before.HeapInuse)/n, "heap-B/sandbox")
		b.ReportMetric(float64(runtime.NumGoroutine()-g0)/n, "goroutines/sandbox")
		cancel()
		c.Close()
		b.StartTimer()
	}
}
