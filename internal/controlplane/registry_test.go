package controlplane

import (
	"errors"
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
)

// clock is a hand-driven time source so node expiry is tested without
// waiting.
type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func testRegistry() (*registry, *clock) {
	c := &clock{t: time.Unix(1_000_000, 0)}
	r := newRegistry(3*time.Second, time.Hour)
	r.now = c.now
	return r, c
}

func beat(node, boot string, sandboxes int64, sums ...*dsecv1.SandboxSummary) *dsecv1.HeartbeatRequest {
	return &dsecv1.HeartbeatRequest{
		NodeId: node, Url: "http://" + node, BootId: boot,
		Capacity:  []*dsecv1.BackendCapacity{{Backend: "container", MilliCpu: 8000, MemoryBytes: 16 << 30, Sandboxes: sandboxes}},
		Sandboxes: sums,
	}
}

func containerReq(cpu int64) placement.Request {
	return placement.Request{Kind: runtime.KindContainer, MilliCPU: cpu}
}

// explicitPR places a container sandbox that states cpu (its request and
// its limit) for tenant.
func explicitPR(tenant string, q *iam.Quota, cpu int64) placeReq {
	return placeReq{tenant: tenant, quota: q, req: containerReq(cpu), charge: iam.Usage{Sandboxes: 1, MilliCPU: cpu}}
}

func TestHeartbeatValidation(t *testing.T) {
	r, _ := testRegistry()
	for _, tc := range []struct {
		hb    *dsecv1.HeartbeatRequest
		field string
	}{
		{&dsecv1.HeartbeatRequest{NodeId: "Bad_Node", Url: "http://x"}, "node_id"},
		{&dsecv1.HeartbeatRequest{NodeId: "n1"}, "url"},
		{&dsecv1.HeartbeatRequest{NodeId: "n1", Url: "http://x", Capacity: []*dsecv1.BackendCapacity{{}}}, "capacity[0].backend"},
		{&dsecv1.HeartbeatRequest{NodeId: "n1", Url: "http://x", Capacity: []*dsecv1.BackendCapacity{{Backend: "container", MilliCpu: -1}}}, "capacity[0]"},
	} {
		err := r.heartbeat(tc.hb)
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("heartbeat(%v) = %v, want an error naming %s", tc.hb, err, tc.field)
		}
	}
}

func TestReserveChargesPendingUntilHeartbeat(t *testing.T) {
	r, _ := testRegistry()
	if err := r.heartbeat(beat("n1", "b1", 2)); err != nil {
		t.Fatal(err)
	}
	q := &iam.Quota{MaxSandboxes: 10}
	one := []placeReq{explicitPR("alice", q, 100)}

	res1, err := r.reserve(one)
	if err != nil || res1[0].err != nil {
		t.Fatal(err, res1[0].err)
	}
	if n, _ := ids.NodeOf(res1[0].id); n != "n1" || res1[0].url != "http://n1" {
		t.Fatalf("reservation %+v not on n1", res1[0])
	}
	r.completed(res1[0].id)
	res2, _ := r.reserve(one)
	if res2[0].err != nil {
		t.Fatal(res2[0].err)
	}
	// The node has two slots and both are pending: a third create must not
	// be placed there although no heartbeat has reported either yet.
	res3, _ := r.reserve(one)
	if !errors.Is(res3[0].err, placement.ErrNoCapacity) {
		t.Fatalf("third reserve err = %v, want no capacity", res3[0].err)
	}
	// A failed create frees its slot.
	r.release(res2[0].id)
	res4, _ := r.reserve(one)
	if res4[0].err != nil {
		t.Fatalf("slot not freed by release: %v", res4[0].err)
	}
	// Once the heartbeat reports the first, it is counted once, not twice.
	sum := &dsecv1.SandboxSummary{Id: res1[0].id, Tenant: "alice", State: string(spec.StateRunning), MilliCpu: 100, Backend: "container"}
	hb := beat("n1", "b1", 2, sum)
	hb.Capacity[0].UsedSandboxes = 1
	if err := r.heartbeat(hb); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	_, stillPending := r.pending[res1[0].id]
	use := r.tenantUseLocked("alice", r.now())
	r.mu.Unlock()
	if stillPending {
		t.Fatal("a create the heartbeat reports is still pending")
	}
	if use != (iam.Usage{Sandboxes: 2, MilliCPU: 200}) {
		t.Fatalf("alice uses %+v, want 2 sandboxes / 200 milliCPU", use)
	}
	r.forget(res1[0].id)
	r.mu.Lock()
	use = r.tenantUseLocked("alice", r.now())
	r.mu.Unlock()
	if use != (iam.Usage{Sandboxes: 1, MilliCPU: 100}) {
		t.Fatalf("after forget alice uses %+v, want 1 sandbox", use)
	}
}

func TestReserveQuota(t *testing.T) {
	r, _ := testRegistry()
	running := &dsecv1.SandboxSummary{Id: "n1-0000000000000001", Tenant: "alice", State: string(spec.StateRunning), MilliCpu: 1000}
	gone := &dsecv1.SandboxSummary{Id: "n1-0000000000000002", Tenant: "alice", State: string(spec.StateDestroyed), MilliCpu: 1000}
	other := &dsecv1.SandboxSummary{Id: "n1-0000000000000003", Tenant: "bob", State: string(spec.StateRunning), MilliCpu: 1000}
	if err := r.heartbeat(beat("n1", "b1", 100, running, gone, other)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		q         *iam.Quota
		n         int
		cpu       int64
		admitted  int
		wantQuota string
	}{
		{"unlimited admin", nil, 5, 1000, 5, ""},
		{"destroyed does not count", &iam.Quota{MaxSandboxes: 2}, 1, 0, 1, ""},
		{"batch tail refused", &iam.Quota{MaxSandboxes: 3}, 4, 0, 2, "max_sandboxes"},
		{"cpu", &iam.Quota{MaxMilliCPU: 2500}, 3, 500, 3, ""},
		{"cpu over", &iam.Quota{MaxMilliCPU: 2500}, 4, 500, 3, "max_milli_cpu"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reqs := make([]placeReq, tc.n)
			for i := range reqs {
				reqs[i] = explicitPR("alice", tc.q, tc.cpu)
			}
			out, err := r.reserve(reqs)
			if err != nil {
				t.Fatal(err)
			}
			admitted := 0
			for i, res := range out {
				if res.err == nil {
					admitted++
					if i >= tc.admitted {
						t.Errorf("item %d admitted after a refused one", i)
					}
					defer r.release(res.id)
					continue
				}
				var qe *iam.QuotaError
				if !errors.As(res.err, &qe) || qe.Quota != tc.wantQuota {
					t.Errorf("item %d: %v, want quota %s", i, res.err, tc.wantQuota)
				}
			}
			if admitted != tc.admitted {
				t.Fatalf("admitted %d, want %d", admitted, tc.admitted)
			}
		})
	}
}

func TestNodeDeathAndRestart(t *testing.T) {
	r, c := testRegistry()
	s1 := &dsecv1.SandboxSummary{Id: "n1-00000000000000aa", Tenant: "alice", State: string(spec.StateRunning), Backend: "container"}
	s2 := &dsecv1.SandboxSummary{Id: "n2-00000000000000bb", Tenant: "bob", State: string(spec.StateRunning), Backend: "container"}
	if err := r.heartbeat(beat("n1", "b1", 10, s1)); err != nil {
		t.Fatal(err)
	}
	if err := r.heartbeat(beat("n2", "b1", 10, s2)); err != nil {
		t.Fatal(err)
	}
	rt, err := r.route(s1.Id)
	if err != nil || !rt.alive || rt.lostReason != "" || rt.summary.GetTenant() != "alice" {
		t.Fatalf("route of a live sandbox = %+v, %v", rt, err)
	}

	// n1 goes silent; n2 keeps beating.
	c.advance(2 * time.Second)
	r.heartbeat(beat("n2", "b1", 10, s2))
	c.advance(2 * time.Second)
	rt, _ = r.route(s1.Id)
	if rt.alive || rt.lostReason != "node n1 is not responding" {
		t.Fatalf("route after timeout = %+v, want lost", rt)
	}
	if died := r.sweep(); len(died) != 1 || died[0] != "n1" {
		t.Fatalf("sweep reported %v dead, want [n1]", died)
	}
	if died := r.sweep(); len(died) != 0 {
		t.Fatalf("second sweep reported %v again", died)
	}
	live, lost := r.snapshot()
	if len(live) != 1 || live[0].id != "n2" || len(lost) != 1 || lost[0].summary.GetId() != s1.Id {
		t.Fatalf("snapshot = %v live, %v lost", live, lost)
	}
	// New creates avoid the dead node.
	for range 10 {
		out, _ := r.reserve([]placeReq{explicitPR("x", nil, 1)})
		if out[0].err != nil || out[0].node != "n2" {
			t.Fatalf("reserve with n1 dead = %+v", out[0])
		}
		r.release(out[0].id)
	}
	counts := r.stateCounts()
	if counts[[2]string{"container", string(spec.StateLost)}] != 1 || counts[[2]string{"container", string(spec.StateRunning)}] != 1 {
		t.Fatalf("state counts %v", counts)
	}

	// n1 comes back as a new process: its old sandbox stays lost.
	s3 := &dsecv1.SandboxSummary{Id: "n1-00000000000000cc", Tenant: "alice", State: string(spec.StateRunning)}
	if err := r.heartbeat(beat("n1", "b2", 10, s3)); err != nil {
		t.Fatal(err)
	}
	rt, _ = r.route(s1.Id)
	if !rt.alive || rt.lostReason != "node n1 restarted" {
		t.Fatalf("route after restart = %+v, want lost on a live node", rt)
	}
	rt, _ = r.route(s3.Id)
	if rt.lostReason != "" {
		t.Fatalf("new sandbox reported lost: %+v", rt)
	}
	r.forget(s1.Id)
	if rt, _ = r.route(s1.Id); rt.summary != nil {
		t.Fatalf("forgotten sandbox still routed: %+v", rt)
	}

	// Past the retention a dead node is forgotten entirely.
	c.advance(2 * time.Hour)
	r.heartbeat(beat("n2", "b1", 10, s2))
	r.sweep()
	if rt, _ = r.route(s3.Id); rt.known {
		t.Fatalf("node n1 still known after retention: %+v", rt)
	}
}

func TestPendingExpiresWithoutHeartbeat(t *testing.T) {
	r, c := testRegistry()
	r.heartbeat(beat("n1", "b1", 1))
	out, _ := r.reserve([]placeReq{explicitPR("a", nil, 0)})
	if out[0].err != nil {
		t.Fatal(out[0].err)
	}
	r.completed(out[0].id)
	// The sandbox was destroyed on the edge before any heartbeat listed it:
	// after the grace period its slot is free again.
	c.advance(r.pendingGrace + time.Second)
	r.heartbeat(beat("n1", "b1", 1))
	r.sweep()
	again, _ := r.reserve([]placeReq{explicitPR("a", nil, 0)})
	if again[0].err != nil {
		t.Fatalf("slot still held after the grace period: %v", again[0].err)
	}
}

// TestReserveRequestsVsLimits: a create that leaves its resources to the
// defaults requests nothing of a node but is charged its limits to its
// tenant, while it is pending as after a heartbeat reports it (whose
// summaries carry the limits): a node of 2 cores at a CPU request share of 1/4 takes
// 20 of them, but only 8 that state a core each; the quota refuses the
// defaulted ones once their limits reach it.
func TestReserveRequestsVsLimits(t *testing.T) {
	r, _ := testRegistry()
	hb := beat("n1", "b1", 100)
	hb.Capacity[0].MilliCpu = 2000
	hb.Capacity[0].RequestShareCpu, hb.Capacity[0].RequestShareMemory = 0.25, 1
	if err := r.heartbeat(hb); err != nil {
		t.Fatal(err)
	}
	defaulted := placeReq{tenant: "alice", quota: &iam.Quota{MaxMilliCPU: 20_000}, req: containerReq(0), charge: iam.Usage{Sandboxes: 1, MilliCPU: 1000, MemoryBytes: 1 << 30}}
	reqs := make([]placeReq, 21)
	for i := range reqs {
		reqs[i] = defaulted
	}
	out, err := r.reserve(reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i, res := range out[:20] {
		if res.err != nil {
			t.Fatalf("defaulted create %d: %v, want placed (it requests no CPU of the node)", i, res.err)
		}
	}
	var qe *iam.QuotaError
	if !errors.As(out[20].err, &qe) || qe.Quota != "max_milli_cpu" {
		t.Fatalf("21st defaulted create: %v, want the quota's max_milli_cpu (limits are charged)", out[20].err)
	}
	r.mu.Lock()
	use := r.tenantUseLocked("alice", r.now())
	nodeUse := r.nodes["n1"].pendingUse[runtime.KindContainer]
	r.mu.Unlock()
	if use != (iam.Usage{Sandboxes: 20, MilliCPU: 20_000, MemoryBytes: 20 << 30}) {
		t.Fatalf("alice uses %+v, want 20 sandboxes of the default limits", use)
	}
	if nodeUse != (placement.Capacity{Sandboxes: 20}) {
		t.Fatalf("node pending %+v, want 20 sandboxes and no CPU or memory", nodeUse)
	}
	explicit := make([]placeReq, 9)
	for i := range explicit {
		explicit[i] = explicitPR("bob", nil, 1000)
	}
	out, err = r.reserve(explicit)
	if err != nil {
		t.Fatal(err)
	}
	for i, res := range out {
		if placed := res.err == nil; placed != (i < 8) {
			t.Errorf("explicit cpu=1 create %d: %v; want the first 8 placed (2 cores x 4), the 9th refused", i, res.err)
		}
	}
}

// TestAnswerIsProofOfLife: a node late with its heartbeats (saturated,
// not gone) stays alive while it answers the calls routed to it; one
// that answers nothing dies at the timeout as before.
func TestAnswerIsProofOfLife(t *testing.T) {
	r, c := testRegistry()
	s1 := &dsecv1.SandboxSummary{Id: "n1-00000000000000aa", Tenant: "alice", State: string(spec.StateRunning), Backend: "container"}
	s2 := &dsecv1.SandboxSummary{Id: "n2-00000000000000bb", Tenant: "bob", State: string(spec.StateRunning), Backend: "container"}
	for _, hb := range []*dsecv1.HeartbeatRequest{beat("n1", "b1", 10, s1), beat("n2", "b1", 10, s2)} {
		if err := r.heartbeat(hb); err != nil {
			t.Fatal(err)
		}
	}
	for range 5 {
		c.advance(2 * time.Second)
		r.answered("http://n1", r.now())
		r.answered("http://elsewhere", r.now()) // no such node: nothing happens
	}
	if rt, _ := r.route(s1.Id); !rt.alive || rt.lostReason != "" {
		t.Fatalf("n1 answered every call but is %+v", rt)
	}
	if rt, _ := r.route(s2.Id); rt.alive || rt.lostReason != "node n2 is not responding" {
		t.Fatalf("n2 answered nothing for 10 s but is %+v", rt)
	}
	if died := r.sweep(); len(died) != 1 || died[0] != "n2" {
		t.Fatalf("sweep reported %v dead, want [n2]", died)
	}
	// A reply to a call sent before n2 died, read only now, proves it
	// alive then, not now (TestCluster/dead_node saw such a late read
	// bring a stopped node back).
	r.answered("http://n2", r.now().Add(-10*time.Second))
	if rt, _ := r.route(s2.Id); rt.alive {
		t.Fatalf("a late-read answer to an old call revived n2: %+v", rt)
	}
}
