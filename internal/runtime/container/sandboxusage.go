package container

import (
	"bytes"
	"fmt"
	"path/filepath"
	"strconv"

	"github.com/dsec-dev/dsec/internal/rawfile"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

var _ rt.SandboxUsage = (*sandbox)(nil)

// Usage reads what the sandbox uses, its agent and its user's processes
// together, from its cgroup: CPU time so far, memory charged less inactive
// file pages (what reclaim takes first, as the backend's own Usage counts
// it) and swap. Every file is opened, read and closed here (rawfile: no
// stat, no poller registration): a sandbox keeps no descriptor for this,
// and a read of a sandbox being destroyed fails rather than blocks.
//
// On cgroup v1 that is three files: cpuacct.usage, memory.usage_in_bytes
// and memory.stat (total_inactive_file, total_swap); on v2 four: cpu.stat,
// memory.current, memory.stat and memory.swap.current. memory.stat is the
// costly one (the kernel sums its counters for the read).
func (s *sandbox) Usage() (rt.Usage, error) {
	switch c := s.cg.(type) {
	case *cgroupV1:
		return groupUsageV1(c.group)
	case *cgroupV2:
		return groupUsageV2(c.group)
	}
	return rt.Usage{}, fmt.Errorf("usage of sandbox %s: no cgroup", s.id)
}

// usageReadSize fits every file read here but a v2 memory.stat (~1.5 KiB
// on v1, ~2 KiB on v2; rawfile grows its buffer past it).
const usageReadSize = 2048

func groupUsageV1(group string) (rt.Usage, error) {
	cpu, err := readCgroupInt(filepath.Join(cgroupRoot, "cpuacct", group, "cpuacct.usage"))
	if err != nil {
		return rt.Usage{}, err
	}
	memDir := filepath.Join(cgroupRoot, "memory", group)
	cur, err := readCgroupInt(filepath.Join(memDir, "memory.usage_in_bytes"))
	if err != nil {
		return rt.Usage{}, err
	}
	path := filepath.Join(memDir, "memory.stat")
	b, err := rawfile.Read(path, usageReadSize)
	if err != nil {
		return rt.Usage{}, fmt.Errorf("sandbox usage: %w", err)
	}
	inactive, swap := statValue(b, "total_inactive_file"), statValue(b, "total_swap")
	return rt.Usage{CPUNanos: uint64(max(cpu, 0)), MemoryBytes: max(cur-inactive, 0), SwapBytes: max(swap, 0)}, nil
}

func groupUsageV2(group string) (rt.Usage, error) {
	dir := filepath.Join(cgroupRoot, group)
	b, err := rawfile.Read(filepath.Join(dir, "cpu.stat"), usageReadSize)
	if err != nil {
		return rt.Usage{}, fmt.Errorf("sandbox usage: %w", err)
	}
	cpu := statValue(b, "usage_usec")
	cur, err := readCgroupInt(filepath.Join(dir, "memory.current"))
	if err != nil {
		return rt.Usage{}, err
	}
	b, err = rawfile.Read(filepath.Join(dir, "memory.stat"), usageReadSize)
	if err != nil {
		return rt.Usage{}, fmt.Errorf("sandbox usage: %w", err)
	}
	inactive := statValue(b, "inactive_file")
	// No swap controller file when the kernel has no swap accounting.
	swap, _ := readCgroupInt(filepath.Join(dir, "memory.swap.current"))
	return rt.Usage{CPUNanos: uint64(max(cpu, 0)) * 1000, MemoryBytes: max(cur-inactive, 0), SwapBytes: max(swap, 0)}, nil
}

// readCgroupInt reads a cgroup file holding one integer.
func readCgroupInt(path string) (int64, error) {
	b, err := rawfile.Read(path, 64)
	if err != nil {
		return 0, fmt.Errorf("sandbox usage: %w", err)
	}
	v, err := strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("sandbox usage: %s: %w", path, err)
	}
	return v, nil
}

// statValue is key's value in a cgroup "key value" file, 0 when absent.
func statValue(b []byte, key string) int64 {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		if len(line) > len(key) && line[len(key)] == ' ' && string(line[:len(key)]) == key {
			v, err := strconv.ParseInt(string(line[len(key)+1:]), 10, 64)
			if err != nil {
				return 0
			}
			return v
		}
	}
	return 0
}
