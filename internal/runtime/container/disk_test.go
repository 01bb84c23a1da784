package container_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
)

// writes reports whether the sandbox can write a file of mib MiB over its
// image, and whether a failed write's result said DiskFull.
func writes(t *testing.T, sb rt.Sandbox, name string, mib int) (ok, full bool) {
	t.Helper()
	res, err := sb.Exec(context.Background(), rt.ExecRequest{
		Shell: fmt.Sprintf("dd if=/dev/zero of=/%s bs=1M count=%d", name, mib)}, nil)
	if err != nil {
		t.Fatalf("write %d MiB: %v", mib, err)
	}
	return res.ExitCode == 0, res.DiskFull
}

func needScratch(t *testing.T, e *env) {
	if e.scratch == nil {
		t.Skip("DSEC_TEST_SCRATCH=off")
	}
}

// TestDiskLimitRebaseAndWarm: a sandbox from a warm agent (made with the
// default limit) gets its spec's limit, a Rebase sets the new spec's in
// both directions, and the writable layer stays where snapshots read it.
func TestDiskLimitRebaseAndWarm(t *testing.T) {
	e := newEnv(t, 1)
	needScratch(t, e)
	ctx := context.Background()
	// Wait for the warm agent, so that the create takes it.
	deadline := time.Now().Add(time.Minute)
	for container.WarmReady(e.backend) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no warm agent started")
		}
		time.Sleep(10 * time.Millisecond)
	}
	spec := e.newSpec()
	spec.Resources.DiskBytes = 16 << 20
	sb, err := e.backend.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	if ok, full := writes(t, sb, "a", 24); ok || !full {
		t.Fatalf("24 MiB in a 16 MiB layer: written %v, disk full %v", ok, full)
	}
	// Snapshots and checkpoints read the upper directory by its host path.
	if _, err := os.Stat(filepath.Join(sb.(rt.Differ).UpperDir(), "a")); err != nil {
		t.Fatalf("the written file is not in the upper directory on the host: %v", err)
	}
	r := sb.(rt.Rebaser)
	for _, c := range []struct {
		limit   int64
		mib     int
		fits    bool
		comment string
	}{
		// The old root's files count until they are removed in the
		// background: 40 MiB fit beside the 16 written before.
		{64 << 20, 40, true, "raised to 64 MiB"},
		{16 << 20, 24, false, "lowered to 16 MiB"},
		{0, 48, true, "the default (10 GiB)"},
	} {
		if err := r.Quiesce(ctx); err != nil {
			t.Fatal(err)
		}
		next := e.newSpec()
		next.Resources.DiskBytes = c.limit
		if err := r.Rebase(ctx, next); err != nil {
			t.Fatal(err)
		}
		if ok, full := writes(t, sb, "b", c.mib); ok != c.fits || full == c.fits {
			t.Fatalf("rebased, %s: %d MiB written %v (want %v), disk full %v", c.comment, c.mib, ok, c.fits, full)
		}
	}
}

// TestDiskLimitInvalid: a negative or tiny limit is the caller's error,
// named, and leaves nothing behind.
func TestDiskLimitInvalid(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	for _, n := range []int64{-1, 1, 1 << 20} {
		spec := e.newSpec()
		spec.Resources.DiskBytes = n
		if sb, err := e.backend.Create(ctx, spec); !errors.Is(err, rt.ErrInvalidSpec) {
			if sb != nil {
				sb.Destroy(ctx)
			}
			t.Errorf("disk_bytes %d: %v, want ErrInvalidSpec", n, err)
		}
	}
	sb := e.create(t)
	if err := sb.(rt.Updater).Update(ctx, rt.Resources{DiskBytes: -5}); !errors.Is(err, rt.ErrInvalidSpec) {
		t.Errorf("Update with disk_bytes -5: %v, want ErrInvalidSpec", err)
	}
	if entries, _ := os.ReadDir(e.backend.StateDir()); len(entries) != 1 {
		t.Errorf("state dir holds %d entries, want the one live sandbox's", len(entries))
	}
}

// BenchmarkResetWritten is BenchmarkReset for a user who wrote a file:
// every Reset takes the full path, a new root over a fresh upper (on the
// scratch file system, a new volume; DSEC_TEST_SCRATCH=off compares with
// plain directories on the host's file system).
func BenchmarkResetWritten(b *testing.B) {
	e := newEnv(b, 0)
	ctx := context.Background()
	sb := e.create(b)
	r := sb.(rt.Resetter)
	var spent time.Duration
	for b.Loop() {
		res, err := sb.Exec(ctx, rt.ExecRequest{Shell: "echo x > /written"}, nil)
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("write: %v %+v", err, res)
		}
		start := time.Now()
		if err := r.Reset(ctx); err != nil {
			b.Fatal(err)
		}
		spent += time.Since(start)
	}
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "reset-ns/op")
}
