package edge_test

// Policy tests: what the edge decides (admission, tenancy, states, error
// codes, recycling), over the in-memory backend, with no root. The same
// decisions are tested over the real container backend elsewhere in this
// package; these run anywhere and pin the rules themselves.

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/memback"
)

// memImage is the image every memback node's store holds: one layer of
// arbitrary bytes (memback records layers, it does not read them).
const memImage = "mem:1"

// memStore is a blob store holding memImage.
func memStore(t *testing.T) *blobstore.Dir {
	t.Helper()
	store, err := blobstore.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	desc, err := store.Put(t.Context(), bytes.NewReader([]byte("not an erofs image: memback does not read it")))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := image.NewStore(store, store.Refs()).Put(t.Context(), memImage, image.Manifest{Layers: []blobstore.Descriptor{desc}}); err != nil {
		t.Fatal(err)
	}
	return store
}

// startMemNode starts an edge over memback b, with a store holding
// memImage, behind an HTTP server.
func startMemNode(t *testing.T, id string, b *memback.Backend, mod func(*edge.Config)) *node {
	t.Helper()
	mux := http.NewServeMux()
	srv := httptest.NewServer(mux)
	reg := prometheus.NewRegistry()
	cfg := edge.Config{
		NodeID:       id,
		DataDir:      t.TempDir(),
		Store:        memStore(t),
		Backends:     map[runtime.Kind]runtime.Backend{b.Kind(): b},
		AdvertiseURL: srv.URL,
		ClusterToken: token,
		Registry:     reg,
		Capacity:     map[runtime.Kind]placement.Capacity{b.Kind(): {MilliCPU: 1 << 20, MemoryBytes: 1 << 40}},
		// The host's own measured memory must not refuse these creates.
		MemoryReserve: 1,
	}
	if mod != nil {
		mod(&cfg)
	}
	e, err := edge.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.Mount(mux)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if err := e.Close(context.Background()); err != nil {
			t.Errorf("close edge %s: %v", id, err)
		}
		srv.Close()
		if live := b.Live(); len(live) != 0 {
			t.Errorf("edge %s left sandboxes behind in its backend: %v", id, live)
		}
	})
	return &node{
		edge:   e,
		id:     id,
		url:    srv.URL,
		client: dsecv1connect.NewEdgeServiceClient(srv.Client(), srv.URL, connect.WithInterceptors(edge.ClusterAuth(token))),
		reg:    reg,
	}
}

func newMemback(t *testing.T, opts memback.Options) *memback.Backend {
	t.Helper()
	b, err := memback.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

var memSpec = &dsecv1.SandboxSpec{Image: memImage}

// TestPolicyAdmission: a node refuses the create past its sandbox
// capacity with ResourceExhausted naming what it is short of, builds
// nothing for the refused one, and has room again once one is destroyed.
func TestPolicyAdmission(t *testing.T) {
	b := newMemback(t, memback.Options{})
	n := startMemNode(t, "pa1", b, func(c *edge.Config) {
		c.Capacity[runtime.KindContainer] = placement.Capacity{MilliCPU: 4000, MemoryBytes: 1 << 40, Sandboxes: 2}
		c.RequestShare = map[runtime.Kind]placement.Share{runtime.KindContainer: {CPU: 1, Memory: 1}}
	})
	a := tenant("a")
	first := n.mustCreate(t, a, memSpec)
	n.mustCreate(t, a, memSpec)
	_, err := n.create(t, a, memSpec)
	wantCode(t, err, connect.CodeResourceExhausted, "out of sandboxes (2 of 2 in use)")
	if live := b.Live(); len(live) != 2 {
		t.Fatalf("backend holds %d sandboxes after a refused create, want 2", len(live))
	}
	// With a full share charged, a request bigger than the node's CPU is
	// refused for CPU.
	if err := n.destroy(t, a, first.Id); err != nil {
		t.Fatal(err)
	}
	_, err = n.create(t, a, &dsecv1.SandboxSpec{Image: memImage, Resources: &dsecv1.Resources{MilliCpu: 5000}})
	wantCode(t, err, connect.CodeResourceExhausted, "milli_cpu (5000 requested at a share of 1, 0 of 4000 charged)")
	n.mustCreate(t, a, memSpec)
}

// TestPolicyTenancy: another tenant's sandbox does not exist for a caller
// (NotFound, so its existence does not leak); an admin sees every one.
func TestPolicyTenancy(t *testing.T) {
	n := startMemNode(t, "pt1", newMemback(t, memback.Options{}), nil)
	sb := n.mustCreate(t, tenant("a"), memSpec)
	_, err := n.get(t, tenant("b"), sb.Id)
	wantCode(t, err, connect.CodeNotFound, "not found")
	_, err = n.exec(t, tenant("b"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}})
	wantCode(t, err, connect.CodeNotFound, "not found")
	wantCode(t, n.destroy(t, tenant("b"), sb.Id), connect.CodeNotFound, "not found")
	if got, err := n.get(t, admin, sb.Id); err != nil || got.Tenant != "a" {
		t.Fatalf("admin get: %v, %v", got, err)
	}
	_, err = n.create(t, nil, memSpec)
	wantCode(t, err, connect.CodeInvalidArgument, "caller is required")
}

// TestPolicyStates walks one sandbox through its states as callers see
// them: running, frozen (operations refused until thawed), lost when its
// runtime dies (an exec gets infra_error, not an error), destroyed.
func TestPolicyStates(t *testing.T) {
	b := newMemback(t, memback.Options{})
	n := startMemNode(t, "ps1", b, nil)
	a := tenant("a")
	sb := n.mustCreate(t, a, memSpec)
	if sb.State != "running" {
		t.Fatalf("created sandbox is %q", sb.State)
	}
	ctx := t.Context()
	if _, err := n.client.FreezeOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: a, SandboxId: sb.Id})); err != nil {
		t.Fatal(err)
	}
	if got, _ := n.get(t, a, sb.Id); got.State != "frozen" {
		t.Fatalf("after freeze: %q", got.State)
	}
	_, err := n.exec(t, a, sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}})
	wantCode(t, err, connect.CodeFailedPrecondition, "is frozen: thaw it first")
	if _, err := n.client.ThawOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: a, SandboxId: sb.Id})); err != nil {
		t.Fatal(err)
	}
	res, err := n.exec(t, a, sb.Id, &dsecv1.ExecRequest{Argv: []string{"echo", "back"}})
	if err != nil || string(res.Stdout) != "back\n" || res.Outcome != "ok" {
		t.Fatalf("exec after thaw: %v, %v", res, err)
	}

	// The runtime dies: the next exec finds it gone and reports an
	// infrastructure failure, the sandbox is lost and its runtime released.
	rs := b.Sandbox(sb.Id)
	if rs == nil {
		t.Fatalf("backend has no sandbox %s: %v", sb.Id, b.Live())
	}
	rs.Kill("test")
	res, err = n.exec(t, a, sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}})
	if err != nil || res.Outcome != "infra_error" {
		t.Fatalf("exec in a dead sandbox: %v, %v; want outcome infra_error", res, err)
	}
	n.waitState(t, sb.Id, "lost")
	deadline := time.Now().Add(30 * time.Second)
	for len(b.Live()) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("a lost sandbox's runtime was never released: %v", b.Live())
		}
		time.Sleep(5 * time.Millisecond)
	}
	_, err = n.exec(t, a, sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}})
	if err != nil {
		t.Fatalf("exec in a lost sandbox: %v", err)
	}
	if err := n.destroy(t, a, sb.Id); err != nil {
		t.Fatalf("destroy a lost sandbox: %v", err)
	}
	n.waitState(t, sb.Id, "destroyed")
	if err := n.destroy(t, a, sb.Id); err != nil {
		t.Fatalf("destroy twice: %v", err)
	}
}

// TestPolicyBusy: a backend too busy to bring a sandbox up refuses the
// create with ResourceExhausted (the server places it again), not
// Internal; a spec the backend refuses is InvalidArgument.
func TestPolicyBusy(t *testing.T) {
	var refuse error
	b := newMemback(t, memback.Options{CreateHook: func(context.Context, runtime.Spec) error { return refuse }})
	n := startMemNode(t, "pb1", b, nil)
	refuse = runtime.ErrBusy
	_, err := n.create(t, tenant("a"), memSpec)
	wantCode(t, err, connect.CodeResourceExhausted, "node too busy")
	refuse = runtime.ErrInvalidSpec
	_, err = n.create(t, tenant("a"), memSpec)
	wantCode(t, err, connect.CodeInvalidArgument, "invalid sandbox spec")
	refuse = nil
	n.mustCreate(t, tenant("a"), memSpec)
	if got := metricValue(t, n.reg, "dsec_edge_sandbox_failures_total", "reason", "busy"); got != 1 {
		t.Fatalf("busy failures counted %v, want 1", got)
	}
}

// TestPolicyRecycling: with automatic pools on, the second destroy of a
// spec (hot by then) resets the sandbox and the next create of the same
// tenant takes it; another tenant gets a new one; a frozen sandbox is not
// recycled. Any backend whose sandboxes reset takes part (a microvm one
// here), not only the container backend.
func TestPolicyRecycling(t *testing.T) {
	for _, kind := range []runtime.Kind{runtime.KindContainer, runtime.KindMicroVM} {
		t.Run(string(kind), func(t *testing.T) { testRecycling(t, kind) })
	}
}

func testRecycling(t *testing.T, kind runtime.Kind) {
	b := newMemback(t, memback.Options{Kind: kind, Reset: true})
	n := startMemNode(t, "pr1", b, func(c *edge.Config) { c.AutoPool = 4 })
	spec := &dsecv1.SandboxSpec{Image: memImage, Backend: string(kind)}
	a := tenant("a")
	x := n.mustCreate(t, a, spec)
	if err := n.destroy(t, a, x.Id); err != nil {
		t.Fatal(err)
	}
	y := n.mustCreate(t, a, spec)
	if _, err := n.client.WriteFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeWriteFileRequest{
		Caller: a, Request: &dsecv1.WriteFileRequest{SandboxId: y.Id, Path: "/secret", Data: []byte("s")}})); err != nil {
		t.Fatal(err)
	}
	if err := n.destroy(t, a, y.Id); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for recycledReady(n) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the destroyed sandbox of a hot spec was never ready again: %+v", n.edge.AutoPoolStats("a"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	z := n.mustCreate(t, a, spec)
	if created, resets := b.Stats(); created != 2 || resets != 1 {
		t.Fatalf("backend created %d and reset %d; want 2 and 1 (the third create recycled)", created, resets)
	}
	res, err := n.exec(t, a, z.Id, &dsecv1.ExecRequest{Argv: []string{"cat", "/secret"}})
	if err != nil || res.ExitCode == 0 {
		t.Fatalf("a recycled sandbox shows its previous user's file: %v, %v", res, err)
	}
	if got := metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "recycled"); got != 1 {
		t.Fatalf("recycled creates %v, want 1", got)
	}
	n.mustCreate(t, tenant("b"), spec)
	if created, _ := b.Stats(); created != 3 {
		t.Fatalf("another tenant's create was served from tenant a's pool (created %d, want 3)", created)
	}

	// A frozen sandbox is torn down, not handed to the next user frozen.
	if _, err := n.client.FreezeOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: a, SandboxId: z.Id})); err != nil {
		t.Fatal(err)
	}
	if err := n.destroy(t, a, z.Id); err != nil {
		t.Fatal(err)
	}
	// Only tenant b's sandbox is left in the backend.
	if live := b.Live(); len(live) != 1 || recycledReady(n) != 0 {
		t.Fatalf("a frozen sandbox was recycled: live %v, ready %d", live, recycledReady(n))
	}
}

// TestPolicyWarmPoolAccounting: a warm pool fills the node up to its last
// slot (the sandbox it is making counts once, not twice), its ready
// sandboxes are charged to the node's capacity (a create of another spec
// is refused when the pool holds the room), a matching create takes one
// (its charge becomes the sandbox's own, so it is admitted on a full
// node), and deleting the pool gives the room back and destroys what it
// held.
func TestPolicyWarmPoolAccounting(t *testing.T) {
	b := newMemback(t, memback.Options{Reset: true})
	n := startMemNode(t, "pw1", b, func(c *edge.Config) {
		c.Capacity[runtime.KindContainer] = placement.Capacity{MilliCPU: 4000, MemoryBytes: 1 << 40, Sandboxes: 2}
	})
	a := tenant("a")
	pooled := &dsecv1.SandboxSpec{Image: memImage, Env: []string{"P=1"}}
	poolID := ids.NewSandbox(n.id)
	if _, err := n.client.CreatePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreatePoolRequest{
		Caller: a, PoolId: poolID, Request: &dsecv1.CreatePoolRequest{Spec: pooled, Size: 2},
	})); err != nil {
		t.Fatal(err)
	}
	n.waitPool(t, poolID, func(p *dsecv1.Pool) bool { return p.Ready == 2 })

	_, err := n.create(t, a, memSpec)
	wantCode(t, err, connect.CodeResourceExhausted, "out of sandboxes (2 of 2 in use)")
	sb := n.mustCreate(t, a, pooled)
	if got := metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "pool"); got != 1 {
		t.Fatalf("creates from the pool %v, want 1", got)
	}
	if created, _ := b.Stats(); created != 2 {
		t.Fatalf("backend created %d sandboxes, want the pool's 2 only", created)
	}
	if err := n.destroy(t, a, sb.Id); err != nil {
		t.Fatal(err)
	}
	n.waitPool(t, poolID, func(p *dsecv1.Pool) bool { return p.Ready == 2 && p.InUse == 0 })
	if _, resets := b.Stats(); resets != 1 {
		t.Fatalf("resets %d, want 1 (the sandbox went back to its pool)", resets)
	}
	if _, err := n.client.DeletePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeDeletePoolRequest{Caller: a, PoolId: poolID})); err != nil {
		t.Fatal(err)
	}
	if live := b.Live(); len(live) != 0 {
		t.Fatalf("a deleted pool's sandboxes live on: %v", live)
	}
	n.mustCreate(t, a, memSpec)
}

// TestPolicyDisplay: a sandbox whose backend has a screen (a fullvm's;
// memback's here, as a microvm: a fullvm boots a disk image, and memback
// runs the layered test image) answers screenshots with the PNG and its size and takes
// input in order; one without a screen refuses with FailedPrecondition,
// a frozen one is refused until thawed, and another tenant's is NotFound.
func TestPolicyDisplay(t *testing.T) {
	vm := newMemback(t, memback.Options{Kind: runtime.KindMicroVM, Display: true})
	ct := newMemback(t, memback.Options{})
	n := startMemNode(t, "pd1", vm, func(c *edge.Config) {
		c.Backends[runtime.KindContainer] = ct
		c.Capacity[runtime.KindContainer] = placement.Capacity{MilliCPU: 1 << 20, MemoryBytes: 1 << 40}
	})
	a := tenant("a")
	ctx := t.Context()
	sb := n.mustCreate(t, a, &dsecv1.SandboxSpec{Image: memImage, Backend: string(runtime.KindMicroVM)})
	shot := func(caller *dsecv1.Caller, id string) (*dsecv1.ScreenshotResponse, error) {
		resp, err := n.client.ScreenshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: caller, SandboxId: id}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	first, err := shot(a, sb.Id)
	if err != nil {
		t.Fatal(err)
	}
	if first.Width != int32(memback.Screen.X) || first.Height != int32(memback.Screen.Y) || len(first.Png) == 0 {
		t.Fatalf("screenshot %dx%d (%d bytes), want %v", first.Width, first.Height, len(first.Png), memback.Screen)
	}
	if _, err := n.client.InputOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeInputRequest{Caller: a, Request: &dsecv1.InputRequest{
		SandboxId: sb.Id, Events: []*dsecv1.InputEvent{{Kind: "text", Text: "ls"}, {Kind: "key", Key: "ret"}},
	}})); err != nil {
		t.Fatal(err)
	}
	if got := vm.Sandbox(sb.Id).Events(); len(got) != 2 || got[0].Text != "ls" || got[1].Key != "ret" {
		t.Fatalf("the display received %+v", got)
	}
	if second, err := shot(a, sb.Id); err != nil || bytes.Equal(second.Png, first.Png) {
		t.Fatalf("the screen did not change after input: %v", err)
	}

	_, err = shot(tenant("b"), sb.Id)
	wantCode(t, err, connect.CodeNotFound, "not found")
	plain := n.mustCreate(t, a, memSpec)
	_, err = shot(a, plain.Id)
	wantCode(t, err, connect.CodeFailedPrecondition, "has no screen")
	if _, err := n.client.FreezeOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: a, SandboxId: sb.Id})); err != nil {
		t.Fatal(err)
	}
	_, err = shot(a, sb.Id)
	wantCode(t, err, connect.CodeFailedPrecondition, "thaw it first")
}
