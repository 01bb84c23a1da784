// Package inproc lets an HTTP client reach a handler in its own process
// without a socket.
//
// `dsec up` runs the control plane and an edge in one process, and the
// server calls edges through Connect clients over HTTP. Over loopback TCP
// every sandbox operation was two HTTP requests inside one process, and the
// second hop (the client transport's read and write loops, the edge side's
// connection goroutine, TCP send and receive, netpoll wake-ups) cost 5-8 %
// of all CPU on a 2-core machine under load. A Transport hands requests
// for a registered origin straight to that origin's http.Handler, run in a
// goroutine, and streams its response back through an in-memory pipe: the
// handler's code (auth middleware, Connect, server streaming) runs
// unchanged, and the kernel is not involved.
//
// It is a package of its own because nothing in it is about DSec: it is an
// http.RoundTripper, tested against plain handlers.
package inproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// RemoteAddr is the Request.RemoteAddr a handler sees on an in-process
// request: loopback, since the caller is on this machine, and port 0,
// which no TCP peer has.
const RemoteAddr = "127.0.0.1:0"

// bufferSize is how many response bytes may wait between a handler and
// its caller before the handler's writes block, as a socket's buffers
// bound them. It is also when a handler that never flushes has its headers
// sent anyway (net/http sends them once its own buffer fills).
const bufferSize = 64 << 10

// errBodyClosed is what a handler's writes return once its caller has
// closed the response body before reading it all.
var errBodyClosed = errors.New("inproc: the caller closed the response body")

// Transport is an http.RoundTripper that serves requests to registered
// origins by calling their handlers in process, and passes every other
// request to a base transport.
//
// The handler sees a request as a server would: Proto HTTP/1.1, Host, the
// request target in URL and RequestURI, a copy of the headers, the body and
// its ContentLength (-1 and Transfer-Encoding chunked when unknown),
// RemoteAddr set to RemoteAddr, and a context that is cancelled when the
// caller's is, when the caller closes the response body early, or when the
// handler returns. Like net/http's server, the response's headers go out
// when the handler flushes, fills the buffer or returns (with an exact
// ContentLength then), and a panic is recovered and logged; the caller gets
// an error, from RoundTrip before the headers, from reading the body after.
// Trailers (declared in a Trailer header or with http.TrailerPrefix) are
// copied into Response.Trailer when the handler returns (the Connect
// protocol, which DSec's clients speak, keeps its trailers in headers and
// in the body and needs none). Not supported: Hijack, Content-Type
// sniffing (set the header) and HTTP/2: responses are HTTP/1.1, so
// Connect's client refuses bidirectional streams over it as it would over
// a real HTTP/1.1 connection, and the gRPC protocol needs HTTP/2 trailers.
type Transport struct {
	base     http.RoundTripper
	log      *slog.Logger
	handlers map[origin]http.Handler
	served   atomic.Int64
}

// origin is a URL's scheme and host: what a client dials.
type origin struct{ scheme, host string }

// New returns a Transport that serves requests to each base URL in
// handlers (scheme://host[:port], no path) with its handler and sends the
// rest through base (nil: http.DefaultTransport). Panics in handlers are
// logged to log (nil: slog.Default()). URLs are matched on scheme and host
// as written: "http://localhost:80" and "http://localhost" are different.
func New(base http.RoundTripper, handlers map[string]http.Handler, log *slog.Logger) (*Transport, error) {
	if base == nil {
		base = http.DefaultTransport
	}
	if log == nil {
		log = slog.Default()
	}
	t := &Transport{base: base, log: log, handlers: make(map[origin]http.Handler, len(handlers))}
	for raw, h := range handlers {
		o, err := parseOrigin(raw)
		if err != nil {
			return nil, err
		}
		if h == nil {
			return nil, fmt.Errorf("inproc: handler URL %q: the handler is nil", raw)
		}
		if _, dup := t.handlers[o]; dup {
			return nil, fmt.Errorf("inproc: handler URL %q: another URL names the same %s://%s", raw, o.scheme, o.host)
		}
		t.handlers[o] = h
	}
	return t, nil
}

func parseOrigin(raw string) (origin, error) {
	const want = "want http://HOST[:PORT] (or https) with no path, query or user"
	u, err := url.Parse(raw)
	if err != nil {
		return origin{}, fmt.Errorf("inproc: handler URL %q: %s (%w)", raw, want, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil ||
		(u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return origin{}, fmt.Errorf("inproc: handler URL %q: %s", raw, want)
	}
	return origin{u.Scheme, strings.ToLower(u.Host)}, nil
}

// Served returns how many requests were served in process so far.
func (t *Transport) Served() int64 { return t.served.Load() }

// CloseIdleConnections closes the base transport's idle connections.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	h := t.handlers[origin{req.URL.Scheme, strings.ToLower(req.URL.Host)}]
	if h == nil {
		return t.base.RoundTrip(req)
	}
	t.served.Add(1)
	return t.serve(h, req)
}

func (t *Transport) serve(h http.Handler, req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	if err := ctx.Err(); err != nil {
		closeBody(req)
		return nil, err
	}
	hctx, cancel := context.WithCancel(ctx)
	x := &exchange{req: req, log: t.log, hctx: hctx, cancel: cancel, ready: make(chan struct{}), head: req.Method == http.MethodHead}
	x.cond.L = &x.mu
	go x.serve(h, x.serverRequest())
	select {
	case <-x.ready:
		if err := ctx.Err(); err != nil {
			// Both happened; the caller's end wins, as it would have
			// torn the connection down.
			(*body)(x).Close()
			return nil, err
		}
		return x.resp, x.err
	case <-ctx.Done():
		// As net/http's transport does, give up at once; the handler's
		// context is cancelled with the caller's and its writes fail.
		return nil, ctx.Err()
	}
}

// serverRequest is the caller's request as a server would have read it off
// a connection.
func (x *exchange) serverRequest() *http.Request {
	req := x.req
	x.url = *req.URL
	x.url.Scheme, x.url.Host, x.url.User = "", "", nil // a server reads only the request target
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	body, n := req.Body, req.ContentLength
	switch {
	case body == nil || body == http.NoBody:
		body, n = http.NoBody, 0
	case n == 0:
		n = -1 // a client's 0 with a body means unknown
	}
	var te []string
	if n < 0 {
		te = []string{"chunked"}
	}
	h := req.Header.Clone()
	if h == nil {
		h = http.Header{}
	}
	r := &http.Request{
		Method:           method,
		URL:              &x.url,
		Proto:            "HTTP/1.1",
		ProtoMajor:       1,
		ProtoMinor:       1,
		Header:           h,
		Body:             body,
		ContentLength:    n,
		TransferEncoding: te,
		Host:             host,
		Trailer:          req.Trailer,
		RemoteAddr:       RemoteAddr,
		RequestURI:       x.url.RequestURI(),
	}
	return r.WithContext(x.hctx)
}

// closeBody closes a request's body, which a RoundTripper must do.
func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// exchange is one request in flight: the handler writes through it as a
// writer, the caller reads it as a body.
type exchange struct {
	req    *http.Request // the caller's
	log    *slog.Logger
	hctx   context.Context // the handler's request context
	cancel context.CancelFunc
	ready  chan struct{}  // closed once resp or err is set
	resp   *http.Response // &response once there is one
	err    error
	// In the exchange to save allocations: the handler's URL and the
	// caller's response.
	url      url.URL
	response http.Response

	// Used by the handler's goroutine only.
	header      http.Header
	wroteHeader bool
	published   bool  // ready is closed
	head        bool  // a HEAD request: writes are discarded
	noBody      bool  // HEAD, 204 or 304
	written     int64 // body bytes written

	// The pipe between them. cond (on mu) is broadcast on every change.
	mu   sync.Mutex
	cond sync.Cond
	buf  []byte // unread bytes are buf[off:]
	off  int
	werr error // set when the handler returned: what reads get once buf is drained
	rerr error // set when the caller is gone: what reads and writes get at once
	// watching is set once abort is registered to run when hctx ends: it
	// is needed only by a read or write that waits, which a small unary
	// exchange never does, so it is registered then.
	watching bool
}

// writer is the handler's http.ResponseWriter.
type writer exchange

// body is the caller's Response.Body.
type body exchange

func (w *writer) Header() http.Header {
	if w.header == nil {
		w.header = http.Header{}
	}
	return w.header
}

func (w *writer) WriteHeader(code int) {
	x := (*exchange)(w)
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // as net/http does
	}
	if x.wroteHeader {
		return
	}
	if code < 200 && code != http.StatusSwitchingProtocols {
		return // informational: a client's RoundTrip skips those too
	}
	x.wroteHeader = true
	x.noBody = x.head || code == http.StatusNoContent || code == http.StatusNotModified
	hdr := x.header.Clone() // later changes to the handler's map are not sent
	if hdr == nil {
		hdr = http.Header{}
	}
	x.response = http.Response{
		Status:        statusLine(code),
		StatusCode:    code,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        hdr,
		Body:          (*body)(x),
		ContentLength: -1,
		Request:       x.req,
	}
	r := &x.response
	if cl := hdr.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			r.ContentLength = n
		}
	}
	for _, v := range hdr["Trailer"] {
		for k := range strings.SplitSeq(v, ",") {
			if k = strings.TrimSpace(k); k != "" {
				if r.Trailer == nil {
					r.Trailer = http.Header{}
				}
				r.Trailer[http.CanonicalHeaderKey(k)] = nil
			}
		}
	}
	x.resp = r
}

func statusLine(code int) string {
	if code == http.StatusOK {
		return "200 OK"
	}
	return strconv.Itoa(code) + " " + http.StatusText(code)
}

func (w *writer) Write(p []byte) (int, error) {
	x := (*exchange)(w)
	if !x.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if x.noBody {
		if x.head {
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	return x.write(p)
}

func (x *exchange) write(p []byte) (int, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.rerr == nil {
		// The context is done before abort runs (context.AfterFunc
		// starts it in a goroutine): a handler that saw it done must not
		// have a write succeed after.
		if err := x.hctx.Err(); err != nil {
			x.rerr, x.buf, x.off = err, nil, 0
		}
	}
	for x.rerr == nil && len(x.buf)-x.off >= bufferSize {
		// The caller must see the headers to start reading.
		x.publish()
		x.watch()
		x.cond.Wait()
	}
	if x.rerr != nil {
		return 0, x.rerr
	}
	if x.off > 0 && len(x.buf)+len(p) > cap(x.buf) {
		// Drop what was read rather than growing past it.
		x.buf = x.buf[:copy(x.buf, x.buf[x.off:])]
		x.off = 0
	}
	x.buf = append(x.buf, p...)
	x.written += int64(len(p))
	x.cond.Broadcast()
	return len(p), nil
}

// Flush sends the headers; written bytes are readable as soon as written.
func (w *writer) Flush() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	(*exchange)(w).publish()
}

// FlushError is Flush for http.ResponseController, which reports whether
// the caller is still there.
func (w *writer) FlushError() error {
	w.Flush()
	x := (*exchange)(w)
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.rerr
}

// publish hands the response to RoundTrip.
func (x *exchange) publish() {
	if !x.published {
		x.published = true
		close(x.ready)
	}
}

// serve runs the handler and then ends the body: at EOF after a normal
// return, with an error after a panic.
func (x *exchange) serve(h http.Handler, r *http.Request) {
	defer func() {
		v := recover()
		end := io.EOF
		if v != nil {
			end = x.panicked(v)
		} else if !x.wroteHeader {
			(*writer)(x).WriteHeader(http.StatusOK)
		}
		x.mu.Lock()
		if v == nil {
			x.trailers()
			if !x.published && !x.head && x.resp.ContentLength < 0 {
				x.resp.ContentLength = x.written
			}
		}
		x.werr = end
		x.cond.Broadcast()
		x.mu.Unlock()
		if !x.published && v != nil {
			x.resp, x.err = nil, end
		}
		x.publish()
		x.cancel()
		closeBody(x.req)
	}()
	h.ServeHTTP((*writer)(x), r)
}

// trailers copies the handler's trailers into the response; the caller
// may read them once it has read the body to EOF. x.mu is held.
func (x *exchange) trailers() {
	t := x.resp.Trailer
	for k := range t {
		t[k] = x.header[k]
	}
	for k, v := range x.header {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			if t == nil {
				t = http.Header{}
				x.resp.Trailer = t
			}
			t[http.CanonicalHeaderKey(name)] = v
		}
	}
}

// panicked logs a handler's panic as net/http's server does (not
// http.ErrAbortHandler, the deliberate way to abort a response) and
// returns the caller's error.
func (x *exchange) panicked(v any) error {
	if v == http.ErrAbortHandler {
		return fmt.Errorf("inproc: %s %s: the handler aborted the response", x.req.Method, x.req.URL)
	}
	stack := make([]byte, 64<<10)
	stack = stack[:runtime.Stack(stack, false)]
	x.log.Error("inproc: handler panicked", "method", x.req.Method, "url", x.req.URL.String(), "panic", v, "stack", string(stack))
	return fmt.Errorf("inproc: %s %s: the handler panicked: %v", x.req.Method, x.req.URL, v)
}

// watch makes the end of the handler's context (the caller's context, an
// early Body.Close or the handler's return) wake whoever waits on cond;
// after the handler's return it is a no-op. x.mu is held. hctx is always
// cancelled in the end, so the registration does not outlive the exchange.
func (x *exchange) watch() {
	if !x.watching {
		x.watching = true
		context.AfterFunc(x.hctx, func() { x.abort(x.hctx.Err()) })
	}
}

// abort ends an unfinished exchange from the caller's side: reads and
// writes return err from now on.
func (x *exchange) abort(err error) {
	x.mu.Lock()
	if x.rerr == nil && x.werr == nil {
		x.rerr = err
		x.buf, x.off = nil, 0
		x.cond.Broadcast()
	}
	x.mu.Unlock()
}

func (b *body) Read(p []byte) (int, error) {
	x := (*exchange)(b)
	x.mu.Lock()
	defer x.mu.Unlock()
	for {
		if x.rerr != nil {
			return 0, x.rerr
		}
		if err := x.req.Context().Err(); err != nil {
			// The caller gave up: as over a torn-down connection, what
			// the handler wrote is lost, even its end.
			x.rerr, x.buf, x.off = err, nil, 0
			x.cond.Broadcast()
			return 0, err
		}
		if x.off < len(x.buf) {
			n := copy(p, x.buf[x.off:])
			x.off += n
			x.cond.Broadcast() // a writer may be waiting for room
			if x.off < len(x.buf) {
				return n, nil
			}
			x.buf, x.off = x.buf[:0], 0
			return n, x.werr // nil while the handler runs
		}
		if x.werr != nil {
			return 0, x.werr
		}
		x.watch()
		x.cond.Wait()
	}
}

// Close ends the exchange from the caller's side. Before the body's end it
// cancels the handler's context and fails its writes, as a closed
// connection would.
func (b *body) Close() error {
	x := (*exchange)(b)
	x.mu.Lock()
	if x.rerr == nil {
		x.rerr = errBodyClosed
		x.buf, x.off = nil, 0
		x.cond.Broadcast()
	}
	x.mu.Unlock()
	x.cancel()
	return nil
}
