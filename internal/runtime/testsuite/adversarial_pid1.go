package testsuite

import (
	"os"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// A workload runs as the same user as the sandbox's PID 1, which the
// kernel lets change a process's limits, nice value, scheduling, CPU
// affinity and I/O priority. PID 1 keeps serving the next user of a
// reset sandbox, and everything it starts inherits them.
func init() {
	adversarialCases = append(adversarialCases, advCase{"pid1-attributes", (*suite).testAdvPid1Attributes})
}

// testAdvPid1Attributes: each system call that changes another process's
// attributes, aimed at PID 1, is refused; so is setting a resource limit
// of any other process (PID 1's threads have IDs of their own, and a
// limit set through one is PID 1's; a hard limit lowered cannot be raised
// again without CAP_SYS_RESOURCE). A workload's own processes keep those
// calls for themselves.
func (s *suite) testAdvPid1Attributes(t *testing.T) {
	s.need(t, ProtectedAgent)
	bin, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/pid1probe"))
	if err != nil {
		t.Fatal(err)
	}
	sb := s.create(t, nil)
	if err := sb.WriteFile(s.ctx(t), "/tmp/pid1probe", bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ what, script string }{
		{"renice PID 1", `renice 15 -p 1`},
		{"renice PID 1's process group", `renice 15 -g 1`},
		{"renice every process of root", `renice 15 -u 0`},
		{"set PID 1's CPU affinity", `taskset -p 1 1`},
		{"set PID 1's I/O priority", `ionice -c 3 -p 1`},
	} {
		res := s.exec(t, sb, runtime.ExecRequest{Shell: c.script + " >/dev/null 2>&1 && echo changed || echo refused"})
		if got := strings.TrimSpace(string(res.Stdout)); got != "refused" {
			t.Errorf("%s (%s): %q; want refused", c.what, c.script, got)
		}
	}
	// RLIMIT_NOFILE (7) lowered on PID 1 and on the low thread IDs a Go
	// agent's threads get; raised back at once if it worked, where it
	// could (the soft limit).
	out := s.sh(t, sb, `for p in 1 2 3 4 5 6 7 8; do /tmp/pid1probe prlimit $p 7 1024 $(ulimit -Hn); done`)
	for i, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line != "operation not permitted" && line != "no such process" {
			t.Errorf("prlimit64 on pid %d from a workload: %q; want operation not permitted", i+1, line)
		}
	}
	// A process's own attributes stay its own to change.
	if got := s.sh(t, sb, `/tmp/pid1probe prlimit 0 7 512 $(ulimit -Hn); sh -c 'renice 5 -p $$ >/dev/null && echo reniced'`); got != "ok\nreniced\n" {
		t.Errorf("a process changing its own limit and nice value: %q; want ok, reniced", got)
	}
}
