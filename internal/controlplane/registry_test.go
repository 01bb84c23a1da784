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
	one := []placeReq{{tenant: "alice", quota: q, req: containerReq(100)}}

	res1, err := r.reserve(one, placement.Overcommit{})
	if err != nil || res1[0].err != nil {
		t.Fatal(err, res1[0].err)
	}
	if n, _ := ids.NodeOf(res1[0].id); n != "n1" || res1[0].url != "http://n1" {
		t.Fatalf("reservation %+v not on n1", res1[0])
	}
	r.completed(res1[0].id)
	res2, _ := r.reserve(one, placement.Overcommit{})
	if res2[0].err != nil {
		t.Fatal(res2[0].err)
	}
	// The node has two slots and both are pending: a third create must not
	// be placed there although no heartbeat has reported either yet.
	res3, _ := r.reserve(one, placement.Overcommit{})
	if !errors.Is(res3[0].err, placement.ErrNoCapacity) {
		t.Fatalf("third reserve err = %v, want no capacity", res3[0].err)
	}
	// A failed create frees its slot.
	r.release(res2[0].id)
	res4, _ := r.reserve(one, placement.Overcommit{})
	if res4[0].err != nil {
		t.Fatalf("slot not freed by release: %v", res4[0].err)
	}
	// Once the heartbeat reports the first, it is counted once, not twice.
	sum := &dsecv1.SandboxSummary{Id: res1[0].id, Tenant: "alice", State: stateRunning, MilliCpu: 100, Backend: "container"}
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
	running := &dsecv1.SandboxSummary{Id: "n1-0000000000000001", Tenant: "alice", State: stateRunning, MilliCpu: 1000}
	gone := &dsecv1.SandboxSummary{Id: "n1-0000000000000002", Tenant: "alice", State: stateDestroyed, MilliCpu: 1000}
	other := &dsecv1.SandboxSummary{Id: "n1-0000000000000003", Tenant: "bob", State: stateRunning, MilliCpu: 1000}
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
				reqs[i] = placeReq{tenant: "alice", quota: tc.q, req: containerReq(tc.cpu)}
			}
			out, err := r.reserve(reqs, placement.Overcommit{})
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
	s1 := &dsecv1.SandboxSummary{Id: "n1-00000000000000aa", Tenant: "alice", State: stateRunning, Backend: "container"}
	s2 := &dsecv1.SandboxSummary{Id: "n2-00000000000000bb", Tenant: "bob", State: stateRunning, Backend: "container"}
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
		out, _ := r.reserve([]placeReq{{tenant: "x", req: containerReq(1)}}, placement.Overcommit{})
		if out[0].err != nil || out[0].node != "n2" {
			t.Fatalf("reserve with n1 dead = %+v", out[0])
		}
		r.release(out[0].id)
	}
	counts := r.stateCounts()
	if counts[[2]string{"container", stateLost}] != 1 || counts[[2]string{"container", stateRunning}] != 1 {
		t.Fatalf("state counts %v", counts)
	}

	// n1 comes back as a new process: its old sandbox stays lost.
	s3 := &dsecv1.SandboxSummary{Id: "n1-00000000000000cc", Tenant: "alice", State: stateRunning}
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
	out, _ := r.reserve([]placeReq{{tenant: "a", req: containerReq(0)}}, placement.Overcommit{})
	if out[0].err != nil {
		t.Fatal(out[0].err)
	}
	r.completed(out[0].id)
	// The sandbox was destroyed on the edge before any heartbeat listed it:
	// after the grace period its slot is free again.
	c.advance(r.pendingGrace + time.Second)
	r.heartbeat(beat("n1", "b1", 1))
	r.sweep()
	again, _ := r.reserve([]placeReq{{tenant: "a", req: containerReq(0)}}, placement.Overcommit{})
	if again[0].err != nil {
		t.Fatalf("slot still held after the grace period: %v", again[0].err)
	}
}
