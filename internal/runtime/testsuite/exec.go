package testsuite

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testExec(t *testing.T) {
	t.Run("exit-codes", s.testExitCodes)
	t.Run("signal", s.testSignal)
	t.Run("stdin", s.testStdin)
	t.Run("env", s.testEnv)
	t.Run("cwd", s.testCwd)
	t.Run("user", s.testUser)
	t.Run("argv-vs-shell", s.testArgvShell)
	t.Run("large-output", s.testLargeOutput)
	t.Run("streaming", s.testStreaming)
	t.Run("timeout-kills-tree", s.testTimeoutKillsTree)
	t.Run("cancel-kills-tree", s.testCancelKillsTree)
}

func (s *suite) testExitCodes(t *testing.T) {
	sb := s.create(t, nil)
	for _, code := range []int{0, 1, 42, 255} {
		res := s.exec(t, sb, runtime.ExecRequest{Shell: fmt.Sprintf("exit %d", code)})
		requireExit(t, res, code, fmt.Sprintf("exit %d", code))
		res = s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/bin/sh", "-c", fmt.Sprintf("exit %d", code)}})
		requireExit(t, res, code, fmt.Sprintf("argv sh -c exit %d", code))
	}
	// A missing program is the command's failure, not the sandbox's.
	res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Argv: []string{"/no/such/program"}}, nil)
	if err == nil && res.ExitCode == 0 {
		t.Errorf("exec of a missing program reported success")
	}
	if isGone(err) {
		t.Errorf("exec of a missing program reported the sandbox gone: %v", err)
	}
	s.sh(t, sb, "true")
}

func (s *suite) testSignal(t *testing.T) {
	sb := s.create(t, nil)
	for _, sig := range []int{9, 15} {
		script := fmt.Sprintf("kill -%d $$", sig)
		res := s.exec(t, sb, runtime.ExecRequest{Shell: script})
		if res.Signal != sig || res.TimedOut || res.OOMKilled {
			t.Errorf("%q: want Signal %d, got %s", script, sig, resultSummary(res))
		}
	}
}

func (s *suite) testStdin(t *testing.T) {
	sb := s.create(t, nil)
	in := make([]byte, 1<<20)
	rand.Read(in)
	res := s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/bin/cat"}, Stdin: in, MaxOutputBytes: 4 << 20})
	requireExit(t, res, 0, "cat")
	if !bytes.Equal(res.Stdout, in) {
		t.Errorf("cat of 1 MiB stdin returned %d bytes that differ from the input", len(res.Stdout))
	}
	// Without stdin, the command sees EOF at once instead of waiting forever.
	res = s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/bin/cat"}, Timeout: 30 * time.Second})
	requireExit(t, res, 0, "cat without stdin")
	if len(res.Stdout) != 0 {
		t.Errorf("cat without stdin printed %q", clip(res.Stdout))
	}
}

func (s *suite) testEnv(t *testing.T) {
	sb := s.create(t, func(sp *runtime.Spec) {
		sp.Env = append(sp.Env, "DSEC_A=spec-a", "DSEC_B=spec-b")
	})
	const show = `echo "$DSEC_A|$DSEC_B|$DSEC_C"`
	if got := s.sh(t, sb, show); got != "spec-a|spec-b|\n" {
		t.Errorf("spec env: got %q, want %q", got, "spec-a|spec-b|\n")
	}
	res := s.exec(t, sb, runtime.ExecRequest{Shell: show, Env: []string{"DSEC_B=exec-b", "DSEC_C=exec-c"}})
	requireExit(t, res, 0, show)
	if got := string(res.Stdout); got != "spec-a|exec-b|exec-c\n" {
		t.Errorf("exec env over spec env: got %q, want %q", got, "spec-a|exec-b|exec-c\n")
	}
	// Per-exec env does not stick to the sandbox.
	if got := s.sh(t, sb, show); got != "spec-a|spec-b|\n" {
		t.Errorf("after an exec with its own env: got %q, want %q", got, "spec-a|spec-b|\n")
	}
	// The variable must appear once: a duplicate DSEC_B would confuse programs
	// that read the environment block directly.
	res = s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/usr/bin/env"}, Env: []string{"DSEC_B=exec-b"}})
	requireExit(t, res, 0, "env")
	if n := strings.Count(string(res.Stdout), "DSEC_B="); n != 1 {
		t.Errorf("DSEC_B appears %d times in the environment:\n%s", n, res.Stdout)
	}
}

func (s *suite) testCwd(t *testing.T) {
	sb := s.create(t, func(sp *runtime.Spec) { sp.Workdir = "/tmp" })
	if got := s.sh(t, sb, "pwd"); got != "/tmp\n" {
		t.Errorf("pwd with Spec.Workdir=/tmp: %q", got)
	}
	res := s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/bin/pwd"}, Cwd: "/etc"})
	requireExit(t, res, 0, "pwd in /etc")
	if got := string(res.Stdout); got != "/etc\n" {
		t.Errorf("pwd with Cwd=/etc: %q", got)
	}
	// A missing cwd must not silently run somewhere else.
	res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Argv: []string{"/bin/pwd"}, Cwd: "/no/such/dir"}, nil)
	if err == nil && res.ExitCode == 0 {
		t.Errorf("exec with a missing Cwd succeeded and printed %q", res.Stdout)
	}
	if isGone(err) {
		t.Errorf("exec with a missing Cwd reported the sandbox gone: %v", err)
	}
}

func (s *suite) testUser(t *testing.T) {
	s.need(t, Users)
	sb := s.create(t, nil)
	if got := s.sh(t, sb, "id -u"); got != "0\n" {
		t.Errorf("default user: id -u = %q, want 0", got)
	}
	for _, tc := range []struct{ user, want string }{
		{"65534", "65534 65534"},
		{"nobody", "65534 65534"},
		{"1000:1001", "1000 1001"},
	} {
		res := s.exec(t, sb, runtime.ExecRequest{Shell: `echo "$(id -u) $(id -g)"`, User: tc.user})
		requireExit(t, res, 0, "id as "+tc.user)
		if got := strings.TrimSpace(string(res.Stdout)); got != tc.want {
			t.Errorf("User=%q: uid gid = %q, want %q", tc.user, got, tc.want)
		}
	}
	// Not just reported: an unprivileged user really cannot write root's files.
	res := s.exec(t, sb, runtime.ExecRequest{Shell: "echo x > /etc/dsec-nobody", User: "nobody"})
	if res.ExitCode == 0 {
		t.Errorf("user nobody could create /etc/dsec-nobody")
	}

	def := s.create(t, func(sp *runtime.Spec) { sp.User = "nobody" })
	if got := s.sh(t, def, "id -u"); got != "65534\n" {
		t.Errorf("Spec.User=nobody: id -u = %q, want 65534", got)
	}
	res = s.exec(t, def, runtime.ExecRequest{Shell: "id -u", User: "0"})
	requireExit(t, res, 0, "id -u as 0")
	if got := string(res.Stdout); got != "0\n" {
		t.Errorf("ExecRequest.User=0 over Spec.User=nobody: id -u = %q, want 0", got)
	}
}

func (s *suite) testArgvShell(t *testing.T) {
	sb := s.create(t, nil)
	// Argv is passed as is: no shell expansion, spaces and quotes kept.
	res := s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/bin/echo", "a  b", "$HOME", "'q'", "*"}})
	requireExit(t, res, 0, "argv echo")
	if got, want := string(res.Stdout), "a  b $HOME 'q' *\n"; got != want {
		t.Errorf("argv form: got %q, want %q", got, want)
	}
	// A bare program name is looked up in PATH.
	res = s.exec(t, sb, runtime.ExecRequest{Argv: []string{"echo", "from-path"}})
	requireExit(t, res, 0, "argv echo via PATH")
	if got := string(res.Stdout); got != "from-path\n" {
		t.Errorf("argv with a bare name: got %q", got)
	}
	// Shell form goes through /bin/sh -c.
	if got := s.sh(t, sb, `x=6; echo $((x*7)) | tr 4 X`); got != "X2\n" {
		t.Errorf("shell form: got %q, want %q", got, "X2\n")
	}
	res = s.exec(t, sb, runtime.ExecRequest{Shell: "echo out; echo err >&2"})
	requireExit(t, res, 0, "stdout and stderr")
	if string(res.Stdout) != "out\n" || string(res.Stderr) != "err\n" {
		t.Errorf("stdout %q and stderr %q; want %q and %q", res.Stdout, res.Stderr, "out\n", "err\n")
	}
}

// seqOutput is what `seq 1 n` prints.
func seqOutput(n int) []byte {
	var b bytes.Buffer
	for i := 1; i <= n; i++ {
		b.WriteString(strconv.Itoa(i))
		b.WriteByte('\n')
	}
	return b.Bytes()
}

func (s *suite) testLargeOutput(t *testing.T) {
	sb := s.create(t, nil)
	const n = 700000 // ~4.8 MB of numbered lines: order and completeness are checkable
	want := seqOutput(n)

	res := s.exec(t, sb, runtime.ExecRequest{Shell: fmt.Sprintf("seq 1 %d", n), MaxOutputBytes: 16 << 20})
	requireExit(t, res, 0, "seq")
	if res.StdoutTruncated {
		t.Errorf("%d bytes under a 16 MiB bound: StdoutTruncated set", len(want))
	}
	if !bytes.Equal(res.Stdout, want) {
		t.Errorf("seq 1 %d: got %d bytes, want %d identical bytes", n, len(res.Stdout), len(want))
	}

	const bound = 1 << 20
	res = s.exec(t, sb, runtime.ExecRequest{Shell: fmt.Sprintf("seq 1 %d; seq 1 %d >&2", n, n), MaxOutputBytes: bound})
	// The program is not killed for writing more than is captured.
	requireExit(t, res, 0, "seq over the bound")
	if !res.StdoutTruncated || !res.StderrTruncated {
		t.Errorf("%d bytes over a %d bound: truncated flags stdout=%v stderr=%v", len(want), bound, res.StdoutTruncated, res.StderrTruncated)
	}
	for name, got := range map[string][]byte{"stdout": res.Stdout, "stderr": res.Stderr} {
		if len(got) == 0 || len(got) > bound || !bytes.HasPrefix(want, got) {
			t.Errorf("truncated %s: %d bytes; want a non-empty prefix of the output of at most %d bytes", name, len(got), bound)
		}
	}
}

func (s *suite) testStreaming(t *testing.T) {
	sb := s.create(t, nil)
	const n = 200000
	want := seqOutput(n)
	var (
		mu       sync.Mutex
		out, err bytes.Buffer
		calls    int
	)
	collect := func(st runtime.Stream, data []byte) {
		mu.Lock()
		defer mu.Unlock()
		calls++
		switch st {
		case runtime.Stdout:
			out.Write(data)
		case runtime.Stderr:
			err.Write(data)
		}
	}
	// A small capture bound: the stream must still get everything.
	const bound = 64 << 10
	req := runtime.ExecRequest{Shell: fmt.Sprintf("seq 1 %d; seq 1 %d >&2", n, n), MaxOutputBytes: bound}
	res, xerr := sb.Exec(s.ctx(t), req, collect)
	if xerr != nil {
		t.Fatalf("Exec: %v", xerr)
	}
	requireExit(t, res, 0, req.Shell)
	mu.Lock()
	defer mu.Unlock()
	if !bytes.Equal(out.Bytes(), want) {
		t.Errorf("streamed stdout: %d bytes, want %d identical bytes in order", out.Len(), len(want))
	}
	if !bytes.Equal(err.Bytes(), want) {
		t.Errorf("streamed stderr: %d bytes, want %d identical bytes in order", err.Len(), len(want))
	}
	if calls < 2 {
		t.Errorf("OutputFunc called %d times for two streams", calls)
	}
	if !res.StdoutTruncated || len(res.Stdout) > bound {
		t.Errorf("captured stdout with a %d bound: %d bytes, truncated=%v", bound, len(res.Stdout), res.StdoutTruncated)
	}
}

// treeScript starts sleeps three ways: background children, and one
// orphaned through a subshell (reparented to the sandbox's init), then says
// so and waits. Killing only the shell, or only its direct children, leaves
// some behind.
func treeScript(marker string) string {
	return fmt.Sprintf(`sleep %[1]s & sleep %[1]s & (sleep %[1]s &); echo started; wait`, marker)
}

func (s *suite) testTimeoutKillsTree(t *testing.T) {
	sb := s.create(t, nil)
	const marker = "3601"
	res := s.exec(t, sb, runtime.ExecRequest{Shell: treeScript(marker), Timeout: 2 * time.Second})
	if !res.TimedOut {
		t.Errorf("exec past its timeout: TimedOut not set (%s)", resultSummary(res))
	}
	if !strings.Contains(string(res.Stdout), "started") {
		t.Fatalf("tree script never started its children: stdout %q stderr %q", res.Stdout, res.Stderr)
	}
	s.waitProcsGone(t, sb, marker)
	if got := s.sh(t, sb, "echo ok"); got != "ok\n" {
		t.Errorf("after a timeout, echo ok printed %q", got)
	}
}

func (s *suite) testCancelKillsTree(t *testing.T) {
	sb := s.create(t, nil)
	const marker = "3604"
	ctx, cancel := context.WithCancel(s.ctx(t))
	defer cancel()
	out, started := signalOn("started")
	type result struct {
		res runtime.ExecResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := sb.Exec(ctx, runtime.ExecRequest{Shell: treeScript(marker)}, out)
		done <- result{res, err}
	}()
	select {
	case <-started:
	case r := <-done:
		t.Fatalf("exec ended before it started its children: %s %v", resultSummary(r.res), r.err)
	case <-t.Context().Done():
		t.Fatal("test ended while waiting for the exec to start")
	}
	cancel()
	var r result
	select {
	case r = <-done:
	case <-time.After(s.h.OpTimeout):
		t.Fatal("Exec did not return after its context was cancelled")
	}
	// Either form says "stopped by the caller"; a clean exit does not.
	if r.err != nil && !errors.Is(r.err, context.Canceled) {
		t.Errorf("cancelled exec returned %v; want an error wrapping context.Canceled or a result", r.err)
	}
	if r.err == nil && !r.res.TimedOut && r.res.Signal == 0 {
		t.Errorf("cancelled exec reported %s; want TimedOut or a signal", resultSummary(r.res))
	}
	if isGone(r.err) {
		t.Errorf("cancelling an exec reported the sandbox gone: %v", r.err)
	}
	s.waitProcsGone(t, sb, marker)
	if got := s.sh(t, sb, "echo ok"); got != "ok\n" {
		t.Errorf("after a cancelled exec, echo ok printed %q", got)
	}
}
