package container_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// BenchmarkReset is what a warm pool pays between two users: a command,
// then Reset of the same sandbox. reset-ns/op is the Reset call alone; the
// rest of ns/op is the command and the background work Reset leaves (old
// overlay removal, next overlay built ahead), which competes for the same
// cores.
func BenchmarkReset(b *testing.B) {
	e := newEnv(b, 0)
	ctx := context.Background()
	sb := e.create(b)
	r := sb.(rt.Resetter)
	var spent time.Duration
	for b.Loop() {
		benchExec(b, sb)
		start := time.Now()
		if err := r.Reset(ctx); err != nil {
			b.Fatal(err)
		}
		spent += time.Since(start)
	}
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "reset-ns/op")
}

// BenchmarkRebase is what recycling across specs pays between two users:
// a command, then Quiesce and a Rebase onto a spec of its own (the same
// layers, another ID and env). quiesce-ns/op and rebase-ns/op are the two
// calls alone; compare with BenchmarkDestroyCreate's create and destroy.
func BenchmarkRebase(b *testing.B) {
	e := newEnv(b, 0)
	ctx := context.Background()
	sb := e.create(b)
	r := sb.(rt.Rebaser)
	var quiescing, rebasing time.Duration
	for b.Loop() {
		benchExec(b, sb)
		start := time.Now()
		if err := r.Quiesce(ctx); err != nil {
			b.Fatal(err)
		}
		mid := time.Now()
		if err := r.Rebase(ctx, e.newSpec()); err != nil {
			b.Fatal(err)
		}
		quiescing += mid.Sub(start)
		rebasing += time.Since(mid)
	}
	b.ReportMetric(float64(quiescing.Nanoseconds())/float64(b.N), "quiesce-ns/op")
	b.ReportMetric(float64(rebasing.Nanoseconds())/float64(b.N), "rebase-ns/op")
}

// BenchmarkDestroyCreate is the alternative to Reset: a command, then
// Destroy and a new Create over the same layers; "cold" spawns an agent per
// create, "warm" takes pre-started ones (Options.Warm) while the pool
// refills in the background on the same cores.
func BenchmarkDestroyCreate(b *testing.B) {
	for _, bc := range []struct {
		name string
		warm int
	}{{"cold", 0}, {"warm", 4}} {
		b.Run(bc.name, func(b *testing.B) {
			e := newEnv(b, bc.warm)
			ctx := context.Background()
			sb, err := e.backend.Create(ctx, e.newSpec())
			if err != nil {
				b.Fatal(err)
			}
			// The latest sandbox, also when the loop fails half-way.
			b.Cleanup(func() {
				if sb != nil {
					sb.Destroy(ctx)
				}
			})
			var destroying, creating time.Duration
			for b.Loop() {
				benchExec(b, sb)
				start := time.Now()
				if err := sb.Destroy(ctx); err != nil {
					b.Fatal(err)
				}
				mid := time.Now()
				if sb, err = e.backend.Create(ctx, e.newSpec()); err != nil {
					b.Fatal(err)
				}
				destroying += mid.Sub(start)
				creating += time.Since(mid)
			}
			b.ReportMetric(float64(destroying.Nanoseconds())/float64(b.N), "destroy-ns/op")
			b.ReportMetric(float64(creating.Nanoseconds())/float64(b.N), "create-ns/op")
		})
	}
}

// BenchmarkExecTrue is the command alone, to subtract from the two above.
// It also reports what the sandbox's agent spends per exec (CPU time and
// page faults of all its threads, from /proc/PID/stat), and the CPU time of
// the commands it reaped (cutime+cstime): the two halves of an exec's cost
// inside the sandbox.
func BenchmarkExecTrue(b *testing.B) {
	e := newEnv(b, 0)
	sb := e.create(b)
	pid, ok := e.backend.AgentPID(sb.ID())
	if !ok {
		b.Fatal("no agent PID")
	}
	benchExec(b, sb) // warm the agent up
	before := procStat(b, pid)
	for b.Loop() {
		benchExec(b, sb)
	}
	after := procStat(b, pid)
	n := float64(b.N)
	b.ReportMetric(float64(after.cpu-before.cpu)/n, "agent-us/op")
	b.ReportMetric(float64(after.faults-before.faults)/n, "agent-faults/op")
	b.ReportMetric(float64(after.childCPU-before.childCPU)/n, "child-us/op")
}

type procCounters struct {
	cpu, childCPU int64 // microseconds
	faults        int64 // minor + major
}

// procStat reads a process's CPU times and page faults from /proc/PID/stat.
func procStat(b *testing.B, pid int) procCounters {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name (which may hold spaces), from field 3.
	f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+2:]))
	num := func(i int) int64 { // i: the field's number in proc(5)
		v, err := strconv.ParseInt(f[i-3], 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		return v
	}
	const usPerTick = 10000 // USER_HZ is 100 on Linux
	return procCounters{
		cpu:      (num(14) + num(15)) * usPerTick,
		childCPU: (num(16) + num(17)) * usPerTick,
		faults:   num(10) + num(12),
	}
}

func benchExec(b *testing.B, sb rt.Sandbox) {
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Argv: []string{"true"}}, nil)
	if err != nil || res.ExitCode != 0 {
		b.Fatalf("exec true: %v %+v", err, res)
	}
}
