package container

import (
	"cmp"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/rawfile"
)

// Quality of service on a node of mostly idle sandboxes (issue 14).
// Sandboxes' CPU and memory are limits, not reservations, and their sum may
// be far above what the node has: most sandboxes wait for a model most of
// the time. What keeps the busy ones fast and everyone alive:
//
//   - A sandbox is active while a request is in flight (an exec, a fork
//     exec, a file transfer, a Reset or Rebase: anything its agent works
//     on) and idle once none has been for Options.IdleAfter.
//   - CPU: an idle sandbox's cgroup gets the least weight (weightIdle), and
//     the threads its execs left running get SCHED_IDLE, so they run only
//     on CPU time nobody else wants; the next request puts the weight back
//     before it reaches the agent. An active sandbox that has used more
//     than hogBudget of CPU time since it became active while the node has
//     more active sandboxes than CPUs is past its share: weightHog until
//     its requests end, so short steps of other sandboxes go first.
//   - Memory: when the node's free memory falls below a low watermark, the
//     loop takes memory back from idle sandboxes, longest idle first, into
//     swap, until it is above a high one; active sandboxes are left alone.
//     The kernel's own reclaim remains the backstop for bursts faster than
//     the loop.
//
// The request path pays two atomic operations and a clock read per
// request, plus one cgroup file write by path for the first request after
// an idle period (no descriptor is kept per sandbox). Everything else runs
// in one goroutine per backend, every tick.

// DefaultIdleAfter is how long a sandbox has had no request in flight
// before it counts as idle (Options.IdleAfter): long enough that execs
// run back to back (a step's commands) do not pay a weight write each,
// short against the model's think time between steps (seconds).
const DefaultIdleAfter = 2 * time.Second

// hogBudget is the CPU time a sandbox may use in one active period before
// it is past its share while the node has more active sandboxes than CPUs.
const hogBudget = time.Second

// Memory watermarks: the loop reclaims idle sandboxes when the node has
// less than lowWater free and stops once it has highWater (within a 1 GiB
// cap: on a large node a few GiB of headroom absorbs any burst).
const (
	lowWaterDiv = 8       // an eighth of the node's memory
	lowWaterMax = 1 << 30 // at most 1 GiB
	// reclaimStep is what one write asks of one sandbox: the loop checks
	// between steps whether it became active (then it stops).
	reclaimStep = 32 << 20
	// reclaimMin: a sandbox charged less is not worth a reclaim.
	reclaimMin = 1 << 20
)

// activity is a sandbox's QoS state.
type activity struct {
	// inFlight counts requests in flight; lastEnd is when the last one
	// ended (UnixNano; Create's end before any).
	inFlight atomic.Int32
	lastEnd  atomic.Int64
	// lowered is set while the weight in force is not weightNormal, and
	// by the loop before it checks inFlight to lower it: begin reads it
	// after counting itself in, so one of the two always sees the other.
	lowered atomic.Bool
	// mu serialises weight changes and the SCHED_IDLE sweep with begin.
	// Lock order: mu, then the sandbox's forkSrvMu (the sweep reads the
	// fork server's pid). The loop's reclaim holds the sandbox's updateMu,
	// never with mu.
	mu     sync.Mutex
	weight weight // under mu

	// Owned by the loop.
	cpuMark   time.Duration // CPU time when the active period began (-1: not active)
	reclaimed int64         // lastEnd of the idle period already reclaimed (0: none)
}

// begin counts a request in. If the loop lowered the sandbox's weight, it
// is put back first, before the request reaches the agent: the agent
// shares the sandbox's weight, and an exec's processes must not be caught
// by the loop's SCHED_IDLE sweep.
func (s *sandbox) begin() {
	first := s.qos.inFlight.Add(1) == 1
	if !s.qos.lowered.Load() {
		return
	}
	s.qos.mu.Lock()
	defer s.qos.mu.Unlock()
	// A hog stays one while its requests last; a new active period starts
	// afresh.
	if s.qos.weight == weightIdle || s.qos.weight == weightHog && first {
		if err := s.cg.setWeight(weightNormal); err != nil {
			s.b.log.Debug("restore CPU weight", "sandbox", s.id, "err", err)
		}
		s.qos.weight = weightNormal
	}
	if s.qos.weight == weightNormal {
		s.qos.lowered.Store(false)
	}
}

// end counts a request out.
func (s *sandbox) end() {
	s.qos.lastEnd.Store(time.Now().UnixNano())
	s.qos.inFlight.Add(-1)
}

// idle lowers an idle sandbox's weight and gives the threads its execs
// left running SCHED_IDLE. It gives up if a request came in.
func (s *sandbox) idle() bool {
	s.qos.mu.Lock()
	defer s.qos.mu.Unlock()
	if s.qos.weight == weightIdle {
		return false
	}
	s.qos.lowered.Store(true)
	if s.qos.inFlight.Load() != 0 {
		if s.qos.weight == weightNormal {
			s.qos.lowered.Store(false)
		}
		return false
	}
	if err := s.cg.setWeight(weightIdle); err != nil {
		s.b.log.Debug("lower CPU weight", "sandbox", s.id, "err", err)
		if s.qos.weight == weightNormal {
			s.qos.lowered.Store(false)
		}
		return false
	}
	s.qos.weight = weightIdle
	s.idleLeftovers()
	return true
}

// hog lowers the weight of an active sandbox past its share.
func (s *sandbox) hog() bool {
	s.qos.mu.Lock()
	defer s.qos.mu.Unlock()
	if s.qos.weight != weightNormal || s.qos.inFlight.Load() == 0 {
		return false
	}
	s.qos.lowered.Store(true)
	if err := s.cg.setWeight(weightHog); err != nil {
		s.b.log.Debug("lower CPU weight", "sandbox", s.id, "err", err)
		s.qos.lowered.Store(false)
		return false
	}
	s.qos.weight = weightHog
	return true
}

// idleLeftovers gives SCHED_IDLE to every thread of the user cgroup but
// the agent's (its spawner thread lives there on v1) and the fork
// server's (whose children would inherit it): what is there while no
// request is in flight was left running by an exec that ended. Their
// children inherit it; a process in a sandbox cannot undo it (leaving
// SCHED_IDLE needs RLIMIT_NICE or CAP_SYS_NICE, which sandboxes lack).
// Caller holds s.qos.mu, so no exec starts meanwhile.
func (s *sandbox) idleLeftovers() {
	b, err := os.ReadFile(s.cg.threadsFile())
	if err != nil {
		return
	}
	agent, server := s.cmd.Process.Pid, s.forkServerPid()
	attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}
	for _, f := range strings.Fields(string(b)) {
		tid, err := strconv.Atoi(f)
		if err != nil || tid == agent || ownThread(agent, tid) || server > 0 && (tid == server || ownThread(server, tid)) {
			continue
		}
		// ESRCH: it ended meanwhile.
		if err := unix.SchedSetAttr(tid, &attr, 0); err == nil {
			s.b.qosStats.leftoversIdled.Add(1)
		}
	}
}

// ownThread reports whether tid is a thread of process pid.
func ownThread(pid, tid int) bool {
	var st unix.Stat_t
	return unix.Stat("/proc/"+strconv.Itoa(pid)+"/task/"+strconv.Itoa(tid), &st) == nil
}

// QoSStats counts what the QoS loop did since the backend started.
type QoSStats struct {
	// IdleLowered: sandboxes given the idle weight; LeftoversIdled:
	// threads given SCHED_IDLE; Hogs: sandboxes found past their share.
	IdleLowered, LeftoversIdled, Hogs int64
	// Reclaims: sandboxes memory was taken back from, ReclaimedBytes how
	// much their charge went down.
	Reclaims, ReclaimedBytes int64
}

type qosCounters struct {
	idleLowered, leftoversIdled, hogs, reclaims, reclaimedBytes atomic.Int64
}

// QoSStats reports what the QoS loop did so far.
func (b *Backend) QoSStats() QoSStats {
	c := &b.qosStats
	return QoSStats{IdleLowered: c.idleLowered.Load(), LeftoversIdled: c.leftoversIdled.Load(), Hogs: c.hogs.Load(),
		Reclaims: c.reclaims.Load(), ReclaimedBytes: c.reclaimedBytes.Load()}
}

// qosTick is how often the loop runs for an idle threshold of idleAfter.
func qosTick(idleAfter time.Duration) time.Duration {
	return min(max(idleAfter/4, 10*time.Millisecond), 500*time.Millisecond)
}

// qosLoop runs the node's QoS (above) until the backend closes.
func (b *Backend) qosLoop() {
	defer close(b.qosDone)
	t := time.NewTicker(qosTick(b.opts.IdleAfter))
	defer t.Stop()
	var sbs []*sandbox
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
		}
		sbs = b.liveSandboxes(sbs[:0])
		b.qosPass(sbs, time.Now().UnixNano())
		clear(sbs)
	}
}

// liveSandboxes appends the live sandboxes to into.
func (b *Backend) liveSandboxes(into []*sandbox) []*sandbox {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, s := range b.live {
		if s != nil {
			into = append(into, s)
		}
	}
	return into
}

// qosPass is one tick of the loop over the sandboxes sbs at time now.
func (b *Backend) qosPass(sbs []*sandbox, now int64) {
	active := 0
	for _, s := range sbs {
		if s.qos.inFlight.Load() > 0 {
			active++
		}
	}
	contended := active > runtime.NumCPU()
	for _, s := range sbs {
		select {
		case <-s.done:
			continue
		default:
		}
		if s.qos.inFlight.Load() == 0 {
			s.qos.cpuMark = -1
			if now-s.qos.lastEnd.Load() >= int64(b.opts.IdleAfter) && s.idle() {
				b.qosStats.idleLowered.Add(1)
			}
			continue
		}
		used, err := s.cg.cpuTime()
		if err != nil {
			continue
		}
		if s.qos.cpuMark < 0 {
			s.qos.cpuMark = used
			continue
		}
		if contended && used-s.qos.cpuMark > hogBudget && s.hog() {
			b.qosStats.hogs.Add(1)
		}
	}
	b.reclaimIdle(sbs, now)
}

// nodeMemory is the node's memory and how much of it is free: the
// backend's bound (Options.MemoryBytes) less what its cgroup is charged,
// or without a bound the host's MemTotal and MemAvailable.
func (b *Backend) nodeMemory() (size, free int64, err error) {
	if b.opts.MemoryBytes > 0 {
		used, err := nodeMemoryUsage(b.opts.CgroupParent)
		return b.opts.MemoryBytes, b.opts.MemoryBytes - used, err
	}
	m, err := rawfile.Meminfo()
	if err != nil {
		return 0, 0, err
	}
	size, free = m["MemTotal"], m["MemAvailable"]
	return size, free, nil
}

// watermarks are the free memory below which the loop reclaims and the
// free memory it reclaims up to, for a node of size bytes.
func watermarks(size int64) (low, high int64) {
	low = min(size/lowWaterDiv, lowWaterMax)
	return low, 2 * low
}

// reclaimIdle takes memory back from idle sandboxes, longest idle first,
// while the node has less than its low watermark free, until it has the
// high one. Each idle period of a sandbox is reclaimed once: what it still
// holds after that the kernel could not take.
func (b *Backend) reclaimIdle(sbs []*sandbox, now int64) {
	size, free, err := b.nodeMemory()
	if err != nil {
		return
	}
	low, high := watermarks(size)
	if free >= low {
		return
	}
	idle := sbs[:0:0]
	for _, s := range sbs {
		end := s.qos.lastEnd.Load()
		if s.qos.inFlight.Load() == 0 && now-end >= int64(b.opts.IdleAfter) && s.qos.reclaimed != end {
			idle = append(idle, s)
		}
	}
	slices.SortFunc(idle, func(x, y *sandbox) int { return cmp.Compare(x.qos.lastEnd.Load(), y.qos.lastEnd.Load()) })
	need := high - free
	for _, s := range idle {
		if need <= 0 {
			break
		}
		got := s.reclaimMemory(need)
		need -= got
	}
}

// reclaimMemory takes up to n bytes back from an idle sandbox, in steps,
// stopping when it becomes active or nothing more comes back, and returns
// how much its charge went down.
func (s *sandbox) reclaimMemory(n int64) int64 {
	end := s.qos.lastEnd.Load()
	s.updateMu.Lock()
	defer s.updateMu.Unlock()
	if !s.resKnown {
		return 0
	}
	var total int64
	for total < n && s.qos.inFlight.Load() == 0 {
		if used, err := s.cg.userMemory(); err != nil || used < reclaimMin {
			break
		}
		got, err := s.cg.reclaim(min(reclaimStep, n-total), s.res.MemoryBytes)
		if err != nil {
			s.b.log.Debug("reclaim", "sandbox", s.id, "err", err)
			break
		}
		total += got
		if got == 0 {
			break
		}
	}
	s.qos.reclaimed = end
	if total > 0 {
		s.b.qosStats.reclaims.Add(1)
		s.b.qosStats.reclaimedBytes.Add(total)
	}
	return total
}
