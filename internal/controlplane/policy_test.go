package controlplane

// Policy tests over edges whose backend is in memory (memback): quotas,
// placement over nodes' capacity, and a busy node's refusal placed again,
// with no root. TestCluster checks the same rules over real containers.

import (
	"bytes"
	"context"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/memback"
)

// memImage is an image of one layer of arbitrary bytes: memback records
// layers and does not read them.
const memImage = "mem:1"

// newMemCluster starts a server whose store holds memImage.
func newMemCluster(t *testing.T) *cluster {
	t.Helper()
	c := startCluster(t)
	desc, err := c.store.Put(t.Context(), bytes.NewReader([]byte("memback layer")))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := image.NewStore(c.store, c.store.Refs()).Put(t.Context(), memImage, image.Manifest{Layers: []blobstore.Descriptor{desc}}); err != nil {
		t.Fatal(err)
	}
	// Edges measure this host: whatever else runs on it must not make
	// them refuse.
	c.memoryReserve = 1
	return c
}

// addMemEdge starts an edge over a memback backend with opts.
func (c *cluster) addMemEdge(id string, opts memback.Options, capacity placement.Capacity) *memback.Backend {
	c.t.Helper()
	b, err := memback.New(opts)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() {
		if live := b.Live(); len(live) != 0 {
			c.t.Errorf("edge %s left sandboxes in its backend: %v", id, live)
		}
	})
	c.startEdge(id, filepath.Join(c.root, id), b, capacity, placement.Share{CPU: 1, Memory: 1})
	return b
}

// TestPolicyQuota: a tenant's quota refuses the create past it with
// ResourceExhausted naming the bound, and a destroy frees it at once.
func TestPolicyQuota(t *testing.T) {
	c := newMemCluster(t)
	c.addMemEdge("q1", memback.Options{}, placement.Capacity{MilliCPU: 64_000, Sandboxes: 16})
	alice := c.createTenant("alice", &dsecv1.Quota{MaxSandboxes: 2})
	carol := c.createTenant("carol", &dsecv1.Quota{MaxMilliCpu: 1000})
	spec := &dsecv1.SandboxSpec{Image: memImage}
	first, err := c.create(alice, spec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.create(alice, spec); err != nil {
		t.Fatal(err)
	}
	_, err = c.create(alice, spec)
	wantCode(t, err, connect.CodeResourceExhausted, "max_sandboxes")
	if err := c.destroy(alice, first.GetId()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.create(alice, spec); err != nil {
		t.Fatalf("create after a destroy freed the quota: %v", err)
	}
	_, err = c.create(carol, &dsecv1.SandboxSpec{Image: memImage, Resources: &dsecv1.Resources{MilliCpu: 1500}})
	wantCode(t, err, connect.CodeResourceExhausted, "max_milli_cpu")
	if _, err := c.create(carol, &dsecv1.SandboxSpec{Image: memImage, Resources: &dsecv1.Resources{MilliCpu: 500}}); err != nil {
		t.Fatal(err)
	}
}

// TestPolicyPlacement: sandboxes go where there is room, never past a
// node's capacity, and a create no node has room for waits in the
// admission queue and is refused at its deadline.
func TestPolicyPlacement(t *testing.T) {
	c := newMemCluster(t)
	c.addMemEdge("p1", memback.Options{}, placement.Capacity{MilliCPU: 4000, Sandboxes: 1})
	c.addMemEdge("p2", memback.Options{}, placement.Capacity{MilliCPU: 4000, Sandboxes: 3})
	nodes := map[string]int{}
	for range 4 {
		sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: memImage, Resources: &dsecv1.Resources{MilliCpu: 500}})
		if err != nil {
			t.Fatalf("create %d (placed so far %v): %v", len(nodes), nodes, err)
		}
		nodes[sb.GetNode()]++
	}
	if nodes["p1"] != 1 || nodes["p2"] != 3 {
		t.Fatalf("placed %v, want p1 1 and p2 3 (their capacities)", nodes)
	}
	c.srv.cfg.QueueTimeout = 200 * time.Millisecond
	defer func() { c.srv.cfg.QueueTimeout = DefaultQueueTimeout }()
	_, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: memImage})
	wantCode(t, err, connect.CodeResourceExhausted, "")
}

// TestPolicyBusyNodePlacedAgain: a node whose backend is too busy to
// bring sandboxes up refuses them (ResourceExhausted, runtime.ErrBusy),
// and the server places them on the other node rather than failing.
func TestPolicyBusyNodePlacedAgain(t *testing.T) {
	c := newMemCluster(t)
	var refused atomic.Int64
	busy := func(context.Context, runtime.Spec) error {
		refused.Add(1)
		return runtime.ErrBusy
	}
	// The busy node has more room, so placement prefers it.
	c.addMemEdge("b1", memback.Options{CreateHook: busy}, placement.Capacity{MilliCPU: 64_000, Sandboxes: 64})
	c.addMemEdge("b2", memback.Options{}, placement.Capacity{MilliCPU: 8_000, Sandboxes: 8})
	retries := c.metric("dsec_server_placement_retries_total", nil)
	for i := range 4 {
		sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: memImage})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		if sb.GetNode() != "b2" {
			t.Fatalf("create %d placed on %s, want b2 (b1 refuses every create)", i, sb.GetNode())
		}
	}
	// Placement scores b1's larger free capacity higher, so it was tried.
	if n := refused.Load(); n == 0 || c.metric("dsec_server_placement_retries_total", nil)-retries < 1 {
		t.Fatalf("b1 refused %d creates and the server counted %v retries; want both above 0", n,
			c.metric("dsec_server_placement_retries_total", nil)-retries)
	}
}

// TestPolicyJobStates: freezing a job reaches its sandboxes on every node
// (and no one else's), they show as frozen, refuse execs until the job is
// thawed, and a sandbox lost on its node (its runtime died) answers execs
// with infra_error through the server.
func TestPolicyJobStates(t *testing.T) {
	c := newMemCluster(t)
	b1 := c.addMemEdge("j1", memback.Options{}, placement.Capacity{MilliCPU: 8000, Sandboxes: 2})
	c.addMemEdge("j2", memback.Options{}, placement.Capacity{MilliCPU: 8000, Sandboxes: 2})
	ctx := t.Context()
	job := map[string]string{"job": "j"}
	var ids []string
	nodes := map[string]bool{}
	for range 3 {
		sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: memImage, Labels: job})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.GetId())
		nodes[sb.GetNode()] = true
	}
	other, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: memImage, Labels: map[string]string{"job": "other"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 2 {
		t.Fatalf("the job's sandboxes are on %v, want both nodes", nodes)
	}
	resp, err := c.clients.sb.FreezeJob(ctx, req(c.admin, &dsecv1.JobRequest{Labels: job}))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Msg.GetResults()) != 3 {
		t.Fatalf("freeze job results %v, want the job's 3 sandboxes", resp.Msg.GetResults())
	}
	for _, r := range resp.Msg.GetResults() {
		if r.GetError() != nil {
			t.Fatalf("freeze %s: %v", r.GetId(), r.GetError())
		}
	}
	all := byID(c.list(c.admin, nil))
	for _, id := range ids {
		if st := all[id].GetState(); st != "frozen" {
			t.Fatalf("%s is %q after the job froze, want frozen", id, st)
		}
	}
	if st := all[other.GetId()].GetState(); st != "running" {
		t.Fatalf("another job's sandbox is %q", st)
	}
	_, err = c.exec(c.admin, ids[0], "true")
	wantCode(t, err, connect.CodeFailedPrecondition, "thaw it first")
	if _, err := c.clients.sb.ThawJob(ctx, req(c.admin, &dsecv1.JobRequest{Labels: job})); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if res, err := c.exec(c.admin, id, "echo", "ok"); err != nil || res.GetStdout() == nil {
			t.Fatalf("exec in %s after the thaw: %v %v", id, res, err)
		}
	}

	// The runtime of a sandbox on j1 dies under it.
	var onJ1 string
	for _, id := range append(ids, other.GetId()) {
		if b1.Sandbox(id) != nil {
			onJ1 = id
			break
		}
	}
	b1.Sandbox(onJ1).Kill("test")
	res, err := c.exec(c.admin, onJ1, "true")
	if err != nil || res.GetOutcome() != "infra_error" {
		t.Fatalf("exec in a sandbox whose runtime died: %v %v, want infra_error", res, err)
	}
	got, err := c.clients.sb.Get(ctx, req(c.admin, &dsecv1.GetSandboxRequest{Id: onJ1}))
	if err != nil || got.Msg.GetSandbox().GetState() != "lost" {
		t.Fatalf("get a lost sandbox: %v %v", got, err)
	}
}
