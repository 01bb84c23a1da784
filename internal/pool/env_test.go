package pool_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/container/containertest"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// env is a node in miniature, shared by every test of the binary: a busybox
// EROFS layer, the layer mount cache and the real container backend (no
// warm agents of its own, so the leak checks see only the pool's work).
type env struct {
	backend *container.Backend
	layer   rt.Layer
	// resettable reports whether the backend's sandboxes implement
	// rt.Resetter (the container backend's Reset is being written while
	// this package is).
	resettable bool
	n          atomic.Int64
}

var (
	sharedOnce sync.Once
	shared     *env
	sharedErr  error
	cleanups   []func() // run by TestMain after every test, in reverse
)

func TestMain(m *testing.M) {
	code := m.Run()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	os.Exit(code)
}

// newEnv returns the shared environment, building it on first use; it
// skips the test when not root.
func newEnv(t testing.TB) *env {
	t.Helper()
	testutil.RequireRoot(t)
	sharedOnce.Do(func() { shared, sharedErr = buildEnv(t) })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared
}

func buildEnv(t testing.TB) (*env, error) {
	ce, err := containertest.New(t, "dsec-pool-test-", testsuite.BusyboxRootfs(t))
	cleanups = append(cleanups, ce.Close)
	if err != nil {
		return nil, err
	}
	b := ce.Backend
	e := &env{backend: b, layer: ce.Layer}
	probe, err := b.Create(context.Background(), e.spec("probe"))
	if err != nil {
		return nil, fmt.Errorf("probe sandbox: %w", err)
	}
	_, e.resettable = probe.(rt.Resetter)
	if err := probe.Destroy(context.Background()); err != nil {
		return nil, err
	}
	return e, nil
}

func (e *env) spec(prefix string) rt.Spec {
	return rt.Spec{
		ID:     fmt.Sprintf("%s-%d", prefix, e.n.Add(1)),
		Layers: []rt.Layer{e.layer},
	}
}

// mode is how a pool's sandboxes come back: reset in place (the backend's
// rt.Resetter) or destroyed and re-created (hidden Reset).
type mode struct {
	name  string
	reset bool
}

var modes = []mode{{"reset", true}, {"destroy", false}}

// forEachMode runs f once per mode; the reset mode is skipped while the
// backend has no Reset.
func forEachMode(t *testing.T, f func(t *testing.T, m mode)) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			if m.reset && !newEnv(t).resettable {
				t.Skip("the container backend does not implement runtime.Resetter yet")
			}
			f(t, m)
		})
	}
}

// plain hides every method but rt.Sandbox's, Reset included: a real
// sandbox that the pool must destroy and replace instead of resetting.
type plain struct{ rt.Sandbox }

// creator is a pool's Options.New over the real backend, recording what it
// created and able to fail on purpose with a real backend error.
type creator struct {
	e      *env
	prefix string
	// wrap, if set, wraps every sandbox created (plain, execReset).
	wrap func(rt.Sandbox) rt.Sandbox

	fail atomic.Bool // create with a layer whose file does not exist
	// gate, if set, holds every create until it is closed or the
	// create's context ends.
	gate    chan struct{}
	mu      sync.Mutex
	ids     []string
	all     []rt.Sandbox // every sandbox created, unwrapped
	calls   []time.Time
	created atomic.Int64
}

func newCreator(t *testing.T, m mode) *creator {
	name := strings.NewReplacer("/", "-", "_", "-").Replace(t.Name())
	c := &creator{e: newEnv(t), prefix: strings.ToLower(name)}
	if !m.reset {
		c.wrap = func(sb rt.Sandbox) rt.Sandbox { return &plain{sb} }
	}
	return c
}

func (c *creator) New(ctx context.Context) (rt.Sandbox, error) {
	if c.gate != nil {
		select {
		case <-c.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	spec := c.e.spec(c.prefix)
	if c.fail.Load() {
		spec.Layers = []rt.Layer{{Digest: c.e.layer.Digest, Path: c.e.layer.Path + ".missing"}}
	}
	c.mu.Lock()
	c.calls = append(c.calls, time.Now())
	c.mu.Unlock()
	sb, err := c.e.backend.Create(ctx, spec)
	if err != nil {
		return nil, err
	}
	c.created.Add(1)
	c.mu.Lock()
	c.ids = append(c.ids, sb.ID())
	c.all = append(c.all, sb)
	c.mu.Unlock()
	if c.wrap != nil {
		return c.wrap(sb), nil
	}
	return sb, nil
}

func (c *creator) createdIDs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.ids...)
}

// logRecorder is a slog handler that keeps records for assertions (t.Log
// is not safe once a test has ended).
type logRecorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	l.records = append(l.records, r.Clone())
	l.mu.Unlock()
	return nil
}
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

// count returns how many records at level have a message containing msg.
func (l *logRecorder) count(level slog.Level, msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.records {
		if r.Level == level && strings.Contains(r.Message, msg) {
			n++
		}
	}
	return n
}

// startPool starts a pool whose New is c's, and registers its Close and a
// leak check (no process, cgroup or state file of any of its sandboxes
// left) to run when the test ends.
func startPool(t *testing.T, c *creator, o pool.Options) (*pool.Pool, *logRecorder) {
	t.Helper()
	leaks := testsuite.HostLeaks(c.e.backend.CgroupDirs(), []string{c.e.backend.StateDir()})
	before := leaks(t)
	rec := &logRecorder{}
	o.New = c.New
	if o.Logger == nil {
		o.Logger = slog.New(rec)
	}
	p := pool.New(o)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := p.Close(ctx); err != nil {
			t.Errorf("close: %v", err)
		}
		if t.Failed() {
			// A test that stopped half-way still holds sandboxes the pool
			// leaves to their takers: destroy them (Destroy is idempotent)
			// so that one failure does not leak into the host.
			c.mu.Lock()
			all := append([]rt.Sandbox(nil), c.all...)
			c.mu.Unlock()
			for _, sb := range all {
				sb.Destroy(context.Background())
			}
		}
		expectNoLeaks(t, leaks, before)
		// Tests do not run in parallel: no goroutine of any pool is left.
		var stacks string
		if !poll(t, 30*time.Second, func() bool {
			buf := make([]byte, 1<<20)
			stacks = string(buf[:runtime.Stack(buf, true)])
			return !strings.Contains(stacks, "internal/pool.(*Pool)")
		}) {
			t.Errorf("pool goroutines left after Close:\n%s", stacks)
		}
	})
	return p, rec
}

func expectNoLeaks(t *testing.T, leaks func(*testing.T) testsuite.Snapshot, before testsuite.Snapshot) {
	t.Helper()
	var leaked []string
	if !poll(t, 30*time.Second, func() bool {
		leaked = leaks(t).Leaked(before)
		return len(leaked) == 0
	}) {
		t.Errorf("%d leaked host resources:\n  %s", len(leaked), strings.Join(leaked, "\n  "))
	}
}

// poll waits until cond holds, for at most bound (a bound on a hang, not a
// speed assertion).
func poll(t *testing.T, bound time.Duration, cond func() bool) bool {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			return cond()
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// waitStats polls until cond holds of the pool's stats or fails the test.
func waitStats(t *testing.T, p *pool.Pool, what string, cond func(pool.Stats) bool) pool.Stats {
	t.Helper()
	var st pool.Stats
	if !poll(t, time.Minute, func() bool { st = p.Stats(); return cond(st) }) {
		t.Fatalf("waiting for %s: stats %+v", what, st)
	}
	return st
}

// echo runs a command in sb and checks that it worked: the sandbox is live.
func echo(t *testing.T, sb rt.Sandbox, word string) {
	t.Helper()
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Shell: "echo " + word}, nil)
	if err != nil || res.ExitCode != 0 || string(res.Stdout) != word+"\n" {
		t.Fatalf("exec in %s: %v %+v", sb.ID(), err, res)
	}
}

// sh runs a command in sb and returns its stdout; a failure is fatal.
func sh(t *testing.T, sb rt.Sandbox, cmd string) string {
	t.Helper()
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Shell: cmd}, nil)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%q in %s: %v exit %d stderr %q", cmd, sb.ID(), err, res.ExitCode, res.Stderr)
	}
	return string(res.Stdout)
}

func isCtxErr(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}
