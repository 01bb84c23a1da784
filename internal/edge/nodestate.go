package edge

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	goruntime "runtime"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/rawfile"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Admission by measured state. A sandbox's resources are limits: an idle
// agent uses a sliver of them while it waits for the model, so the node
// does not refuse a create because the sum of its sandboxes' limits
// exceeds its size. It refuses one when what it measures says it is full:
// memory it cannot get back (MemAvailable counts reclaimable page cache;
// swap free counts what idle sandboxes can still give up), memory
// pressure (PSI: tasks stalled on memory), descriptors of its own process,
// or the kernel's thread table. Samples are taken every heartbeat
// interval; creates admitted since the last sample are counted at what a
// sandbox costs each, so a burst cannot overrun a sample.
const (
	// pidsPerSandbox is what an idle sandbox holds of the kernel's thread
	// table: its agent's threads (~6) and a few more for the set-up.
	pidsPerSandbox = 8
	// pidReserve is kept free of sandboxes in the thread table, for the
	// host and for what sandboxes' own processes start.
	pidReserve = 4096
	// memoryStallLimit is the share of the last 10 s in which every
	// non-idle task waited for memory (PSI "full" avg10, percent) past
	// which the node is thrashing and takes no more sandboxes.
	memoryStallLimit = 10.0
)

// nodeState is one sample of what the node measures about itself.
type nodeState struct {
	at time.Time
	// MilliCPU is the node's busy CPU over the last interval.
	milliCPU int64
	// memTotal, memAvailable, swapTotal, swapFree from /proc/meminfo.
	memTotal, memAvailable, swapTotal, swapFree int64
	// memSome, memFull, cpuSome are PSI avg10 percentages (-1: no PSI).
	memSome, memFull, cpuSome float64
	// openFiles and maxOpenFiles of this process.
	openFiles, maxOpenFiles int64
	// threads in the system and the most the kernel allows.
	threads, maxThreads int64
	// use is what each backend's sandboxes use, for backends that say
	// (runtime.UsageReporter).
	use map[runtime.Kind]backendUse
}

// backendUse is what one backend's sandboxes use together.
type backendUse struct {
	milliCPU    int64 // over the last interval
	memoryBytes int64 // charged, less what reclaim takes at once
	swapBytes   int64
}

// memUsed is what the node's memory holds that it cannot reclaim.
func (s *nodeState) memUsed() int64 { return max(s.memTotal-s.memAvailable, 0) }

// sampler keeps the latest nodeState. Its mutex is a leaf: no other lock
// is taken while it is held.
type sampler struct {
	// meters are the backends that report their sandboxes' use; set
	// before the first sample, read-only afterwards.
	meters map[runtime.Kind]runtime.UsageReporter

	mu   sync.Mutex
	last nodeState
	// since counts sandboxes admitted after last was taken.
	since int64
	// prevBusy, prevTotal are /proc/stat's jiffies at the last sample,
	// prevCPU each backend's CPU time then.
	prevBusy, prevTotal uint64
	prevCPU             map[runtime.Kind]uint64
}

// sample takes a new nodeState.
func (s *sampler) sample() {
	st := nodeState{at: time.Now(), memSome: -1, memFull: -1, cpuSome: -1}
	if mi, err := rawfile.Meminfo(); err == nil {
		st.memTotal, st.memAvailable = mi["MemTotal"], mi["MemAvailable"]
		st.swapTotal, st.swapFree = mi["SwapTotal"], mi["SwapFree"]
	}
	st.memSome, st.memFull = psi("/proc/pressure/memory")
	st.cpuSome, _ = psi("/proc/pressure/cpu")
	st.openFiles = openFiles()
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil && rl.Cur != unix.RLIM_INFINITY {
		st.maxOpenFiles = int64(rl.Cur)
	}
	st.threads, st.maxThreads = threads()
	busy, total := cpuJiffies()
	use := make(map[runtime.Kind]runtime.Usage, len(s.meters))
	for kind, m := range s.meters {
		if u, err := m.Usage(); err == nil {
			use[kind] = u
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	elapsed := st.at.Sub(s.last.at)
	st.use = make(map[runtime.Kind]backendUse, len(use))
	if s.prevCPU == nil {
		s.prevCPU = map[runtime.Kind]uint64{}
	}
	for kind, u := range use {
		bu := backendUse{memoryBytes: u.MemoryBytes, swapBytes: u.SwapBytes}
		if prev, ok := s.prevCPU[kind]; ok && u.CPUNanos >= prev && elapsed > 0 {
			bu.milliCPU = int64(float64(u.CPUNanos-prev) / float64(elapsed.Nanoseconds()) * 1000)
		} else {
			bu.milliCPU = s.last.use[kind].milliCPU
		}
		s.prevCPU[kind] = u.CPUNanos
		st.use[kind] = bu
	}
	if s.prevTotal != 0 && total > s.prevTotal && busy >= s.prevBusy {
		frac := float64(busy-s.prevBusy) / float64(total-s.prevTotal)
		st.milliCPU = int64(frac * float64(goruntime.NumCPU()) * 1000)
	} else {
		st.milliCPU = s.last.milliCPU
	}
	s.prevBusy, s.prevTotal = busy, total
	s.last = st
	s.since = 0
}

// get returns the latest sample and the sandboxes admitted since.
func (s *sampler) get() (nodeState, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last, s.since
}

// admitted counts one more sandbox against the latest sample.
func (s *sampler) admitted() {
	s.mu.Lock()
	s.since++
	s.mu.Unlock()
}

// full says what the measured state is short of for one more sandbox, or
// "" when it has room. reserve is the memory that must stay available.
func (st *nodeState) full(since, reserve int64) string {
	switch {
	case st.memTotal > 0 && st.memAvailable+st.swapFree < reserve:
		return fmt.Sprintf("memory (%d bytes available and %d of swap free, below the %d kept in reserve)", st.memAvailable, st.swapFree, reserve)
	case st.memFull >= memoryStallLimit:
		return fmt.Sprintf("memory (under pressure: every task stalled on memory %.1f%% of the last 10 s)", st.memFull)
	case st.maxOpenFiles > 0 && st.openFiles+(since+1)*fdsPerSandbox > st.maxOpenFiles-min(int64(fdReserve), st.maxOpenFiles/4):
		return fmt.Sprintf("descriptors (%d of the open-file limit %d in use, %d a sandbox)", st.openFiles+since*fdsPerSandbox, st.maxOpenFiles, fdsPerSandbox)
	case st.maxThreads > 0 && st.threads+(since+1)*pidsPerSandbox > st.maxThreads-pidReserve:
		return fmt.Sprintf("pids (%d of the kernel's %d threads in use)", st.threads+since*pidsPerSandbox, st.maxThreads)
	}
	return ""
}

// proto is the sample as heartbeats report it.
func (st *nodeState) proto(refusing string) *dsecv1.NodeStatus {
	return &dsecv1.NodeStatus{
		MilliCpu:             st.milliCPU,
		MemoryUsedBytes:      st.memUsed(),
		MemoryTotalBytes:     st.memTotal,
		MemoryAvailableBytes: st.memAvailable,
		SwapTotalBytes:       st.swapTotal,
		SwapFreeBytes:        st.swapFree,
		PsiMemorySome:        st.memSome,
		PsiMemoryFull:        st.memFull,
		PsiCpuSome:           st.cpuSome,
		OpenFiles:            st.openFiles,
		MaxOpenFiles:         st.maxOpenFiles,
		Threads:              st.threads,
		MaxThreads:           st.maxThreads,
		Full:                 refusing,
	}
}

// sampleLoop samples the node's state every heartbeat interval until ctx
// is done.
func (e *Edge) sampleLoop(ctx context.Context) {
	t := time.NewTicker(e.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			e.state.sample()
		}
	}
}

// psi reads the avg10 of a /proc/pressure file's "some" and "full" lines;
// -1 where the kernel has no PSI.
func psi(path string) (some, full float64) {
	some, full = -1, -1
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		f := bytes.Fields(line)
		if len(f) < 2 || !bytes.HasPrefix(f[1], []byte("avg10=")) {
			continue
		}
		v, err := strconv.ParseFloat(string(f[1][len("avg10="):]), 64)
		if err != nil {
			continue
		}
		switch string(f[0]) {
		case "some":
			some = v
		case "full":
			full = v
		}
	}
	return
}

// openFiles counts this process's descriptors. Reading the directory in
// one pass costs ~1 ms per 10,000 entries, once per sample.
func openFiles() int64 {
	f, err := os.Open("/proc/self/fd")
	if err != nil {
		return 0
	}
	defer f.Close()
	var n int64
	for {
		names, err := f.Readdirnames(4096)
		n += int64(len(names))
		if err != nil {
			break
		}
	}
	return n - 1 // the directory's own descriptor
}

// threads returns the system's threads (the fourth field of loadavg,
// "running/total") and the most the kernel allows: the smaller of pid_max
// and threads-max.
func threads() (n, most int64) {
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := bytes.Fields(b); len(f) >= 4 {
			if _, t, ok := bytes.Cut(f[3], []byte("/")); ok {
				n, _ = strconv.ParseInt(string(t), 10, 64)
			}
		}
	}
	read := func(p string) int64 {
		b, err := os.ReadFile(p)
		if err != nil {
			return 0
		}
		v, _ := strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
		return v
	}
	pidMax, threadsMax := read("/proc/sys/kernel/pid_max"), read("/proc/sys/kernel/threads-max")
	switch {
	case pidMax > 0 && threadsMax > 0:
		most = min(pidMax, threadsMax)
	default:
		most = max(pidMax, threadsMax)
	}
	return n, most
}

// cpuJiffies returns the busy and total jiffies of /proc/stat's cpu line.
func cpuJiffies() (busy, total uint64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := bytes.Fields(line)
	if len(f) < 5 || string(f[0]) != "cpu" {
		return 0, 0
	}
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(string(v), 10, 64)
		if err != nil {
			continue
		}
		total += n
		// user nice system idle iowait irq softirq steal guest guest_nice:
		// idle and iowait are not busy; guest time is already in user.
		if i != 3 && i != 4 && i < 8 {
			busy += n
		}
	}
	// guest and guest_nice are counted inside user and nice.
	if len(f) > 9 {
		for _, v := range f[9:] {
			n, _ := strconv.ParseUint(string(v), 10, 64)
			total -= n
		}
	}
	return busy, total
}

// What bounds a node's capacity, as `dsec up` reports it at start.
const (
	// idleSandboxMemory is what an idle sandbox holds of the node's memory
	// (its agent, page tables, cgroup and namespace structures): the
	// density target, ~1.3 MiB measured for an idle agent.
	idleSandboxMemory = 2 << 20
	// memcgIDMax is the kernel's limit on memory cgroups (MEM_CGROUP_ID_MAX),
	// removed ones included until their last page is freed; each sandbox
	// has two (its own and its user processes').
	memcgIDMax = 65535
	memcgs     = 2
)

// Bound is one thing that limits how many sandboxes a node holds.
type Bound struct {
	// What: "sandbox slots", "descriptors", "memory", "pids", "cgroups".
	What string
	// Sandboxes is how many idle sandboxes it allows.
	Sandboxes int64
	// Detail says how that was worked out.
	Detail string
}

// Bounds lists what limits the node's container sandboxes at start, the
// tightest first.
func (e *Edge) Bounds() []Bound {
	st, _ := e.state.get()
	var out []Bound
	capa := e.cfg.Capacity[runtime.KindContainer]
	if capa.Sandboxes == 0 {
		for _, c := range e.cfg.Capacity {
			capa = c
			break
		}
	}
	out = append(out, Bound{"sandbox slots", capa.Sandboxes, "--max-sandboxes, or the default lowered to what the open-file limit holds"})
	if st.maxOpenFiles > 0 {
		free := st.maxOpenFiles - min(int64(fdReserve), st.maxOpenFiles/4) - st.openFiles
		out = append(out, Bound{"descriptors", max(free/fdsPerSandbox, 0),
			fmt.Sprintf("open-file limit %d, %d in use, %d kept for the process, %d a sandbox", st.maxOpenFiles, st.openFiles, min(int64(fdReserve), st.maxOpenFiles/4), fdsPerSandbox)})
	}
	if st.memTotal > 0 {
		free := st.memAvailable + st.swapFree - e.cfg.MemoryReserve
		out = append(out, Bound{"memory", max(free/idleSandboxMemory, 0),
			fmt.Sprintf("%d MiB available + %d MiB swap free - %d MiB reserve, ~%d MiB an idle sandbox (sandboxes' limits are not reserved)", st.memAvailable>>20, st.swapFree>>20, e.cfg.MemoryReserve>>20, idleSandboxMemory>>20)})
	}
	if st.maxThreads > 0 {
		free := st.maxThreads - pidReserve - st.threads
		out = append(out, Bound{"pids", max(free/pidsPerSandbox, 0),
			fmt.Sprintf("kernel limit %d threads, %d in use, %d kept free, %d an idle sandbox", st.maxThreads, st.threads, pidReserve, pidsPerSandbox)})
	}
	if n := memoryCgroups(); n >= 0 {
		out = append(out, Bound{"cgroups", max((memcgIDMax-n)/memcgs, 0),
			fmt.Sprintf("%d of the kernel's %d memory cgroups in use, %d a sandbox", n, memcgIDMax, memcgs)})
	}
	slices.SortStableFunc(out, func(a, b Bound) int { return cmp.Compare(a.Sandboxes, b.Sandboxes) })
	return out
}

// memoryCgroups is the memory controller's cgroup count from /proc/cgroups
// (-1 when unknown).
func memoryCgroups() int64 {
	b, err := os.ReadFile("/proc/cgroups")
	if err != nil {
		return -1
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		f := bytes.Fields(line)
		if len(f) >= 3 && string(f[0]) == "memory" {
			n, err := strconv.ParseInt(string(f[2]), 10, 64)
			if err == nil {
				return n
			}
		}
	}
	return -1
}

var (
	nodeMemoryDesc = prometheus.NewDesc("dsec_edge_node_memory_bytes",
		"What the node measures of memory: kind=used (not reclaimable), available, swap_total, swap_free, sandboxes (charged to the backend's sandboxes, less inactive file pages), sandboxes_swap.",
		[]string{"kind", "backend"}, nil)
	nodePressureDesc = prometheus.NewDesc("dsec_edge_node_pressure_percent",
		"PSI avg10 of the node: resource=memory|cpu, kind=some|full.", []string{"resource", "kind"}, nil)
	nodeCPUDesc = prometheus.NewDesc("dsec_edge_node_cpu_millis",
		"Busy CPU over the last sample interval, of the node (backend=\"\") and of each backend's sandboxes.", []string{"backend"}, nil)
	nodeLimitDesc = prometheus.NewDesc("dsec_edge_node_limit",
		"What bounds the node: resource=open_files|threads, kind=used|max.", []string{"resource", "kind"}, nil)
	nodeFullDesc = prometheus.NewDesc("dsec_edge_node_full",
		"1 while the node's measured state refuses creates.", nil, nil)
	usagePassDesc = prometheus.NewDesc("dsec_edge_sandbox_usage_pass_seconds",
		"The last pass reading every running sandbox's own usage: kind=wall (how long it took), cpu (the CPU time it spent; passes repeat at --usage-interval or 50 times this, whichever is longer).", []string{"kind"}, nil)
)

// stateCollector reports the node's latest measured state at each scrape.
type stateCollector struct{ e *Edge }

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{nodeMemoryDesc, nodePressureDesc, nodeCPUDesc, nodeLimitDesc, nodeFullDesc, usagePassDesc} {
		ch <- d
	}
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	st, since := c.e.state.get()
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	g(nodeMemoryDesc, float64(st.memUsed()), "used", "")
	g(nodeMemoryDesc, float64(st.memAvailable), "available", "")
	g(nodeMemoryDesc, float64(st.swapTotal), "swap_total", "")
	g(nodeMemoryDesc, float64(st.swapFree), "swap_free", "")
	g(nodeCPUDesc, float64(st.milliCPU), "")
	for kind, u := range st.use {
		g(nodeMemoryDesc, float64(u.memoryBytes), "sandboxes", string(kind))
		g(nodeMemoryDesc, float64(u.swapBytes), "sandboxes_swap", string(kind))
		g(nodeCPUDesc, float64(u.milliCPU), string(kind))
	}
	if st.memSome >= 0 {
		g(nodePressureDesc, st.memSome, "memory", "some")
		g(nodePressureDesc, st.memFull, "memory", "full")
	}
	if st.cpuSome >= 0 {
		g(nodePressureDesc, st.cpuSome, "cpu", "some")
	}
	g(nodeLimitDesc, float64(st.openFiles), "open_files", "used")
	g(nodeLimitDesc, float64(st.maxOpenFiles), "open_files", "max")
	g(nodeLimitDesc, float64(st.threads), "threads", "used")
	g(nodeLimitDesc, float64(st.maxThreads), "threads", "max")
	full := 0.0
	if st.full(since, c.e.cfg.MemoryReserve) != "" {
		full = 1
	}
	g(nodeFullDesc, full)
	g(usagePassDesc, time.Duration(c.e.usagePass.Load()).Seconds(), "wall")
	g(usagePassDesc, time.Duration(c.e.usagePassCPU.Load()).Seconds(), "cpu")
}
