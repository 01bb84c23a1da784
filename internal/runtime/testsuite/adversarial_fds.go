package testsuite

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/testutil"
)

func init() {
	adversarialCases = append(adversarialCases,
		advCase{"fds/only-stdio", (*suite).advOnlyStdio},
		advCase{"fds/only-stdio-as-nobody", (*suite).advOnlyStdioNobody},
		advCase{"fds/no-forged-results", (*suite).advNoForgedResults},
	)
}

// advOnlyStdio: a command starts with stdin, stdout and stderr and nothing
// else; any other descriptor (the agent's control channel, one dsecd
// inherited) would let it read later requests and forge their results.
func (s *suite) advOnlyStdio(t *testing.T) {
	sb := s.create(t, nil)
	s.checkOnlyStdio(t, sb, "")
}

// advOnlyStdioNobody: the same for a command run as another user, and for
// a process a previous exec left running.
func (s *suite) advOnlyStdioNobody(t *testing.T) {
	s.need(t, Users)
	sb := s.create(t, nil)
	s.checkOnlyStdio(t, sb, "nobody")
	// A background process of an earlier exec, listed by a later one.
	s.sh(t, sb, "sleep 1000 >/dev/null 2>&1 </dev/null & echo $! >/tmp/bg.pid")
	res := s.exec(t, sb, runtime.ExecRequest{Shell: "ls /proc/$(cat /tmp/bg.pid)/fd"})
	if got := strings.Fields(string(res.Stdout)); res.ExitCode != 0 || strings.Join(got, " ") != "0 1 2" {
		t.Errorf("a background process holds descriptors %q (exit %d, stderr %q); want 0 1 2", res.Stdout, res.ExitCode, res.Stderr)
	}
}

func (s *suite) checkOnlyStdio(t *testing.T, sb runtime.Sandbox, user string) {
	t.Helper()
	res := s.exec(t, sb, runtime.ExecRequest{Shell: "ls /proc/self/fd", User: user})
	if res.ExitCode != 0 {
		t.Fatalf("ls /proc/self/fd as %q: exit %d, stderr %q", user, res.ExitCode, res.Stderr)
	}
	// ls itself holds the directory it lists open (fd 3 here).
	var fds []string
	for _, f := range strings.Fields(string(res.Stdout)) {
		if f != "0" && f != "1" && f != "2" {
			fds = append(fds, f)
		}
	}
	if len(fds) > 1 || (len(fds) == 1 && fds[0] != "3") {
		t.Errorf("a command run as %q holds descriptors beyond stdio and the one it opened: %v (all: %q)", user, fds, res.Stdout)
	}
}

// advNoForgedResults: a program that walks every descriptor and socket it
// can reach (its own, other processes' through /proc and pidfd_getfd, the
// Unix sockets /proc/net/unix lists), reading and writing frames of the
// agent protocol on each while it runs in the background, changes nothing
// about later operations: a grading exec still reports what it printed and
// its exit code, a file reads back as written, and the program saw none of
// the requests (a grader's secret in its environment least of all).
func (s *suite) advNoForgedResults(t *testing.T) {
	s.need(t, ProtectedAgent)
	bin, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/forger"))
	if err != nil {
		t.Fatal(err)
	}
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	if err := sb.WriteFile(ctx, "/tmp/forger", bin, 0o755); err != nil {
		t.Fatalf("WriteFile(/tmp/forger): %v", err)
	}
	start := s.exec(t, sb, runtime.ExecRequest{Shell: "mkdir -p /tmp/forge && /tmp/forger start /tmp/forge"})
	switch {
	case start.ExitCode != 0:
		t.Fatalf("forger start: exit %d, stdout %q, stderr %q", start.ExitCode, start.Stdout, start.Stderr)
	case string(start.Stdout) != "started\n":
		// Its own exec's result, forged already: go on to the grader's.
		t.Errorf("forger start: stdout %q, want %q", start.Stdout, "started\n")
	}

	const secret = "dsec-grader-secret-"
	for i := range 5 {
		key := fmt.Sprintf("%s%d", secret, i)
		res := s.exec(t, sb, runtime.ExecRequest{Shell: `echo "3 failed"; exit 1`, Env: []string{"API_KEY=" + key}})
		if res.ExitCode != 1 || string(res.Stdout) != "3 failed\n" || res.Signal != 0 {
			t.Errorf("grading exec %d: exit %d, signal %d, stdout %q; want exit 1 and %q", i, res.ExitCode, res.Signal, res.Stdout, "3 failed\n")
		}
		want := []byte(key + "\n")
		if err := sb.WriteFile(ctx, "/tmp/answer", want, 0o644); err != nil {
			t.Errorf("WriteFile during the attack: %v", err)
		}
		if got, err := sb.ReadFile(ctx, "/tmp/answer", 0); err != nil || string(got) != string(want) {
			t.Errorf("ReadFile during the attack: %q, %v; want %q", got, err, want)
		}
	}
	// (Destroying the sandbox would end it too, but its log is wanted.)
	if res := s.exec(t, sb, runtime.ExecRequest{Argv: []string{"/tmp/forger", "stop", "/tmp/forge"}}); res.ExitCode != 0 {
		t.Errorf("forger stop: exit %d, stderr %q", res.ExitCode, res.Stderr)
	}
	log, err := sb.ReadFile(ctx, "/tmp/forge/log", 0)
	if err != nil {
		t.Fatalf("ReadFile(/tmp/forge/log): %v", err)
	}
	for _, line := range strings.Split(string(log), "\n") {
		if strings.HasPrefix(line, "held ") || strings.HasPrefix(line, "peeked ") || strings.Contains(line, secret) {
			t.Errorf("the workload reached the platform's channel: %s", line)
		}
	}
	if t.Failed() {
		t.Logf("forger's log:\n%s", log)
	}
}
