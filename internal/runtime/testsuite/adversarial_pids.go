package testsuite

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func init() {
	adversarialCases = append(adversarialCases, advCase{"pids/exec-with-the-limit-full", (*suite).advExecPidsFull})
}

// advExecPidsFull: with the sandbox's pids limit full (as a fork bomb
// leaves it), an exec is the sandbox's failure, not an error: exit code
// 126, PidsExhausted, the reason on stderr. The fork's EAGAIN came back as
// an infrastructure error ("node stopped answering mid-exec: resource
// temporarily unavailable"), which a trainer masks: a sample could escape
// its reward. Once a slot is free again, execs run.
//
// The limit is filled without a race: a shell forks sleeps until its fork
// fails and ends (ash stops at its first failed fork), which frees its own
// slot; an exec that holds that one (its shell execs a sleep, no fork)
// leaves none.
func (s *suite) advExecPidsFull(t *testing.T) {
	s.need(t, PidsLimit)
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.Pids = 16 })
	s.exec(t, sb, runtime.ExecRequest{Shell: `i=0; while [ $i -lt 64 ]; do sleep 3610 >/dev/null 2>&1 </dev/null & i=$((i+1)); done`})
	ctx, cancel := context.WithCancel(s.ctx(t))
	started := make(chan struct{})
	held := make(chan error, 1)
	go func() {
		var once bool
		_, err := sb.Exec(ctx, runtime.ExecRequest{Shell: "echo holding; exec sleep 3611"}, func(st runtime.Stream, b []byte) {
			if !once && bytes.Contains(b, []byte("holding")) {
				once = true
				close(started)
			}
		})
		held <- err
	}()
	select {
	case <-started:
	case err := <-held:
		cancel()
		t.Fatalf("the exec holding the last slot ended: %v", err)
	}
	res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Argv: []string{"true"}}, nil)
	cancel()
	<-held
	if err != nil {
		t.Fatalf("exec with the pids limit full: %v; want a failed result", err)
	}
	if res.ExitCode != 126 || !res.PidsExhausted || !strings.Contains(string(res.Stderr), "process limit") {
		t.Errorf("exec with the pids limit full: %s, stderr %q; want exit 126, PidsExhausted and the reason", resultSummary(res), res.Stderr)
	}
	s.waitUsable(t, sb)
}
