package edge

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Per-sandbox usage (`dsec sandbox ls`). The node's own figures come from
// the backends' parent cgroups at every heartbeat interval (nodestate.go):
// three reads for the whole node. A sandbox's own figures cost three or
// four cgroup file reads each (runtime.SandboxUsage), so a pass over a
// node's thousands of sandboxes is taken less often, at
// Config.UsageInterval, and never more often than keeps its cost under
// 1/usageCostFactor of one core: a pass that took 100 ms waits at least
// 5 s for the next.
const (
	// DefaultUsageInterval is the time between two passes reading every
	// running sandbox's usage; milli-CPU is averaged over it.
	DefaultUsageInterval = 5 * time.Second
	usageCostFactor      = 50
)

// sandboxUse is what one sandbox was last measured to use; guarded by
// Edge.mu.
type sandboxUse struct {
	// rt is the runtime sandbox measured: a rollback replaces it, and
	// its CPU time starts again.
	rt runtime.Sandbox
	// at is when it was read (zero: never), cpuNanos the CPU time then.
	at       time.Time
	cpuNanos uint64
	// milliCPU is the CPU over window, the time since the read before
	// (0: one read only so far).
	milliCPU     int64
	window       time.Duration
	memory, swap int64
}

// proto is the usage as Get and List report it, nil before any read.
func (u *sandboxUse) proto() *dsecv1.SandboxUsage {
	if u.at.IsZero() {
		return nil
	}
	p := &dsecv1.SandboxUsage{MilliCpu: u.milliCPU, MemoryBytes: u.memory, SwapBytes: u.swap, MeasuredAt: timestamppb.New(u.at)}
	if u.window > 0 {
		p.Window = durationpb.New(u.window)
	}
	return p
}

// summary is the usage as heartbeats carry it, without its time (servers
// sum it per tenant for metrics and show it for sandboxes of nodes that
// stop answering).
func (u *sandboxUse) summary() *dsecv1.SandboxUsage {
	p := u.proto()
	if p != nil {
		p.MeasuredAt = nil
	}
	return p
}

// usageLoop reads every running sandbox's usage until ctx is done, at
// Config.UsageInterval or, when a pass costs more than that allows, at
// usageCostFactor times what the last pass took.
func (e *Edge) usageLoop(ctx context.Context) {
	t := time.NewTimer(e.cfg.UsageInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		start := time.Now()
		n := e.readUsage()
		took := time.Since(start)
		e.usagePass.Store(int64(took))
		if n > 0 {
			e.log.Debug("sandbox usage read", "sandboxes", n, "took", took)
		}
		t.Reset(max(e.cfg.UsageInterval, usageCostFactor*took))
	}
}

// readUsage reads the usage of every running sandbox whose backend can
// say, outside Edge.mu, and records it; it returns how many it read.
func (e *Edge) readUsage() int {
	type probe struct {
		sb *sandbox
		rs runtime.Sandbox
		su runtime.SandboxUsage
		u  runtime.Usage
		at time.Time
		ok bool
	}
	e.mu.Lock()
	probes := make([]probe, 0, len(e.sandboxes))
	for _, sb := range e.sandboxes {
		if sb.state != StateRunning || sb.rt == nil || sb.rolling || sb.destroying != nil {
			continue
		}
		if su, ok := sb.rt.(runtime.SandboxUsage); ok {
			probes = append(probes, probe{sb: sb, rs: sb.rt, su: su})
		}
	}
	e.mu.Unlock()
	for i := range probes {
		p := &probes[i]
		// A sandbox destroyed meanwhile answers an error: it is skipped.
		u, err := p.su.Usage()
		p.u, p.at, p.ok = u, time.Now(), err == nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range probes {
		sb := p.sb
		if !p.ok || sb.rt != p.rs || sb.state != StateRunning {
			continue
		}
		prev := sb.use
		next := sandboxUse{rt: p.rs, at: p.at, cpuNanos: p.u.CPUNanos, memory: p.u.MemoryBytes, swap: p.u.SwapBytes}
		if prev.rt == p.rs && !prev.at.IsZero() && p.at.After(prev.at) && p.u.CPUNanos >= prev.cpuNanos {
			next.window = p.at.Sub(prev.at)
			next.milliCPU = int64(float64(p.u.CPUNanos-prev.cpuNanos) * 1000 / float64(next.window.Nanoseconds()))
		}
		sb.use = next
	}
	return len(probes)
}
