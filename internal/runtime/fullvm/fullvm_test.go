package fullvm_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fullvm"
)

func create(t *testing.T, spec runtime.Spec) *fullvm.Sandbox {
	t.Helper()
	b, _ := backend(t)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	sb, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create(%q): %v", spec.ID, err)
	}
	t.Cleanup(func() {
		if err := sb.Destroy(context.Background()); err != nil {
			t.Errorf("Destroy(%q): %v", spec.ID, err)
		}
	})
	return sb.(*fullvm.Sandbox)
}

func sh(t *testing.T, sb runtime.Sandbox, script string) string {
	t.Helper()
	res, err := sb.Exec(t.Context(), runtime.ExecRequest{Shell: script}, nil)
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d: %s%s", script, res.ExitCode, res.Stdout, res.Stderr)
	}
	return string(res.Stdout)
}

// TestRestoredSandboxesDiffer: two sandboxes restored from one boot
// template are different machines where it matters: their own hostname,
// the host's clock (not the template's), different random numbers, and
// their own disk.
func TestRestoredSandboxesDiffer(t *testing.T) {
	// The first create makes the template; the next two restore it.
	create(t, newSpec(t))
	a, b := create(t, newSpec(t)), create(t, newSpec(t))
	for _, sb := range []*fullvm.Sandbox{a, b} {
		if got := strings.TrimSpace(sh(t, sb, "hostname")); got != sb.ID() {
			t.Errorf("hostname of %s: %q", sb.ID(), got)
		}
		secs, err := strconv.ParseInt(strings.TrimSpace(sh(t, sb, "date +%s")), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if d := time.Since(time.Unix(secs, 0)); d < -time.Minute || d > time.Minute {
			t.Errorf("clock of %s is %v off the host's", sb.ID(), d)
		}
	}
	ra, rb := sh(t, a, "head -c 32 /dev/urandom | od -An -tx1"), sh(t, b, "head -c 32 /dev/urandom | od -An -tx1")
	if ra == rb {
		t.Errorf("two restored sandboxes read the same random bytes: %s", ra)
	}
	sh(t, a, "echo mine > /root/file && sync")
	if out := sh(t, b, "cat /root/file 2>/dev/null || echo none"); strings.TrimSpace(out) != "none" {
		t.Errorf("a file written in one sandbox shows in another: %q", out)
	}
}

// TestDestroyLeavesNothing: after destroy no QEMU of the sandbox runs and
// its directory (overlay, sockets, console log) is gone.
func TestDestroyLeavesNothing(t *testing.T) {
	b, _ := backend(t)
	sb, err := b.Create(t.Context(), newSpec(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := sb.Destroy(t.Context()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sb.Done():
	default:
		t.Error("QEMU still runs after Destroy")
	}
	ents, err := os.ReadDir(sandboxDir())
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		t.Errorf("sandbox directories left after destroy: %v", ents)
	}
	if err := sb.Destroy(t.Context()); err != nil {
		t.Errorf("second Destroy: %v", err)
	}
}
