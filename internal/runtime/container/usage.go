package container

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/containerd/cgroups/v3"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

var _ rt.UsageReporter = (*Backend)(nil)

// Usage reads what every sandbox of the backend uses together from their
// parent cgroup: CPU time, and memory charged less inactive file pages
// (what reclaim takes first, without writing anything). Three small reads
// of cgroup files: cheap enough for every heartbeat.
func (b *Backend) Usage() (rt.Usage, error) {
	if cgroupMode() == cgroups.Unified {
		dir := filepath.Join(cgroupRoot, b.opts.CgroupParent)
		stat, err := statFile(filepath.Join(dir, "cpu.stat"))
		if err != nil {
			return rt.Usage{}, err
		}
		cur, err := readInt(filepath.Join(dir, "memory.current"))
		if err != nil {
			return rt.Usage{}, fmt.Errorf("sandboxes' usage: %w", err)
		}
		mem, err := statFile(filepath.Join(dir, "memory.stat"))
		if err != nil {
			return rt.Usage{}, err
		}
		swap, _ := readInt(filepath.Join(dir, "memory.swap.current"))
		return rt.Usage{CPUNanos: uint64(stat["usage_usec"]) * 1000, MemoryBytes: max(cur-mem["inactive_file"], 0), SwapBytes: swap}, nil
	}
	cpu, err := readInt(filepath.Join(cgroupRoot, "cpuacct", b.opts.CgroupParent, "cpuacct.usage"))
	if err != nil {
		return rt.Usage{}, fmt.Errorf("sandboxes' usage: %w", err)
	}
	memDir := filepath.Join(cgroupRoot, "memory", b.opts.CgroupParent)
	cur, err := readInt(filepath.Join(memDir, "memory.usage_in_bytes"))
	if err != nil {
		return rt.Usage{}, fmt.Errorf("sandboxes' usage: %w", err)
	}
	mem, err := statFile(filepath.Join(memDir, "memory.stat"))
	if err != nil {
		return rt.Usage{}, err
	}
	return rt.Usage{CPUNanos: uint64(cpu), MemoryBytes: max(cur-mem["total_inactive_file"], 0), SwapBytes: mem["total_swap"]}, nil
}

// statFile reads a cgroup "key value" file.
func statFile(path string) (map[string]int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sandboxes' usage: %w", err)
	}
	out := map[string]int64{}
	for _, line := range bytes.Split(b, []byte("\n")) {
		k, v, ok := bytes.Cut(line, []byte(" "))
		if !ok {
			continue
		}
		if n, err := strconv.ParseInt(string(v), 10, 64); err == nil {
			out[string(k)] = n
		}
	}
	return out, nil
}
