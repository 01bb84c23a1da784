package seccomp

import (
	"fmt"
	"slices"
	"strings"
	"syscall"

	mobyseccomp "github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/audit/caps"
)

// Action is a seccomp return value: SECCOMP_RET_* with its data bits.
type Action uint32

// Actions a policy can take.
const (
	Allow       Action = unix.SECCOMP_RET_ALLOW
	KillProcess Action = unix.SECCOMP_RET_KILL_PROCESS
	KillThread  Action = unix.SECCOMP_RET_KILL_THREAD
	Trap        Action = unix.SECCOMP_RET_TRAP
	Log         Action = unix.SECCOMP_RET_LOG
)

// Errno is the action that fails the syscall with e.
func Errno(e syscall.Errno) Action {
	return Action(unix.SECCOMP_RET_ERRNO | uint32(e)&unix.SECCOMP_RET_DATA)
}

func (a Action) String() string {
	switch uint32(a) & unix.SECCOMP_RET_ACTION_FULL {
	case unix.SECCOMP_RET_ALLOW:
		return "allow"
	case unix.SECCOMP_RET_KILL_PROCESS:
		return "kill_process"
	case unix.SECCOMP_RET_KILL_THREAD:
		return "kill_thread"
	case unix.SECCOMP_RET_TRAP:
		return "trap"
	case unix.SECCOMP_RET_LOG:
		return "log"
	case unix.SECCOMP_RET_ERRNO:
		return "errno(" + unix.ErrnoName(syscall.Errno(uint32(a)&unix.SECCOMP_RET_DATA)) + ")"
	}
	return fmt.Sprintf("action(%#x)", uint32(a))
}

// Op compares a syscall argument with a value.
type Op int

// Comparisons, as in the OCI runtime spec (SCMP_CMP_*).
const (
	OpEqual Op = iota
	OpNotEqual
	OpLess
	OpLessEqual
	OpGreater
	OpGreaterEqual
	// OpMaskedEqual matches when arg & Value == ValueTwo.
	OpMaskedEqual
)

// Cond is one test on one syscall argument.
type Cond struct {
	Arg      int // 0..5
	Op       Op
	Value    uint64
	ValueTwo uint64 // OpMaskedEqual only: the value the masked argument must equal
	// Low32 compares only the low 32 bits of the argument. Deny rules on an
	// argument the kernel declares as int or unsigned int (an ioctl request,
	// say) must set it: the kernel truncates the register, so a caller could
	// set the high bits to slip past a 64-bit comparison and still reach the
	// same ioctl.
	Low32 bool
}

// Rule applies Action to a syscall when all its conditions hold.
type Rule struct {
	Syscall string
	Conds   []Cond
	Action  Action
}

// Policy is an ordered list of rules. For each syscall the first rule whose
// conditions hold decides; a syscall no rule matches gets DefaultAction.
type Policy struct {
	DefaultAction Action
	Rules         []Rule
}

// Ioctl is an ioctl request DSec denies, with the reason.
type Ioctl struct {
	Name string
	Cmd  uint32
	Why  string
}

// DeniedIoctls are refused with EPERM in every sandbox. Agents have used
// them to get at the contents of files they are not meant to see through a
// second descriptor (clone or dedupe a file's blocks into a file of their
// own, or swap the extents of two files), or to tamper with files through a
// path that ordinary permission checks on read/write do not cover. The
// btrfs aliases (BTRFS_IOC_CLONE, BTRFS_IOC_CLONE_RANGE,
// BTRFS_IOC_FILE_EXTENT_SAME) share FICLONE's, FICLONERANGE's and
// FIDEDUPERANGE's numbers, so they are covered too. Numbers are for x86_64.
// DefaultPolicy reads this list once; do not modify it.
//
// copy_file_range(2) stays allowed: the kernel checks that the source is
// open for reading and the destination for writing exactly as read(2) and
// write(2) would (and refuses O_APPEND destinations), so it reads nothing a
// plain read could not, and cp(1) depends on it.
//
// Block-mapping queries are denied too: a file's extents there are its
// physical offsets on the host's disk (for an upper-layer file) or in the
// layer image, host information a sandbox has no use for (cp, tar and
// rsync find holes with SEEK_DATA/SEEK_HOLE; coreutils falls back from
// FIEMAP when it fails). FIBMAP and the fsmap ioctl already need
// capabilities sandboxes lack; they are listed so that no file system's
// mapping query is left to its own checks.
var DeniedIoctls = []Ioctl{
	{"FICLONE", unix.FICLONE, "shares the blocks of one file with another (reflink)"},
	{"FICLONERANGE", unix.FICLONERANGE, "shares a block range of one file with another (reflink)"},
	{"FIDEDUPERANGE", unix.FIDEDUPERANGE, "merges equal blocks of two files; the destination may be open read-only, and the result tells whether contents match"},
	{"EXT4_IOC_MOVE_EXT", 0xc028660f, "ext4: moves extents from a donor file into another file"},
	{"EXT4_IOC_SWAP_BOOT", 0x6611, "ext4: swaps a file's blocks with the boot loader inode"},
	{"XFS_IOC_SWAPEXT", 0xc0c0586d, "xfs: swaps the extents of two files"},
	{"XFS_IOC_EXCHANGE_RANGE", 0x40285881, "xfs (6.10+): exchanges a range of blocks between two files"},
	{"XFS_IOC_COMMIT_RANGE", 0x40585883, "xfs (6.13+): exchanges a range of blocks between two files if the target is unchanged"},
	{"F2FS_IOC_MOVE_RANGE", 0xc020f509, "f2fs: moves a block range from one file to another"},
	{"FS_IOC_FIEMAP", 0xc020660b, "maps a file's extents to physical offsets on its device"},
	{"FIBMAP", 0x1, "maps a file's block to its physical block number"},
	{"FS_IOC_GETFSMAP", 0xc0c0583b, "maps a whole file system's physical space to its owners"},
	{"EXT4_IOC_GET_ES_CACHE", 0xc020662a, "ext4: a file's cached extents with their physical blocks (FIEMAP's format)"},
	{"XFS_IOC_GETBMAP", 0xc0205826, "xfs: a file's block map with physical blocks"},
	{"XFS_IOC_GETBMAPA", 0xc020582c, "xfs: a file's attribute-fork block map with physical blocks"},
	{"XFS_IOC_GETBMAPX", 0xc0205838, "xfs: a file's extended block map with physical blocks"},
}

// denyRules turns DeniedIoctls into rules that must come before the
// profile's own ioctl rule (the Docker profile allows ioctl outright).
func denyRules() []Rule {
	rules := make([]Rule, 0, len(DeniedIoctls))
	for _, io := range DeniedIoctls {
		rules = append(rules, Rule{
			Syscall: "ioctl",
			Conds:   []Cond{{Arg: 1, Op: OpEqual, Value: uint64(io.Cmd), Low32: true}},
			Action:  Errno(unix.EPERM),
		})
	}
	return rules
}

// dockerArch is how Docker's profile names x86_64 in its arch conditions.
const dockerArch = "amd64"

// FromDocker resolves a Docker seccomp profile for an x86_64 sandbox that
// holds the capabilities in grant, on a kernel of the given version, the way
// Docker (moby's setupSeccomp) does:
//
//   - a rule with Excludes is dropped if any excluded arch is amd64, if the
//     sandbox holds any excluded capability, or if the kernel is at least the
//     excluded minimum version;
//   - a rule with Includes is dropped unless its arches (if any) include
//     amd64, the sandbox holds every included capability, and the kernel is at
//     least the included minimum version.
//
// Only x86_64 itself is kept from the profile's architecture map: the filter
// refuses the i386 and x32 ABIs rather than filtering them, since sandboxes
// run x86_64 programs only.
func FromDocker(p *mobyseccomp.Seccomp, grant caps.Set, kernel mobyseccomp.KernelVersion) (Policy, error) {
	def, err := dockerAction(p.DefaultAction, p.DefaultErrnoRet)
	if err != nil {
		return Policy{}, fmt.Errorf("seccomp: profile default action: %w", err)
	}
	pol := Policy{DefaultAction: def}
	held := grant.Names()
	for i, sc := range p.Syscalls {
		if !dockerRuleApplies(sc, held, kernel) {
			continue
		}
		act, err := dockerAction(sc.Action, sc.ErrnoRet)
		if err != nil {
			return Policy{}, fmt.Errorf("seccomp: profile rule %d (%s): %w", i, strings.Join(sc.Names, ","), err)
		}
		conds := make([]Cond, 0, len(sc.Args))
		for _, a := range sc.Args {
			c, err := dockerCond(a)
			if err != nil {
				return Policy{}, fmt.Errorf("seccomp: profile rule %d (%s): %w", i, strings.Join(sc.Names, ","), err)
			}
			conds = append(conds, c)
		}
		names := sc.Names
		if sc.Name != "" {
			names = append(slices.Clone(names), sc.Name)
		}
		for _, n := range names {
			pol.Rules = append(pol.Rules, Rule{Syscall: n, Conds: conds, Action: act})
		}
	}
	return pol, nil
}

func dockerRuleApplies(sc *mobyseccomp.Syscall, held []string, kernel mobyseccomp.KernelVersion) bool {
	if ex := sc.Excludes; ex != nil {
		if slices.Contains(ex.Arches, dockerArch) {
			return false
		}
		for _, c := range ex.Caps {
			if slices.Contains(held, c) {
				return false
			}
		}
		if ex.MinKernel != nil && !kernelLess(kernel, *ex.MinKernel) {
			return false
		}
	}
	if in := sc.Includes; in != nil {
		if len(in.Arches) > 0 && !slices.Contains(in.Arches, dockerArch) {
			return false
		}
		for _, c := range in.Caps {
			if !slices.Contains(held, c) {
				return false
			}
		}
		if in.MinKernel != nil && kernelLess(kernel, *in.MinKernel) {
			return false
		}
	}
	return true
}

func kernelLess(a, b mobyseccomp.KernelVersion) bool {
	if a.Kernel != b.Kernel {
		return a.Kernel < b.Kernel
	}
	return a.Major < b.Major
}

func dockerAction(a specs.LinuxSeccompAction, errnoRet *uint) (Action, error) {
	switch a {
	case specs.ActAllow:
		return Allow, nil
	case specs.ActErrno:
		e := syscall.EPERM // runc's default when errnoRet is unset
		if errnoRet != nil {
			e = syscall.Errno(*errnoRet)
		}
		return Errno(e), nil
	case specs.ActKillProcess:
		return KillProcess, nil
	case specs.ActKill, specs.ActKillThread:
		return KillThread, nil
	case specs.ActTrap:
		return Trap, nil
	case specs.ActLog:
		return Log, nil
	}
	return 0, fmt.Errorf("unsupported action %q", a)
}

func dockerCond(a specs.LinuxSeccompArg) (Cond, error) {
	if a.Index > 5 {
		return Cond{}, fmt.Errorf("argument index %d out of range 0..5", a.Index)
	}
	c := Cond{Arg: int(a.Index), Value: a.Value, ValueTwo: a.ValueTwo}
	switch a.Op {
	case specs.OpEqualTo:
		c.Op = OpEqual
	case specs.OpNotEqual:
		c.Op = OpNotEqual
	case specs.OpLessThan:
		c.Op = OpLess
	case specs.OpLessEqual:
		c.Op = OpLessEqual
	case specs.OpGreaterThan:
		c.Op = OpGreater
	case specs.OpGreaterEqual:
		c.Op = OpGreaterEqual
	case specs.OpMaskedEqual:
		c.Op = OpMaskedEqual
	default:
		return Cond{}, fmt.Errorf("unsupported comparison %q", a.Op)
	}
	return c, nil
}

// hostKernel is the running kernel's version, which decides Docker's
// minimum-kernel conditions as it does for Docker. The filter is compiled on
// the node that runs the sandboxes (VM guests run a kernel of the same era).
func hostKernel() (mobyseccomp.KernelVersion, error) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return mobyseccomp.KernelVersion{}, fmt.Errorf("seccomp: uname: %w", err)
	}
	return parseKernel(unix.ByteSliceToString(u.Release[:]))
}

func parseKernel(release string) (mobyseccomp.KernelVersion, error) {
	var k mobyseccomp.KernelVersion
	if _, err := fmt.Sscanf(release, "%d.%d", &k.Kernel, &k.Major); err != nil {
		return k, fmt.Errorf("seccomp: parse kernel release %q: %w", release, err)
	}
	return k, nil
}

// DefaultPolicy is the sandbox policy: DSec's ioctl denials, then Docker's
// default profile resolved for caps.DockerDefault() on the running kernel.
func DefaultPolicy() (Policy, error) {
	k, err := hostKernel()
	if err != nil {
		return Policy{}, err
	}
	docker, err := FromDocker(mobyseccomp.DefaultProfile(), caps.DockerDefault(), k)
	if err != nil {
		return Policy{}, err
	}
	docker.Rules = append(append(denyRules(), pid1Rules()...), docker.Rules...)
	return docker, nil
}

// The sandbox's PID 1 is its agent, and in the sandbox's PID namespace a
// workload running as root (the agent's user) may otherwise change what
// the kernel lets a process's owner change about it: lower its resource
// limits (a lowered hard limit cannot be raised again without
// CAP_SYS_RESOURCE, so every Reset failed and the sandbox was destroyed:
// any tenant could force a cold create per call), renice it, change its
// scheduling, CPU affinity, I/O priority or memory placement. Every
// process the agent starts inherits those, from one tenant to the next.
// pid1Rules refuse those calls with EPERM when they are aimed at PID 1
// (or at its process group, 1, since the agent leads its own session;
// or at every process of a user, which includes the agent's threads).
//
// Setting a resource limit is refused for any process but the caller
// itself (pid 0): the agent's other threads have IDs of their own that a
// workload can name, and a process-wide limit set through any of them is
// the agent's. setrlimit(2) and the C library's setrlimit (prlimit64 with
// pid 0) are unaffected; reading another process's limits stays allowed.
// The per-thread attributes of the agent's other threads are put back by
// Reset (as are its limits and OOM score), so a workload can reach them
// only for its own session. The agent's /proc files (oom_score_adj,
// autogroup) are outside seccomp's reach; Reset restores what they set.
func pid1Rules() []Rule {
	eperm := Errno(unix.EPERM)
	pidIs := func(arg int, v uint64) Cond { return Cond{Arg: arg, Op: OpEqual, Value: v, Low32: true} }
	const (
		prioProcess, prioPgrp, prioUser = 0, 1, 2
		ioprioWhoProcess, ioprioWhoPgrp = 1, 2
		ioprioWhoUser                   = 3
	)
	rules := []Rule{
		// prlimit64(pid, resource, new, old): a new limit for another process.
		{Syscall: "prlimit64", Conds: []Cond{{Arg: 0, Op: OpNotEqual, Value: 0, Low32: true}, {Arg: 2, Op: OpNotEqual, Value: 0}}, Action: eperm},
		// setpriority(which, who, prio).
		{Syscall: "setpriority", Conds: []Cond{pidIs(0, prioProcess), pidIs(1, 1)}, Action: eperm},
		{Syscall: "setpriority", Conds: []Cond{pidIs(0, prioPgrp), pidIs(1, 1)}, Action: eperm},
		{Syscall: "setpriority", Conds: []Cond{pidIs(0, prioUser)}, Action: eperm},
		// ioprio_set(which, who, ioprio).
		{Syscall: "ioprio_set", Conds: []Cond{pidIs(0, ioprioWhoProcess), pidIs(1, 1)}, Action: eperm},
		{Syscall: "ioprio_set", Conds: []Cond{pidIs(0, ioprioWhoPgrp), pidIs(1, 1)}, Action: eperm},
		{Syscall: "ioprio_set", Conds: []Cond{pidIs(0, ioprioWhoUser)}, Action: eperm},
	}
	// Calls whose first argument is the target pid.
	for _, sc := range []string{"sched_setattr", "sched_setscheduler", "sched_setparam", "sched_setaffinity", "migrate_pages", "move_pages"} {
		rules = append(rules, Rule{Syscall: sc, Conds: []Cond{pidIs(0, 1)}, Action: eperm})
	}
	return rules
}
