package controlplane

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/spec"
	dsectest "github.com/dsec-dev/dsec/internal/testutil"
)

const clusterToken = "cluster-secret"

// cluster is a server and real edges (container backend) talking over HTTP
// on loopback, as `dsec server` and `dsec edge` processes would.
type cluster struct {
	t       testing.TB
	root    string
	store   *blobstore.Dir
	srv     *Server
	prom    *prometheus.Registry
	url     string
	admin   string
	offset  atomic.Int64 // added to the registry's clock
	beats   chan struct{}
	edges   map[string]*testEdge
	clients clients
	// autoPool is the edges' Config.AutoPool (0: no recycling), for the
	// edges added after it is set.
	autoPool int
	// defaults are the edges' Config.Defaults, for the edges added after
	// it is set.
	defaults spec.Resources
	// memoryReserve is the edges' Config.MemoryReserve, for the edges
	// added after it is set (0: the default).
	memoryReserve int64
	// wrap, when set, wraps the handler of the edges added after it is
	// set (to stand for a node whose state changed since its heartbeat).
	wrap func(http.Handler) http.Handler
}

type testEdge struct {
	e      *edge.Edge
	hs     *httptest.Server
	cancel context.CancelFunc
	done   chan struct{}
}

type clients struct {
	sb     dsecv1connect.SandboxServiceClient
	img    dsecv1connect.ImageServiceClient
	tenant dsecv1connect.TenantServiceClient
}

func newCluster(t testing.TB) *cluster {
	t.Helper()
	dsectest.RequireRoot(t)
	return startCluster(t)
}

// startCluster starts the server of a cluster, with no edge yet; it needs
// no root (edges over the container backend do).
func startCluster(t testing.TB) *cluster {
	t.Helper()
	root, err := os.MkdirTemp("", "dsec-cp-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	store, err := blobstore.NewDir(filepath.Join(root, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, root: root, store: store, prom: prometheus.NewRegistry(), beats: make(chan struct{}, 1), edges: map[string]*testEdge{}}
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv, err := New(Config{DataDir: root, Store: store, ClusterToken: clusterToken, Registry: c.prom, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	srv.reg.now = func() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }
	c.srv = srv
	mux := http.NewServeMux()
	srv.Mount(mux)
	// Tell the test about every heartbeat, so it waits for events rather
	// than for time to pass.
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mux.ServeHTTP(w, r)
		if r.URL.Path == dsecv1connect.NodeServiceHeartbeatProcedure {
			select {
			case c.beats <- struct{}{}:
			default:
			}
		}
	}))
	t.Cleanup(hs.Close)
	c.url = hs.URL
	b, err := os.ReadFile(filepath.Join(root, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	c.admin = strings.TrimSpace(string(b))
	c.clients = clients{
		sb:     dsecv1connect.NewSandboxServiceClient(http.DefaultClient, hs.URL),
		img:    dsecv1connect.NewImageServiceClient(http.DefaultClient, hs.URL),
		tenant: dsecv1connect.NewTenantServiceClient(http.DefaultClient, hs.URL),
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return c
}

// addEdge starts a real edge with its own container backend and layer
// mounts, sharing the cluster's blob store.
func (c *cluster) addEdge(id string, capacity placement.Capacity, share placement.Share) {
	t := c.t
	t.Helper()
	dir := filepath.Join(c.root, id)
	mounts, err := layer.NewMounts(filepath.Join(dir, "layers"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mounts.Close() })
	b, err := container.New(container.Options{
		StateDir:     filepath.Join(dir, "sandboxes"),
		AgentPath:    dsectest.BuildBinary(t, "./cmd/dsec-agent"),
		Layers:       mounts,
		Logger:       slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})),
		CgroupParent: "dsec-cp-test-" + filepath.Base(c.root) + "-" + id,
	})
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, so it runs after the edge's cleanup has
	// destroyed its sandboxes.
	t.Cleanup(func() {
		for _, d := range b.CgroupDirs() {
			os.Remove(d)
		}
	})
	c.startEdge(id, dir, b, capacity, share)
}

// startEdge starts an edge over backend b with its data in dir, and waits
// until the server knows it.
func (c *cluster) startEdge(id, dir string, b runtime.Backend, capacity placement.Capacity, share placement.Share) {
	t := c.t
	t.Helper()
	kind := b.Kind()
	mux := http.NewServeMux()
	var h http.Handler = mux
	if c.wrap != nil {
		h = c.wrap(mux)
	}
	hs := httptest.NewUnstartedServer(h)
	hs.Start()
	e, err := edge.New(edge.Config{
		NodeID:            id,
		DataDir:           dir,
		Store:             c.store,
		Backends:          map[runtime.Kind]runtime.Backend{kind: b},
		Capacity:          map[runtime.Kind]placement.Capacity{kind: capacity},
		RequestShare:      map[runtime.Kind]placement.Share{kind: share},
		AdvertiseURL:      hs.URL,
		Servers:           []string{c.url},
		ClusterToken:      clusterToken,
		HeartbeatInterval: 50 * time.Millisecond,
		UsageInterval:     100 * time.Millisecond, // sandboxes' own use shows soon
		AutoPool:          c.autoPool,
		Defaults:          c.defaults,
		MemoryReserve:     c.memoryReserve,
		Registry:          prometheus.NewRegistry(),
		Logger:            slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	e.Mount(mux)
	ctx, cancel := context.WithCancel(context.Background())
	te := &testEdge{e: e, hs: hs, cancel: cancel, done: make(chan struct{})}
	go func() { defer close(te.done); e.Run(ctx) }()
	c.edges[id] = te
	t.Cleanup(func() {
		te.stop()
		if err := e.Close(context.Background()); err != nil {
			t.Errorf("close edge %s: %v", id, err)
		}
	})
	c.waitFor("node "+id+" registered", func() bool {
		rt, _ := c.srv.reg.route(id + "-0000000000000000")
		return rt.alive
	})
}

// stop ends an edge's heartbeats and its HTTP service, as if its process
// died (its sandboxes are destroyed later, by the test cleanup).
func (te *testEdge) stop() {
	te.cancel()
	<-te.done
	te.hs.CloseClientConnections()
	te.hs.Close()
}

// waitFor blocks until cond holds, re-checking after every heartbeat.
func (c *cluster) waitFor(what string, cond func() bool) {
	c.t.Helper()
	deadline := time.After(30 * time.Second)
	for !cond() {
		select {
		case <-c.beats:
		case <-deadline:
			c.t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func req[T any](token string, msg *T) *connect.Request[T] {
	r := connect.NewRequest(msg)
	r.Header().Set("Authorization", "Bearer "+token)
	return r
}

func wantCode(t *testing.T, err error, code connect.Code, mention string) {
	t.Helper()
	if connect.CodeOf(err) != code {
		t.Fatalf("error %v: code %v, want %v", err, connect.CodeOf(err), code)
	}
	if mention != "" && !strings.Contains(err.Error(), mention) {
		t.Fatalf("error %q does not mention %q", err, mention)
	}
}

// tarDir writes dir as a tar stream (what `dsec image import` uploads).
func tarDir(t *testing.T, dir string) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		hdr.Name = rel
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = io.Copy(tw, f)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func (c *cluster) upload(token, ref string, public bool, data []byte) (*dsecv1.Image, error) {
	st := c.clients.img.Import(context.Background())
	st.RequestHeader().Set("Authorization", "Bearer "+token)
	if err := st.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Header{Header: &dsecv1.ImportHeader{Ref: ref, Public: public}}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	for len(data) > 0 {
		n := min(len(data), 64<<10)
		if err := st.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Chunk{Chunk: data[:n]}}); err != nil {
			break // the server answered early; CloseAndReceive has its error
		}
		data = data[n:]
	}
	resp, err := st.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetImage(), nil
}

func (c *cluster) importPath(token, ref, path string) (*dsecv1.Image, error) {
	st := c.clients.img.Import(context.Background())
	st.RequestHeader().Set("Authorization", "Bearer "+token)
	st.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Header{Header: &dsecv1.ImportHeader{Ref: ref, ServerPath: path}}})
	resp, err := st.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetImage(), nil
}

func (c *cluster) createTenant(name string, q *dsecv1.Quota) string {
	c.t.Helper()
	resp, err := c.clients.tenant.Create(context.Background(), req(c.admin, &dsecv1.CreateTenantRequest{Name: name, Quota: q}))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Msg.GetToken()
}

func (c *cluster) create(token string, spec *dsecv1.SandboxSpec) (*dsecv1.Sandbox, error) {
	resp, err := c.clients.sb.Create(context.Background(), req(token, &dsecv1.CreateSandboxRequest{Spec: spec}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetSandbox(), nil
}

func (c *cluster) exec(token, id string, argv ...string) (*dsecv1.ExecResult, error) {
	resp, err := c.clients.sb.Exec(context.Background(), req(token, &dsecv1.ExecRequest{SandboxId: id, Argv: argv}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetResult(), nil
}

func (c *cluster) execStream(token, id string, argv ...string) (stdout string, res *dsecv1.ExecResult, err error) {
	st, err := c.clients.sb.ExecStream(context.Background(), req(token, &dsecv1.ExecRequest{SandboxId: id, Argv: argv}))
	if err != nil {
		return "", nil, err
	}
	defer st.Close()
	var out strings.Builder
	for st.Receive() {
		out.Write(st.Msg().GetStdout())
		if r := st.Msg().GetResult(); r != nil {
			res = r
		}
	}
	return out.String(), res, st.Err()
}

func (c *cluster) list(token string, labels map[string]string) []*dsecv1.Sandbox {
	c.t.Helper()
	resp, err := c.clients.sb.List(context.Background(), req(token, &dsecv1.ListSandboxesRequest{Labels: labels}))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Msg.GetSandboxes()
}

func (c *cluster) destroy(token, id string) error {
	_, err := c.clients.sb.Destroy(context.Background(), req(token, &dsecv1.DestroySandboxRequest{Id: id}))
	return err
}

func byID(sbs []*dsecv1.Sandbox) map[string]*dsecv1.Sandbox {
	m := map[string]*dsecv1.Sandbox{}
	for _, s := range sbs {
		m[s.GetId()] = s
	}
	return m
}

// metric sums the scraped values of name over series carrying labels.
func (c *cluster) metric(name string, labels map[string]string) float64 {
	c.t.Helper()
	mfs, err := c.prom.Gather()
	if err != nil {
		c.t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

func TestCluster(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	// n1 reserves what sandboxes request (a share of 1); n2 places by
	// measured use only, and holds 1 GiB.
	const slots = 6
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: slots}, placement.Share{CPU: 1, Memory: 1})
	c.addEdge("n2", placement.Capacity{MilliCPU: 500_000, MemoryBytes: 1 << 30, Sandboxes: slots}, placement.Share{})

	rootfs := testsuite.BusyboxRootfs(t)
	var alice, bob, carol string

	t.Run("auth", func(t *testing.T) {
		_, err := c.clients.sb.List(ctx, connect.NewRequest(&dsecv1.ListSandboxesRequest{}))
		wantCode(t, err, connect.CodeUnauthenticated, "Bearer")
		_, err = c.clients.sb.List(ctx, req("alice.0000", &dsecv1.ListSandboxesRequest{}))
		wantCode(t, err, connect.CodeUnauthenticated, "")

		alice = c.createTenant("alice", &dsecv1.Quota{MaxSandboxes: 2})
		bob = c.createTenant("bob", nil)
		carol = c.createTenant("carol", &dsecv1.Quota{MaxMilliCpu: 1000})
		_, err = c.clients.tenant.Create(ctx, req(alice, &dsecv1.CreateTenantRequest{Name: "eve"}))
		wantCode(t, err, connect.CodePermissionDenied, "admin")
		_, err = c.clients.tenant.Create(ctx, req(c.admin, &dsecv1.CreateTenantRequest{Name: "alice"}))
		wantCode(t, err, connect.CodeAlreadyExists, "alice")
		_, err = c.clients.tenant.Create(ctx, req(c.admin, &dsecv1.CreateTenantRequest{Name: "Bad Name"}))
		wantCode(t, err, connect.CodeInvalidArgument, "name")

		// The cluster token is for edges, not for the public API, and the
		// admin token does not let anyone heartbeat.
		_, err = c.clients.sb.List(ctx, req(clusterToken, &dsecv1.ListSandboxesRequest{}))
		wantCode(t, err, connect.CodeUnauthenticated, "")
		nodes := dsecv1connect.NewNodeServiceClient(http.DefaultClient, c.url)
		_, err = nodes.Heartbeat(ctx, req(c.admin, &dsecv1.HeartbeatRequest{NodeId: "n9", Url: "http://x"}))
		wantCode(t, err, connect.CodeUnauthenticated, "cluster token")
	})

	t.Run("images", func(t *testing.T) {
		img, err := c.importPath(c.admin, "busybox:1", rootfs)
		if err != nil {
			t.Fatal(err)
		}
		if img.GetRef() != "busybox:1" || img.GetTenant() != "" || len(img.GetLayers()) != 1 {
			t.Fatalf("public import = %v", img)
		}
		mine, err := c.upload(alice, "mine:1", false, tarDir(t, rootfs))
		if err != nil {
			t.Fatal(err)
		}
		if mine.GetRef() != "mine:1" || mine.GetTenant() != "alice" {
			t.Fatalf("private import = %v", mine)
		}
		_, err = c.upload(alice, "pub:1", true, []byte("x"))
		wantCode(t, err, connect.CodePermissionDenied, "public")
		_, err = c.importPath(alice, "x:1", rootfs)
		wantCode(t, err, connect.CodePermissionDenied, "server_path")
		_, err = c.upload(alice, "t/bob/x:1", false, []byte("x"))
		wantCode(t, err, connect.CodeInvalidArgument, "reserved")

		refs := func(token string) []string {
			resp, err := c.clients.img.List(ctx, req(token, &dsecv1.ListImagesRequest{}))
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, i := range resp.Msg.GetImages() {
				out = append(out, i.GetRef()+"@"+i.GetTenant())
			}
			return out
		}
		for _, tc := range []struct {
			who, token string
			want       string
		}{
			{"alice", alice, "busybox:1@ mine:1@alice"},
			{"bob", bob, "busybox:1@"},
			{"admin", c.admin, "busybox:1@ t/alice/mine:1@alice"},
		} {
			if got := strings.Join(refs(tc.token), " "); got != tc.want {
				t.Errorf("%s lists %q, want %q", tc.who, got, tc.want)
			}
		}
		_, err = c.clients.img.Get(ctx, req(bob, &dsecv1.GetImageRequest{Ref: "mine:1"}))
		wantCode(t, err, connect.CodeNotFound, `"mine:1"`)
		_, err = c.clients.img.Delete(ctx, req(bob, &dsecv1.DeleteImageRequest{Ref: "busybox:1"}))
		wantCode(t, err, connect.CodePermissionDenied, "public")

		tagged, err := c.clients.img.Tag(ctx, req(alice, &dsecv1.TagImageRequest{Src: "mine:1", Dst: "mine:2"}))
		if err != nil || tagged.Msg.GetImage().GetRef() != "mine:2" || tagged.Msg.GetImage().GetDigest() != mine.GetDigest() {
			t.Fatalf("tag = %v, %v", tagged, err)
		}
		if _, err := c.clients.img.Delete(ctx, req(alice, &dsecv1.DeleteImageRequest{Ref: "mine:2"})); err != nil {
			t.Fatal(err)
		}
		_, err = c.clients.img.Get(ctx, req(alice, &dsecv1.GetImageRequest{Ref: "mine:2"}))
		wantCode(t, err, connect.CodeNotFound, "mine:2")
	})

	var aliceSB *dsecv1.Sandbox
	t.Run("sandbox lifecycle and isolation", func(t *testing.T) {
		sb, err := c.create(alice, &dsecv1.SandboxSpec{Image: "mine:1", Labels: map[string]string{"job": "a"}})
		if err != nil {
			t.Fatal(err)
		}
		aliceSB = sb
		if sb.GetTenant() != "alice" || sb.GetState() != "running" || sb.GetSpec().GetImage() != "mine:1" || sb.GetSpec().GetBackend() != "container" {
			t.Fatalf("created %v", sb)
		}
		res, err := c.exec(alice, sb.Id, "echo", "hello")
		if err != nil {
			t.Fatal(err)
		}
		if res.GetOutcome() != "ok" || string(res.GetStdout()) != "hello\n" {
			t.Fatalf("exec = %v", res)
		}
		res, _ = c.exec(alice, sb.Id, "sh", "-c", "exit 3")
		if res.GetOutcome() != "failed" || res.GetExitCode() != 3 {
			t.Fatalf("failing exec = %v", res)
		}
		out, res, err := c.execStream(alice, sb.Id, "sh", "-c", "echo one; echo two")
		if err != nil || out != "one\ntwo\n" || res.GetOutcome() != "ok" {
			t.Fatalf("exec stream = %q, %v, %v", out, res, err)
		}
		if _, err := c.clients.sb.WriteFile(ctx, req(alice, &dsecv1.WriteFileRequest{SandboxId: sb.Id, Path: "/tmp/f", Data: []byte("data")})); err != nil {
			t.Fatal(err)
		}
		rf, err := c.clients.sb.ReadFile(ctx, req(alice, &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/tmp/f"}))
		if err != nil || string(rf.Msg.GetData()) != "data" {
			t.Fatalf("read back %v, %v", rf, err)
		}
		got, err := c.clients.sb.Get(ctx, req(alice, &dsecv1.GetSandboxRequest{Id: sb.Id}))
		if err != nil || got.Msg.GetSandbox().GetSpec().GetImage() != "mine:1" {
			t.Fatalf("get = %v, %v", got, err)
		}

		// Bob cannot tell alice's sandbox from a missing one.
		_, err = c.clients.sb.Get(ctx, req(bob, &dsecv1.GetSandboxRequest{Id: sb.Id}))
		wantCode(t, err, connect.CodeNotFound, sb.Id)
		_, err = c.exec(bob, sb.Id, "true")
		wantCode(t, err, connect.CodeNotFound, "")
		_, _, err = c.execStream(bob, sb.Id, "true")
		wantCode(t, err, connect.CodeNotFound, "")
		_, err = c.clients.sb.ReadFile(ctx, req(bob, &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/tmp/f"}))
		wantCode(t, err, connect.CodeNotFound, "")
		wantCode(t, c.destroy(bob, sb.Id), connect.CodeNotFound, "")
		if l := c.list(bob, nil); len(l) != 0 {
			t.Fatalf("bob lists %d sandboxes, want 0", len(l))
		}
		_, err = c.create(bob, &dsecv1.SandboxSpec{Image: "mine:1"})
		wantCode(t, err, connect.CodeNotFound, `"mine:1"`)

		// Validation names the field.
		for _, tc := range []struct {
			spec  *dsecv1.SandboxSpec
			field string
		}{
			{nil, "spec"},
			{&dsecv1.SandboxSpec{}, "spec.image"},
			{&dsecv1.SandboxSpec{Image: "busybox:1", Backend: "kvm"}, "spec.backend"},
			{&dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: -1}}, "spec.resources.milli_cpu"},
			{&dsecv1.SandboxSpec{Image: "busybox:1", Toolkits: []string{"nope:1"}}, "spec.toolkits[0]"},
			{&dsecv1.SandboxSpec{Image: "Busybox"}, "spec.image"},
		} {
			_, err := c.create(alice, tc.spec)
			if err == nil || !strings.Contains(err.Error(), tc.field) {
				t.Errorf("create(%v) = %v, want an error naming %s", tc.spec, err, tc.field)
			}
		}
		_, err = c.exec(alice, "nonsense", "true")
		wantCode(t, err, connect.CodeInvalidArgument, "sandbox_id")
	})

	t.Run("quota", func(t *testing.T) {
		second, err := c.create(alice, &dsecv1.SandboxSpec{Image: "busybox:1", Labels: map[string]string{"job": "b"}})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.create(alice, &dsecv1.SandboxSpec{Image: "busybox:1"})
		wantCode(t, err, connect.CodeResourceExhausted, "max_sandboxes")
		batch, err := c.clients.sb.BatchCreate(ctx, req(alice, &dsecv1.BatchCreateSandboxesRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1"}, Count: 2}))
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range batch.Msg.GetResults() {
			if r.GetError().GetCode() != "resource_exhausted" {
				t.Errorf("batch item %d = %v, want resource_exhausted", i, r)
			}
		}
		_, err = c.create(carol, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 1500}})
		wantCode(t, err, connect.CodeResourceExhausted, "max_milli_cpu")

		if l := c.list(alice, map[string]string{"job": "a"}); len(l) != 1 || l[0].GetId() != aliceSB.GetId() {
			t.Fatalf("alice job=a lists %v", l)
		}
		if l := c.list(alice, nil); len(l) != 2 {
			t.Fatalf("alice lists %d sandboxes, want 2", len(l))
		}
		// Destroying frees the quota at once, without waiting for a
		// heartbeat.
		if err := c.destroy(alice, second.GetId()); err != nil {
			t.Fatal(err)
		}
		third, err := c.create(alice, &dsecv1.SandboxSpec{Image: "busybox:1"})
		if err != nil {
			t.Fatalf("create after destroy: %v", err)
		}
		if err := c.destroy(alice, third.GetId()); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("batch spreads over nodes", func(t *testing.T) {
		// Both edges share this host's load, which placement counts as a
		// floor on busyness, so layer locality decides between otherwise
		// equal nodes. A batch larger than one node's slots must still
		// spread, and never overfill a node.
		const batchSize = 8
		resp, err := c.clients.sb.BatchCreate(ctx, req(c.admin, &dsecv1.BatchCreateSandboxesRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1"}, Count: batchSize}))
		if err != nil {
			t.Fatal(err)
		}
		nodes := map[string]int{}
		var created []string
		for i, r := range resp.Msg.GetResults() {
			if r.GetError() != nil {
				t.Fatalf("item %d: %v", i, r.GetError())
			}
			nodes[r.GetSandbox().GetNode()]++
			created = append(created, r.GetSandbox().GetId())
		}
		if nodes["n1"] == 0 || nodes["n2"] == 0 || nodes["n1"] > slots || nodes["n2"] > slots {
			t.Fatalf("batch placed %v, want both nodes used", nodes)
		}
		if all := byID(c.list(c.admin, nil)); len(all) != batchSize+1 {
			t.Fatalf("admin lists %d sandboxes, want %d (alice's and the batch)", len(all), batchSize+1)
		}
		bogus := "n1-0000000000000000"
		d, err := c.clients.sb.BatchDestroy(ctx, req(c.admin, &dsecv1.BatchDestroySandboxesRequest{Ids: append(created, bogus)}))
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range d.Msg.GetResults() {
			if r.GetId() == bogus {
				if r.GetError().GetCode() != "not_found" {
					t.Errorf("destroy of unknown id = %v, want not_found", r)
				}
			} else if r.GetError() != nil {
				t.Errorf("destroy %s: %v", r.GetId(), r.GetError())
			}
		}
	})

	var onN2 *dsecv1.Sandbox
	t.Run("a node that says it is full gets nothing", func(t *testing.T) {
		// n4 keeps more memory in reserve than the machine has: its
		// heartbeats say it is full, so the server places nothing there
		// (no refusal, no retry), and a create only it could hold waits
		// in the admission queue until its deadline.
		c.memoryReserve = 1 << 50
		c.addEdge("n4", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: slots}, placement.Share{})
		c.memoryReserve = 0
		defer c.edges["n4"].stop()
		c.waitFor("n4 reported full", func() bool {
			c.srv.reg.mu.Lock()
			defer c.srv.reg.mu.Unlock()
			return c.srv.reg.nodes["n4"].status.GetFull() != ""
		})

		before := c.metric("dsec_server_placement_retries_total", nil)
		// The server's own bound on the wait, so that it answers (a
		// caller's deadline would race its answer).
		c.srv.cfg.QueueTimeout = time.Second
		defer func() { c.srv.cfg.QueueTimeout = DefaultQueueTimeout }()
		_, err := c.clients.sb.Create(context.Background(), req(c.admin, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 3_000_000, MemoryBytes: 2 << 30}}}))
		wantCode(t, err, connect.CodeResourceExhausted, "admission queue")
		if got := c.metric("dsec_server_placement_retries_total", nil) - before; got != 0 {
			t.Fatalf("placement retries went up by %v, want 0: a full node is not tried", got)
		}
	})

	t.Run("edge refusal is retried elsewhere", func(t *testing.T) {
		// n3 refuses every create, as a node whose measured state
		// filled up since its last heartbeat does: the server places
		// on it what it then refuses, which exercises optimistic
		// placement's retry. It goes at the end.
		c.wrap = func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if strings.HasSuffix(r.URL.Path, "/CreateOnEdge") {
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusTooManyRequests)
					w.Write([]byte(`{"code":"resource_exhausted","message":"node \"n3\" has no room: out of memory (under pressure)"}`))
					return
				}
				h.ServeHTTP(w, r)
			})
		}
		c.addEdge("n3", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: slots}, placement.Share{})
		c.wrap = nil
		defer c.edges["n3"].stop()
		retries := c.metric("dsec_server_placement_retries_total", nil)
		// n2 and n3 fit 1,500 cores in the server's view (n1 reserves
		// only 1,000); n3 refuses them at admission, so the sandbox must
		// end up on n2 whichever node placement tried first.
		sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 1_500_000}})
		if err != nil {
			t.Fatal(err)
		}
		if sb.GetNode() != "n2" {
			t.Fatalf("sandbox placed on %s, want n2", sb.GetNode())
		}
		onN2 = sb
		if got := c.metric("dsec_server_placement_retries_total", nil) - retries; got > 1 {
			t.Fatalf("first create retried %v times", got)
		}
		// 3,000 cores with 2 GiB fit only n3 in the server's view (n1
		// reserves cores, n2 holds 1 GiB), and n3 refuses: the create
		// waits for room (heartbeats) and places again, until its
		// deadline.
		before := c.metric("dsec_server_placement_retries_total", nil)
		c.srv.cfg.QueueTimeout = 2 * time.Second
		defer func() { c.srv.cfg.QueueTimeout = DefaultQueueTimeout }()
		_, err = c.clients.sb.Create(context.Background(), req(c.admin, &dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 3_000_000, MemoryBytes: 2 << 30}}}))
		wantCode(t, err, connect.CodeResourceExhausted, "n3")
		if got := c.metric("dsec_server_placement_retries_total", nil) - before; got < 1 || got > maxCreateAttempts {
			t.Fatalf("placement retries went up by %v, want 1 to %d", got, maxCreateAttempts)
		}
	})

	t.Run("dead node", func(t *testing.T) {
		// n2 must have reported the sandbox in a heartbeat before it dies,
		// or the registry only knows it as a pending create.
		c.waitFor("n2 reports "+onN2.GetId(), func() bool {
			for _, s := range c.srv.reg.liveSummaries("n2") {
				if s.GetId() == onN2.GetId() {
					return true
				}
			}
			return false
		})
		c.edges["n2"].stop()
		// Move the server's clock past the node timeout, then wait for a
		// heartbeat from n1 so that only n2 is dead.
		c.offset.Add(int64(2 * c.srv.cfg.NodeTimeout))
		c.waitFor("n1 alive again", func() bool {
			rt, _ := c.srv.reg.route("n1-0000000000000000")
			return rt.alive
		})
		got, err := c.clients.sb.Get(ctx, req(c.admin, &dsecv1.GetSandboxRequest{Id: onN2.GetId()}))
		if err != nil {
			t.Fatal(err)
		}
		if s := got.Msg.GetSandbox(); s.GetState() != "lost" || !strings.Contains(s.GetReason(), "n2 is not responding") {
			t.Fatalf("sandbox on dead node = %v", s)
		}
		res, err := c.exec(c.admin, onN2.GetId(), "true")
		if err != nil {
			t.Fatal(err)
		}
		if res.GetOutcome() != "infra_error" || res.GetInfraError() != "node n2 is not responding" {
			t.Fatalf("exec on dead node = %v", res)
		}
		_, res, err = c.execStream(c.admin, onN2.GetId(), "true")
		if err != nil || res.GetOutcome() != "infra_error" {
			t.Fatalf("exec stream on dead node = %v, %v", res, err)
		}
		_, err = c.clients.sb.WriteFile(ctx, req(c.admin, &dsecv1.WriteFileRequest{SandboxId: onN2.GetId(), Path: "/x"}))
		wantCode(t, err, connect.CodeUnavailable, "lost")
		wantCode(t, c.destroy(c.admin, onN2.GetId()), connect.CodeUnavailable, "lost")
		// A tenant cannot probe the dead node's sandboxes either.
		_, err = c.exec(bob, onN2.GetId(), "true")
		wantCode(t, err, connect.CodeNotFound, "")

		all := byID(c.list(c.admin, nil))
		if all[onN2.GetId()].GetState() != "lost" {
			t.Fatalf("list shows %v for the dead node's sandbox", all[onN2.GetId()])
		}
		// New sandboxes go to the live node only.
		for range 3 {
			sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1"})
			if err != nil {
				t.Fatal(err)
			}
			if sb.GetNode() != "n1" {
				t.Fatalf("created on %s with n2 dead", sb.GetNode())
			}
			if err := c.destroy(c.admin, sb.GetId()); err != nil {
				t.Fatal(err)
			}
		}
		// The scrape sees three dead nodes (n2, and n3 and n4 stopped
		// after their cases) and the lost sandbox.
		if got := c.metric("dsec_server_sandboxes", map[string]string{"state": "lost"}); got < 1 {
			t.Fatalf("dsec_server_sandboxes{state=lost} = %v, want at least 1", got)
		}
		if got := c.metric("dsec_server_nodes", map[string]string{"alive": "false"}); got != 3 {
			t.Fatalf("dsec_server_nodes{alive=false} = %v, want 3", got)
		}
	})
}

// TestJobFreezeAcrossEdges freezes and thaws a job whose sandboxes live on
// two edges in one call each, and checks that sandboxes outside the job
// (another label, or another tenant's with the same label) are untouched.
func TestJobFreezeAcrossEdges(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	// Four slots per edge: five sandboxes of the job cannot all fit on one.
	const slots = 4
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: slots}, placement.Share{})
	c.addEdge("n2", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: slots}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	alice := c.createTenant("alice", nil)
	bob := c.createTenant("bob", nil)
	job := map[string]string{"job": "x"}

	mustCreate := func(token string, labels map[string]string) *dsecv1.Sandbox {
		t.Helper()
		sb, err := c.create(token, &dsecv1.SandboxSpec{Image: "busybox:1", Labels: labels})
		if err != nil {
			t.Fatal(err)
		}
		return sb
	}
	members := map[string]bool{}
	nodes := map[string]int{}
	for range slots + 1 {
		sb := mustCreate(alice, job)
		members[sb.GetId()] = true
		nodes[sb.GetNode()]++
	}
	if nodes["n1"] == 0 || nodes["n2"] == 0 {
		t.Fatalf("the job's sandboxes are on %v, want both edges", nodes)
	}
	other := mustCreate(alice, map[string]string{"job": "y"})
	bobs := mustCreate(bob, job)

	state := func(token, id string) string {
		t.Helper()
		resp, err := c.clients.sb.Get(ctx, req(token, &dsecv1.GetSandboxRequest{Id: id}))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg.GetSandbox().GetState()
	}
	execOK := func(token, id string) {
		t.Helper()
		res, err := c.exec(token, id, "true")
		if err != nil || res.GetOutcome() != "ok" {
			t.Fatalf("exec in %s: %v, %v", id, res, err)
		}
	}
	results := func(resp *connect.Response[dsecv1.JobResponse], err error) map[string]bool {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]bool{}
		for _, r := range resp.Msg.GetResults() {
			if r.GetError() != nil {
				t.Fatalf("job result %s: %v", r.GetId(), r.GetError())
			}
			got[r.GetId()] = true
		}
		return got
	}
	sameSet := func(a, b map[string]bool) bool {
		if len(a) != len(b) {
			return false
		}
		for k := range a {
			if !b[k] {
				return false
			}
		}
		return true
	}

	frozen := results(c.clients.sb.FreezeJob(ctx, req(alice, &dsecv1.JobRequest{Labels: job})))
	if !sameSet(frozen, members) {
		t.Fatalf("FreezeJob acted on %v, want the job's sandboxes %v", frozen, members)
	}
	for id := range members {
		if got := state(alice, id); got != "frozen" {
			t.Errorf("%s after FreezeJob: state %q, want frozen", id, got)
		}
		_, err := c.exec(alice, id, "true")
		wantCode(t, err, connect.CodeFailedPrecondition, "frozen")
	}
	if got := state(alice, other.GetId()); got != "running" {
		t.Errorf("sandbox with another label: state %q, want running", got)
	}
	execOK(alice, other.GetId())
	if got := state(bob, bobs.GetId()); got != "running" {
		t.Errorf("another tenant's sandbox with the job's label: state %q, want running", got)
	}
	execOK(bob, bobs.GetId())
	// The registry's view (List) shows the frozen state once the edges
	// have reported it.
	c.waitFor("List to show the job frozen", func() bool {
		for _, sb := range c.list(alice, job) {
			if sb.GetState() != "frozen" {
				return false
			}
		}
		return true
	})

	thawed := results(c.clients.sb.ThawJob(ctx, req(alice, &dsecv1.JobRequest{Labels: job})))
	if !sameSet(thawed, members) {
		t.Fatalf("ThawJob acted on %v, want %v", thawed, members)
	}
	for id := range members {
		if got := state(alice, id); got != "running" {
			t.Errorf("%s after ThawJob: state %q, want running", id, got)
		}
		execOK(alice, id)
	}

	_, err := c.clients.sb.FreezeJob(ctx, req(alice, &dsecv1.JobRequest{}))
	wantCode(t, err, connect.CodeInvalidArgument, "label")
}
