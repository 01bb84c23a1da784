package aether

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ListenAddr is where the agent listens inside every sandbox, and what
// ProxyEnv points the workload's tools at.
const ListenAddr = "127.0.0.1:3128"

// ProxyEnv is the environment every exec gets: both spellings of the usual
// variables, since tools read one or the other.
func ProxyEnv() []string {
	u := "http://" + ListenAddr
	no := "localhost,127.0.0.1,::1"
	return []string{
		"http_proxy=" + u, "HTTP_PROXY=" + u,
		"https_proxy=" + u, "HTTPS_PROXY=" + u,
		"no_proxy=" + no, "NO_PROXY=" + no,
	}
}

// Bounds of one proxied connection's set-up, so a workload that sends
// nothing or sends too much holds little for little time.
const (
	maxHeaderBytes = 64 << 10
	helloTimeout   = 10 * time.Second
	defaultDial    = 10 * time.Second
	// DefaultMaxConns is how many connections one sandbox may have open
	// through the proxy at once; later ones wait in the agent's backlog.
	DefaultMaxConns = 32
)

// Conn is one connection a workload made to its proxy, relayed by the
// agent (agent.EgressConn): what the workload sent is read, what it should
// receive is written; CloseWrite ends that direction.
type Conn interface {
	io.ReadWriteCloser
	CloseWrite() error
}

// Event is one decision, recorded when the connection ends (or at once
// when it is refused): what the trajectory and the metrics get.
type Event struct {
	// Start is when the connection was made, Time when it was decided
	// (refused) or ended.
	Start   time.Time
	Time    time.Time
	Host    string
	Port    int
	Method  string
	Addr    string // the address dialled, when one was
	Allowed bool
	// Rule is what decided ("allow pypi", "default deny", "deny pypi: SNI
	// other.example does not match the CONNECT host").
	Rule string
	// BytesOut went from the sandbox upstream, BytesIn came back.
	BytesOut, BytesIn int64
	// Ended says why an allowed connection ended early, if it did (the
	// policy changed, the upstream failed).
	Ended string
}

// Config is what a Proxy needs from the edge.
type Config struct {
	Resolver *Resolver
	// Dial connects to an address the proxy resolved; default net.Dialer.
	Dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	DialTimeout time.Duration
	MaxConns    int
	// Record receives every decision; it must not block for long.
	Record func(sandbox string, e Event)
	// Mirror, if set, answers plain-HTTP requests for MirrorHost (and
	// apt's for deb.debian.org/debian/) without dialing, for the
	// ecosystems a sandbox's policy allows (mirrorserve.go).
	Mirror *Mirror
}

// Proxy is the edge's half of egress, shared by all of its sandboxes.
type Proxy struct {
	cfg Config
}

// New returns a proxy.
func New(cfg Config) *Proxy {
	if cfg.Resolver == nil {
		cfg.Resolver = NewResolver(nil)
	}
	if cfg.Dial == nil {
		cfg.Dial = (&net.Dialer{}).DialContext
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = defaultDial
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.Record == nil {
		cfg.Record = func(string, Event) {}
	}
	return &Proxy{cfg: cfg}
}

// Sandbox is one sandbox's egress: its policy and its open connections.
type Sandbox struct {
	p  *Proxy
	id string

	mu     sync.Mutex
	policy Policy
	conns  map[*tunnel]struct{}
	closed bool
}

// tunnel is one allowed, open connection: what it was allowed as, and how
// to end it when the policy no longer allows it.
type tunnel struct {
	q      Request
	client Conn
	up     net.Conn // nil when the mirror serves it
	ended  string   // set under Sandbox.mu when the policy closed it
}

// close ends both sides; a request the mirror serves has no upstream.
func (t *tunnel) close() {
	t.client.Close()
	if t.up != nil {
		t.up.Close()
	}
}

// Sandbox starts tracking a sandbox's egress under policy.
func (p *Proxy) Sandbox(id string, policy Policy) *Sandbox {
	return &Sandbox{p: p, id: id, policy: policy, conns: map[*tunnel]struct{}{}}
}

// Policy returns the sandbox's current policy.
func (sb *Sandbox) Policy() Policy {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.policy
}

// SetPolicy replaces the policy: new connections are decided by it at
// once, and open connections it no longer allows are closed. It returns
// how many were closed.
func (sb *Sandbox) SetPolicy(p Policy) int {
	sb.mu.Lock()
	sb.policy = p
	var drop []*tunnel
	for t := range sb.conns {
		if d := p.Decide(t.q); !d.Allowed {
			t.ended = "policy changed: " + d.Rule
			drop = append(drop, t)
		}
	}
	sb.mu.Unlock()
	for _, t := range drop {
		t.close()
	}
	return len(drop)
}

// Close closes every open connection; later ones are refused.
func (sb *Sandbox) Close() {
	sb.mu.Lock()
	sb.closed = true
	conns := sb.conns
	sb.conns = map[*tunnel]struct{}{}
	for t := range conns {
		t.ended = "sandbox closed"
	}
	sb.mu.Unlock()
	for t := range conns {
		t.close()
	}
}

// Run accepts the sandbox's proxy connections with accept (the agent's
// AcceptEgress) and serves each, at most MaxConns at once, until ctx ends
// or accept fails for good; it returns why.
func (sb *Sandbox) Run(ctx context.Context, accept func(ctx context.Context) (Conn, error)) error {
	sem := make(chan struct{}, sb.p.cfg.MaxConns)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
		c, err := accept(ctx)
		if err != nil {
			<-sem
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			sb.Serve(ctx, c)
		}()
	}
}

// Serve handles one connection: a CONNECT tunnel or one plain-HTTP
// request with an absolute http:// URL. Every outcome is recorded.
func (sb *Sandbox) Serve(ctx context.Context, c Conn) {
	defer c.Close()
	start := time.Now()
	lr := &io.LimitedReader{R: c, N: maxHeaderBytes}
	br := bufio.NewReaderSize(lr, 4096)
	req, err := http.ReadRequest(br)
	if err != nil {
		reply(c, http.StatusBadRequest, "dsec egress: not an HTTP proxy request")
		sb.record(Event{Rule: "deny: not an HTTP proxy request"})
		return
	}
	lr.N = math.MaxInt64
	q := Request{Method: req.Method}
	if req.Method == http.MethodConnect {
		host, port, err := net.SplitHostPort(req.Host)
		p, perr := strconv.Atoi(port)
		if err != nil || perr != nil || p < 1 || p > 65535 {
			reply(c, http.StatusBadRequest, "dsec egress: CONNECT needs HOST:PORT")
			sb.record(Event{Host: req.Host, Method: req.Method, Rule: "deny: CONNECT without HOST:PORT"})
			return
		}
		q.Host, q.Port = host, p
	} else {
		if req.URL.Scheme != "http" || req.URL.Host == "" {
			reply(c, http.StatusBadRequest, "dsec egress: a proxy request needs an absolute http:// URL (https goes through CONNECT)")
			sb.record(Event{Host: req.Host, Method: req.Method, Rule: "deny: not an absolute http:// URL"})
			return
		}
		q.Host, q.Port = req.URL.Hostname(), 80
		if p := req.URL.Port(); p != "" {
			if q.Port, err = strconv.Atoi(p); err != nil {
				reply(c, http.StatusBadRequest, "dsec egress: bad port")
				return
			}
		}
	}
	ev := Event{Start: start, Host: q.Host, Port: q.Port, Method: q.Method}
	deny := func(status int, rule string) {
		ev.Rule = rule
		reply(c, status, "dsec egress: "+rule)
		sb.record(ev)
	}

	if sb.p.cfg.Mirror != nil && req.Method != http.MethodConnect {
		if done := sb.serveMirror(ctx, c, req, q, &ev, deny); done {
			return
		}
	}
	d := sb.Policy().Decide(q)
	if !d.Allowed {
		deny(http.StatusForbidden, d.Rule)
		return
	}
	addr, d, err := sb.resolve(ctx, q)
	if err != nil {
		deny(http.StatusBadGateway, "resolve: "+err.Error())
		return
	}
	if !d.Allowed {
		deny(http.StatusForbidden, d.Rule)
		return
	}
	q.Addr = addr.Addr()
	ev.Addr = addr.String()
	dctx, cancel := context.WithTimeout(ctx, sb.p.cfg.DialTimeout)
	up, err := sb.p.cfg.Dial(dctx, "tcp", addr.String())
	cancel()
	if err != nil {
		deny(http.StatusBadGateway, fmt.Sprintf("%s; dial %s: %v", d.Rule, addr, errors.Unwrap(err)))
		return
	}
	defer up.Close()
	t := &tunnel{q: q, client: c, up: up}
	if !sb.add(t) {
		deny(http.StatusServiceUnavailable, "sandbox closed")
		return
	}
	defer sb.remove(t)
	ev.Allowed, ev.Rule = true, d.Rule

	var out io.Reader = br
	if req.Method == http.MethodConnect {
		if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
			return
		}
		if _, err := netip.ParseAddr(strings.Trim(q.Host, "[]")); err != nil {
			// A name was allowed: what is sent through must be TLS for
			// that name. Anything else the proxy cannot vouch for.
			hello, why := checkHello(c, br, q.Host)
			if why != "" {
				ev.Allowed, ev.Rule = false, "deny "+strings.TrimPrefix(d.Rule, "allow ")+": "+why
				sb.record(ev)
				return
			}
			out = io.MultiReader(strings.NewReader(string(hello)), br)
		}
	} else {
		req.Header.Del("Proxy-Connection")
		req.Header.Del("Proxy-Authorization")
		req.Close = true // one request per connection: each is decided
		cw := &countWriter{w: up}
		if err := req.Write(cw); err != nil {
			ev.Ended = "upstream: " + err.Error()
			ev.BytesOut = cw.n
			sb.record(ev)
			return
		}
		ev.BytesOut = cw.n
		out = eofReader{}
	}
	o, i := relay(c, out, up, req.Method == http.MethodConnect)
	ev.BytesOut += o
	ev.BytesIn = i
	sb.mu.Lock()
	if t.ended != "" {
		ev.Ended = t.ended
	}
	sb.mu.Unlock()
	sb.record(ev)
}

// resolve picks the first address of q.Host the policy allows; the
// decision returned is for that address, or the last refusal.
func (sb *Sandbox) resolve(ctx context.Context, q Request) (netip.AddrPort, Decision, error) {
	if a, err := netip.ParseAddr(strings.Trim(q.Host, "[]")); err == nil {
		q.Addr = a.Unmap()
		return netip.AddrPortFrom(q.Addr, uint16(q.Port)), sb.Policy().Decide(q), nil
	}
	addrs, trusted, err := sb.p.cfg.Resolver.Resolve(ctx, q.Host)
	if err != nil {
		return netip.AddrPort{}, Decision{}, err
	}
	if len(addrs) == 0 {
		return netip.AddrPort{}, Decision{}, fmt.Errorf("%s has no address", q.Host)
	}
	// IPv4 first: a node here may have no IPv6 route.
	slices.SortStableFunc(addrs, func(a, b netip.Addr) int {
		switch {
		case a.Is4() && !b.Is4():
			return -1
		case b.Is4() && !a.Is4():
			return 1
		}
		return 0
	})
	var last Decision
	pol := sb.Policy()
	for _, a := range addrs {
		q.Addr, q.Trusted = a, trusted
		if last = pol.Decide(q); last.Allowed {
			return netip.AddrPortFrom(a, uint16(q.Port)), last, nil
		}
	}
	return netip.AddrPort{}, last, nil
}

func (sb *Sandbox) add(t *tunnel) bool {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.closed {
		return false
	}
	sb.conns[t] = struct{}{}
	return true
}

func (sb *Sandbox) remove(t *tunnel) {
	sb.mu.Lock()
	delete(sb.conns, t)
	sb.mu.Unlock()
}

func (sb *Sandbox) record(e Event) {
	e.Time = time.Now()
	if e.Start.IsZero() {
		e.Start = e.Time
	}
	sb.p.cfg.Record(sb.id, e)
}

// checkHello reads the TLS ClientHello the workload sends through an
// allowed CONNECT and returns its bytes, or why it is refused: not TLS,
// no server name or another one than the CONNECT host, or Encrypted
// Client Hello (whose real server name the proxy cannot see).
func checkHello(c Conn, br *bufio.Reader, host string) ([]byte, string) {
	timer := time.AfterFunc(helloTimeout, func() { c.Close() })
	defer timer.Stop()
	rec := &recorder{r: br}
	var hello *tls.ClientHelloInfo
	errStop := errors.New("stop")
	srv := tls.Server(rec, &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		hello = h
		return nil, errStop
	}})
	srv.Handshake()
	if hello == nil {
		return nil, "not a TLS ClientHello (only TLS for the CONNECT host goes through)"
	}
	if slices.Contains(hello.Extensions, 0xfe0d) {
		return nil, "Encrypted Client Hello hides the server name"
	}
	if !strings.EqualFold(strings.TrimSuffix(hello.ServerName, "."), strings.TrimSuffix(host, ".")) {
		if hello.ServerName == "" {
			return nil, "TLS ClientHello names no server (SNI)"
		}
		return nil, fmt.Sprintf("SNI %q does not match the CONNECT host", hello.ServerName)
	}
	return rec.buf, ""
}

// recorder is a net.Conn over what the workload sent, remembering every
// byte read so the ClientHello can be replayed upstream; what crypto/tls
// writes (an alert when it is stopped) is dropped.
type recorder struct {
	r   io.Reader
	buf []byte
}

func (r *recorder) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	r.buf = append(r.buf, p[:n]...)
	return n, err
}
func (r *recorder) Write(p []byte) (int, error)      { return len(p), nil }
func (r *recorder) Close() error                     { return nil }
func (r *recorder) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (r *recorder) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (r *recorder) SetDeadline(time.Time) error      { return nil }
func (r *recorder) SetReadDeadline(time.Time) error  { return nil }
func (r *recorder) SetWriteDeadline(time.Time) error { return nil }

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// relay copies from (what the workload sends) to up and up to c until
// both directions end, half-closing c when up ends, and up when from ends
// if halfClose (a tunnel; a plain-HTTP request was sent whole, and an HTTP
// server takes a half-close for a client that went away).
func relay(c Conn, from io.Reader, up net.Conn, halfClose bool) (out, in int64) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		out, _ = io.Copy(up, from)
		if cw, ok := up.(interface{ CloseWrite() error }); ok && halfClose {
			cw.CloseWrite()
		}
	}()
	in, err := io.Copy(c, up)
	if err != nil {
		// The workload's side is gone: stop the other direction too.
		up.Close()
		c.Close()
	} else {
		c.CloseWrite()
	}
	<-done
	return out, in
}

func reply(c Conn, status int, msg string) {
	fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s\n",
		status, http.StatusText(status), len(msg)+1, msg)
}
