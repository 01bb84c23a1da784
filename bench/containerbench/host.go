package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/peer"
)

const cgroupRoot = "/sys/fs/cgroup"

// hostMemUsed is MemTotal - MemAvailable: the memory the kernel could not
// hand to a new workload, which is what idle sandboxes cost a node.
func hostMemUsed() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("read meminfo: %w", err)
	}
	var total, avail int64 = -1, -1
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		switch f[0] {
		case "MemTotal:":
			total = v * 1024
		case "MemAvailable:":
			avail = v * 1024
		}
	}
	if total < 0 || avail < 0 {
		return 0, errors.New("meminfo lacks MemTotal or MemAvailable")
	}
	return total - avail, nil
}

// cgroupV2 reports whether the host runs the unified hierarchy only.
func cgroupV2() bool {
	_, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers"))
	return err == nil
}

// cgroupMemoryUsage reads the memory charged to the cgroup at rel (relative
// to the hierarchy root) and its descendants, on v1 or v2.
func cgroupMemoryUsage(rel string) (int64, error) {
	p := filepath.Join(cgroupRoot, "memory", rel, "memory.usage_in_bytes")
	if cgroupV2() {
		p = filepath.Join(cgroupRoot, rel, "memory.current")
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, fmt.Errorf("read cgroup memory usage: %w", err)
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", p, err)
	}
	return v, nil
}

// removeCgroupTree removes the cgroup directory rel and everything below
// it in every mounted hierarchy. Runtimes delete their per-container
// cgroups but leave the parent they created, and a killed runtime leaves
// both, sometimes with a half-started container's processes still inside
// (an interrupted `crun run --detach`). Cgroup directories only go away
// with rmdir, deepest first, once empty of tasks, so each pass kills what
// is left, reaps it, and tries again until a bound passes.
func removeCgroupTree(rel string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := removeCgroupTreeOnce(rel)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func removeCgroupTreeOnce(rel string) error {
	roots := []string{filepath.Join(cgroupRoot, rel)}
	if !cgroupV2() {
		hs, err := filepath.Glob(filepath.Join(cgroupRoot, "*", rel))
		if err != nil {
			return fmt.Errorf("glob cgroups %s: %w", rel, err)
		}
		roots = roots[:0]
		for _, h := range hs {
			// Only real cgroup hierarchies: a scratch tmpfs standing in
			// for one (see hideUnifiedCgroup) holds plain files that
			// rmdir cannot remove and that vanish with their namespace.
			var st unix.Statfs_t
			if err := unix.Statfs(filepath.Dir(h), &st); err == nil &&
				(st.Type == unix.CGROUP_SUPER_MAGIC || st.Type == unix.CGROUP2_SUPER_MAGIC) {
				roots = append(roots, h)
			}
		}
	}
	var errs []error
	killed := false
	for _, root := range roots {
		var dirs []string
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) {
					return nil
				}
				return err
			}
			if d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("walk cgroup %s: %w", root, err))
			continue
		}
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			if b, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil {
				for _, f := range strings.Fields(string(b)) {
					if pid, err := strconv.Atoi(f); err == nil && unix.Kill(pid, unix.SIGKILL) == nil {
						killed = true
					}
				}
			}
		}
		if killed {
			peer.ReapOrphans()
		}
		for _, d := range dirs {
			if err := unix.Rmdir(d); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
			}
		}
	}
	return errors.Join(errs...)
}

// mountsUnder lists the mount points at or below dir, deepest first, from
// this process's mount namespace.
func mountsUnder(dir string) ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	dir = filepath.Clean(dir)
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMountinfo(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

// unescapeMountinfo undoes the octal escapes (\040 for space ...) that
// mountinfo uses in paths.
func unescapeMountinfo(s string) string {
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

// unmountUnder detaches every mount at or below dir. It must run before a
// recursive delete of dir: removing files through a leftover bind or
// overlay mount would reach into the shared rootfs or the host.
func unmountUnder(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, mp := range mps {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", mp, err))
		}
	}
	return errors.Join(errs...)
}

// removeWorkDir unmounts what is left under dir and deletes it. It refuses
// to delete while a mount remains, so a failed unmount cannot turn into
// deleting files of another file system.
func removeWorkDir(dir string) error {
	if err := unmountUnder(dir); err != nil {
		return err
	}
	left, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if len(left) > 0 {
		return fmt.Errorf("work dir %s still has mounts %v; not deleting it", dir, left)
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove work dir: %w", err)
	}
	return nil
}

// memCgroup is a memory cgroup the harness makes for systems that have no
// cgroup of their own (bwrap, the floor rows), so that their idle memory
// can be read as a precise charge instead of only the noisy host figure.
type memCgroup struct{ rel string }

func (c memCgroup) dir() string {
	if cgroupV2() {
		return filepath.Join(cgroupRoot, c.rel)
	}
	return filepath.Join(cgroupRoot, "memory", c.rel)
}

func newMemCgroup(rel string) (memCgroup, error) {
	c := memCgroup{rel: rel}
	if err := os.Mkdir(c.dir(), 0o755); err != nil {
		return c, fmt.Errorf("create memory cgroup %s: %w", rel, err)
	}
	if !cgroupV2() {
		// On v1 a process's existing charges stay behind when it moves
		// unless the target asks for them; best effort (deprecated knob).
		_ = os.WriteFile(filepath.Join(c.dir(), "memory.move_charge_at_immigrate"), []byte("3"), 0o644)
	}
	return c, nil
}

// add moves pid into the cgroup.
func (c memCgroup) add(pid int) error {
	if err := os.WriteFile(filepath.Join(c.dir(), "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		return fmt.Errorf("move pid %d to cgroup %s: %w", pid, c.rel, err)
	}
	return nil
}

func (c memCgroup) usage() (int64, error) { return cgroupMemoryUsage(c.rel) }

func (c memCgroup) remove() error { return removeCgroupTree(c.rel) }

// cgexecFlag makes the harness binary a wrapper: join a cgroup, then exec
// the rest of the command line. Joining before exec charges everything the
// command does, and everything it forks, to that cgroup from the start,
// which moving a multi-process sandbox in after it started cannot promise.
const cgexecFlag = "-cgexec"

// cgexecMain is main for wrapper mode: argv is CGROUPDIR CMD ARGS...
func cgexecMain(argv []string) error {
	if len(argv) < 2 {
		return errors.New("usage: -cgexec CGROUP_PROCS_DIR CMD [ARGS...]")
	}
	if err := os.WriteFile(filepath.Join(argv[0], "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return fmt.Errorf("join cgroup %s: %w", argv[0], err)
	}
	return unix.Exec(argv[1], argv[1:], os.Environ())
}

// cgroupName is the cgroup parent for one system's sandboxes. The worker's
// pid makes it unique, so two harness runs (or a run and the tests) never
// measure or remove each other's cgroups.
func cgroupName(system string) string {
	return fmt.Sprintf("dsecbench-%s-%d", system, os.Getpid())
}

// drain kills whatever is still in the cgroup and reaps what this process
// inherited as subreaper, until the cgroup is empty or a bound passes.
// Sandbox processes killed a moment ago can still be exiting, or be zombies
// waiting for a reaper; either keeps rmdir failing with EBUSY. Polling is
// the only signal v1 gives for "empty".
func (c memCgroup) drain(ctx context.Context) error {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(filepath.Join(c.dir(), "cgroup.procs"))
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read cgroup %s procs: %w", c.rel, err)
		}
		pids := strings.Fields(string(b))
		if len(pids) == 0 {
			return nil
		}
		for _, p := range pids {
			if pid, err := strconv.Atoi(p); err == nil {
				_ = unix.Kill(pid, unix.SIGKILL)
			}
		}
		peer.ReapOrphans()
		select {
		case <-ctx.Done():
			return fmt.Errorf("cgroup %s still has pids %v: %w", c.rel, pids, ctx.Err())
		case <-tick.C:
		}
	}
}
