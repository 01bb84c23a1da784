package main

// What the harness reads from the host: memory, swap, a process's
// descriptors and resident memory, cgroup charges, OOM kills.

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// meminfo reads the named fields of /proc/meminfo, in bytes.
func meminfo(fields ...string) (map[string]int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return nil, fmt.Errorf("read meminfo: %w", err)
	}
	want := map[string]bool{}
	for _, f := range fields {
		want[f] = true
	}
	out := map[string]int64{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		name := strings.TrimSuffix(f[0], ":")
		if !want[name] {
			continue
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("meminfo %s: %w", name, err)
		}
		out[name] = v * 1024
	}
	for _, f := range fields {
		if _, ok := out[f]; !ok {
			return nil, fmt.Errorf("meminfo lacks %s", f)
		}
	}
	return out, nil
}

// memAvailable is MemAvailable: what the kernel could hand to a new
// workload without swapping. Its drop while sandboxes start is what they
// cost the node.
func memAvailable() (int64, error) {
	m, err := meminfo("MemAvailable")
	if err != nil {
		return 0, err
	}
	return m["MemAvailable"], nil
}

// swapUsed is SwapTotal - SwapFree of the whole host.
func swapUsed() (int64, error) {
	m, err := meminfo("SwapTotal", "SwapFree")
	if err != nil {
		return 0, err
	}
	return m["SwapTotal"] - m["SwapFree"], nil
}

// vmstat reads one counter of /proc/vmstat (oom_kill, pswpout...).
func vmstat(name string) (int64, error) {
	b, err := os.ReadFile("/proc/vmstat")
	if err != nil {
		return 0, fmt.Errorf("read vmstat: %w", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, " "); ok && k == name {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("vmstat %s: %w", name, err)
			}
			return n, nil
		}
	}
	return 0, fmt.Errorf("vmstat has no %s", name)
}

// procFDs counts the open descriptors of pid.
func procFDs(pid int) (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0, fmt.Errorf("descriptors of %d: %w", pid, err)
	}
	return len(ents), nil
}

// procRSS is VmRSS of pid in bytes.
func procRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("status of %d: %w", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				v, err := strconv.ParseInt(f[0], 10, 64)
				if err != nil {
					return 0, fmt.Errorf("VmRSS of %d: %w", pid, err)
				}
				return v * 1024, nil
			}
		}
	}
	return 0, fmt.Errorf("no VmRSS for %d", pid)
}

// cgroupV2 reports whether the host runs the unified hierarchy only.
func cgroupV2() bool {
	_, err := os.Stat(filepath.Join(dsecup.CgroupRoot, "cgroup.controllers"))
	return err == nil
}

// memoryHierarchy is where memory cgroups live: the v1 memory controller's
// mount, or the unified hierarchy.
func memoryHierarchy() string {
	if cgroupV2() {
		return dsecup.CgroupRoot
	}
	return filepath.Join(dsecup.CgroupRoot, "memory")
}

// sandboxMemCgroups finds the memory cgroups of dsec up (pid)'s sandboxes:
// directories named s<pid>-<n> anywhere below dsec/ in the memory
// hierarchy (today dsec/s<pid>-<n>; a node-level cgroup between them, as
// a real node bound may bring, is found too).
func sandboxMemCgroups(pid int) ([]string, error) {
	root := filepath.Join(memoryHierarchy(), "dsec")
	prefix := fmt.Sprintf("s%d-", pid)
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if !d.IsDir() {
			return nil
		}
		if strings.HasPrefix(d.Name(), prefix) {
			out = append(out, p)
			return fs.SkipDir
		}
		if strings.Count(strings.TrimPrefix(p, root), "/") >= 3 {
			return fs.SkipDir
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find sandbox cgroups of %d: %w", pid, err)
	}
	return out, nil
}

// readInt reads a cgroup file holding one integer ("max" reads as -1).
func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return -1, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", path, err)
	}
	return v, nil
}

// cgroupUsage is the memory charged to the cgroup dir (v1
// memory.usage_in_bytes, v2 memory.current), page cache included.
func cgroupUsage(dir string) (int64, error) {
	if cgroupV2() {
		return readInt(filepath.Join(dir, "memory.current"))
	}
	return readInt(filepath.Join(dir, "memory.usage_in_bytes"))
}

// cgroupSwap is what of the cgroup dir's memory is in swap: v2
// memory.swap.current; v1 memory.memsw.usage_in_bytes minus
// memory.usage_in_bytes (needs swap accounting; an error without it).
func cgroupSwap(dir string) (int64, error) {
	if cgroupV2() {
		return readInt(filepath.Join(dir, "memory.swap.current"))
	}
	memsw, err := readInt(filepath.Join(dir, "memory.memsw.usage_in_bytes"))
	if err != nil {
		return 0, err
	}
	mem, err := readInt(filepath.Join(dir, "memory.usage_in_bytes"))
	if err != nil {
		return 0, err
	}
	return max(0, memsw-mem), nil
}

// cgroupOOMKills counts the processes the kernel OOM-killed in the cgroup
// dir: the oom_kill line of v1 memory.oom_control or v2 memory.events.
func cgroupOOMKills(dir string) (int64, error) {
	name := "memory.oom_control"
	if cgroupV2() {
		name = "memory.events"
	}
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "oom_kill "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("%s/%s has no oom_kill line", dir, name)
}

// cgroupLimit is the memory limit of the cgroup dir (v1
// memory.limit_in_bytes, v2 memory.max), -1 or a huge value if none.
func cgroupLimit(dir string) (int64, error) {
	if cgroupV2() {
		return readInt(filepath.Join(dir, "memory.max"))
	}
	return readInt(filepath.Join(dir, "memory.limit_in_bytes"))
}

// nodeBound is the tightest memory limit among dir's ancestors in the
// memory hierarchy (dir itself excluded), and the cgroup that sets it;
// -1 when none is limited.
func nodeBound(dir string) (int64, string) {
	root := memoryHierarchy()
	best, where := int64(-1), ""
	for p := filepath.Dir(dir); strings.HasPrefix(p, root+"/"); p = filepath.Dir(p) {
		v, err := cgroupLimit(p)
		if err != nil || v < 0 || v >= 1<<60 {
			continue
		}
		if best < 0 || v < best {
			best, where = v, p
		}
	}
	return best, where
}

// sumCgroups sums f over dirs, skipping the ones that vanished.
func sumCgroups(dirs []string, f func(string) (int64, error)) (int64, error) {
	var total int64
	for _, d := range dirs {
		v, err := f(d)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, err
		}
		total += v
	}
	return total, nil
}

const mib = 1 << 20

func toMiB(b int64) float64 { return float64(b) / mib }
