package inproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

const local = "http://edge.test:7111"

// newTransport serves local with h and everything else over the network.
func newTransport(t *testing.T, h http.Handler) (*Transport, *bytes.Buffer) {
	t.Helper()
	var log syncBuffer
	tr, err := New(nil, map[string]http.Handler{local: h}, slog.New(slog.NewTextHandler(&log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return tr, &log.buf
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// The handler sees what a server would have read off a connection, and
// the caller gets the handler's status, headers and body.
func TestUnary(t *testing.T) {
	type seen struct {
		method, host, uri, urlHost, remote, proto, auth, body string
		contentLength                                         int64
		te                                                    []string
	}
	got := make(chan seen, 1)
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("read request body: %v", err)
		}
		got <- seen{r.Method, r.Host, r.RequestURI, r.URL.Host, r.RemoteAddr, r.Proto, r.Header.Get("Authorization"), string(b), r.ContentLength, r.TransferEncoding}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		w.Header().Set("X-Late", "not sent") // after WriteHeader, as over the network
		io.WriteString(w, "hello ")
		io.WriteString(w, "world")
	}))
	req, err := http.NewRequest(http.MethodPost, local+"/dsec.v1.EdgeService/GetOnEdge?x=1", strings.NewReader("ping"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer secret")
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusCreated || resp.Status != "201 Created" || resp.ProtoMajor != 1 ||
		resp.Header.Get("Content-Type") != "text/plain" || resp.Header.Get("X-Late") != "" || string(b) != "hello world" {
		t.Errorf("response %q %v %q body %q", resp.Status, resp.Header, resp.Proto, b)
	}
	if resp.ContentLength != int64(len("hello world")) {
		t.Errorf("ContentLength %d, want %d: the handler had returned", resp.ContentLength, len("hello world"))
	}
	want := seen{"POST", "edge.test:7111", "/dsec.v1.EdgeService/GetOnEdge?x=1", "", RemoteAddr, "HTTP/1.1", "Bearer secret", "ping", 4, nil}
	if s := <-got; fmt.Sprint(s) != fmt.Sprint(want) {
		t.Errorf("handler saw %+v\nwant %+v", s, want)
	}
	if tr.Served() != 1 {
		t.Errorf("Served() = %d, want 1", tr.Served())
	}
}

// A request body of unknown length arrives as a server sees a chunked one,
// and the handler reads it while the caller writes it.
func TestRequestBodyStreams(t *testing.T) {
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != -1 || len(r.TransferEncoding) != 1 || r.TransferEncoding[0] != "chunked" {
			t.Errorf("ContentLength %d TransferEncoding %v, want -1 [chunked]", r.ContentLength, r.TransferEncoding)
		}
		io.Copy(w, r.Body)
	}))
	pr, pw := io.Pipe()
	go func() {
		for i := range 100 {
			fmt.Fprintf(pw, "line %d\n", i)
		}
		pw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPost, local+"/echo", pr)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if n := strings.Count(string(b), "\n"); n != 100 {
		t.Errorf("echoed %d lines, want 100", n)
	}
}

// A streaming response's first chunk reaches the caller while the handler
// is still running: the handler cannot finish before the caller has read it.
func TestStreamingResponse(t *testing.T) {
	release := make(chan struct{})
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "first")
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, "second")
	}))
	req, _ := http.NewRequest(http.MethodGet, local+"/stream", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.ContentLength != -1 {
		t.Errorf("ContentLength %d while the handler runs, want -1", resp.ContentLength)
	}
	first := make([]byte, 5)
	if _, err := io.ReadFull(resp.Body, first); err != nil || string(first) != "first" {
		t.Fatalf("first chunk %q, %v", first, err)
	}
	close(release)
	rest, err := io.ReadAll(resp.Body)
	if err != nil || string(rest) != "second" {
		t.Fatalf("rest %q, %v", rest, err)
	}
}

// A body larger than the buffer goes through without a flush: the headers
// are sent once the buffer is full and the writes wait for the reader.
func TestLargeBody(t *testing.T) {
	want := bytes.Repeat([]byte("0123456789abcdef"), 4*bufferSize/16+7)
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for p := want; len(p) > 0; {
			n := min(len(p), 1000)
			if _, err := w.Write(p[:n]); err != nil {
				t.Errorf("write: %v", err)
				return
			}
			p = p[n:]
		}
	}))
	req, _ := http.NewRequest(http.MethodGet, local+"/big", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got bytes.Buffer
	buf := make([]byte, 777) // small reads, so the writer waits for room
	for {
		n, err := resp.Body.Read(buf)
		got.Write(buf[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Errorf("got %d bytes, want %d, equal %v", got.Len(), len(want), bytes.Equal(got.Bytes(), want))
	}
}

// Closing the body before its end cancels the handler's context and fails
// its writes, even one blocked on a full buffer.
func TestEarlyCloseCancelsHandler(t *testing.T) {
	type result struct{ writeErr, ctxErr error }
	done := make(chan result, 1)
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := bytes.Repeat([]byte("x"), 1024)
		for {
			if _, err := w.Write(chunk); err != nil {
				<-r.Context().Done()
				done <- result{err, r.Context().Err()}
				return
			}
			w.(http.Flusher).Flush()
		}
	}))
	req, _ := http.NewRequest(http.MethodGet, local+"/forever", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	r := <-done
	if !errors.Is(r.writeErr, errBodyClosed) || !errors.Is(r.ctxErr, context.Canceled) {
		t.Errorf("handler: write error %v, context %v; want %v and %v", r.writeErr, r.ctxErr, errBodyClosed, context.Canceled)
	}
	if _, err := resp.Body.Read(make([]byte, 1)); err == nil {
		t.Error("read after Close succeeded")
	}
}

// The caller's context reaches the handler, before the response and after.
func TestContextCancel(t *testing.T) {
	for _, flush := range []bool{false, true} {
		t.Run(fmt.Sprintf("flushed=%v", flush), func(t *testing.T) {
			started, done := make(chan struct{}), make(chan error, 1)
			tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if flush {
					io.WriteString(w, "head")
					w.(http.Flusher).Flush()
				}
				close(started)
				<-r.Context().Done()
				_, err := io.WriteString(w, "too late")
				done <- errors.Join(r.Context().Err(), err)
			}))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, local+"/wait", nil)
			if !flush {
				go func() { <-started; cancel() }()
				if _, err := tr.RoundTrip(req); !errors.Is(err, context.Canceled) {
					t.Fatalf("RoundTrip: %v, want context.Canceled", err)
				}
			} else {
				resp, err := tr.RoundTrip(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				<-started
				cancel()
				b, err := io.ReadAll(resp.Body)
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("read %q, %v; want context.Canceled", b, err)
				}
			}
			if err := <-done; !errors.Is(err, context.Canceled) || err.Error() == context.Canceled.Error() {
				t.Errorf("handler: %v; want its context cancelled and its write failed", err)
			}
		})
	}
	// A context already done never reaches the handler.
	tr, _ := newTransport(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("handler ran") }))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, local+"/", nil)
	if _, err := tr.RoundTrip(req); !errors.Is(err, context.Canceled) {
		t.Errorf("RoundTrip with a done context: %v", err)
	}
}

// A panicking handler is an error for its caller, logged, and the process
// lives on.
func TestPanic(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before bool // panic before the response went out
		value  any
		logged bool
	}{
		{"before headers", true, "boom", true},
		{"after headers", false, "boom", true},
		{"abort", true, http.ErrAbortHandler, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, log := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !tc.before {
					io.WriteString(w, "partial")
					w.(http.Flusher).Flush()
				}
				panic(tc.value)
			}))
			req, _ := http.NewRequest(http.MethodGet, local+"/panic", nil)
			resp, err := tr.RoundTrip(req)
			if !tc.before {
				if err != nil {
					t.Fatal(err)
				}
				var b []byte
				b, err = io.ReadAll(resp.Body)
				resp.Body.Close()
				if string(b) != "partial" {
					t.Errorf("body %q before the error, want %q", b, "partial")
				}
			}
			if err == nil || !strings.Contains(err.Error(), "/panic") {
				t.Fatalf("error %v, want one naming the request", err)
			}
			if tc.logged && (!strings.Contains(err.Error(), "panicked: boom") || !strings.Contains(log.String(), "inproc_test.go")) {
				t.Errorf("error %q, log %q: want the panic value and its stack", err, log)
			}
			if !tc.logged && log.Len() > 0 {
				t.Errorf("ErrAbortHandler logged: %s", log)
			}
		})
	}
}

func TestTrailers(t *testing.T) {
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Sum")
		io.WriteString(w, "body")
		w.Header().Set("X-Sum", "42")
		w.Header().Set(http.TrailerPrefix+"x-late", "yes")
	}))
	req, _ := http.NewRequest(http.MethodGet, local+"/t", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	if resp.Trailer.Get("X-Sum") != "42" || resp.Trailer.Get("X-Late") != "yes" {
		t.Errorf("trailers %v", resp.Trailer)
	}
}

// Other URLs go to the base transport, here over real TCP.
func TestOtherURLsDelegate(t *testing.T) {
	remote := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "remote saw %s", r.RemoteAddr)
	}))
	defer remote.Close()
	tr, _ := newTransport(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Error("local handler called") }))
	resp, err := (&http.Client{Transport: tr}).Get(remote.URL + "/x")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if !strings.HasPrefix(string(b), "remote saw 127.0.0.1:") || strings.HasSuffix(string(b), ":0") {
		t.Errorf("remote answered %q", b)
	}
	if tr.Served() != 0 {
		t.Errorf("Served() = %d, want 0", tr.Served())
	}
}

func TestNewRefusesBadURLs(t *testing.T) {
	h := http.NotFoundHandler()
	for _, tc := range []struct {
		handlers map[string]http.Handler
		want     string
	}{
		{map[string]http.Handler{"127.0.0.1:7110": h}, `"127.0.0.1:7110": want http://HOST[:PORT]`},
		{map[string]http.Handler{"ftp://h": h}, `"ftp://h"`},
		{map[string]http.Handler{"http://h/edge": h}, "no path"},
		{map[string]http.Handler{"http://": h}, `"http://"`},
		{map[string]http.Handler{"http://h\x7f": h}, "invalid control character"},
		{map[string]http.Handler{"http://h": nil}, "nil"},
		{map[string]http.Handler{"http://H": h, "http://h/": h}, "same http://h"},
	} {
		if _, err := New(nil, tc.handlers, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%v): %v, want an error containing %q", tc.handlers, err, tc.want)
		}
	}
	if _, err := New(nil, map[string]http.Handler{"https://Edge.Example:443/": h}, nil); err != nil {
		t.Errorf("New with a good URL: %v", err)
	}
}

// edgeStub is an EdgeService with two methods, enough to run Connect's
// unary and server-streaming protocols over the transport.
type edgeStub struct {
	dsecv1connect.UnimplementedEdgeServiceHandler
	release  chan struct{}
	wantPeer string // if set, the peer address GetOnEdge must see
}

func (s edgeStub) GetOnEdge(_ context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.GetSandboxResponse], error) {
	if req.Header().Get("Authorization") != "Bearer secret" || (s.wantPeer != "" && req.Peer().Addr != s.wantPeer) {
		return nil, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("auth %q from %q", req.Header().Get("Authorization"), req.Peer().Addr))
	}
	if req.Msg.GetSandboxId() == "missing" {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("sandbox missing not found"))
	}
	return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: &dsecv1.Sandbox{Id: req.Msg.GetSandboxId()}}), nil
}

func (s edgeStub) ExecStreamOnEdge(ctx context.Context, _ *connect.Request[dsecv1.EdgeExecRequest], st *connect.ServerStream[dsecv1.ExecStreamResponse]) error {
	if err := st.Send(&dsecv1.ExecStreamResponse{Event: &dsecv1.ExecStreamResponse_Stdout{Stdout: []byte("early")}}); err != nil {
		return err
	}
	select {
	case <-s.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return st.Send(&dsecv1.ExecStreamResponse{Event: &dsecv1.ExecStreamResponse_Result{Result: &dsecv1.ExecResult{ExitCode: 3}}})
}

func TestConnect(t *testing.T) {
	stub := edgeStub{release: make(chan struct{}), wantPeer: RemoteAddr}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewEdgeServiceHandler(stub))
	tr, _ := newTransport(t, mux)
	client := dsecv1connect.NewEdgeServiceClient(&http.Client{Transport: tr}, local)
	ctx := context.Background()

	req := connect.NewRequest(&dsecv1.EdgeSandboxRequest{SandboxId: "n1-1"})
	req.Header().Set("Authorization", "Bearer secret")
	resp, err := client.GetOnEdge(ctx, req)
	if err != nil || resp.Msg.GetSandbox().GetId() != "n1-1" {
		t.Fatalf("GetOnEdge: %v, %v", resp, err)
	}
	req = connect.NewRequest(&dsecv1.EdgeSandboxRequest{SandboxId: "missing"})
	req.Header().Set("Authorization", "Bearer secret")
	if _, err := client.GetOnEdge(ctx, req); connect.CodeOf(err) != connect.CodeNotFound || !strings.Contains(err.Error(), "missing not found") {
		t.Fatalf("GetOnEdge(missing): %v, want NotFound", err)
	}

	st, err := client.ExecStreamOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeExecRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	// The handler is blocked until the first message has been received.
	if !st.Receive() || string(st.Msg().GetStdout()) != "early" {
		t.Fatalf("first message %v, %v", st.Msg(), st.Err())
	}
	close(stub.release)
	if !st.Receive() || st.Msg().GetResult().GetExitCode() != 3 {
		t.Fatalf("second message %v, %v", st.Msg(), st.Err())
	}
	if st.Receive() || st.Err() != nil {
		t.Fatalf("after the end: %v, %v", st.Msg(), st.Err())
	}
}

// BenchmarkUnary is one small Connect call through the transport, against
// the same call over loopback TCP.
func BenchmarkUnary(b *testing.B) {
	mux := http.NewServeMux()
	// Small answers uncompressed, as the edge's handler does.
	mux.Handle(dsecv1connect.NewEdgeServiceHandler(edgeStub{}, connect.WithCompressMinBytes(4096)))
	tr, err := New(nil, map[string]http.Handler{local: mux}, nil)
	if err != nil {
		b.Fatal(err)
	}
	tcp := httptest.NewServer(mux)
	defer tcp.Close()
	for _, bc := range []struct {
		name string
		url  string
	}{{"loopback", tcp.URL}, {"inproc", local}} {
		b.Run(bc.name, func(b *testing.B) {
			client := dsecv1connect.NewEdgeServiceClient(&http.Client{Transport: tr}, bc.url)
			b.ReportAllocs()
			for b.Loop() {
				req := connect.NewRequest(&dsecv1.EdgeSandboxRequest{SandboxId: "n1-1"})
				req.Header().Set("Authorization", "Bearer secret")
				if _, err := client.GetOnEdge(context.Background(), req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
