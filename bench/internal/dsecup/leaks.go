package dsecup

// Everything needed to make sure a run leaves nothing behind: dsec up's
// layer mounts and sandbox cgroups, the harness's own peer cgroups, and
// any process started from the run's binaries.

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// CgroupRoot is where the cgroup hierarchies are mounted.
const CgroupRoot = "/sys/fs/cgroup"

// Leaks is what a run left behind, found (and removed) at its end. All
// empty after a clean run.
type Leaks struct {
	Mounts    []string `json:"mounts,omitempty"`
	Cgroups   []string `json:"cgroups,omitempty"`
	Processes []string `json:"processes,omitempty"`
}

// Empty reports whether nothing was left behind.
func (l Leaks) Empty() bool { return len(l.Mounts)+len(l.Cgroups)+len(l.Processes) == 0 }

func (l Leaks) String() string {
	var parts []string
	if len(l.Mounts) > 0 {
		parts = append(parts, fmt.Sprintf("mounts %v", l.Mounts))
	}
	if len(l.Cgroups) > 0 {
		parts = append(parts, fmt.Sprintf("cgroups %v", l.Cgroups))
	}
	if len(l.Processes) > 0 {
		parts = append(parts, fmt.Sprintf("processes %v", l.Processes))
	}
	return strings.Join(parts, ", ")
}

// Reclaim finds what dsec up (pid upPID, already exited) left behind and
// removes it: processes started from the run's binaries (killed), its
// sandboxes' cgroups (tasks killed, directories removed) and mounts under
// dataDir (detached, deepest first). Sandbox rootfs mounts live in the
// sandboxes' own mount namespaces and die with them; the host sees only
// the layer mounts under DATA/layers.
func Reclaim(bins Binaries, upPID int, dataDir string) (Leaks, error) {
	var (
		leaks Leaks
		errs  []error
	)
	procs, err := processesFrom(bins.Dir)
	if err != nil {
		errs = append(errs, err)
	}
	for _, p := range procs {
		leaks.Processes = append(leaks.Processes, fmt.Sprintf("%d %s", p.pid, p.exe))
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
	}
	cgs, err := SandboxCgroups(upPID)
	errs = leaks.reclaim(cgs, err, dataDir, errs)
	return leaks, errors.Join(errs...)
}

// ReclaimHarness finds what the harness's own peers left: their cgroups
// (PREFIX*-PID, with whatever runs in them) and any mount under the work
// dir; it removes them.
func ReclaimHarness(cgroupPrefix, work string) (Leaks, error) {
	var leaks Leaks
	cgs, err := HarnessCgroups(cgroupPrefix, os.Getpid())
	errs := leaks.reclaim(cgs, err, work, nil)
	return leaks, errors.Join(errs...)
}

// reclaim records and removes the cgroups cgs (found with error cgErr) and
// the mounts under dir, appending what failed to errs.
func (l *Leaks) reclaim(cgs []string, cgErr error, dir string, errs []error) []error {
	if cgErr != nil {
		errs = append(errs, cgErr)
	}
	l.Cgroups = cgs
	if err := RemoveCgroups(cgs); err != nil {
		errs = append(errs, err)
	}
	mps, err := MountsUnder(dir)
	if err != nil {
		errs = append(errs, err)
	}
	l.Mounts = mps
	if err := unmountAll(mps); err != nil {
		errs = append(errs, err)
	}
	return errs
}

type proc struct {
	pid int
	exe string
}

// processesFrom lists live processes whose executable is in dir.
func processesFrom(dir string) ([]proc, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []proc
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		if err != nil {
			continue
		}
		exe = strings.TrimSuffix(exe, " (deleted)")
		if filepath.Dir(exe) == dir {
			// A zombie has no exe link, so this one is alive.
			out = append(out, proc{pid, exe})
		}
	}
	return out, nil
}

// SandboxCgroups lists the cgroups the container backend of dsec up (pid)
// made: "s<pid>-<n>" under its parent "dsec" in every hierarchy.
func SandboxCgroups(pid int) ([]string, error) {
	return GlobCgroups(fmt.Sprintf("dsec/s%d-*", pid))
}

// HarnessCgroups lists the peer cgroups of the harness with pid, named
// PREFIX*-PID (a freezer floor's, an OCI runtime's parent...), in every
// hierarchy.
func HarnessCgroups(prefix string, pid int) ([]string, error) {
	return GlobCgroups(fmt.Sprintf("%s*-%d", prefix, pid))
}

// GlobCgroups expands the pattern rel (relative to a hierarchy root) in
// every mounted cgroup hierarchy, v1 or v2. Only real cgroup file systems
// count.
func GlobCgroups(rel string) ([]string, error) {
	var out []string
	for _, pat := range []string{filepath.Join(CgroupRoot, "*", rel), filepath.Join(CgroupRoot, rel)} {
		m, err := filepath.Glob(pat)
		if err != nil {
			return nil, err
		}
		for _, p := range m {
			if IsCgroupFS(filepath.Dir(p)) {
				out = append(out, p)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}

// IsCgroupFS reports whether dir is on a cgroup (v1 or v2) file system.
func IsCgroupFS(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	return st.Type == unix.CGROUP_SUPER_MAGIC || st.Type == unix.CGROUP2_SUPER_MAGIC
}

// RemoveCgroups removes each cgroup tree in dirs: thaws it (a frozen task
// cannot die), kills its tasks, removes the directories deepest first,
// retrying while killed tasks are still exiting.
func RemoveCgroups(dirs []string) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		var errs []error
		for _, d := range dirs {
			var sub []string
			err := filepath.WalkDir(d, func(p string, e fs.DirEntry, err error) error {
				if err != nil {
					if errors.Is(err, fs.ErrNotExist) {
						return nil
					}
					return err
				}
				if e.IsDir() {
					sub = append(sub, p)
				}
				return nil
			})
			if err != nil {
				errs = append(errs, fmt.Errorf("walk cgroup %s: %w", d, err))
				continue
			}
			sort.Slice(sub, func(i, j int) bool { return len(sub[i]) > len(sub[j]) })
			var killed []int
			for _, s := range sub {
				_ = os.WriteFile(filepath.Join(s, "freezer.state"), []byte("THAWED"), 0o644)
				_ = os.WriteFile(filepath.Join(s, "cgroup.freeze"), []byte("0"), 0o644)
				if b, err := os.ReadFile(filepath.Join(s, "cgroup.procs")); err == nil {
					for _, f := range strings.Fields(string(b)) {
						if pid, err := strconv.Atoi(f); err == nil && syscall.Kill(pid, syscall.SIGKILL) == nil {
							killed = append(killed, pid)
						}
					}
				}
			}
			time.Sleep(10 * time.Millisecond)
			reap(killed)
			for _, s := range sub {
				if err := unix.Rmdir(s); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("remove cgroup %s: %w", s, err))
				}
			}
		}
		if len(errs) == 0 || time.Now().After(deadline) {
			return errors.Join(errs...)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// reap collects the exit status of those of pids that are this process's
// exited children (an unreaped zombie can keep its cgroup busy), without
// blocking on live ones; it never waits for any other child, so it cannot
// steal an exit status that some Cmd.Wait is waiting for.
func reap(pids []int) {
	for _, pid := range pids {
		for {
			_, err := unix.Wait4(pid, nil, unix.WNOHANG, nil)
			if !errors.Is(err, unix.EINTR) {
				break
			}
		}
	}
}

// MountsUnder lists the host mount points at or below dir, deepest first.
func MountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	dir = filepath.Clean(dir)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

func unmountAll(mps []string) error {
	var errs []error
	for _, m := range mps {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space...).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// RemoveDir removes dir unless something is still mounted below it:
// RemoveAll would then delete inside the mounted file system.
func RemoveDir(dir string) error {
	mps, err := MountsUnder(dir)
	if err != nil {
		return err
	}
	if err := unmountAll(mps); err != nil {
		return fmt.Errorf("not removing %s: %w", dir, err)
	}
	if left, err := MountsUnder(dir); err != nil || len(left) > 0 {
		return fmt.Errorf("not removing %s: still mounted %v (%v)", dir, left, err)
	}
	return os.RemoveAll(dir)
}
