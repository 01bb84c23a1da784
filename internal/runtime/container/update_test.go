package container_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// limitFiles names the files that hold a sandbox's limits in its cgroups,
// on cgroup v1 or v2.
type limitFiles struct {
	cpu, memory, pids, userPids string
	// sbMemory is the sandbox cgroup's memory limit: memory's plus the
	// agent's headroom.
	sbMemory string
	v2       bool
}

// sandboxLimits finds the cgroup files of sandbox id from its agent's
// /proc/PID/cgroup.
func sandboxLimits(t *testing.T, e *env, id string) limitFiles {
	t.Helper()
	pid, ok := e.backend.AgentPID(id)
	if !ok {
		t.Fatalf("no agent for sandbox %s", id)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	var f limitFiles
	unified := ""
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			dir := filepath.Join("/sys/fs/cgroup", c, parts[2])
			switch c {
			case "cpu":
				f.cpu = filepath.Join(dir, "cpu.cfs_quota_us")
			case "memory":
				// The spec's limit is the user cgroup's; the sandbox's
				// cgroup, the agent's, adds the agent's headroom.
				f.memory = filepath.Join(dir, "user", "memory.limit_in_bytes")
				f.sbMemory = filepath.Join(dir, "memory.limit_in_bytes")
			case "pids":
				f.pids = filepath.Join(dir, "pids.max")
				f.userPids = filepath.Join(dir, "user", "pids.max")
			}
		}
		if parts[0] == "0" && parts[1] == "" {
			unified = parts[2]
		}
	}
	if f.memory == "" && unified != "" {
		// v2: the agent lives in the "agent" leaf of the sandbox's cgroup.
		dir := filepath.Dir(filepath.Join("/sys/fs/cgroup", unified))
		f = limitFiles{cpu: filepath.Join(dir, "cpu.max"), memory: filepath.Join(dir, "user", "memory.max"),
			sbMemory: filepath.Join(dir, "memory.max"),
			pids:     filepath.Join(dir, "pids.max"), userPids: filepath.Join(dir, "user", "pids.max"), v2: true}
	}
	if f.cpu == "" || f.memory == "" || f.pids == "" {
		t.Fatalf("cgroups of sandbox %s not found in:\n%s", id, b)
	}
	return f
}

// read returns the limits in the files, 0 for none (v1 spells it -1, v2
// "max"); the CPU limit is the quota in microseconds per 100 ms period.
func (f limitFiles) read(t *testing.T) (quota, memory, pids, userPids int64) {
	t.Helper()
	num := func(file string) int64 {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		s := strings.Fields(string(b))[0] // v2 cpu.max: "QUOTA PERIOD"
		if s == "max" || s == "-1" {
			return 0
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("%s: %q", file, b)
		}
		if n >= 1<<62 { // v1 spells "no memory limit" as the largest page-aligned int64
			return 0
		}
		return n
	}
	return num(f.cpu), num(f.memory), num(f.pids), num(f.userPids)
}

// write sets a limit file behind the backend's back.
func (f limitFiles) write(t *testing.T, file string, v int64) {
	t.Helper()
	s := strconv.FormatInt(v, 10)
	if f.v2 && file == f.cpu {
		s += " 100000"
	}
	if err := os.WriteFile(file, []byte(s), 0); err != nil {
		t.Fatal(err)
	}
}

// TestUpdateWritesOnlyChanges checks that Update sets the limits it is
// given, writes only those that differ from the limits in force (fncall
// changes one per call), and nothing at all when none differs. Values
// written into the cgroup files behind the backend's back show which files
// an Update wrote.
func TestUpdateWritesOnlyChanges(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	spec := e.spec(t)
	spec.Resources = rt.Resources{MilliCPU: 500, MemoryBytes: 256 << 20, Pids: 100}
	sb, err := e.backend.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	u := sb.(rt.Updater)
	f := sandboxLimits(t, e, sb.ID())
	check := func(step string, quota, memory, pids, userPids int64) {
		t.Helper()
		q, m, p, up := f.read(t)
		if q != quota || m != memory || p != pids || up != userPids {
			t.Errorf("%s: cpu quota %d, memory %d, pids %d, user pids %d; want %d, %d, %d, %d",
				step, q, m, p, up, quota, memory, pids, userPids)
		}
	}
	check("after Create", 50000, 256<<20, 164, 100)
	checkAgent := func(step string, memory int64) {
		t.Helper()
		g := f
		g.memory = f.sbMemory
		if _, m, _, _ := g.read(t); m != memory {
			t.Errorf("%s: the sandbox cgroup's memory limit is %d; want %d (the user's plus the agent's 32 MiB)", step, m, memory)
		}
	}
	checkAgent("after Create", 256<<20+32<<20)

	// Only the memory limit changes: the CPU file keeps what was written
	// behind the backend's back.
	f.write(t, f.cpu, 70000)
	if err := u.Update(ctx, rt.Resources{MilliCPU: 500, MemoryBytes: 128 << 20, Pids: 100}); err != nil {
		t.Fatal(err)
	}
	check("memory changed", 70000, 128<<20, 164, 100)

	// The limits in force again: nothing is written.
	f.write(t, f.memory, 96<<20)
	if err := u.Update(ctx, rt.Resources{MilliCPU: 500, MemoryBytes: 128 << 20, Pids: 100}); err != nil {
		t.Fatal(err)
	}
	check("no change", 70000, 96<<20, 164, 100)

	// Zero lifts the CPU and memory limits and gives the default pids
	// bound (the backend's 2048, plus the agent's 64 in the sandbox's
	// cgroup).
	if err := u.Update(ctx, rt.Resources{}); err != nil {
		t.Fatal(err)
	}
	check("limits lifted", 0, 0, 2048+64, 2048)
	checkAgent("limits lifted", 0)
	if err := u.Update(ctx, rt.Resources{MilliCPU: 250, MemoryBytes: 64 << 20, Pids: 10}); err != nil {
		t.Fatal(err)
	}
	check("all changed", 25000, 64<<20, 74, 10)
	checkAgent("all changed", 64<<20+32<<20)
}

// TestMemoryLimitCoversSwap: on cgroup v1 a sandbox's memory limit bounds
// RAM and swap together (memory.memsw.limit_in_bytes at the limit), in
// the user cgroup and the sandbox's (plus the agent's headroom), through
// every change: the kernel refuses a RAM limit above the memsw one, so a
// write in the wrong order fails the Update.
func TestMemoryLimitCoversSwap(t *testing.T) {
	e := newEnv(t, 0)
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"); err != nil {
		t.Skipf("no cgroup v1 swap accounting: %v", err)
	}
	ctx := context.Background()
	spec := e.spec(t)
	spec.Resources = rt.Resources{MemoryBytes: 256 << 20}
	sb, err := e.backend.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	f := sandboxLimits(t, e, sb.ID())
	memsw := func(file string) string {
		return strings.Replace(file, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", 1)
	}
	check := func(step string, limit int64) {
		t.Helper()
		for _, c := range []struct {
			file string
			want int64
		}{{f.memory, limit}, {memsw(f.memory), limit}, {f.sbMemory, limit + 32<<20}, {memsw(f.sbMemory), limit + 32<<20}} {
			g := f
			g.memory = c.file
			if _, m, _, _ := g.read(t); limit == 0 && m != 0 || limit != 0 && m != c.want {
				t.Errorf("%s: %s is %d, want %d", step, c.file, m, c.want)
			}
		}
	}
	check("after Create", 256<<20)
	for _, step := range []struct {
		name  string
		limit int64
	}{{"raised", 512 << 20}, {"lowered", 64 << 20}, {"lifted", 0}, {"set from none", 128 << 20}, {"raised again", 1 << 30}} {
		if err := sb.(rt.Updater).Update(ctx, rt.Resources{MemoryBytes: step.limit}); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		check(step.name, step.limit)
	}
}
