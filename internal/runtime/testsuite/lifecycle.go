package testsuite

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testLifecycle(t *testing.T) {
	t.Run("id", s.testID)
	t.Run("destroy", s.testDestroy)
	t.Run("freeze-thaw", s.testFreezeThaw)
	t.Run("destroy-frozen", s.testDestroyFrozen)
}

// cpuTicks reads a process's user+system CPU time (clock ticks) in the
// sandbox from /proc/PID/stat.
func (s *suite) cpuTicks(t *testing.T, sb runtime.Sandbox, pid string) int64 {
	t.Helper()
	out := s.sh(t, sb, "cat /proc/"+pid+"/stat")
	// Fields after the parenthesised command: state is field 3, utime 14, stime 15.
	f := strings.Fields(out[strings.LastIndexByte(out, ')')+1:])
	if len(f) < 13 {
		t.Fatalf("unexpected /proc/%s/stat: %q", pid, out)
	}
	var u, st int64
	if _, err := fmt.Sscan(f[11], &u); err != nil {
		t.Fatalf("utime of %q: %v", out, err)
	}
	if _, err := fmt.Sscan(f[12], &st); err != nil {
		t.Fatalf("stime of %q: %v", out, err)
	}
	return u + st
}

// testFreezeThaw runs a busy loop, freezes the sandbox for a while and
// checks that the loop got no CPU while frozen and gets it again after.
func (s *suite) testFreezeThaw(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	pid := strings.TrimSpace(s.sh(t, sb, "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!"))
	interval := 700 * time.Millisecond
	if s.h.FreezeInterval > 0 {
		interval = s.h.FreezeInterval
	}
	time.Sleep(100 * time.Millisecond)
	before := s.cpuTicks(t, sb, pid)
	if err := sb.Freeze(ctx); err != nil {
		t.Fatalf("freeze: %v", err)
	}
	if err := sb.Freeze(ctx); err != nil {
		t.Fatalf("freeze of a frozen sandbox: %v", err)
	}
	time.Sleep(interval)
	if err := sb.Thaw(ctx); err != nil {
		t.Fatalf("thaw: %v", err)
	}
	frozen := s.cpuTicks(t, sb, pid) - before
	time.Sleep(interval)
	running := s.cpuTicks(t, sb, pid) - before - frozen
	// Frozen, the loop can only run in the moments around the freeze and
	// the thaw; running, it takes a good part of a core for the interval.
	if running <= 0 || frozen*3 > running {
		t.Fatalf("busy loop got %d ticks across a %v freeze and %d ticks in %v running", frozen, interval, running, interval)
	}
	if err := sb.Thaw(ctx); err != nil {
		t.Fatalf("thaw of a thawed sandbox: %v", err)
	}
}

// testDestroyFrozen checks that a frozen sandbox can be destroyed.
func (s *suite) testDestroyFrozen(t *testing.T) {
	sb := s.create(t, nil)
	s.sh(t, sb, "sleep 1000 >/dev/null 2>&1 &")
	if err := sb.Freeze(s.ctx(t)); err != nil {
		t.Fatalf("freeze: %v", err)
	}
	if err := sb.Destroy(s.ctx(t)); err != nil {
		t.Fatalf("destroy a frozen sandbox: %v", err)
	}
	select {
	case <-sb.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("a destroyed frozen sandbox's init did not exit")
	}
}

func (s *suite) testID(t *testing.T) {
	spec := s.h.NewSpec(t)
	sb := s.createSpec(t, spec)
	if sb.ID() != spec.ID {
		t.Errorf("ID() = %q, want the spec's %q", sb.ID(), spec.ID)
	}
}

func (s *suite) testDestroy(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	select {
	case <-sb.Done():
		t.Fatal("Done() is closed while the sandbox is live")
	default:
	}
	s.sh(t, sb, "true")

	// Two concurrent destroys, then a third: all succeed.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = sb.Destroy(ctx)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("concurrent Destroy #%d: %v", i, err)
		}
	}
	if err := sb.Destroy(ctx); err != nil {
		t.Errorf("Destroy of a destroyed sandbox: %v", err)
	}

	// Init is dead once Destroy returns; Done may be closed by the goroutine
	// that reaps it, so allow that goroutine a bounded moment.
	select {
	case <-sb.Done():
	case <-time.After(10 * time.Second):
		t.Errorf("Done() not closed after Destroy")
	}

	ops := map[string]func() error{
		"Exec": func() error {
			_, err := sb.Exec(ctx, runtime.ExecRequest{Shell: "true"}, nil)
			return err
		},
		"WriteFile": func() error { return sb.WriteFile(ctx, "/tmp/x", []byte("x"), 0o644) },
		"ReadFile": func() error {
			_, err := sb.ReadFile(ctx, "/etc/passwd", 1<<20)
			return err
		},
		"PutArchive": func() error { return sb.PutArchive(ctx, "/tmp", bytes.NewReader(nil)) },
		"GetArchive": func() error { return sb.GetArchive(ctx, "/tmp", io.Discard) },
	}
	for name, op := range ops {
		if err := op(); !isGone(err) {
			t.Errorf("%s after Destroy: %v; want an error wrapping runtime.ErrSandboxGone", name, err)
		}
	}
}

func (s *suite) testInvalidSpec(t *testing.T) {
	notEROFS := filepath.Join(t.TempDir(), "not-erofs")
	if err := os.WriteFile(notEROFS, bytes.Repeat([]byte("not an erofs image\n"), 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		// mutate breaks a valid spec.
		mutate func(*runtime.Spec)
		// invalid: the error must wrap runtime.ErrInvalidSpec (checkable
		// without touching the host); otherwise any error will do.
		invalid bool
	}{
		{"empty-id", func(sp *runtime.Spec) { sp.ID = "" }, true},
		{"id-with-slash", func(sp *runtime.Spec) { sp.ID = "a/b" }, true},
		{"id-dot-dot", func(sp *runtime.Spec) { sp.ID = ".." }, true},
		{"id-traversal", func(sp *runtime.Spec) { sp.ID = "../../dsec-escape" }, true},
		{"no-layers", func(sp *runtime.Spec) { sp.Layers = nil }, true},
		{"negative-memory", func(sp *runtime.Spec) { sp.Resources.MemoryBytes = -1 }, true},
		{"negative-cpu", func(sp *runtime.Spec) { sp.Resources.MilliCPU = -1 }, true},
		{"negative-pids", func(sp *runtime.Spec) { sp.Resources.Pids = -1 }, true},
		{"missing-layer-file", func(sp *runtime.Spec) {
			sp.Layers = []runtime.Layer{{Digest: "sha256:" + strings.Repeat("0", 64), Path: "/nonexistent/dsec/layer.erofs"}}
		}, false},
		// Good layers first: the backend has set part of the sandbox up when
		// the bad top layer fails, and must undo it.
		{"bad-top-layer", func(sp *runtime.Spec) {
			sp.Layers = append(sp.Layers, runtime.Layer{Digest: "sha256:" + strings.Repeat("1", 64), Path: notEROFS})
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before Snapshot
			if s.h.Leaks != nil {
				before = s.h.Leaks(t)
			}
			spec := s.h.NewSpec(t)
			tc.mutate(&spec)
			sb, err := s.h.Backend.Create(s.ctx(t), spec)
			if sb != nil {
				s.destroy(t, sb)
			}
			switch {
			case err == nil:
				t.Fatalf("Create with %s succeeded", tc.name)
			case tc.invalid && !errors.Is(err, runtime.ErrInvalidSpec):
				t.Errorf("Create with %s: %v; want an error wrapping runtime.ErrInvalidSpec", tc.name, err)
			}
			t.Logf("Create with %s: %v", tc.name, err)
			if s.h.Leaks != nil {
				s.expectNoLeaks(t, before)
			}
		})
	}

	// The ID of a live sandbox is taken; refusing it must leave the live
	// sandbox intact (a careless rollback would tear down its resources).
	t.Run("duplicate-id", func(t *testing.T) {
		spec := s.h.NewSpec(t)
		live := s.createSpec(t, spec)
		s.sh(t, live, "echo alive > /tmp/alive")
		var before Snapshot
		if s.h.Leaks != nil {
			before = s.h.Leaks(t)
		}
		dup, err := s.h.Backend.Create(s.ctx(t), spec)
		if dup != nil {
			// Destroying the duplicate could tear the live one down; that is
			// part of what the checks below catch.
			s.destroy(t, dup)
		}
		if err == nil {
			t.Errorf("Create with the ID of a live sandbox %q succeeded", spec.ID)
		}
		if got := s.sh(t, live, "cat /tmp/alive"); got != "alive\n" {
			t.Errorf("live sandbox after a refused duplicate create: /tmp/alive = %q", got)
		}
		if s.h.Leaks != nil {
			s.expectNoLeaks(t, before)
		}
	})
}
