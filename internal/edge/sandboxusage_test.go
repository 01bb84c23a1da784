package edge_test

import (
	"context"
	goruntime "runtime"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// TestSandboxUsage: Get, List and heartbeats carry each sandbox's own use.
// A sandbox spinning in a shell loop shows CPU (over a window), one
// holding 48 MiB in its /dev/shm shows that memory and the idle one does
// not; the heartbeat's capacity carries the backend's measured use.
func TestSandboxUsage(t *testing.T) {
	w := newWorld(t)
	rec, url := startRecorder(t)
	n := w.startNode(t, "use", func(c *edge.Config) {
		c.Servers = []string{url}
		c.UsageInterval = 100 * time.Millisecond
		c.Capacity = map[runtime.Kind]placement.Capacity{runtime.KindContainer: {MilliCPU: 8000, MemoryBytes: 16 << 30, Sandboxes: 10}}
	})
	spec := &dsecv1.SandboxSpec{Image: baseImage, Resources: &dsecv1.Resources{MemoryBytes: 256 << 20}}
	busy, holder, idle := n.mustCreate(t, tenant("a"), spec), n.mustCreate(t, tenant("a"), spec), n.mustCreate(t, tenant("a"), spec)

	if res, err := n.exec(t, tenant("a"), holder.Id, &dsecv1.ExecRequest{Argv: []string{"sh", "-c", "head -c 48m /dev/zero > /dev/shm/hold"}}); err != nil || res.ExitCode != 0 {
		t.Fatalf("fill /dev/shm: %v %v", res, err)
	}
	// Spin until the test has seen it; destroying the sandbox ends it.
	ctx, cancel := context.WithCancel(t.Context())
	spinning := make(chan struct{})
	go func() {
		defer close(spinning)
		n.client.ExecOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeExecRequest{Caller: tenant("a"), Request: &dsecv1.ExecRequest{
			SandboxId: busy.Id, Argv: []string{"sh", "-c", "while :; do :; done"}}}))
	}()
	defer func() {
		cancel()
		n.destroy(t, tenant("a"), busy.Id)
		<-spinning
	}()

	// Wait for the measurements (the deadline bounds a broken test only):
	// CPU needs two reads while the loop runs.
	var got map[string]*dsecv1.Sandbox
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := n.client.ListOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeListRequest{Caller: tenant("a")}))
		if err != nil {
			t.Fatal(err)
		}
		got = map[string]*dsecv1.Sandbox{}
		for _, sb := range resp.Msg.Sandboxes {
			got[sb.Id] = sb
		}
		b, h := got[busy.Id].GetUsage(), got[holder.Id].GetUsage()
		if b.GetMilliCpu() > 0 && h.GetMemoryBytes() >= 48<<20 && got[idle.Id].GetUsage().GetWindow() != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no usage seen: busy %v, holder %v, idle %v", b, h, got[idle.Id].GetUsage())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for id, sb := range got {
		u := sb.GetUsage()
		if u.GetMeasuredAt() == nil || u.GetWindow().AsDuration() <= 0 || u.GetMemoryBytes() <= 0 {
			t.Errorf("sandbox %s: usage %v, want a time, a window and memory", id, u)
		}
	}
	if u := got[idle.Id].GetUsage(); u.GetMemoryBytes() >= 48<<20 {
		t.Errorf("idle sandbox holds %d bytes", u.GetMemoryBytes())
	}
	// A unit slip (µs for ns) would be off by 1,000; jitter of the
	// window is not.
	if u := got[busy.Id].GetUsage(); u.GetMilliCpu() > int64(2*1000*goruntime.NumCPU()) {
		t.Errorf("busy sandbox uses %d milli-CPU: more than the whole machine", u.GetMilliCpu())
	}
	// Get says the same as List.
	if sb, err := n.get(t, tenant("a"), holder.Id); err != nil || sb.GetUsage().GetMemoryBytes() < 48<<20 {
		t.Errorf("get: usage %v, %v", sb.GetUsage(), err)
	}

	// Heartbeats carry it too (without its time), and the backend's
	// measured use beside its capacity.
	beat := rec.waitFor(t, func(b *dsecv1.HeartbeatRequest) bool {
		for _, s := range b.Sandboxes {
			if s.Id == holder.Id && s.GetUsage().GetMemoryBytes() >= 48<<20 {
				return len(b.Capacity) == 1 && b.Capacity[0].MeasuredMemoryBytes >= 48<<20
			}
		}
		return false
	})
	for _, s := range beat.Sandboxes {
		if s.GetUsage() != nil && s.GetUsage().GetMeasuredAt() != nil {
			t.Errorf("summary of %s carries its measurement time", s.Id)
		}
	}
	fams, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	pass := map[string]float64{}
	for _, f := range fams {
		if f.GetName() == "dsec_edge_sandbox_usage_pass_seconds" {
			for _, m := range f.GetMetric() {
				pass[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
			}
		}
	}
	if pass["wall"] <= 0 || pass["cpu"] < 0 || len(pass) != 2 {
		t.Errorf("dsec_edge_sandbox_usage_pass_seconds = %v, want a wall time > 0 and a CPU time", pass)
	}
}
