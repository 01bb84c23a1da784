package testsuite

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// Memory and pids exhaustion by the sandbox's own workload: the kernel
// must take it out on the workload, never on the agent (an agent killed by
// the OOM killer loses the sandbox, an infrastructure error the workload
// caused, which a trainer masks), and the exec that ran into the limit
// says so (OOMKilled, PidsExhausted) so that it reads as the command's own
// failure.
func init() {
	adversarialCases = append(adversarialCases,
		advCase{"oom-fork-bomb", (*suite).testAdvOOMForkBomb},
		advCase{"oom-background", (*suite).testAdvOOMBackground},
		advCase{"pids-exhausted", (*suite).testAdvPidsExhausted},
		advCase{"reset-fork-bomb", (*suite).testAdvResetForkBomb},
	)
}

// limitSummary is resultSummary with the limit indicators.
func limitSummary(res runtime.ExecResult) string {
	return fmt.Sprintf("%s pidsExhausted=%v", resultSummary(res), res.PidsExhausted)
}

// bomb64 is a sandbox of 64 MiB with a CPU and a pids bound: a fork bomb
// reaches one of the two limits (which depends on how much each shell
// costs the memory cgroup). The pids bound is 256, not a node's default
// 1024: with hundreds more processes thrashing in 64 MiB their kill at
// the exec's timeout took up to minutes (bench/RESULTS.md, architecture's
// known limits), longer than the suite's per-call bound.
func (s *suite) bomb64(t *testing.T) runtime.Sandbox {
	s.need(t, MemoryLimit)
	s.need(t, PidsLimit)
	return s.create(t, func(sp *runtime.Spec) {
		sp.Resources.MemoryBytes = 64 << 20
		sp.Resources.Pids = 256
		sp.Resources.MilliCPU = 1000
	})
}

// forkBomb is the fork bomb of the report, f(){ f|f & }; f, made to stop
// forking after secs seconds (read from /proc/uptime by the shell itself:
// no fork) so that it dies out by itself even when the OOM killer picks
// the exec's own process, which then leaves the bomb running in the
// background as any workload's strays; then its process sleeps until
// marker's sleep is killed by the exec's timeout.
func forkBomb(secs int, marker string) string {
	return fmt.Sprintf(`read up _ </proc/uptime; end=$((${up%%.*} + %d)); f(){ read up _ </proc/uptime; [ ${up%%.*} -lt $end ] && { f|f & }; }; f; exec sleep %s`, secs, marker)
}

// testAdvOOMForkBomb: the fork bomb of the report, in a 64 MiB sandbox.
// Its processes fill the memory limit and the OOM killer runs; it must
// pick the bomb's processes, not PID 1.
func (s *suite) testAdvOOMForkBomb(t *testing.T) {
	sb := s.bomb64(t)
	const marker = "3620"
	res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{
		Shell:   forkBomb(8, marker),
		Timeout: 12 * time.Second,
	}, nil)
	if err != nil {
		t.Fatalf("fork bomb in a 64 MiB sandbox: the exec failed as the platform's fault (the agent was killed?): %v", err)
	}
	t.Logf("fork bomb: %s", limitSummary(res))
	select {
	case <-sb.Done():
		t.Fatal("fork bomb in a 64 MiB sandbox ended the sandbox's init")
	default:
	}
	if !res.OOMKilled && !res.PidsExhausted {
		t.Errorf("fork bomb in a 64 MiB sandbox: neither OOMKilled nor PidsExhausted is set (%s)", limitSummary(res))
	}
	s.waitUsable(t, sb)
	s.waitProcsGone(t, sb, marker)
	res = s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(22)})
	requireExit(t, res, 0, "awk 4 MiB after the fork bomb")
	if res.OOMKilled || res.PidsExhausted {
		t.Errorf("an exec after the fork bomb is reported as hitting a limit: %s", limitSummary(res))
	}
}

// testAdvOOMBackground: the process the OOM killer picks need not be the
// exec's main process, which may exit normally; the exec is still
// reported as OOM-killed.
func (s *suite) testAdvOOMBackground(t *testing.T) {
	sb := s.bomb64(t)
	res := s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(27) + ` & wait; echo survived`, Timeout: 2 * time.Minute})
	t.Logf("allocation in a child: %s stdout %q", limitSummary(res), res.Stdout)
	if got := strings.TrimSpace(string(res.Stdout)); got != "survived" || res.ExitCode != 0 {
		t.Fatalf("the exec's shell did not survive its child's OOM kill: stdout %q, %s", got, limitSummary(res))
	}
	if !res.OOMKilled {
		t.Errorf("a child allocating ~270 MB under a 64 MiB limit: OOMKilled not set (%s)", limitSummary(res))
	}
	if got := s.sh(t, sb, `echo ok`); got != "ok\n" {
		t.Errorf("after the OOM kill, echo ok printed %q", got)
	}
}

// testAdvPidsExhausted: an exec whose forks the pids limit refuses is
// reported as such; the execs before and after it are not.
func (s *suite) testAdvPidsExhausted(t *testing.T) {
	s.need(t, PidsLimit)
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.Pids = 32 })
	res := s.exec(t, sb, runtime.ExecRequest{Shell: `sleep 0 & wait; echo ok`})
	requireExit(t, res, 0, "one fork")
	if res.PidsExhausted || res.OOMKilled {
		t.Fatalf("an exec with one fork is reported as hitting a limit: %s", limitSummary(res))
	}
	// ash stops at the first refused fork; the exec's own process waits for
	// its timeout, which ends the session with its sleeps.
	const marker = "3621"
	res = s.exec(t, sb, runtime.ExecRequest{
		Shell:   `(i=0; while [ $i -lt 64 ]; do sleep ` + marker + ` & i=$((i+1)); done) 2>/dev/null; exec sleep 3622`,
		Timeout: 3 * time.Second,
	})
	t.Logf("64 forks under a pids limit of 32: %s", limitSummary(res))
	if !res.PidsExhausted {
		t.Errorf("64 forks under a pids limit of 32: PidsExhausted not set (%s)", limitSummary(res))
	}
	s.waitUsable(t, sb)
	s.waitProcsGone(t, sb, marker)
	res = s.exec(t, sb, runtime.ExecRequest{Shell: `sleep 0 & wait; echo ok`})
	requireExit(t, res, 0, "one fork after the pids limit was hit")
	if res.PidsExhausted {
		t.Errorf("an exec after the one that hit the pids limit is reported as hitting it: %s", limitSummary(res))
	}
}

// testAdvResetForkBomb: a sandbox handed back with a fork bomb still
// running (an exec that left it behind) is reset for the next user, and
// Reset must get every process killed and reaped although hundreds of
// dying processes share the sandbox's small CPU quota.
func (s *suite) testAdvResetForkBomb(t *testing.T) {
	sb := s.bomb64(t)
	if _, ok := sb.(runtime.Resetter); !ok {
		t.Skip("the backend's sandboxes do not implement runtime.Resetter")
	}
	res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Shell: `f(){ f|f & }; f; exec sleep 3631`, Timeout: 4 * time.Second}, nil)
	if err != nil {
		t.Fatalf("fork bomb exec: %v", err)
	}
	t.Logf("fork bomb left running: %s", limitSummary(res))
	if err := s.tryReset(t, sb); err != nil {
		t.Fatalf("Reset with a fork bomb running: %v", err)
	}
	if got := s.sh(t, sb, `echo ok`); got != "ok\n" {
		t.Errorf("after Reset, echo ok printed %q", got)
	}
}
