package testsuite

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Snapshot is a picture of host resources a backend could leak. Each field
// is a list of items (duplicates allowed: two identical stacked mounts are
// two items); a leak is an item present after that was not present before.
type Snapshot struct {
	// Mounts: "mountpoint fstype source" of host mounts in scope.
	Mounts []string
	// Cgroups: directories under the backend's cgroup roots.
	Cgroups []string
	// Files: entries under the backend's state directories.
	Files []string
	// Processes: descendants of the test process, "comm pid start".
	Processes []string
	// FDs: open file descriptors of the test process, "fd -> target".
	FDs []string
	// Other: whatever else a backend wants compared (pool sizes, sockets).
	Other []string
}

// Leaked returns the items of s that were not in before, prefixed by kind.
func (s Snapshot) Leaked(before Snapshot) []string {
	var out []string
	for _, k := range []struct {
		kind          string
		after, before []string
	}{
		{"mount", s.Mounts, before.Mounts},
		{"cgroup", s.Cgroups, before.Cgroups},
		{"file", s.Files, before.Files},
		{"process", s.Processes, before.Processes},
		{"fd", s.FDs, before.FDs},
		{"other", s.Other, before.Other},
	} {
		for _, item := range extra(k.after, k.before) {
			out = append(out, k.kind+": "+item)
		}
	}
	return out
}

// extra is the multiset difference after − before, sorted.
func extra(after, before []string) []string {
	count := map[string]int{}
	for _, b := range before {
		count[b]++
	}
	var out []string
	for _, a := range after {
		if count[a] > 0 {
			count[a]--
			continue
		}
		out = append(out, a)
	}
	sort.Strings(out)
	return out
}

// HostSnapshot records what a backend that keeps its cgroups under
// cgroupRoots and its files and mounts under stateDirs could leave behind:
//   - mounts whose mount point or source lies under a state dir or cgroup
//     root (all mounts when both lists are empty). Mounts elsewhere are
//     ignored because other packages' tests mount concurrently in the same
//     `go test ./...` run; a backend keeps per-sandbox mounts in the
//     sandbox's own mount namespace anyway, and its host-side mounts (layer
//     cache) under its state dir;
//   - every directory under each cgroup root (a root that does not exist
//     yet is empty);
//   - every entry under each state dir, not descending into other file
//     systems (a mounted rootfs is one entry, not thousands);
//   - the test process's descendant processes, zombies included (a zombie
//     is a child nobody waited for);
//   - the test process's open file descriptors.
//
// A backend's test can wrap it to drop or add items.
func HostSnapshot(cgroupRoots, stateDirs []string) (Snapshot, error) {
	var s Snapshot
	var err error
	scope := append(append([]string(nil), stateDirs...), cgroupRoots...)
	if s.Mounts, err = scopedMounts(scope); err != nil {
		return s, err
	}
	for _, root := range cgroupRoots {
		dirs, err := walk(root, true)
		if err != nil {
			return s, fmt.Errorf("cgroup root %s: %w", root, err)
		}
		s.Cgroups = append(s.Cgroups, dirs...)
	}
	for _, dir := range stateDirs {
		entries, err := walk(dir, false)
		if err != nil {
			return s, fmt.Errorf("state dir %s: %w", dir, err)
		}
		s.Files = append(s.Files, entries...)
	}
	if s.Processes, err = descendants(os.Getpid()); err != nil {
		return s, err
	}
	if s.FDs, err = openFDs(); err != nil {
		return s, err
	}
	return s, nil
}

// scopedMounts reads /proc/self/mountinfo.
func scopedMounts(scope []string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// "id parent major:minor root mountpoint opts [optional...] - fstype source superopts"
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		f1, f2 := strings.Fields(pre), strings.Fields(post)
		if len(f1) < 5 || len(f2) < 2 {
			continue
		}
		mnt, fstype, src := unescapeMount(f1[4]), f2[0], unescapeMount(f2[1])
		if len(scope) > 0 && !under(mnt, scope) && !under(src, scope) {
			continue
		}
		out = append(out, mnt+" "+fstype+" "+src)
	}
	return out, sc.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for space, ...).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
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

// under reports whether p is one of dirs or inside one of them.
func under(p string, dirs []string) bool {
	for _, d := range dirs {
		d = filepath.Clean(d)
		if p == d || strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}

// walk lists paths under root (directories only if dirsOnly), without
// crossing into other file systems. A missing root lists nothing.
func walk(root string, dirsOnly bool) ([]string, error) {
	var rootDev uint64
	if st, err := os.Stat(root); err != nil {
		if os.IsNotExist(err) {
			return nil, nil
		}
		return nil, err
	} else if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		rootDev = sys.Dev
	}
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			// Entries vanish while a backend tears down asynchronously.
			if os.IsNotExist(err) {
				return nil
			}
			return err
		}
		if p == root {
			return nil
		}
		if dirsOnly && !d.IsDir() {
			return nil
		}
		out = append(out, p)
		if d.IsDir() {
			if info, err := d.Info(); err == nil {
				if sys, ok := info.Sys().(*syscall.Stat_t); ok && sys.Dev != rootDev {
					return fs.SkipDir
				}
			}
		}
		return nil
	})
	return out, err
}

// descendants lists the processes below pid (not pid itself).
func descendants(pid int) ([]string, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	type info struct {
		ppid int
		desc string
	}
	procs := map[int]info{}
	children := map[int][]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // exited meanwhile
		}
		line := string(b)
		open, close := strings.IndexByte(line, '('), strings.LastIndexByte(line, ')')
		if open < 0 || close < open {
			continue
		}
		f := strings.Fields(line[close+1:])
		if len(f) < 20 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		// starttime tells a reused PID from the original.
		procs[p] = info{ppid: ppid, desc: fmt.Sprintf("%s pid=%d start=%s state=%s", line[open+1:close], p, f[19], f[0])}
		children[ppid] = append(children[ppid], p)
	}
	var out []string
	stack := append([]int(nil), children[pid]...)
	for len(stack) > 0 {
		p := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		out = append(out, procs[p].desc)
		stack = append(stack, children[p]...)
	}
	sort.Strings(out)
	return out, nil
}

// openFDs lists the test process's descriptors, without the one used to
// read the list.
func openFDs() ([]string, error) {
	dir := fmt.Sprintf("/proc/%d/fd", os.Getpid())
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // the directory's own descriptor is closed by now
		}
		if target == dir {
			continue
		}
		out = append(out, e.Name()+" -> "+target)
	}
	return out, nil
}

// HostLeaks is a Harness.Leaks built on HostSnapshot.
func HostLeaks(cgroupRoots, stateDirs []string) func(t *testing.T) Snapshot {
	return func(t *testing.T) Snapshot {
		t.Helper()
		snap, err := HostSnapshot(cgroupRoots, stateDirs)
		if err != nil {
			t.Fatalf("host snapshot: %v", err)
		}
		return snap
	}
}

func (s *suite) needLeaks(t *testing.T) {
	t.Helper()
	if s.h.Leaks == nil {
		t.Skip("harness has no Leaks snapshot function")
	}
}

// expectNoLeaks polls until a new snapshot has nothing that before lacks;
// teardown may finish asynchronously (a reaper goroutine, a cgroup that
// empties a moment after its last process), so it polls with a bound.
func (s *suite) expectNoLeaks(t *testing.T, before Snapshot) {
	t.Helper()
	var leaked []string
	if !poll(t.Context(), 30*time.Second, func() bool {
		leaked = s.h.Leaks(t).Leaked(before)
		return len(leaked) == 0
	}) {
		t.Errorf("%d leaked host resources:\n  %s", len(leaked), strings.Join(leaked, "\n  "))
	}
}

func (s *suite) testLeaks(t *testing.T) {
	s.needLeaks(t)
	before := s.h.Leaks(t)
	for i := range s.h.LeakCycles {
		s.cycle(t, i)
	}
	s.expectNoLeaks(t, before)
}
