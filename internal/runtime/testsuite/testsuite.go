// Package testsuite is the conformance suite every runtime.Backend runs
// (container, fncall, microvm, fullvm), in the way containerd's snapshotter
// test suite is run by each snapshotter: one set of behavioural tests written
// against the runtime.Backend and runtime.Sandbox interfaces only, so that
// every backend gives the edge the same isolation, limits and exec semantics.
//
// A backend's test builds a Harness (usually from BusyboxRootfs turned into
// an EROFS layer, and HostSnapshot over its cgroup and state directories) and
// calls Run. Every check is written so that it fails when the feature it
// names is missing; a backend that cannot offer a feature declares it in
// Harness.Lacks and the check is skipped with that reason.
package testsuite

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// Capability names a feature a backend may lack; tests needing it skip.
type Capability string

// Capabilities the suite checks that some backend may legitimately not have.
const (
	// MemoryLimit: Resources.MemoryBytes is enforced and OOM kills are reported.
	MemoryLimit Capability = "memory-limit"
	// PidsLimit: Resources.Pids is enforced (fork bombs are contained).
	PidsLimit Capability = "pids-limit"
	// CPUQuota: Resources.MilliCPU is enforced.
	CPUQuota Capability = "cpu-quota"
	// ReadOnlySystem: /sys and /proc/sys cannot be written from inside.
	ReadOnlySystem Capability = "read-only-system"
	// NetworkIsolation: only loopback exists; the host's network is unreachable.
	NetworkIsolation Capability = "network-isolation"
	// Users: execs can run as another user (ExecRequest.User, Spec.User).
	Users Capability = "users"
)

// Harness is what a backend's test hands to Run.
type Harness struct {
	Backend runtime.Backend
	// NewSpec returns a valid spec with a fresh unique ID over the harness's
	// base image layers: a rootfs made by BusyboxRootfs (busybox applets only).
	// Tests change fields of the returned spec, so it must be a fresh value.
	NewSpec func(t *testing.T) runtime.Spec
	// Leaks returns a snapshot of host resources the backend may leak; the
	// suite compares snapshots taken before and after. HostSnapshot is the
	// usual implementation. Nil skips the leak checks.
	Leaks func(t *testing.T) Snapshot
	// Lacks maps each capability the backend does not offer to the reason;
	// the tests that need it skip with that reason.
	Lacks map[Capability]string
	// AgentName, if set, must be a substring of PID 1's command line inside
	// a sandbox (e.g. "dsec-agent").
	AgentName string
	// LeakCycles is the number of create→exec→destroy cycles of the leak
	// check; default 100 (10 with -short).
	LeakCycles int
	// FreezeInterval is how long the freeze-thaw check holds the sandbox
	// frozen, then running (default 700ms). The execs that sample CPU time
	// around the freeze run the busy loop too; a backend whose execs take
	// a good part of a second (a VM under TCG) needs longer phases for
	// them to be small beside.
	FreezeInterval time.Duration
	// OpTimeout bounds each single backend call (create, exec, ...) so that a
	// hung backend fails the test instead of hanging it; default 2 minutes.
	OpTimeout time.Duration
	// Sections, if set, runs only these top-level sections ("isolation",
	// "exec", "adversarial", ...; the leak checks always run); the others
	// are skipped naming the harness's reason, SectionsWhy. For a backend
	// whose every sandbox is a slow boot (a TCG guest), CI runs a part
	// and the benchmark run the whole.
	Sections    []string
	SectionsWhy string
}

// suite carries the harness and its defaults through the subtests.
type suite struct {
	h Harness
}

// Run runs the whole conformance suite against h as subtests of t.
// Subtests run one after another: the limit checks measure CPU and memory
// and would disturb each other in parallel.
func Run(t *testing.T, h Harness) {
	if h.Backend == nil || h.NewSpec == nil {
		t.Fatal("testsuite: Harness.Backend and Harness.NewSpec are required")
	}
	if h.OpTimeout <= 0 {
		h.OpTimeout = 2 * time.Minute
	}
	if h.LeakCycles <= 0 {
		h.LeakCycles = 100
		if testing.Short() {
			h.LeakCycles = 10
		}
	}
	s := &suite{h: h}

	// One full cycle first: it fails fast on a backend that cannot run at all,
	// and it lets the backend create what it keeps for its whole life (layer
	// mounts of its cache, parent cgroups, pools) before the first leak
	// snapshot, so that those are not counted as leaks.
	s.cycle(t, 0)
	var before Snapshot
	if h.Leaks != nil {
		before = h.Leaks(t)
	}

	for _, sec := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"isolation", s.testIsolation},
		{"rootfs", s.testRootfs},
		{"limits", s.testLimits},
		{"exec", s.testExec},
		{"files", s.testFiles},
		{"concurrency", s.testConcurrency},
		{"lifecycle", s.testLifecycle},
		{"reset", s.testReset},
		{"update", s.testUpdate},
		{"invalid-spec", s.testInvalidSpec},
		{"adversarial", s.testAdversarial},
		{"leaks", s.testLeaks},
	} {
		run := sec.run
		if h.Sections != nil && sec.name != "leaks" && !slices.Contains(h.Sections, sec.name) {
			run = func(t *testing.T) { t.Skipf("section not run here: %s", h.SectionsWhy) }
		}
		t.Run(sec.name, run)
	}
	// Whatever the subtests above did (timeouts, OOM kills, fork bombs,
	// failed creates), once all their sandboxes are destroyed the host must
	// look as it did before them.
	t.Run("leaks/whole-suite", func(t *testing.T) {
		s.needLeaks(t)
		s.expectNoLeaks(t, before)
	})
}

// need skips t when the backend declared it lacks c.
func (s *suite) need(t *testing.T, c Capability) {
	t.Helper()
	if reason, ok := s.h.Lacks[c]; ok {
		t.Skipf("backend lacks %s: %s", c, reason)
	}
}

// ctx returns a context bounded by OpTimeout and cancelled when t ends.
func (s *suite) ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), s.h.OpTimeout)
	t.Cleanup(cancel)
	return ctx
}

// create makes a sandbox from a fresh spec changed by mutate (may be nil)
// and destroys it when t ends.
func (s *suite) create(t *testing.T, mutate func(*runtime.Spec)) runtime.Sandbox {
	t.Helper()
	spec := s.h.NewSpec(t)
	if mutate != nil {
		mutate(&spec)
	}
	return s.createSpec(t, spec)
}

func (s *suite) createSpec(t *testing.T, spec runtime.Spec) runtime.Sandbox {
	t.Helper()
	sb, err := s.h.Backend.Create(s.ctx(t), spec)
	if err != nil {
		t.Fatalf("Create(%q): %v", spec.ID, err)
	}
	if sb == nil {
		t.Fatalf("Create(%q) returned a nil sandbox and no error", spec.ID)
	}
	t.Cleanup(func() { s.destroy(t, sb) })
	return sb
}

// destroy runs in cleanups, after t.Context() is cancelled, so it has its own
// context.
func (s *suite) destroy(t testing.TB, sb runtime.Sandbox) {
	ctx, cancel := context.WithTimeout(context.Background(), s.h.OpTimeout)
	defer cancel()
	if err := sb.Destroy(ctx); err != nil {
		t.Errorf("Destroy(%q): %v", sb.ID(), err)
	}
}

// exec runs req and fails t on an infrastructure error.
func (s *suite) exec(t *testing.T, sb runtime.Sandbox, req runtime.ExecRequest) runtime.ExecResult {
	t.Helper()
	type result struct {
		res runtime.ExecResult
		err error
	}
	// A backend that ignores its context would hang the whole test binary;
	// the watchdog turns that into a failure that names the exec.
	ch := make(chan result, 1)
	go func() {
		res, err := sb.Exec(s.ctx(t), req, nil)
		ch <- result{res, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-time.After(s.h.OpTimeout + 30*time.Second):
		t.Fatalf("Exec(%s) did not return within 30s after its context expired", describe(req))
	}
	if r.err != nil {
		t.Fatalf("Exec(%s): %v", describe(req), r.err)
	}
	return r.res
}

// sh runs a shell script that must exit 0 and returns its stdout.
func (s *suite) sh(t *testing.T, sb runtime.Sandbox, script string) string {
	t.Helper()
	res := s.exec(t, sb, runtime.ExecRequest{Shell: script})
	requireExit(t, res, 0, script)
	return string(res.Stdout)
}

// requireExit fails t unless res is a normal exit with code.
func requireExit(t *testing.T, res runtime.ExecResult, code int, what string) {
	t.Helper()
	if res.ExitCode != code || res.Signal != 0 || res.TimedOut || res.OOMKilled {
		t.Fatalf("%q: want exit %d, got %s\nstdout: %s\nstderr: %s",
			what, code, resultSummary(res), clip(res.Stdout), clip(res.Stderr))
	}
}

func resultSummary(res runtime.ExecResult) string {
	return fmt.Sprintf("exit=%d signal=%d timedOut=%v oomKilled=%v stdoutTruncated=%v stderrTruncated=%v",
		res.ExitCode, res.Signal, res.TimedOut, res.OOMKilled, res.StdoutTruncated, res.StderrTruncated)
}

func describe(req runtime.ExecRequest) string {
	if len(req.Argv) > 0 {
		return fmt.Sprintf("argv %q", req.Argv)
	}
	return fmt.Sprintf("shell %q", clip([]byte(req.Shell)))
}

// clip keeps failure messages readable when outputs are megabytes long.
func clip(b []byte) string {
	const max = 2000
	if len(b) > max {
		return string(b[:max]) + fmt.Sprintf("... (%d bytes)", len(b))
	}
	return string(b)
}

// cycle is one create→exec→destroy round trip; used as warm-up and by the
// leak check.
func (s *suite) cycle(t *testing.T, i int) {
	t.Helper()
	spec := s.h.NewSpec(t)
	ctx := s.ctx(t)
	sb, err := s.h.Backend.Create(ctx, spec)
	if err != nil {
		t.Fatalf("cycle %d: Create(%q): %v", i, spec.ID, err)
	}
	res, err := sb.Exec(ctx, runtime.ExecRequest{Argv: []string{"/bin/echo", strconv.Itoa(i)}}, nil)
	if derr := sb.Destroy(ctx); derr != nil {
		t.Fatalf("cycle %d: Destroy(%q): %v", i, spec.ID, derr)
	}
	if err != nil {
		t.Fatalf("cycle %d: Exec: %v", i, err)
	}
	if got, want := string(res.Stdout), strconv.Itoa(i)+"\n"; got != want || res.ExitCode != 0 {
		t.Fatalf("cycle %d: echo printed %q (%s), want %q", i, got, resultSummary(res), want)
	}
}

// proc is one process seen inside a sandbox.
type proc struct {
	pid int
	cmd string // cmdline with NULs turned into spaces
}

// psScript lists "pid cmdline" for every process the sandbox can see, with
// busybox only (no ps(1) dependency on its output format).
const psScript = `for d in /proc/[0-9]*; do c=$(tr '\0' ' ' < $d/cmdline 2>/dev/null) || continue; echo "${d#/proc/} $c"; done`

// procs lists the processes visible inside sb.
func (s *suite) procs(t *testing.T, sb runtime.Sandbox) []proc {
	t.Helper()
	return parseProcs(t, s.sh(t, sb, psScript))
}

// parseProcs parses psScript's output.
func parseProcs(t *testing.T, out string) []proc {
	t.Helper()
	var ps []proc
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		pidStr, cmd, _ := strings.Cut(line, " ")
		pid, err := strconv.Atoi(pidStr)
		if err != nil {
			t.Fatalf("process listing: bad line %q", line)
		}
		ps = append(ps, proc{pid: pid, cmd: strings.TrimSpace(cmd)})
	}
	return ps
}

// withMarker returns the processes whose command line contains marker.
func withMarker(ps []proc, marker string) []proc {
	var out []proc
	for _, p := range ps {
		if strings.Contains(p.cmd, marker) {
			out = append(out, p)
		}
	}
	return out
}

// waitProcsGone polls sb until no process with marker in its command line is
// left. Killing is asynchronous on some backends, so this polls a condition
// with a bound instead of checking once.
func (s *suite) waitProcsGone(t *testing.T, sb runtime.Sandbox, marker string) {
	t.Helper()
	var left []proc
	ok := poll(t.Context(), 20*time.Second, func() bool {
		// Right after a kill the dying processes may still hold the pids
		// limit, so the listing itself (which forks) can fail: not done yet.
		res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Shell: psScript}, nil)
		if err != nil {
			left = []proc{{cmd: "(listing failed: " + err.Error() + ")"}}
			return false
		}
		if res.ExitCode != 0 || res.Signal != 0 {
			left = []proc{{cmd: "(listing failed: " + strings.TrimSpace(string(res.Stderr)) + ")"}}
			return false
		}
		left = withMarker(parseProcs(t, string(res.Stdout)), marker)
		return len(left) == 0
	})
	if !ok {
		t.Fatalf("processes matching %q still running in the sandbox: %v", marker, left)
	}
}

// poll calls cond until it returns true or the bound passes; it returns
// whether cond became true.
func poll(ctx context.Context, bound time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if cond() {
			return true
		}
		select {
		case <-ctx.Done():
			return cond()
		case <-tick.C:
		}
	}
}

// signalOn returns an OutputFunc that collects output and closes the returned
// channel the first time stdout contains marker: the test's way to know a
// script reached a point without sleeping.
func signalOn(marker string) (runtime.OutputFunc, <-chan struct{}) {
	var (
		mu   sync.Mutex
		seen []byte
		once sync.Once
	)
	ch := make(chan struct{})
	return func(st runtime.Stream, data []byte) {
		if st != runtime.Stdout {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, data...)
		if strings.Contains(string(seen), marker) {
			once.Do(func() { close(ch) })
		}
	}, ch
}

// isGone reports whether err says the sandbox is gone.
func isGone(err error) bool { return errors.Is(err, runtime.ErrSandboxGone) }
