package edge

import (
	"context"
	goruntime "runtime"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Per-sandbox usage (`dsec sandbox ls`). The node's own figures come from
// the backends' parent cgroups at every heartbeat interval (nodestate.go):
// three reads for the whole node. A sandbox's own figures cost three or
// four cgroup file reads each (runtime.SandboxUsage): ~0.1 ms of CPU a
// sandbox on the CI machines with 1,000 of them (BenchmarkSandboxUsage),
// so a pass over a node's thousands is taken less often, at
// Config.UsageInterval, and never more often than keeps its cost under
// 1/usageCostFactor of one core: a pass that spent 150 ms of CPU waits at
// least 7.5 s for the next. The pass is paced by the CPU time it spent,
// not by its wall time, which a loaded machine stretches several times.
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
		n, wall, cpu := e.timedReadUsage()
		e.usagePass.Store(int64(wall))
		e.usagePassCPU.Store(int64(cpu))
		if n > 0 {
			e.log.Debug("sandbox usage read", "sandboxes", n, "took", wall, "cpu", cpu)
		}
		t.Reset(max(e.cfg.UsageInterval, usageCostFactor*cpu))
	}
}

// timedReadUsage runs readUsage on a thread of its own and returns how
// many sandboxes it read, its wall time and the CPU time (user and
// system) the thread spent on it. With no thread CPU clock, the CPU time
// is the wall time.
func (e *Edge) timedReadUsage() (n int, wall, cpu time.Duration) {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	var r0, r1 unix.Rusage
	err0 := unix.Getrusage(unix.RUSAGE_THREAD, &r0)
	start := time.Now()
	n = e.readUsage()
	wall = time.Since(start)
	if err0 != nil || unix.Getrusage(unix.RUSAGE_THREAD, &r1) != nil {
		return n, wall, wall
	}
	cpu = time.Duration(r1.Utime.Nano() + r1.Stime.Nano() - r0.Utime.Nano() - r0.Stime.Nano())
	return n, wall, max(cpu, 0)
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
		if !sb.st.Live() || sb.rt == nil {
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
		if !p.ok || sb.rt != p.rs || sb.phase() != StateRunning {
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
