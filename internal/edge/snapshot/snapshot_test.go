package snapshot_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/edge/snapshot"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/memback"
	dsectest "github.com/dsec-dev/dsec/internal/testutil"
)

// vmSandbox is a memback sandbox changed as a guest would change its disk:
// a base file removed, a base directory made again (opaque), a new file.
func vmSandbox(t *testing.T) runtime.Sandbox {
	t.Helper()
	b, err := memback.New(memback.Options{Kind: runtime.KindMicroVM, Base: map[string]string{
		"/etc/hosts": "h", "/etc/keep": "k", "/opt/d/old": "o",
	}})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := b.Create(t.Context(), runtime.Spec{ID: "vm1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(context.Background()) })
	res, err := sb.Exec(t.Context(), runtime.ExecRequest{Shell: "rm /etc/hosts; rm -r /opt/d; mkdir /opt/d; write /opt/d/new n; write /data/note hello"}, nil)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("change the sandbox: %v %+v", err, res)
	}
	return sb
}

// TestWritableLayerFromDiffArchiver: a DiffArchiver's stream is unpacked
// into overlayfs form (whiteout devices, opaque xattr), handed to fn, and
// removed after; the sandbox is left as it was (not frozen by the edge).
func TestWritableLayerFromDiffArchiver(t *testing.T) {
	dsectest.RequireRoot(t) // whiteouts are device nodes
	root := t.TempDir()
	s, err := snapshot.Open(filepath.Join(root, "ck"), nil)
	if err != nil {
		t.Fatal(err)
	}
	sb := vmSandbox(t)
	var seen string
	err = s.WithWritableLayer(t.Context(), "vm1", sb, false, func(dir string) error {
		seen = dir
		if b, err := os.ReadFile(filepath.Join(dir, "data/note")); err != nil || string(b) != "hello" {
			t.Errorf("data/note: %q %v", b, err)
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(dir, "etc/hosts"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
			t.Errorf("etc/hosts is not a 0:0 whiteout device: %+v %v", st, err)
		}
		if _, err := os.Lstat(filepath.Join(dir, "etc/keep")); !os.IsNotExist(err) {
			t.Errorf("an unchanged base file is in the diff: %v", err)
		}
		buf := make([]byte, 8)
		n, err := unix.Lgetxattr(filepath.Join(dir, "opt/d"), "trusted.overlay.opaque", buf)
		if err != nil || string(buf[:n]) != "y" {
			t.Errorf("opt/d is not opaque: %q %v", buf[:n], err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(seen); !os.IsNotExist(err) {
		t.Fatalf("the unpacked layer %s was left behind: %v", seen, err)
	}
	if sb.(*memback.Sandbox).Frozen() {
		t.Fatal("the sandbox was left frozen")
	}
}

// notPackable hides every optional interface of a sandbox.
type notPackable struct{ runtime.Sandbox }

// TestCheckpointsOverDiffArchiver: a checkpoint of a DiffArchiver holds
// its diff as a directory layer on top of the sandbox's stack; the layer
// stays while a checkpoint or a sandbox running on it uses it, and goes
// with the last user. A sandbox that cannot hand its layer over is
// Unimplemented.
func TestCheckpointsOverDiffArchiver(t *testing.T) {
	dsectest.RequireRoot(t)
	s, err := snapshot.Open(filepath.Join(t.TempDir(), "ck"), nil)
	if err != nil {
		t.Fatal(err)
	}
	sb := vmSandbox(t)
	base := []runtime.Layer{{Digest: "sha256:" + strings.Repeat("0", 64), Path: "/nonexistent/base"}}
	ck, digest, err := s.Take(t.Context(), "vm1", sb, false, base)
	if err != nil {
		t.Fatal(err)
	}
	top := ck.Stack[len(ck.Stack)-1]
	if len(ck.Stack) != 2 || top.Digest != digest || !s.IsLocal(top) || s.IsLocal(ck.Stack[0]) {
		t.Fatalf("checkpoint stack %+v (digest %s)", ck.Stack, digest)
	}
	if b, err := os.ReadFile(filepath.Join(top.Path, "data/note")); err != nil || string(b) != "hello" {
		t.Fatalf("checkpoint layer data/note: %q %v", b, err)
	}
	// A rollback runs a sandbox on the stack: it holds the layer past the
	// checkpoint's deletion.
	held, err := s.Acquire("vm1", ck.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.Hold(held.Stack)
	s.Release(held)
	if _, err := s.Acquire("other", ck.ID); !fail.Is(err, fail.NotFound) {
		t.Fatalf("another sandbox's checkpoint: %v, want NotFound", err)
	}
	if err := s.Delete("vm1", ck.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("vm1", ck.ID); !fail.Is(err, fail.NotFound) {
		t.Fatalf("second delete: %v, want NotFound", err)
	}
	if _, err := os.Stat(top.Path); err != nil {
		t.Fatalf("a layer a sandbox runs on went with its checkpoint: %v", err)
	}
	s.Drop(held.Stack)()
	if _, err := os.Stat(top.Path); !os.IsNotExist(err) {
		t.Fatalf("an unused checkpoint layer stayed: %v", err)
	}
	if cks, layers := s.Count(); cks != 0 || layers != 0 {
		t.Fatalf("store holds %d checkpoints and %d layers, want none", cks, layers)
	}

	err = s.WithWritableLayer(t.Context(), "vm1", notPackable{sb}, false, func(string) error { return nil })
	if !fail.Is(err, fail.Unimplemented) || snapshot.CanPack(notPackable{sb}) {
		t.Fatalf("a sandbox with neither Differ nor DiffArchiver: %v, want Unimplemented", err)
	}
}
