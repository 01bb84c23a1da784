package edge

import (
	"log/slog"
	"strings"
	"syscall"
	"testing"

	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
)

func TestFDBoundedSandboxes(t *testing.T) {
	for _, tc := range []struct {
		limit uint64
		want  int64
	}{
		{0, 0}, {1024, (1024 - 256) / fdsPerSandbox}, {4096, (4096 - fdReserve) / fdsPerSandbox},
		{20000, (20000 - fdReserve) / fdsPerSandbox}, {1 << 20, (1<<20 - fdReserve) / fdsPerSandbox},
		// This host's hard limit (root cannot raise it): issue 14's
		// 3,000 sandboxes a node fit, with room.
		{20000, 4744},
	} {
		if got := fdBoundedSandboxes(tc.limit); got != tc.want {
			t.Errorf("fdBoundedSandboxes(%d) = %d, want %d", tc.limit, got, tc.want)
		}
	}
}

// TestCapacityBoundByOpenFiles lowers this process's open-file limit for
// a moment: a default capacity above what it holds is lowered to it, one
// the operator set above it is refused with an error that says what to
// change, and one below it is kept.
func TestCapacityBoundByOpenFiles(t *testing.T) {
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	low := syscall.Rlimit{Cur: 2048, Max: old.Max}
	if old.Cur < low.Cur {
		t.Skipf("the open-file limit is already %d", old.Cur)
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	defer syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old)
	most := fdBoundedSandboxes(low.Cur)
	log := slog.New(slog.DiscardHandler)
	ct := runtime.KindContainer

	caps := map[runtime.Kind]placement.Capacity{ct: {Sandboxes: DefaultMaxSandboxes}}
	if err := boundByOpenFiles(caps, nil, log); err != nil || caps[ct].Sandboxes != most {
		t.Fatalf("default capacity: %v, %d sandboxes; want %d", err, caps[ct].Sandboxes, most)
	}

	given := map[runtime.Kind]placement.Capacity{ct: {Sandboxes: most + 1}}
	caps = map[runtime.Kind]placement.Capacity{ct: given[ct]}
	err := boundByOpenFiles(caps, given, log)
	if err == nil || !strings.Contains(err.Error(), "RLIMIT_NOFILE 2048") || !strings.Contains(err.Error(), "--max-sandboxes") {
		t.Fatalf("a capacity set above the limit: %v; want an error naming RLIMIT_NOFILE and --max-sandboxes", err)
	}

	given = map[runtime.Kind]placement.Capacity{ct: {Sandboxes: most}}
	caps = map[runtime.Kind]placement.Capacity{ct: given[ct]}
	if err := boundByOpenFiles(caps, given, log); err != nil || caps[ct].Sandboxes != most {
		t.Fatalf("a capacity the limit holds: %v, %d sandboxes", err, caps[ct].Sandboxes)
	}
}
