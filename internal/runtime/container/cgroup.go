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
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	"github.com/containerd/cgroups/v3/cgroup2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit"
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
	// sandboxinit.Config.UserTasks).
	user(cfg *sandboxinit.Config)
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
}

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

// toSpec is the sandbox cgroup's limits for r: the CPU quota covers
// every process of the sandbox, the agent included; pids and memory leave
// the agent room above the user's limits (agentPids, agentMemory), which
// the "user" child cgroup holds its processes to.
func toSpec(r rt.Resources) *specs.LinuxResources {
	pids := r.Pids + agentPids
	res := &specs.LinuxResources{Pids: &specs.LinuxPids{Limit: &pids}}
	if r.MilliCPU > 0 {
		period := uint64(cpuPeriod)
		quota := r.MilliCPU * int64(period) / 1000
		res.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	if r.MemoryBytes > 0 {
		limit := r.MemoryBytes + agentMemory
		res.Memory = &specs.LinuxMemory{Limit: &limit}
	}
	return res
}

// userEvents are the user cgroup's event counters.
type userEvents struct {
	oomKills, pidsMax uint64
}

// The user cgroup's files an exec and a Reset read (userFiles), in the
// order of Config.CgroupFiles.
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
	if err := c.setUser(nil, r); err != nil {
		c.delete()
		return nil, fmt.Errorf("set user limits: %w", err)
	}
	return c, nil
}

// v1UserWrites are the writes that give the user cgroups (pids, memory)
// the limits to, where they differ from from (nil: all). Raising a memory
// limit raises the sandbox's first, lowering it lowers the user's first:
// a child's limit above its parent's is allowed but pointless, and the
// order keeps the agent's headroom whichever way the limit moves.
func v1UserWrites(group string, from *rt.Resources, to rt.Resources) []cgroupWrite {
	var w []cgroupWrite
	if from == nil || from.MemoryBytes != to.MemoryBytes {
		user, sb := "-1", "-1"
		if to.MemoryBytes > 0 {
			user, sb = strconv.FormatInt(to.MemoryBytes, 10), strconv.FormatInt(to.MemoryBytes+agentMemory, 10)
		}
		dir := filepath.Join(cgroupRoot, "memory", group)
		userW := cgroupWrite{filepath.Join(dir, "user", "memory.limit_in_bytes"), user}
		sbW := cgroupWrite{filepath.Join(dir, "memory.limit_in_bytes"), sb}
		if from != nil && (to.MemoryBytes == 0 || from.MemoryBytes != 0 && to.MemoryBytes > from.MemoryBytes) {
			w = append(w, sbW, userW)
		} else {
			w = append(w, userW, sbW)
		}
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w,
			cgroupWrite{filepath.Join(cgroupRoot, "pids", group, "pids.max"), strconv.FormatInt(to.Pids+agentPids, 10)},
			cgroupWrite{filepath.Join(cgroupRoot, "pids", group, "user", "pids.max"), strconv.FormatInt(to.Pids, 10)})
	}
	return w
}

// setUser writes the user cgroups' limits only (the sandbox cgroup's are
// containerd's, through toSpec).
func (c *cgroupV1) setUser(from *rt.Resources, to rt.Resources) error {
	var w []cgroupWrite
	for _, x := range v1UserWrites(c.group, from, to) {
		if filepath.Base(filepath.Dir(x.file)) == "user" {
			w = append(w, x)
		}
	}
	return writeAll(w)
}

func (c *cgroupV1) freeze() error { return c.cg.Freeze() }
func (c *cgroupV1) thaw() error   { return c.cg.Thaw() }

// update applies r to a pre-started agent's cgroups, which hold the
// warm pool's limits (pids only): the sandbox cgroup's first, so that the
// user's memory limit is never above the sandbox's.
func (c *cgroupV1) update(r rt.Resources) error {
	if err := c.cg.Update(toSpec(r)); err != nil {
		return err
	}
	return c.setUser(nil, r)
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

func (c *cgroupV1) user(cfg *sandboxinit.Config) {
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
		limit := r.MemoryBytes + agentMemory
		zero := int64(0)
		res.Memory = &cgroup2.Memory{Max: &limit, Swap: &zero}
	}
	return res
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
		limit := "max"
		if to.MemoryBytes > 0 {
			limit = strconv.FormatInt(to.MemoryBytes, 10)
			w = append(w, cgroupWrite{filepath.Join(user, "memory.swap.max"), "0"})
		}
		w = append(w, cgroupWrite{filepath.Join(user, "memory.max"), limit})
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w, cgroupWrite{filepath.Join(user, "pids.max"), strconv.FormatInt(to.Pids, 10)})
	}
	return w
}

// set writes "max" for lifted limits (v2 has no -1), and no swap with a
// memory limit, as update does.
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
		if to.MemoryBytes > 0 {
			w = append(w, cgroupWrite{filepath.Join(dir, "memory.swap.max"), "0"},
				cgroupWrite{filepath.Join(dir, "memory.max"), strconv.FormatInt(to.MemoryBytes+agentMemory, 10)})
		} else {
			w = append(w, cgroupWrite{filepath.Join(dir, "memory.max"), "max"})
		}
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w, cgroupWrite{filepath.Join(dir, "pids.max"), strconv.FormatInt(to.Pids+agentPids, 10)})
	}
	// v2 takes a child's limit above its parent's, so the order of the
	// sandbox's and the user's writes does not matter.
	return writeAll(append(w, v2UserWrites(dir, from, to)...))
}

func (c *cgroupV2) userDir() string { return filepath.Join(cgroupRoot, c.group, "user") }

func (c *cgroupV2) user(cfg *sandboxinit.Config) {
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
