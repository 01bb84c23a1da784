package controlplane

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// countingBody counts the bytes a handler reads of a request body.
type countingBody struct {
	r io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.n.Add(int64(n))
	return n, err
}

func (b countingBody) Close() error { return b.r.Close() }

// counted serves h, counting what it reads of request bodies in n.
func counted(h http.Handler, n *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = countingBody{r.Body, n}
		h.ServeHTTP(w, r)
	})
}

// post sends body to url+path as a Connect unary call (proto; gzip when
// gz), with token if any, and returns the HTTP status and the error text.
func post(t *testing.T, url, path, token string, body io.Reader, gz bool) (int, string) {
	t.Helper()
	r, err := http.NewRequest(http.MethodPost, url+path, body)
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("Content-Type", "application/proto")
	if gz {
		r.Header.Set("Content-Encoding", "gzip")
	}
	if token != "" {
		r.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(b)
}

// gzipZeros is n zero bytes gzipped: a few hundred KB for hundreds of MB.
func gzipZeros(t *testing.T, n int64) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(zw, zeros{}, n); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// procedures lists every RPC path of fd's services.
func procedures(fd protoreflect.FileDescriptor) []string {
	var out []string
	svcs := fd.Services()
	for i := range svcs.Len() {
		ms := svcs.Get(i).Methods()
		for j := range ms.Len() {
			out = append(out, "/"+string(svcs.Get(i).FullName())+"/"+string(ms.Get(j).Name()))
		}
	}
	return out
}

// countedCluster is a cluster with one edge whose server and edge each
// listen on a real HTTP server, both counting into read the body bytes
// their handlers read.
func countedCluster(t *testing.T) (c *cluster, api, edgeSrv *httptest.Server, read *atomic.Int64) {
	t.Helper()
	c = newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 8000, MemoryBytes: 8 << 30, Sandboxes: 4}, placement.Share{})
	read = new(atomic.Int64)
	mux := http.NewServeMux()
	c.srv.Mount(mux)
	api = httptest.NewServer(counted(mux, read))
	t.Cleanup(api.Close)
	emux := http.NewServeMux()
	c.edges["n1"].e.Mount(emux)
	edgeSrv = httptest.NewServer(counted(emux, read))
	t.Cleanup(edgeSrv.Close)
	return c, api, edgeSrv, read
}

// Nothing is read of a request before its caller is authenticated: every
// procedure of the public API, NodeService, /run_code and EdgeService
// answers 401 to a call without a token, or with a wrong one, having read
// none of its body. A gzip bomb sent without a token is not inflated.
// (Connect reads and inflates a body before interceptors run: the token
// check was an interceptor, and a 50 KB POST became 50 MB before its 401.)
func TestAuthBeforeBody(t *testing.T) {
	c, api, edgeSrv, read := countedCluster(t)

	bomb := gzipZeros(t, 64<<20)
	paths := append(procedures(dsecv1.File_dsec_v1_dsec_proto), "/run_code")
	var nodePaths, edgePaths []string
	for _, p := range procedures(dsecv1.File_dsec_v1_edge_proto) {
		if strings.HasPrefix(p, "/dsec.v1.NodeService/") {
			nodePaths = append(nodePaths, p)
		} else {
			edgePaths = append(edgePaths, p)
		}
	}
	if len(paths) < 20 || len(nodePaths) != 1 || len(edgePaths) < 10 {
		t.Fatalf("procedures: %d public, %d node, %d edge", len(paths), len(nodePaths), len(edgePaths))
	}
	check := func(base string, paths []string, tokens ...string) {
		for _, p := range paths {
			for _, tok := range tokens {
				read.Store(0)
				code, body := post(t, base, p, tok, bytes.NewReader(bomb), true)
				if code != http.StatusUnauthorized && code != http.StatusForbidden {
					t.Errorf("%s with token %q: HTTP %d %q, want 401", p, tok, code, body)
				}
				if n := read.Load(); n != 0 {
					t.Errorf("%s with token %q: the server read %d bytes of the body before refusing it", p, tok, n)
				}
			}
		}
	}
	// The cluster token is no API token, and neither is an API token a
	// cluster token.
	check(api.URL, paths, "", "alice.0000", clusterToken)
	check(api.URL, nodePaths, "", c.admin)
	check(edgeSrv.URL, edgePaths, "", c.admin)
}

// Bodies are bounded on the wire and after inflation, for authenticated
// callers too: a body past limits.MaxRequestBytes is ResourceExhausted
// having read at most the bound, and a gzip bomb stops inflating at the
// bound instead of being inflated to its end to report its size.
func TestRequestBounds(t *testing.T) {
	c, api, edgeSrv, read := countedCluster(t)

	const over = limits.MaxRequestBytes + 8<<20
	for _, tc := range []struct {
		name, base, path, token string
	}{
		{"api", api.URL, "/dsec.v1.SandboxService/WriteFile", c.admin},
		{"node service", api.URL, "/dsec.v1.NodeService/Heartbeat", clusterToken},
		{"edge service", edgeSrv.URL, "/dsec.v1.EdgeService/WriteFileOnEdge", clusterToken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			read.Store(0)
			code, body := post(t, tc.base, tc.path, tc.token, io.LimitReader(zeros{}, over), false)
			if code != http.StatusTooManyRequests || !strings.Contains(body, "resource_exhausted") {
				t.Errorf("plain body of %d bytes: HTTP %d %q, want 429 resource_exhausted", over, code, body)
			}
			if n := read.Load(); n > limits.MaxRequestBytes+(1<<20)+1 {
				t.Errorf("read %d bytes of a body bounded at %d", n, limits.MaxRequestBytes)
			}

			// 256 MiB of zeros in ~250 KB: refused once the inflated
			// message passes the bound, without inflating the rest (the
			// error cannot say the message's full size).
			code, body = post(t, tc.base, tc.path, tc.token, bytes.NewReader(gzipZeros(t, 256<<20)), true)
			if code != http.StatusTooManyRequests || !strings.Contains(body, "resource_exhausted") {
				t.Errorf("gzip bomb: HTTP %d %q, want 429 resource_exhausted", code, body)
			}
			if !strings.Contains(body, "inflates past") || strings.Contains(body, "268435456") {
				t.Errorf("gzip bomb: %q: the body was inflated past its bound", body)
			}
		})
	}

	// A request within the bounds, gzipped, still works.
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	client := dsecv1connect.NewSandboxServiceClient(http.DefaultClient, api.URL, connect.WithSendGzip())
	sb, err := client.Create(context.Background(), req(c.admin, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1"}}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.destroy(c.admin, sb.Msg.GetSandbox().GetId())
	data := bytes.Repeat([]byte("0123456789abcdef"), 1<<20) // 16 MiB, compresses well
	if _, err := client.WriteFile(context.Background(), req(c.admin, &dsecv1.WriteFileRequest{
		SandboxId: sb.Msg.GetSandbox().GetId(), Path: "/tmp/f", Data: data,
	})); err != nil {
		t.Fatalf("gzipped 16 MiB WriteFile: %v", err)
	}
}

// What a service buffers for one answer is bounded: an exec's result
// carries at most limits.MaxOutputBytes of each stream, flagged truncated,
// whatever max_output_bytes asked for (one exec of 100 MB output took
// dsecd from 54 to 632 MB), while ExecStream delivers everything; a
// ReadFile returns at most limits.MaxReadBytes, and a larger file is the
// caller's InvalidArgument.
func TestOutputCeilings(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 8000, MemoryBytes: 8 << 30, Sandboxes: 4}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1"})
	if err != nil {
		t.Fatal(err)
	}
	id := sb.GetId()
	defer c.destroy(c.admin, id)
	const more = limits.MaxOutputBytes + 1<<20
	cmd := fmt.Sprintf("head -c %d /dev/zero; head -c %d /dev/zero >&2", more, more)

	resp, err := c.clients.sb.Exec(ctx, req(c.admin, &dsecv1.ExecRequest{SandboxId: id, Shell: cmd, MaxOutputBytes: 1 << 30}))
	if err != nil {
		t.Fatal(err)
	}
	res := resp.Msg.GetResult()
	if res.GetOutcome() != "ok" || len(res.GetStdout()) != limits.MaxOutputBytes || len(res.GetStderr()) != limits.MaxOutputBytes ||
		!res.GetStdoutTruncated() || !res.GetStderrTruncated() {
		t.Errorf("exec asking for 1 GiB of %d bytes each: outcome %q, stdout %d (truncated %v), stderr %d (truncated %v); want both %d and truncated",
			more, res.GetOutcome(), len(res.GetStdout()), res.GetStdoutTruncated(), len(res.GetStderr()), res.GetStderrTruncated(), limits.MaxOutputBytes)
	}

	// The same through BatchExec and Run: each item's result is bounded.
	bresp, err := c.clients.sb.BatchExec(ctx, req(c.admin, &dsecv1.BatchExecRequest{Requests: []*dsecv1.ExecRequest{
		{SandboxId: id, Shell: cmd, MaxOutputBytes: 1 << 30}}}))
	if err != nil {
		t.Fatal(err)
	}
	if r := bresp.Msg.GetResults()[0].GetResult(); len(r.GetStdout()) != limits.MaxOutputBytes || !r.GetStdoutTruncated() {
		t.Errorf("batch exec: stdout %d (truncated %v), want %d truncated", len(r.GetStdout()), r.GetStdoutTruncated(), limits.MaxOutputBytes)
	}

	// ExecStream is the way to more: all of it arrives.
	st, err := c.clients.sb.ExecStream(ctx, req(c.admin, &dsecv1.ExecRequest{SandboxId: id, Shell: cmd, MaxOutputBytes: 1 << 30}))
	if err != nil {
		t.Fatal(err)
	}
	var nout, nerr int
	for st.Receive() {
		nout += len(st.Msg().GetStdout())
		nerr += len(st.Msg().GetStderr())
	}
	st.Close()
	if st.Err() != nil || nout != more || nerr != more {
		t.Errorf("exec stream: %d and %d bytes, %v; want %d each", nout, nerr, st.Err(), more)
	}

	// fncall: output and fetched files are bounded likewise.
	if _, err := c.importPath(c.admin, fncall.DefaultImage, testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	fn := dsecv1connect.NewFnServiceClient(http.DefaultClient, c.url)
	fr, err := fn.RunCode(ctx, req(c.admin, &dsecv1.RunCodeRequest{Language: "sh", MaxOutputBytes: 1 << 30,
		Code:       fmt.Sprintf("head -c %d /dev/zero; head -c %d /dev/zero > a.bin; head -c %d /dev/zero > b.bin", more, 10<<20, 10<<20),
		FetchFiles: []string{"a.bin", "b.bin"}}))
	if err != nil {
		t.Fatal(err)
	}
	if rr := fr.Msg.GetRunResult(); len(rr.GetStdout()) != limits.MaxOutputBytes || !rr.GetStdoutTruncated() {
		t.Errorf("run_code asking for 1 GiB of %d bytes: stdout %d (truncated %v), want %d truncated", more, len(rr.GetStdout()), rr.GetStdoutTruncated(), limits.MaxOutputBytes)
	}
	if files := fr.Msg.GetFiles(); len(files["a.bin"]) != 10<<20 || files["b.bin"] != nil || !strings.Contains(fr.Msg.GetMessage(), "b.bin") {
		t.Errorf("run_code fetching 2 x 10 MiB: got %d and %d bytes, message %q; want the first, and the second named as over the bound",
			len(files["a.bin"]), len(files["b.bin"]), fr.Msg.GetMessage())
	}

	// ReadFile: a file of the ceiling reads (max_bytes 0 or above the
	// ceiling); one byte more is InvalidArgument naming the bound.
	if r, err := c.exec(c.admin, id, "sh", "-c", fmt.Sprintf("head -c %d /dev/zero > /tmp/at; head -c %d /dev/zero > /tmp/over", limits.MaxReadBytes, limits.MaxReadBytes+1)); err != nil || r.GetOutcome() != "ok" {
		t.Fatalf("make files: %v %v", r, err)
	}
	for _, max := range []int64{0, 1 << 30} {
		got, err := c.clients.sb.ReadFile(ctx, req(c.admin, &dsecv1.ReadFileRequest{SandboxId: id, Path: "/tmp/at", MaxBytes: max}))
		if err != nil || len(got.Msg.GetData()) != limits.MaxReadBytes {
			t.Errorf("read a file of the ceiling, max_bytes %d: %v", max, err)
		}
		_, err = c.clients.sb.ReadFile(ctx, req(c.admin, &dsecv1.ReadFileRequest{SandboxId: id, Path: "/tmp/over", MaxBytes: max}))
		wantCode(t, err, connect.CodeInvalidArgument, "max_bytes")
	}

	// The trajectory now holds records of tens of MiB each (outputs and
	// files inlined): a page stops at limits.MaxPageBytes (before its last
	// record) instead of holding page_size of them.
	token, pages, records := "", 0, 0
	for {
		tr, err := c.clients.sb.GetTrajectory(ctx, req(c.admin, &dsecv1.GetTrajectoryRequest{SandboxId: id, IncludeData: true, PageToken: token}))
		if err != nil {
			t.Fatal(err)
		}
		size, last := 0, 0
		for _, r := range tr.Msg.GetRecords() {
			size, last = size+len(r), len(r)
		}
		if len(tr.Msg.GetRecords()) == 0 || size-last >= limits.MaxPageBytes {
			t.Errorf("trajectory page %d: %d records, %d bytes, %d before its last; want at least one and under %d before the last",
				pages, len(tr.Msg.GetRecords()), size, size-last, limits.MaxPageBytes)
		}
		pages, records = pages+1, records+len(tr.Msg.GetRecords())
		if token = tr.Msg.GetNextPageToken(); token == "" {
			break
		}
	}
	if pages < 3 || records < 8 {
		t.Errorf("trajectory: %d records in %d pages; want the big records spread over pages", records, pages)
	}
}
