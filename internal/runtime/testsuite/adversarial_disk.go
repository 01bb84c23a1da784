package testsuite

import (
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// Capabilities of the writable-layer limit (Resources.DiskBytes).
const (
	// DiskLimit: Resources.DiskBytes bounds what a sandbox can write over
	// its image, and a command that fails for lack of it says DiskFull.
	DiskLimit Capability = "disk-limit"
	// DiskStatfs: statfs (df) of the root inside reports the limit.
	DiskStatfs Capability = "disk-statfs"
)

func init() {
	adversarialCases = append(adversarialCases, advCase{"disk-fill", (*suite).testDiskFill})
}

// diskLimit is the fill attack's sandbox's writable-layer limit.
const diskLimit = 32 << 20

// testDiskFill: a sandbox with a 32 MiB writable layer tries to write
// 1 GiB. The write must fail with ENOSPC or EDQUOT, the command's result
// must be a failure that says DiskFull (never an infrastructure error),
// the sandbox must stay usable, deleting the file must give the space
// back, and the host must not have lost more than the limit. A full
// sandbox can be reset, and the limit holds after it.
func (s *suite) testDiskFill(t *testing.T) {
	s.need(t, DiskLimit)
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.DiskBytes = diskLimit })
	hostBefore := hostFree(t)

	fill := func(what string) {
		t.Helper()
		res := s.exec(t, sb, runtime.ExecRequest{Shell: "dd if=/dev/zero of=/fill bs=1M count=1024"})
		stderr := string(res.Stderr)
		if res.ExitCode == 0 || !strings.Contains(stderr, "No space left") && !strings.Contains(stderr, "quota exceeded") {
			t.Fatalf("%s: writing 1 GiB into a %d MiB writable layer: want a failure with ENOSPC or EDQUOT, got %s\nstderr: %s",
				what, diskLimit>>20, resultSummary(res), clip(res.Stderr))
		}
		t.Logf("%s: %s disk_full=%v stderr %q", what, resultSummary(res), res.DiskFull, clip(res.Stderr))
		if !res.DiskFull {
			t.Errorf("%s: the failed fill's result does not say DiskFull (%s)", what, resultSummary(res))
		}
		size := s.sh(t, sb, "stat -c %s /fill")
		if n, err := strconv.ParseInt(strings.TrimSpace(size), 10, 64); err != nil || n > diskLimit || n < diskLimit/2 {
			t.Errorf("%s: the fill stopped at %s bytes, want at most the %d MiB limit and more than half of it", what, strings.TrimSpace(size), diskLimit>>20)
		}
	}
	fill("fill")

	// The sandbox works: a command runs, and a small write that is not
	// refused by a full layer is not reported as one.
	if out := s.sh(t, sb, "echo alive"); out != "alive\n" {
		t.Fatalf("after the fill: %q", out)
	}
	res := s.exec(t, sb, runtime.ExecRequest{Shell: "exit 3"})
	if res.ExitCode != 3 {
		t.Fatalf("exit 3 after the fill: %s", resultSummary(res))
	}
	if !res.DiskFull {
		// Still full: a failing command is reported as possibly out of
		// space. Acceptable either way; only the fill's result is required.
		t.Logf("a failing command while the layer is full: DiskFull %v", res.DiskFull)
	}

	if hostLost := hostBefore - hostFree(t); hostLost > 512<<20 {
		t.Errorf("the host's free space fell by %d MiB while a sandbox limited to %d MiB tried to write 1 GiB", hostLost>>20, diskLimit>>20)
	}

	if _, lacks := s.h.Lacks[DiskStatfs]; !lacks {
		out := s.sh(t, sb, "df -k / | tail -n 1")
		f := strings.Fields(out)
		if len(f) < 2 {
			t.Fatalf("df -k /: %q", out)
		}
		if kb, err := strconv.ParseInt(f[1], 10, 64); err != nil || kb > diskLimit>>10 {
			t.Errorf("df inside reports %s KiB for /, want at most the %d KiB limit", f[1], diskLimit>>10)
		}
	}

	// A full sandbox can still be reset (a Reset that failed would have
	// the sandbox destroyed: any workload could force a cold create), and
	// the limit holds after it.
	if r, ok := sb.(runtime.Resetter); ok {
		if err := r.Reset(s.ctx(t)); err != nil {
			t.Fatalf("Reset of a sandbox whose writable layer is full: %v", err)
		}
		fill("fill after a Reset")
	}

	// Deleting the file gives the space back.
	s.sh(t, sb, "rm /fill && dd if=/dev/zero of=/again bs=1M count=16 2>&1 && rm /again")
}

// hostFree is the free space of the file system holding the host's root.
func hostFree(t *testing.T) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}
