package container_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/rawfile"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

func sandboxUsage(t testing.TB, sb rt.Sandbox) rt.Usage {
	t.Helper()
	su, ok := sb.(rt.SandboxUsage)
	if !ok {
		t.Fatalf("%T does not implement runtime.SandboxUsage", sb)
	}
	u, err := su.Usage()
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// TestSandboxUsage: a sandbox's usage is its own. One that computes has
// CPU time the idle one has not; one holding 48 MiB in its /dev/shm
// (tmpfs: anonymous memory, which reclaim cannot drop) is charged it,
// and the idle one, its agent only, is not; and a destroyed sandbox's
// usage is an error, not zeros.
func TestSandboxUsage(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	idle, busy := e.create(t), e.create(t)
	idle0, busy0 := sandboxUsage(t, idle), sandboxUsage(t, busy)

	res, err := busy.Exec(ctx, rt.ExecRequest{Argv: []string{"sh", "-c",
		`head -c 48m /dev/zero > /dev/shm/hold && i=0 && while [ $i -lt 100000 ]; do i=$((i+1)); done`}}, nil)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec: %v %+v", err, res)
	}
	idle1, busy1 := sandboxUsage(t, idle), sandboxUsage(t, busy)
	if got := busy1.CPUNanos - busy0.CPUNanos; busy1.CPUNanos < busy0.CPUNanos || got < uint64(10*time.Millisecond) {
		t.Errorf("busy sandbox used %v of CPU over a 100,000-step shell loop", time.Duration(got))
	}
	if idle1.CPUNanos < idle0.CPUNanos {
		t.Errorf("idle sandbox's CPU time went back: %d then %d", idle0.CPUNanos, idle1.CPUNanos)
	}
	if idle1.CPUNanos-idle0.CPUNanos >= busy1.CPUNanos-busy0.CPUNanos {
		t.Errorf("idle sandbox used %v of CPU, the busy one %v", time.Duration(idle1.CPUNanos-idle0.CPUNanos), time.Duration(busy1.CPUNanos-busy0.CPUNanos))
	}
	if busy1.MemoryBytes < 48<<20 {
		t.Errorf("sandbox holding 48 MiB in /dev/shm is charged %d bytes", busy1.MemoryBytes)
	}
	if idle1.MemoryBytes <= 0 || idle1.MemoryBytes >= 48<<20 {
		t.Errorf("idle sandbox is charged %d bytes (its agent: a few MiB)", idle1.MemoryBytes)
	}

	if err := idle.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if u, err := idle.(rt.SandboxUsage).Usage(); err == nil {
		t.Errorf("usage of a destroyed sandbox: %+v, want an error", u)
	}
}

// BenchmarkSandboxUsage is one Usage call of one of DSEC_BENCH_SANDBOXES
// (default 10) idle sandboxes, round robin: what the edge pays per live
// sandbox at each usage sample. The kernel's cost of a cgroup's
// memory.stat can grow with the number of cgroups, so run it with the
// density the node holds, e.g. DSEC_BENCH_SANDBOXES=1000.
func BenchmarkSandboxUsage(b *testing.B) {
	n := 10
	if s := os.Getenv("DSEC_BENCH_SANDBOXES"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			b.Fatalf("DSEC_BENCH_SANDBOXES=%q: want a positive count", s)
		}
		n = v
	}
	e := newEnv(b, 0)
	sbs := make([]rt.SandboxUsage, n)
	for i := range sbs {
		sbs[i] = e.create(b).(rt.SandboxUsage)
	}
	// Wall time stretches with the machine's load; the CPU time the
	// process spent (user and system: the kernel's side of the reads) is
	// what a pass costs the node.
	var ru0 syscall.Rusage
	start := func() { syscall.Getrusage(syscall.RUSAGE_SELF, &ru0) }
	pass := func(b *testing.B, per int) {
		var ru syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		cpu := time.Duration(ru.Utime.Nano()+ru.Stime.Nano()-ru0.Utime.Nano()-ru0.Stime.Nano()) / time.Duration(b.N)
		b.ReportMetric(float64(cpu.Nanoseconds())/1e3, "cpu-µs/op")
		b.ReportMetric(float64(cpu.Nanoseconds())*float64(per)/1e6, "cpu-ms/pass")
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)*float64(per)/1000, "ms/pass")
	}
	b.Run("usage", func(b *testing.B) {
		start()
		for i := 0; b.Loop(); i++ {
			if _, err := sbs[i%n].Usage(); err != nil {
				b.Fatal(err)
			}
		}
		pass(b, n)
	})
	// Where the time goes: each file alone (cgroup v1 layout).
	var groups []string
	for _, d := range e.backend.CgroupDirs() {
		if filepath.Base(filepath.Dir(d)) != "memory" {
			continue
		}
		ents, err := os.ReadDir(d)
		if err != nil {
			b.Fatal(err)
		}
		for _, ent := range ents {
			if ent.IsDir() {
				groups = append(groups, filepath.Join(filepath.Dir(filepath.Dir(d)), "%s", filepath.Base(d), ent.Name()))
			}
		}
	}
	for _, f := range []string{"cpuacct/cpuacct.usage", "memory/memory.usage_in_bytes", "memory/memory.stat"} {
		if len(groups) == 0 {
			break
		}
		ctrl, name := filepath.Split(f)
		b.Run("file="+name, func(b *testing.B) {
			start()
			for i := 0; b.Loop(); i++ {
				if _, err := rawfile.Read(filepath.Join(fmt.Sprintf(groups[i%len(groups)], filepath.Clean(ctrl)), name), 2048); err != nil {
					b.Fatal(err)
				}
			}
			pass(b, len(groups))
		})
	}
}
