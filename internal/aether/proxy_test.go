package aether

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"
)

// harness is one sandbox's proxy served on a real loopback listener (the
// agent's relay is tested in internal/agent; here a TCP connection stands
// in for the relayed one), with upstreams on loopback named through a
// hosts map, as `dsec edge --hosts` does.
type harness struct {
	t      *testing.T
	sb     *Sandbox
	proxy  string // host:port of the proxy listener
	mu     sync.Mutex
	events []Event
	tlsUp  *httptest.Server
	httpUp *httptest.Server
}

func newHarness(t *testing.T, policy Policy, maxConns int) *harness {
	t.Helper()
	h := &harness{t: t}
	h.tlsUp = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hang" {
			fmt.Fprint(w, "first\n")
			w.(http.Flusher).Flush()
			<-r.Context().Done()
			return
		}
		fmt.Fprintf(w, "tls %s %s", r.Method, r.URL.Path)
	}))
	t.Cleanup(h.tlsUp.Close)
	h.httpUp = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "plain %s %s host=%s", r.Method, r.URL.Path, r.Host)
	}))
	t.Cleanup(h.httpUp.Close)
	lo := []netip.Addr{netip.MustParseAddr("127.0.0.1")}
	p := New(Config{
		Resolver: NewResolver(map[string][]netip.Addr{"example.com": lo, "plain.example.org": lo, "other.example.org": lo}),
		MaxConns: maxConns,
		Record: func(_ string, e Event) {
			h.mu.Lock()
			h.events = append(h.events, e)
			h.mu.Unlock()
		},
	})
	h.sb = p.Sandbox("sb-1", policy)
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

func (h *harness) port(s *httptest.Server) string {
	return s.Listener.Addr().(*net.TCPAddr).AddrPort().String()[len("127.0.0.1:"):]
}

// client is what a workload's tool does with https_proxy set: CONNECT
// through the proxy, TLS to the name, with the upstream's test CA.
func (h *harness) client(serverName string) *http.Client {
	pool := h.tlsUp.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	u, _ := url.Parse("http://" + h.proxy)
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		Proxy:             http.ProxyURL(u),
		TLSClientConfig:   &tls.Config{RootCAs: pool, ServerName: serverName},
		DisableKeepAlives: true,
	}}
}

func (h *harness) lastEvent() Event {
	h.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		h.mu.Lock()
		n := len(h.events)
		var e Event
		if n > 0 {
			e = h.events[n-1]
		}
		h.mu.Unlock()
		if n > 0 {
			return e
		}
		if time.Now().After(deadline) {
			h.t.Fatal("no event recorded")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (h *harness) reset() {
	h.mu.Lock()
	h.events = nil
	h.mu.Unlock()
}

func get(c *http.Client, u string) (int, string, error) {
	resp, err := c.Get(u)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// rawConnect sends a CONNECT and returns the connection and the status line.
func (h *harness) rawConnect(target string) (net.Conn, *bufio.Reader, string) {
	h.t.Helper()
	c, err := net.Dial("tcp", h.proxy)
	if err != nil {
		h.t.Fatal(err)
	}
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
	br := bufio.NewReader(c)
	line, _ := br.ReadString('\n')
	// Skip the rest of the head.
	for {
		l, err := br.ReadString('\n')
		if err != nil || l == "\r\n" {
			break
		}
	}
	return c, br, strings.TrimSpace(line)
}

func TestProxy(t *testing.T) {
	pol := mustPolicy(t, []string{"example.com", "plain.example.org", "other.example.org"}, []string{"other.example.org:" + "1"})
	h := newHarness(t, pol, 0)
	tlsPort, plainPort := h.port(h.tlsUp), h.port(h.httpUp)

	t.Run("https allowed", func(t *testing.T) {
		h.reset()
		code, body, err := get(h.client(""), "https://example.com:"+tlsPort+"/x")
		if err != nil || code != 200 || body != "tls GET /x" {
			t.Fatalf("got %d %q %v", code, body, err)
		}
		e := h.lastEvent()
		if !e.Allowed || e.Rule != "allow example.com" || e.Method != "CONNECT" || e.Addr != "127.0.0.1:"+tlsPort || e.BytesOut == 0 || e.BytesIn == 0 {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("plain http allowed, sent to the name", func(t *testing.T) {
		h.reset()
		code, body, err := get(h.client(""), "http://plain.example.org:"+plainPort+"/p")
		if err != nil || code != 200 || body != "plain GET /p host=plain.example.org:"+plainPort {
			t.Fatalf("got %d %q %v", code, body, err)
		}
		if e := h.lastEvent(); !e.Allowed || e.Method != "GET" || e.BytesIn == 0 {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("denied by default", func(t *testing.T) {
		h.reset()
		_, _, err := get(h.client(""), "https://notlisted.example.net:"+tlsPort+"/")
		if err == nil || !strings.Contains(err.Error(), "Forbidden") {
			t.Fatalf("err %v", err)
		}
		if e := h.lastEvent(); e.Allowed || e.Rule != "default deny" || e.Host != "notlisted.example.net" {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("SNI other than the CONNECT host", func(t *testing.T) {
		h.reset()
		// CONNECT to an allowed name, then TLS naming another (allowed or
		// not, it is not what was decided).
		_, _, err := get(h.client("other.example.org"), "https://example.com:"+tlsPort+"/")
		if err == nil {
			t.Fatal("request went through")
		}
		if e := h.lastEvent(); e.Allowed || !strings.Contains(e.Rule, `SNI "other.example.org" does not match`) {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("not TLS through a CONNECT to a name", func(t *testing.T) {
		h.reset()
		c, br, status := h.rawConnect("example.com:" + tlsPort)
		defer c.Close()
		if !strings.Contains(status, "200") {
			t.Fatalf("status %q", status)
		}
		fmt.Fprint(c, "SSH-2.0-OpenSSH_9.2\r\n")
		c.SetReadDeadline(time.Now().Add(30 * time.Second))
		if n, _ := br.Read(make([]byte, 1)); n != 0 {
			t.Fatal("bytes came back through a tunnel that is not TLS")
		}
		if e := h.lastEvent(); e.Allowed || !strings.Contains(e.Rule, "not a TLS ClientHello") {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("direct IP needs an address rule", func(t *testing.T) {
		h.reset()
		_, _, status := h.rawConnect("127.0.0.1:" + tlsPort)
		if !strings.Contains(status, "403") {
			t.Fatalf("status %q", status)
		}
		if e := h.lastEvent(); e.Allowed || !strings.Contains(e.Rule, "address is allowed only by an address rule") {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("port rule", func(t *testing.T) {
		h.reset()
		_, _, status := h.rawConnect("other.example.org:1")
		if !strings.Contains(status, "403") {
			t.Fatalf("status %q", status)
		}
		if e := h.lastEvent(); e.Rule != "deny other.example.org:1" {
			t.Fatalf("event %+v", e)
		}
	})
	t.Run("malformed", func(t *testing.T) {
		h.reset()
		c, err := net.Dial("tcp", h.proxy)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprint(c, "\x16\x03\x01\x00\x05hello\r\n\r\n")
		line, _ := bufio.NewReader(c).ReadString('\n')
		if !strings.Contains(line, "400") {
			t.Fatalf("reply %q", line)
		}
	})
	t.Run("header too large", func(t *testing.T) {
		c, err := net.Dial("tcp", h.proxy)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		go func() {
			fmt.Fprintf(c, "GET http://plain.example.org:%s/ HTTP/1.1\r\nX: ", plainPort)
			c.Write([]byte(strings.Repeat("a", 1<<20)))
		}()
		line, _ := bufio.NewReader(c).ReadString('\n')
		if !strings.Contains(line, "400") {
			t.Fatalf("reply %q", line)
		}
	})
}

// TestProxyPolicyChange: a policy change is effective for the next
// connection at once and closes open connections it no longer allows.
func TestProxyPolicyChange(t *testing.T) {
	h := newHarness(t, mustPolicy(t, []string{"example.com"}, nil), 0)
	tlsPort := h.port(h.tlsUp)
	resp, err := h.client("").Get("https://example.com:" + tlsPort + "/hang")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if l, err := br.ReadString('\n'); err != nil || l != "first\n" {
		t.Fatalf("first line %q %v", l, err)
	}
	h.reset()
	deny, _ := ParseRule(Deny, "example.com")
	if n := h.sb.SetPolicy(h.sb.Policy().With(deny)); n != 1 {
		t.Fatalf("SetPolicy closed %d connections, want 1", n)
	}
	if _, err := io.ReadAll(br); err == nil {
		t.Fatal("the open connection still reads to a clean end after the policy denied it")
	}
	if e := h.lastEvent(); !e.Allowed || e.Ended != "policy changed: deny example.com" {
		t.Fatalf("event %+v", e)
	}
	if _, _, err := get(h.client(""), "https://example.com:"+tlsPort+"/"); err == nil {
		t.Fatal("new connection allowed after deny")
	}
}

// TestProxyMaxConns: connections beyond the bound are not served until
// one ends.
func TestProxyMaxConns(t *testing.T) {
	h := newHarness(t, mustPolicy(t, []string{"example.com"}, nil), 2)
	tlsPort := h.port(h.tlsUp)
	var open []net.Conn
	for range 2 {
		c, _, status := h.rawConnect("example.com:" + tlsPort)
		if !strings.Contains(status, "200") {
			t.Fatalf("status %q", status)
		}
		open = append(open, c)
	}
	c3, err := net.Dial("tcp", h.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	fmt.Fprintf(c3, "CONNECT example.com:%s HTTP/1.1\r\n\r\n", tlsPort)
	c3.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, _ := c3.Read(make([]byte, 1)); n != 0 {
		t.Fatal("a third connection was served with a bound of two")
	}
	open[0].Close()
	c3.SetReadDeadline(time.Now().Add(30 * time.Second))
	line, err := bufio.NewReader(c3).ReadString('\n')
	if err != nil || !strings.Contains(line, "200") {
		t.Fatalf("third connection after one closed: %q %v", line, err)
	}
	open[1].Close()
}
