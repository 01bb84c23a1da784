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
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	"github.com/containerd/cgroups/v3/cgroup2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit"
)

// agentPids is the headroom of tasks the sandbox cgroup keeps for the
// agent's own threads above the user's pids limit: user processes live in
// the child cgroup "user" with the spec's limit.
const agentPids = 64

const cgroupRoot = "/sys/fs/cgroup"

// v1Controllers are the cgroup v1 hierarchies a sandbox gets a directory in.
// Each mkdir costs, so only the controllers DSec uses: limits (cpu, memory,
// pids), accounting (cpuacct) and freezing (freezer).
var v1Controllers = []cgroup1.Name{cgroup1.Cpu, cgroup1.Cpuacct, cgroup1.Memory, cgroup1.Pids, cgroup1.Freezer}

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
	// oomKills is the number of OOM kills in the cgroup so far.
	oomKills() (uint64, error)
	// user fills in where the sandbox's user processes are born (see
	// sandboxinit.Config.UserTasks).
	user(cfg *sandboxinit.Config)
	// freeze stops every process of the cgroup (and below) and returns
	// once they are all stopped; thaw resumes them.
	freeze() error
	thaw() error
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

func toSpec(r rt.Resources) *specs.LinuxResources {
	pids := r.Pids + agentPids
	res := &specs.LinuxResources{Pids: &specs.LinuxPids{Limit: &pids}}
	if r.MilliCPU > 0 {
		period := uint64(cpuPeriod)
		quota := r.MilliCPU * int64(period) / 1000
		res.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	if r.MemoryBytes > 0 {
		limit := r.MemoryBytes
		res.Memory = &specs.LinuxMemory{Limit: &limit}
	}
	return res
}

type cgroupV1 struct {
	group string
	cg    cgroup1.Cgroup
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
	user := filepath.Join(cgroupRoot, "pids", group, "user")
	if err := os.Mkdir(user, 0o755); err != nil {
		cg.Delete()
		return nil, fmt.Errorf("create cgroup %s/user: %w", group, err)
	}
	if err := os.WriteFile(filepath.Join(user, "pids.max"), []byte(strconv.FormatInt(r.Pids, 10)), 0); err != nil {
		os.Remove(user)
		cg.Delete()
		return nil, fmt.Errorf("set pids limit: %w", err)
	}
	return c, nil
}

func (c *cgroupV1) freeze() error { return c.cg.Freeze() }
func (c *cgroupV1) thaw() error   { return c.cg.Thaw() }

func (c *cgroupV1) update(r rt.Resources) error {
	if err := c.cg.Update(toSpec(r)); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(cgroupRoot, "pids", c.group, "user", "pids.max"), []byte(strconv.FormatInt(r.Pids, 10)), 0)
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
	if from == nil || from.MemoryBytes != to.MemoryBytes {
		limit := "-1"
		if to.MemoryBytes > 0 {
			limit = strconv.FormatInt(to.MemoryBytes, 10)
		}
		w = append(w, cgroupWrite{filepath.Join(cgroupRoot, "memory", c.group, "memory.limit_in_bytes"), limit})
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w,
			cgroupWrite{filepath.Join(cgroupRoot, "pids", c.group, "pids.max"), strconv.FormatInt(to.Pids+agentPids, 10)},
			cgroupWrite{filepath.Join(c.userDir(), "pids.max"), strconv.FormatInt(to.Pids, 10)})
	}
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

func (c *cgroupV1) oomKills() (uint64, error) {
	return readKV(filepath.Join(cgroupRoot, "memory", c.group, "memory.oom_control"), "oom_kill")
}

func (c *cgroupV1) paths() []string {
	p := []string{filepath.Join(cgroupRoot, "pids", c.group, "user")}
	for _, ctrl := range v1Controllers {
		p = append(p, filepath.Join(cgroupRoot, string(ctrl), c.group))
	}
	return p
}

func (c *cgroupV1) delete() error {
	if err := os.Remove(filepath.Join(cgroupRoot, "pids", c.group, "user")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove cgroup %s/user: %w", c.group, err)
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
}

func v2Resources(r rt.Resources) *cgroup2.Resources {
	res := &cgroup2.Resources{Pids: &cgroup2.Pids{Max: r.Pids + agentPids}}
	if r.MilliCPU > 0 {
		period := uint64(cpuPeriod)
		quota := r.MilliCPU * int64(period) / 1000
		res.CPU = &cgroup2.CPU{Max: cgroup2.NewCPUMax(&quota, &period)}
	}
	if r.MemoryBytes > 0 {
		limit := r.MemoryBytes
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
	err = func() error {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+pids"), 0); err != nil {
			return err
		}
		for _, child := range []string{"agent", "user"} {
			if err := os.Mkdir(filepath.Join(dir, child), 0o755); err != nil {
				return err
			}
		}
		return os.WriteFile(filepath.Join(dir, "user", "pids.max"), []byte(strconv.FormatInt(r.Pids, 10)), 0)
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
	return os.WriteFile(filepath.Join(cgroupRoot, c.group, "user", "pids.max"), []byte(strconv.FormatInt(r.Pids, 10)), 0)
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
				cgroupWrite{filepath.Join(dir, "memory.max"), strconv.FormatInt(to.MemoryBytes, 10)})
		} else {
			w = append(w, cgroupWrite{filepath.Join(dir, "memory.max"), "max"})
		}
	}
	if from == nil || from.Pids != to.Pids {
		w = append(w,
			cgroupWrite{filepath.Join(dir, "pids.max"), strconv.FormatInt(to.Pids+agentPids, 10)},
			cgroupWrite{filepath.Join(dir, "user", "pids.max"), strconv.FormatInt(to.Pids, 10)})
	}
	return writeAll(w)
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

func (c *cgroupV2) oomKills() (uint64, error) {
	return readKV(filepath.Join(cgroupRoot, c.group, "memory.events"), "oom_kill")
}

func (c *cgroupV2) paths() []string {
	d := filepath.Join(cgroupRoot, c.group)
	return []string{d, filepath.Join(d, "agent"), filepath.Join(d, "user")}
}

func (c *cgroupV2) delete() error {
	for _, child := range []string{"agent", "user"} {
		if err := os.Remove(filepath.Join(cgroupRoot, c.group, child)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove cgroup %s/%s: %w", c.group, child, err)
		}
	}
	return c.m.Delete()
}

// readKV reads "key value" lines and returns key's value.
func readKV(path, key string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
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
