package container

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	"github.com/containerd/cgroups/v3/cgroup2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// agentPids is the headroom of tasks the sandbox cgroup keeps for the
// agent's own threads above the user's pids limit: user processes live in
// the child cgroup "user" with the spec's limit.
const agentPids = 64

// agentMemory is the memory the sandbox cgroup allows above the user's
// limit, for the agent. User processes are born in the child cgroup "user"
// (pids, memory and cpu hierarchies on v1, a leaf on v2)
// whose memory limit is the spec's, so the user's memory is the only thing
// that can OOM there and its OOM kills only user processes: the kernel
// picks a memory cgroup's OOM victim among that cgroup's processes, and
// the agent is not one of them. (Its own oom_score_adj of -1000 is only a
// request: it needs CAP_SYS_RESOURCE, which some hosts withhold from root.)
// The agent, outside "user", is bounded by the sandbox cgroup, at the
// user's limit plus this: an idle agent is charged ~1.3 MiB, one serving
// many streams a few MiB more, so 32 MiB bounds what a workload can make
// the node pay for the agent without the agent ever reaching it in normal
// use.
const agentMemory = 32 << 20

const cgroupRoot = "/sys/fs/cgroup"

// v1Controllers are the cgroup v1 hierarchies a sandbox gets a directory in.
// Each mkdir costs, so only the controllers DSec uses: limits (cpu, memory,
// pids), accounting (cpuacct) and freezing (freezer).
var v1Controllers = []cgroup1.Name{cgroup1.Cpu, cgroup1.Cpuacct, cgroup1.Memory, cgroup1.Pids, cgroup1.Freezer}

// v1UserMore are the v1 hierarchies besides pids where the sandbox's
// cgroup has a "user" child for the user's processes: memory, so that
// the user's limit and OOM kills are theirs alone (see agentMemory), and
// cpu, so that the sandbox's quota, on the sandbox's cgroup, is shared
// between the agent and the user's processes as two groups of equal
// weight: a fork storm of hundreds of runnable processes would otherwise
// leave the agent a few thousandths of the quota, and every request to it
// would stall until the storm was killed. (On v2 the "agent" and "user"
// leaves do the same with the memory and cpu controllers.)
var v1UserMore = []string{"memory", "cpu"}

// cgroup is one sandbox's control group, in whichever mode the host runs.
type cgroup interface {
	// spawn runs start so that the process it forks is born inside the
	// cgroup. The process must be born inside, not moved in afterwards:
	// its cgroup namespace (CLONE_NEWCGROUP) is rooted where it is born.
	spawn(attr *syscall.SysProcAttr, start func() error) error
	// update applies r (a pre-started agent gets its sandbox's limits).
	update(r rt.Resources) error
	// set changes a running sandbox's limits from those in force, from,
	// to to, writing only the limits that differ (fncall changes one
	// limit per call; each file written costs). Unlike update, a zero CPU
	// or memory field lifts that limit. A nil from writes every limit.
	set(from *rt.Resources, to rt.Resources) error
	// userDir is the cgroup directory of the user's processes (with the
	// pids controller; on v1 the agent's spawner thread lives there too).
	userDir() string
	// files are the user cgroup's files an exec and a Reset read.
	files() *userFiles
	// user fills in where the sandbox's user processes are born (see
	// agent.ContainerInit.UserTasks).
	user(cfg *agent.ContainerInit)
	// freeze stops every process of the cgroup (and below) and returns
	// once they are all stopped; thaw resumes them.
	freeze() error
	thaw() error
	// unthrottle lifts the CPU quota of a sandbox whose processes have all
	// been sent SIGKILL (Destroy): a killed process still needs CPU time to
	// exit, and hundreds of them sharing a small quota (a fork storm) took
	// minutes, holding up the destroy and every processes' memory.
	unthrottle() error
	// paths lists the cgroup's directories (for leak checks).
	paths() []string
	delete() error

	// What the node's QoS loop (qos.go) reads and writes.

	// setWeight sets the sandbox's CPU weight among the node's sandboxes.
	setWeight(w weight) error
	// threadsFile lists the threads of the user cgroup, one ID a line (on
	// v1 the agent's spawner thread among them).
	threadsFile() string
	// cpuTime is the CPU time the sandbox's processes have used so far,
	// the agent's included.
	cpuTime() (time.Duration, error)
	// userMemory is the user cgroup's memory charge (RAM, page cache
	// included; not what is in swap).
	userMemory() (int64, error)
	// reclaim has the kernel take up to n bytes of the user cgroup's
	// memory back (anonymous pages to swap, page cache dropped), the user's
	// memory limit in force being limit (0: none), and returns how much
	// its charge went down.
	reclaim(n, limit int64) (int64, error)
}

// weight is a sandbox's CPU weight level among the node's sandboxes: CFS
// shares the CPU between sibling cgroups in proportion to their weights
// when they all want it, and a weight changes nothing on an idle CPU.
type weight int

const (
	// weightNormal: requests in flight; the kernel's default weight.
	weightNormal weight = iota
	// weightHog: requests in flight past the sandbox's share (qos.go):
	// an eighth of normal, so that short steps of other sandboxes go
	// first while it still progresses.
	weightHog
	// weightIdle: no request in flight: only what earlier execs left
	// running can want the CPU, and it gets the least the kernel allows.
	weightIdle
)

// v1Shares and v2Weights are the cpu.shares (default 1024, least 2) and
// cpu.weight (default 100, least 1) of each weight level.
var (
	v1Shares  = [...]string{weightNormal: "1024", weightHog: "128", weightIdle: "2"}
	v2Weights = [...]string{weightNormal: "100", weightHog: "12", weightIdle: "1"}
)

// cgroupMode says which cgroup layout to use: v2 when the host is unified,
// v1 otherwise (hybrid hosts like the CI machines keep their controllers in v1).
func cgroupMode() cgroups.CGMode { return cgroups.Mode() }

func newCgroup(parent, id string, r rt.Resources) (cgroup, error) {
	group := "/" + parent + "/" + id
	if cgroupMode() == cgroups.Unified {
		return newCgroup2(group, r)
	}
	return newCgroup1(group, r)
}

// toSpec is the sandbox cgroup's CPU and pids limits for r: the CPU quota
// covers every process of the sandbox, the agent included; pids leave the
// agent room above the user's limit (agentPids), which the "user" child
// cgroup holds its processes to. Memory is written by v1MemoryWrites, not
// by containerd: its Update writes memory.limit_in_bytes before
// memory.memsw.limit_in_bytes whichever way they move, and the kernel
// refuses a memory limit above the memsw one.
func toSpec(r rt.Resources) *specs.LinuxResources {
	pids := r.Pids + agentPids
	res := &specs.LinuxResources{Pids: &specs.LinuxPids{Limit: &pids}}
	if r.MilliCPU > 0 {
		period := uint64(cpuPeriod)
		quota := r.MilliCPU * int64(period) / 1000
		res.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	return res
}

// userEvents are the user cgroup's event counters.
type userEvents struct {
	oomKills, pidsMax uint64
}

// The user cgroup's files an exec and a Reset read (userFiles), in the
// order of agent.ContainerInit.CgroupFiles.
const (
	// fileOOM is memory.oom_control (v1) or memory.events (v2): its
	// oom_kill count.
	fileOOM = iota
	// filePidsEvents is pids.events: its max count, forks refused.
	filePidsEvents
	// filePidsCurrent is pids.current: tasks charged to the cgroup.
	filePidsCurrent
	numUserFiles
)

// fileID is a file's device and inode numbers.
type fileID struct{ dev, ino uint64 }

// userFiles are the user cgroup's files that an exec reads before and
// after it runs (one pread each of fileOOM and filePidsEvents) to tell
// whether its processes were OOM-killed or refused a fork, and that a
// Reset reads to tell whether the agent is alone (filePidsCurrent). They
// are open only while used: an exec's are opened as it starts and closed
// when the last exec in flight ends, so an idle sandbox keeps no
// descriptor for them in the edge (whose open-file limit bounds how many
// sandboxes a node holds). Opening a cgroup file costs (kernfs: tens of
// microseconds here), so they are borrowed from the agent, which opened
// them before it pivoted and keeps them (see sandbox.openUserFile).
type userFiles struct {
	// path and id name each file and its device and inode numbers (a
	// stat when the cgroup was made); oomKey is fileOOM's counter.
	path   [numUserFiles]string
	id     [numUserFiles]fileID
	oomKey string

	mu sync.Mutex
	// execs counts the execs between start and end; oom and pid are
	// the event files' descriptors while open.
	execs    int
	open     bool
	oom, pid int
}

// newUserFiles names the files of the user cgroup (memory events file
// oom with its counter key, pids directory pidsDir) and records their
// identities.
func newUserFiles(oom, oomKey, pidsDir string) (*userFiles, error) {
	f := &userFiles{path: [numUserFiles]string{oom, filepath.Join(pidsDir, "pids.events"), filepath.Join(pidsDir, "pids.current")}, oomKey: oomKey}
	for i, p := range f.path {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return nil, fmt.Errorf("stat %s: %w", p, err)
		}
		f.id[i] = fileID{st.Dev, st.Ino}
	}
	return f, nil
}

// opener opens file i of userFiles (sandbox.openUserFile).
type opener func(i int) (int, error)

// execStart reads the user cgroup's counters of OOM kills and of forks
// refused by its pids limit so far, as an exec starts, and keeps their
// files open until the matching execEnd (every execStart has one,
// whatever it returned), which reads them again if read is set.
func (e *userFiles) execStart(open opener) (userEvents, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.execs++
	return e.readLocked(open)
}

func (e *userFiles) execEnd(open opener, read bool) (ev userEvents, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if read {
		ev, err = e.readLocked(open)
	}
	if e.execs--; e.execs <= 0 {
		e.execs = 0
		e.closeLocked()
	}
	return ev, err
}

func (e *userFiles) readLocked(open opener) (userEvents, error) {
	var ev userEvents
	if !e.open {
		oom, err := open(fileOOM)
		if err != nil {
			return ev, err
		}
		pid, err := open(filePidsEvents)
		if err != nil {
			unix.Close(oom)
			return ev, err
		}
		e.oom, e.pid, e.open = oom, pid, true
	}
	var err error
	if ev.oomKills, err = preadKV(e.oom, e.path[fileOOM], e.oomKey); err != nil {
		return ev, err
	}
	ev.pidsMax, err = preadKV(e.pid, e.path[filePidsEvents], "max")
	return ev, err
}

// close closes the event files (the cgroup is being deleted); an exec
// still in flight opens them again if it can.
func (e *userFiles) close() {
	if e == nil {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closeLocked()
}

func (e *userFiles) closeLocked() {
	if e.open {
		unix.Close(e.oom)
		unix.Close(e.pid)
		e.open = false
	}
}

// preadKV reads a small "key value" file (name) from its start through
// fd, in one pread, and returns key's value.
func preadKV(fd int, name, key string) (uint64, error) {
	var buf [512]byte
	b, ok, err := preadSmall(fd, buf[:])
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", name, err)
	}
	if !ok {
		return 0, fmt.Errorf("%s is larger than %d bytes", name, len(buf))
	}
	return parseKV(b, name, key)
}

type cgroupV1 struct {
	group string
	cg    cgroup1.Cgroup
	ev    *userFiles
}

func v1Hierarchy() ([]cgroup1.Subsystem, error) {
	return []cgroup1.Subsystem{
		cgroup1.NewCpu(cgroupRoot), cgroup1.NewCpuacct(cgroupRoot), cgroup1.NewMemory(cgroupRoot),
		cgroup1.NewPids(cgroupRoot), cgroup1.NewFreezer(cgroupRoot),
	}, nil
}

func newCgroup1(group string, r rt.Resources) (*cgroupV1, error) {
	cg, err := cgroup1.New(cgroup1.StaticPath(group), toSpec(r), cgroup1.WithHierarchy(v1Hierarchy))
	if err != nil {
		// cgroup1.New leaves the directories it made; remove them.
		removeV1Dirs(group)
		return nil, fmt.Errorf("create cgroup %s: %w", group, err)
	}
	c := &cgroupV1{group: group, cg: cg}
	for _, ctrl := range append([]string{"pids"}, v1UserMore...) {
		dir := filepath.Join(cgroupRoot, ctrl, group, "user")
		if err := os.Mkdir(dir, 0o755); err != nil {
			c.delete()
			return nil, fmt.Errorf("create cgroup %s: %w", dir, err)
		}
	}
	memUser := filepath.Join(cgroupRoot, "memory", group, "user")
	if c.ev, err = newUserFiles(filepath.Join(memUser, "memory.oom_control"), "oom_kill", c.userDir()); err != nil {
		c.delete()
		return nil, fmt.Errorf("create cgroup %s: %w", group, err)
	}
	if err := writeAll(v1InitWrites(group, r)); err != nil {
		c.delete()
		return nil, fmt.Errorf("set memory and user limits: %w", err)
	}
	return c, nil
}

// v1InitWrites give a cgroup just made from toSpec(r), with no memory
// limit in force, the rest of r: the memory limits of the sandbox and
// user cgroups and the user's pids limit.
func v1InitWrites(group string, r rt.Resources) []cgroupWrite {
	return append(v1MemoryWrites(group, 0, true, r.MemoryBytes),
		cgroupWrite{filepath.Join(cgroupRoot, "pids", group, "user", "pids.max"), strconv.FormatInt(r.Pids, 10)})
}

// v1MemoryWrites are the writes that move the memory limit of the user
// cgroup from from to to (0: none; known false: not known) and the
// sandbox cgroup's with it (to plus agentMemory). Each cgroup's limit
// bounds RAM (memory.limit_in_bytes) and RAM and swap together
// (memory.memsw.limit_in_bytes) at the same value: a sandbox may use its
// limit and no more whether its pages are resident or swapped out, and
// the node, not the sandbox, decides which (qos.go). The kernel keeps
// limit <= memsw in each cgroup, so a limit that rises moves memsw first
// and one that falls moves it last; across the two cgroups, a rise moves
// the sandbox's first and a fall the user's first (a child's limit above
// its parent's is allowed but pointless, and the order keeps the agent's
// headroom whichever way the limit moves). Without swap accounting (no
// memsw files: swapaccount=0) only the RAM limits are written.
func v1MemoryWrites(group string, from int64, known bool, to int64) []cgroupWrite {
	user := filepath.Join(cgroupRoot, "memory", group, "user")
	sb := filepath.Join(cgroupRoot, "memory", group)
	val := func(n, extra int64) string {
		if n == 0 {
			return "-1"
		}
		return strconv.FormatInt(n+extra, 10)
	}
	// one cgroup's two files, RAM limit first or last.
	one := func(dir, v string, ramFirst bool) []cgroupWrite {
		ram := cgroupWrite{filepath.Join(dir, "memory.limit_in_bytes"), v}
		if !memswAccounting() {
			return []cgroupWrite{ram}
		}
		sw := cgroupWrite{filepath.Join(dir, "memory.memsw.limit_in_bytes"), v}
		if ramFirst {
			return []cgroupWrite{ram, sw}
		}
		return []cgroupWrite{sw, ram}
	}
	var w []cgroupWrite
	if !known {
		// Lift both, then set from none: whatever was in force, every
		// write is then allowed.
		w = append(one(sb, "-1", false), one(user, "-1", false)...)
		from = 0
	}
	if to == 0 || from != 0 && to > from { // rising
		w = append(w, one(sb, val(to, agentMemory), false)...)
		return append(w, one(user, val(to, 0), false)...)
	}
	w = append(w, one(user, val(to, 0), true)...)
	return append(w, one(sb, val(to, agentMemory), true)...)
}

// memswAccounting reports whether the v1 memory controller accounts swap
// (memory.memsw.* exist: swapaccount=1, the default since Linux 5.8).
var memswAccounting = sync.OnceValue(func() bool {
	_, err := os.Stat(filepath.Join(cgroupRoot, "memory", "memory.memsw.limit_in_bytes"))
	return err == nil
})

// v1UserWrites are the writes that move the sandbox's memory and pids
// limits (its own cgroups and the user's) from from to to, where they
// differ (nil: all).
func v1UserWrites(group string, from *rt.Resources, to rt.Resources) []cgroupWrite {
	var w []cgroupWrite
	if from == nil {
		w = v1MemoryWrites(group, 0, false, to.MemoryBytes)
	} else if from.MemoryBytes != to.MemoryBytes {
		w = v1MemoryWrites(group, from.MemoryBytes, true, to.MemoryBytes)
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w,
			cgroupWrite{filepath.Join(cgroupRoot, "pids", group, "pids.max"), strconv.FormatInt(to.Pids+agentPids, 10)},
			cgroupWrite{filepath.Join(cgroupRoot, "pids", group, "user", "pids.max"), strconv.FormatInt(to.Pids, 10)})
	}
	return w
}

func (c *cgroupV1) freeze() error { return c.cg.Freeze() }
func (c *cgroupV1) thaw() error   { return c.cg.Thaw() }

// update applies r to a pre-started agent's cgroups, which hold the
// warm pool's limits (pids only, no memory limit).
func (c *cgroupV1) update(r rt.Resources) error {
	if err := c.cg.Update(toSpec(r)); err != nil {
		return err
	}
	return writeAll(v1InitWrites(c.group, r))
}

func (c *cgroupV1) set(from *rt.Resources, to rt.Resources) error {
	var w []cgroupWrite
	if from == nil || from.MilliCPU != to.MilliCPU {
		dir := filepath.Join(cgroupRoot, "cpu", c.group)
		quota := "-1"
		if to.MilliCPU > 0 {
			quota = strconv.FormatInt(to.MilliCPU*cpuPeriod/1000, 10)
			// The period first: the quota is checked against it.
			w = append(w, cgroupWrite{filepath.Join(dir, "cpu.cfs_period_us"), strconv.Itoa(cpuPeriod)})
		}
		w = append(w, cgroupWrite{filepath.Join(dir, "cpu.cfs_quota_us"), quota})
	}
	w = append(w, v1UserWrites(c.group, from, to)...)
	return writeAll(w)
}

// cpuPeriod is the CFS period of CPU limits, in microseconds.
const cpuPeriod = 100000

// cgroupWrite is one value to write into one cgroup file.
type cgroupWrite struct{ file, value string }

// writeAll writes each value in order and stops at the first error.
func writeAll(w []cgroupWrite) error {
	for _, x := range w {
		if err := os.WriteFile(x.file, []byte(x.value), 0); err != nil {
			return err
		}
	}
	return nil
}

func (c *cgroupV1) userDir() string { return filepath.Join(cgroupRoot, "pids", c.group, "user") }

func (c *cgroupV1) user(cfg *agent.ContainerInit) {
	cfg.UserTasks = filepath.Join(cgroupRoot, "pids", c.group, "user", "tasks")
	for _, ctrl := range v1UserMore {
		cfg.UserMoreTasks = append(cfg.UserMoreTasks, filepath.Join(cgroupRoot, ctrl, c.group, "user", "tasks"))
	}
}

func removeV1Dirs(group string) {
	for _, c := range v1Controllers {
		os.Remove(filepath.Join(cgroupRoot, string(c), group))
	}
}

// spawn moves the calling OS thread into the sandbox's cgroups (v1 lets a
// single thread move), forks, and moves the thread back. Cheaper than a
// cgroup-aware pre-exec helper process and race-free: the child never runs
// outside its cgroup.
func (c *cgroupV1) spawn(_ *syscall.SysProcAttr, start func() error) error {
	runtime.LockOSThread()
	tid := []byte(strconv.Itoa(syscall.Gettid()))
	home, err := threadCgroups()
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	var moved []cgroup1.Name
	err = func() error {
		for _, ctrl := range v1Controllers {
			if err := os.WriteFile(filepath.Join(cgroupRoot, string(ctrl), c.group, "tasks"), tid, 0); err != nil {
				return fmt.Errorf("enter cgroup %s%s: %w", ctrl, c.group, err)
			}
			moved = append(moved, ctrl)
		}
		return start()
	}()
	for _, ctrl := range moved {
		if werr := os.WriteFile(filepath.Join(cgroupRoot, string(ctrl), home[string(ctrl)], "tasks"), tid, 0); werr != nil {
			// A thread left in a sandbox's cgroup would charge the edge's
			// work to the sandbox. Staying locked makes the Go runtime end
			// the thread when this goroutine exits.
			return errors.Join(err, fmt.Errorf("leave cgroup %s%s: %w", ctrl, c.group, werr))
		}
	}
	runtime.UnlockOSThread()
	return err
}

// threadCgroups maps each v1 controller to the calling thread's cgroup path.
func threadCgroups() (map[string]string, error) {
	b, err := os.ReadFile("/proc/thread-self/cgroup")
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, ctrl := range strings.Split(parts[1], ",") {
			m[ctrl] = parts[2]
		}
	}
	for _, c := range v1Controllers {
		if _, ok := m[string(c)]; !ok {
			return nil, fmt.Errorf("cgroup v1 controller %s is not mounted", c)
		}
	}
	return m, nil
}

func (c *cgroupV1) files() *userFiles { return c.ev }

func (c *cgroupV1) unthrottle() error {
	return os.WriteFile(filepath.Join(cgroupRoot, "cpu", c.group, "cpu.cfs_quota_us"), []byte("-1"), 0)
}

func (c *cgroupV1) paths() []string {
	var p []string
	for _, ctrl := range append([]string{"pids"}, v1UserMore...) {
		p = append(p, filepath.Join(cgroupRoot, ctrl, c.group, "user"))
	}
	for _, ctrl := range v1Controllers {
		p = append(p, filepath.Join(cgroupRoot, string(ctrl), c.group))
	}
	return p
}

func (c *cgroupV1) delete() error {
	c.ev.close()
	for _, ctrl := range append([]string{"pids"}, v1UserMore...) {
		if err := os.Remove(filepath.Join(cgroupRoot, ctrl, c.group, "user")); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove cgroup %s%s/user: %w", ctrl, c.group, err)
		}
	}
	err := c.cg.Delete()
	if errors.Is(err, cgroup1.ErrCgroupDeleted) {
		return nil
	}
	return err
}

func (c *cgroupV1) setWeight(w weight) error {
	return os.WriteFile(filepath.Join(cgroupRoot, "cpu", c.group, "cpu.shares"), []byte(v1Shares[w]), 0)
}

func (c *cgroupV1) threadsFile() string {
	return filepath.Join(cgroupRoot, "cpu", c.group, "user", "tasks")
}

func (c *cgroupV1) cpuTime() (time.Duration, error) {
	n, err := readInt(filepath.Join(cgroupRoot, "cpuacct", c.group, "cpuacct.usage"))
	return time.Duration(n), err
}

func (c *cgroupV1) userMemory() (int64, error) {
	return readInt(filepath.Join(cgroupRoot, "memory", c.group, "user", "memory.usage_in_bytes"))
}

// reclaim lowers the user cgroup's memory limit to its charge less n and
// puts it back. cgroup v1 has no memory.reclaim, but a lower limit makes
// the writer reclaim the cgroup's own pages (swapping anonymous ones out,
// the coldest first) until the charge fits or nothing more can go: the
// write returns EBUSY and leaves the limit as it was, having taken what it
// could. The limit is only in force between the two writes, after the
// charge already fits under it, so the sandbox's processes are never held
// to it (bench/reclaimbench compares this with soft limits, force_empty
// and process_madvise). The memsw limit, which bounds RAM and swap
// together, is not touched: what goes to swap still counts.
func (c *cgroupV1) reclaim(n, limit int64) (int64, error) {
	dir := filepath.Join(cgroupRoot, "memory", c.group, "user")
	before, err := c.userMemory()
	if err != nil {
		return 0, err
	}
	target := max(before-n, 0)
	file := filepath.Join(dir, "memory.limit_in_bytes")
	err = os.WriteFile(file, []byte(strconv.FormatInt(target, 10)), 0)
	if err == nil {
		restore := "-1"
		if limit > 0 {
			restore = strconv.FormatInt(limit, 10)
		}
		if err := os.WriteFile(file, []byte(restore), 0); err != nil {
			return 0, fmt.Errorf("restore memory limit after reclaim: %w", err)
		}
	} else if !errors.Is(err, unix.EBUSY) {
		return 0, err
	}
	after, err := c.userMemory()
	if err != nil {
		return 0, err
	}
	return max(before-after, 0), nil
}

// readInt reads a cgroup file holding one integer.
func readInt(file string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

type cgroupV2 struct {
	group string
	m     *cgroup2.Manager
	ev    *userFiles
}

// v2Controllers are the controllers a sandbox's v2 cgroup gets, whatever
// its limits (a pre-started agent's are set later), and v2Delegated those
// its "agent" and "user" leaves get: limits on the user's processes alone,
// and the quota shared between the two as on v1 (see v1UserMore).
var (
	v2Controllers = []string{"cpu", "memory", "pids"}
	v2Delegated   = "+cpu +memory +pids"
)

// v2Resources is the sandbox cgroup's limits for r (see toSpec). A lifted
// limit is written as "max", since Update writes only what is set.
func v2Resources(r rt.Resources) *cgroup2.Resources {
	res := &cgroup2.Resources{Pids: &cgroup2.Pids{Max: r.Pids + agentPids}}
	period := uint64(cpuPeriod)
	if r.MilliCPU > 0 {
		quota := r.MilliCPU * int64(period) / 1000
		res.CPU = &cgroup2.CPU{Max: cgroup2.NewCPUMax(&quota, &period)}
	}
	if r.MemoryBytes > 0 {
		ram, swap := v2Memory(r.MemoryBytes)
		ram += agentMemory
		res.Memory = &cgroup2.Memory{Max: &ram, Swap: &swap}
	}
	return res
}

// v2SwapShare is the part of a sandbox's memory limit that may be in swap
// on cgroup v2 when the host has swap. v2 has no limit on RAM and swap
// together (v1's memsw): memory.max bounds RAM and memory.swap.max swap,
// each alone, so the limit is split between them and their sum is the
// limit, as v1's memsw makes it. A fixed split caps RAM below the limit,
// so the share is small: a sandbox touching its whole limit has a quarter
// of it in swap even on an empty node, and an idle one can give back up
// to a quarter of its limit, which for the mostly idle agents DSec holds
// (a few hundred MiB used of GiBs allowed) is all they use. Without swap
// the whole limit is RAM.
const v2SwapShare = 4

// hostSwap is whether the host had swap when the last backend was made
// (New): v2Memory splits limits only then.
var hostSwap atomic.Bool

// v2Memory splits a user memory limit into memory.max and memory.swap.max
// (see v2SwapShare).
func v2Memory(limit int64) (ram, swap int64) {
	if !hostSwap.Load() {
		return limit, 0
	}
	swap = limit / v2SwapShare
	return limit - swap, swap
}

func newCgroup2(group string, r rt.Resources) (*cgroupV2, error) {
	m, err := cgroup2.NewManager(cgroupRoot, group, v2Resources(r))
	if err != nil {
		os.Remove(filepath.Join(cgroupRoot, group))
		return nil, fmt.Errorf("create cgroup %s: %w", group, err)
	}
	c := &cgroupV2{group: group, m: m}
	// v2 allows processes only in leaves once controllers are delegated:
	// the agent lives in "agent", user processes in "user".
	dir := filepath.Join(cgroupRoot, group)
	user := filepath.Join(dir, "user")
	err = func() error {
		// Every controller, limits or not: a pre-started agent gets its
		// limits later, and files of a controller not enabled do not exist.
		if err := m.ToggleControllers(v2Controllers, cgroup2.Enable); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte(v2Delegated), 0); err != nil {
			return err
		}
		for _, child := range []string{"agent", "user"} {
			if err := os.Mkdir(filepath.Join(dir, child), 0o755); err != nil {
				return err
			}
		}
		if c.ev, err = newUserFiles(filepath.Join(user, "memory.events"), "oom_kill", user); err != nil {
			return err
		}
		return writeAll(v2UserWrites(dir, nil, r))
	}()
	if err != nil {
		c.delete()
		return nil, fmt.Errorf("create cgroup %s children: %w", group, err)
	}
	return c, nil
}

func (c *cgroupV2) freeze() error { return c.m.Freeze() }
func (c *cgroupV2) thaw() error   { return c.m.Thaw() }

func (c *cgroupV2) update(r rt.Resources) error {
	if err := c.m.Update(v2Resources(r)); err != nil {
		return err
	}
	return writeAll(v2UserWrites(filepath.Join(cgroupRoot, c.group), nil, r))
}

// v2UserWrites are the writes that give the user leaf of the sandbox
// cgroup dir the limits to, where they differ from from (nil: all).
func v2UserWrites(dir string, from *rt.Resources, to rt.Resources) []cgroupWrite {
	user := filepath.Join(dir, "user")
	var w []cgroupWrite
	if from == nil || from.MemoryBytes != to.MemoryBytes {
		w = append(w, v2MemoryWrites(user, to.MemoryBytes, 0)...)
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w, cgroupWrite{filepath.Join(user, "pids.max"), strconv.FormatInt(to.Pids, 10)})
	}
	return w
}

// v2MemoryWrites give the cgroup dir the memory limit limit (0: none)
// plus extra RAM (the agent's headroom in the sandbox's cgroup): RAM and
// swap split by v2Memory; v2 has no -1, a lifted limit is "max".
func v2MemoryWrites(dir string, limit, extra int64) []cgroupWrite {
	ram, swap := "max", "max"
	if limit > 0 {
		r, s := v2Memory(limit)
		ram, swap = strconv.FormatInt(r+extra, 10), strconv.FormatInt(s, 10)
	}
	return []cgroupWrite{{filepath.Join(dir, "memory.swap.max"), swap}, {filepath.Join(dir, "memory.max"), ram}}
}

// set writes "max" for lifted limits (v2 has no -1), and memory limits
// split between RAM and swap as update does.
func (c *cgroupV2) set(from *rt.Resources, to rt.Resources) error {
	dir := filepath.Join(cgroupRoot, c.group)
	var w []cgroupWrite
	if from == nil || from.MilliCPU != to.MilliCPU {
		cpuMax := "max " + strconv.Itoa(cpuPeriod)
		if to.MilliCPU > 0 {
			cpuMax = strconv.FormatInt(to.MilliCPU*cpuPeriod/1000, 10) + " " + strconv.Itoa(cpuPeriod)
		}
		w = append(w, cgroupWrite{filepath.Join(dir, "cpu.max"), cpuMax})
	}
	if from == nil || from.MemoryBytes != to.MemoryBytes {
		w = append(w, v2MemoryWrites(dir, to.MemoryBytes, agentMemory)...)
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w, cgroupWrite{filepath.Join(dir, "pids.max"), strconv.FormatInt(to.Pids+agentPids, 10)})
	}
	// v2 takes a child's limit above its parent's, so the order of the
	// sandbox's and the user's writes does not matter.
	return writeAll(append(w, v2UserWrites(dir, from, to)...))
}

func (c *cgroupV2) userDir() string { return filepath.Join(cgroupRoot, c.group, "user") }

func (c *cgroupV2) user(cfg *agent.ContainerInit) {
	cfg.UserCgroupDir = filepath.Join(cgroupRoot, c.group, "user")
}

// spawn uses clone3's CLONE_INTO_CGROUP: the child is born in the cgroup.
func (c *cgroupV2) spawn(attr *syscall.SysProcAttr, start func() error) error {
	fd, err := syscall.Open(filepath.Join(cgroupRoot, c.group, "agent"), syscall.O_DIRECTORY|syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open cgroup %s: %w", c.group, err)
	}
	defer syscall.Close(fd)
	attr.UseCgroupFD = true
	attr.CgroupFD = fd
	return start()
}

func (c *cgroupV2) files() *userFiles { return c.ev }

func (c *cgroupV2) unthrottle() error {
	return os.WriteFile(filepath.Join(cgroupRoot, c.group, "cpu.max"), []byte("max "+strconv.Itoa(cpuPeriod)), 0)
}

func (c *cgroupV2) paths() []string {
	d := filepath.Join(cgroupRoot, c.group)
	return []string{d, filepath.Join(d, "agent"), filepath.Join(d, "user")}
}

func (c *cgroupV2) delete() error {
	c.ev.close()
	for _, child := range []string{"agent", "user"} {
		if err := os.Remove(filepath.Join(cgroupRoot, c.group, child)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove cgroup %s/%s: %w", c.group, child, err)
		}
	}
	return c.m.Delete()
}

func (c *cgroupV2) setWeight(w weight) error {
	return os.WriteFile(filepath.Join(cgroupRoot, c.group, "cpu.weight"), []byte(v2Weights[w]), 0)
}

func (c *cgroupV2) threadsFile() string {
	return filepath.Join(cgroupRoot, c.group, "user", "cgroup.threads")
}

func (c *cgroupV2) cpuTime() (time.Duration, error) {
	file := filepath.Join(cgroupRoot, c.group, "cpu.stat")
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	us, err := parseKV(b, file, "usage_usec")
	return time.Duration(us) * time.Microsecond, err
}

func (c *cgroupV2) userMemory() (int64, error) {
	return readInt(filepath.Join(cgroupRoot, c.group, "user", "memory.current"))
}

// reclaim writes memory.reclaim, which does what it says (EAGAIN when it
// took less than asked).
func (c *cgroupV2) reclaim(n, _ int64) (int64, error) {
	before, err := c.userMemory()
	if err != nil {
		return 0, err
	}
	err = os.WriteFile(filepath.Join(cgroupRoot, c.group, "user", "memory.reclaim"), []byte(strconv.FormatInt(n, 10)), 0)
	if err != nil && !errors.Is(err, unix.EAGAIN) {
		return 0, err
	}
	after, err := c.userMemory()
	if err != nil {
		return 0, err
	}
	return max(before-after, 0), nil
}

// setNodeMemory bounds the RAM of every sandbox under parent together at
// bytes (0: no bound), the edge's --memory: the parent cgroup's memory
// limit, so that the kernel reclaims within the node's sandboxes (to swap)
// when they reach it, and the rest of the host never feels them. Swap is
// not bounded by it (v1 memsw, v2 memory.swap.max are left as they are):
// what the node may swap is the swap area's size, and a RAM+swap bound at
// the same value would make swap useless (a page swapped out would still
// count against it).
func setNodeMemory(parent string, bytes int64) error {
	if cgroupMode() == cgroups.Unified {
		dir := filepath.Join(cgroupRoot, parent)
		if bytes == 0 {
			if err := os.WriteFile(filepath.Join(dir, "memory.max"), []byte("max"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
			return nil
		}
		// NewManager makes the directory and enables the memory
		// controller in the cgroups above it.
		_, err := cgroup2.NewManager(cgroupRoot, "/"+parent, &cgroup2.Resources{Memory: &cgroup2.Memory{Max: &bytes}})
		return err
	}
	dir := filepath.Join(cgroupRoot, "memory", parent)
	if bytes == 0 {
		if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte("-1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte(strconv.FormatInt(bytes, 10)), 0)
}

// nodeMemoryUsage is the memory charged to parent's cgroup: every
// sandbox's RAM and page cache, and what removed cgroups left to it.
func nodeMemoryUsage(parent string) (int64, error) {
	if cgroupMode() == cgroups.Unified {
		return readInt(filepath.Join(cgroupRoot, parent, "memory.current"))
	}
	return readInt(filepath.Join(cgroupRoot, "memory", parent, "memory.usage_in_bytes"))
}

// parseKV returns key's value from "key value" lines b read from path.
func parseKV(b []byte, path, key string) (uint64, error) {
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if ok && k == key {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("%s has no %q", path, key)
}

// existingCgroup loads a sandbox cgroup left by an earlier process, or nil.
func existingCgroup(parent, id string) cgroup {
	group := "/" + parent + "/" + id
	if cgroupMode() == cgroups.Unified {
		m, err := cgroup2.Load(group, cgroup2.WithMountpoint(cgroupRoot))
		if err != nil {
			return nil
		}
		if _, err := os.Stat(filepath.Join(cgroupRoot, group)); err != nil {
			return nil
		}
		return &cgroupV2{group: group, m: m}
	}
	if _, err := os.Stat(filepath.Join(cgroupRoot, "pids", group)); err != nil {
		return nil
	}
	cg, err := cgroup1.Load(cgroup1.StaticPath(group), cgroup1.WithHierarchy(v1Hierarchy))
	if err != nil {
		removeV1Dirs(group)
		return nil
	}
	return &cgroupV1{group: group, cg: cg}
}

// killCgroup SIGKILLs every process in the cgroup and waits (bounded) for
// them to go, so the cgroup can be removed.
func killCgroup(c cgroup) {
	procs := filepath.Join(c.paths()[0], "cgroup.procs")
	if v1, ok := c.(*cgroupV1); ok {
		procs = filepath.Join(cgroupRoot, "pids", v1.group, "cgroup.procs")
	}
	for wait := time.Millisecond; wait < 2*time.Second; wait *= 2 {
		b, err := os.ReadFile(procs)
		if err != nil || len(bytes.TrimSpace(b)) == 0 {
			return
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		time.Sleep(wait)
	}
}
