package fullvm_test

import (
	"bytes"
	"context"
	"image"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// TestDisplay: a screenshot of a booted guest is a PNG of its text
// console (720x400: 80x25 characters of 9x16 pixels), and typing on the
// keyboard changes what it shows: the login prompt on tty1 echoes what is
// typed. The text typed lands on the console's line, which the guest's
// own view of tty1 (its screen dump through /dev/vcs1) confirms.
func TestDisplay(t *testing.T) {
	sb := create(t, newSpec(t))
	ctx := t.Context()
	before := screenshot(t, sb)
	if b := before.Bounds(); b.Dx() != 720 || b.Dy() != 400 {
		t.Fatalf("screenshot is %dx%d, want the 720x400 text console", b.Dx(), b.Dy())
	}
	const typed = "Dsec-42"
	if err := sb.Input(ctx, []runtime.InputEvent{{Kind: runtime.InputText, Text: typed}}); err != nil {
		t.Fatal(err)
	}
	// The guest's own copy of tty1's screen shows the text once the
	// console has drawn it; wait for that, not for a time.
	waitFor(t, ctx, func() bool {
		return strings.Contains(sh(t, sb, "cat /dev/vcs1"), typed)
	})
	after := screenshot(t, sb)
	if samePixels(before, after) {
		t.Error("the screen did not change after typing on the keyboard")
	}
	// A key chord and pointer events go through too; bad ones are refused.
	if err := sb.Input(ctx, []runtime.InputEvent{
		{Kind: runtime.InputKey, Key: "ctrl-u"},
		{Kind: runtime.InputMove, X: 10, Y: 10},
		{Kind: runtime.InputClick, X: 719, Y: 399, Button: "right"},
	}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []runtime.InputEvent{
		{Kind: runtime.InputText, Text: "é"},
		{Kind: runtime.InputKey, Key: "Ctrl-A"},
		{Kind: runtime.InputClick, X: 720, Y: 0},
		{Kind: runtime.InputClick, X: 1, Y: 1, Button: "fourth"},
		{Kind: "wave"},
	} {
		if err := sb.Input(ctx, []runtime.InputEvent{bad}); err == nil {
			t.Errorf("Input(%+v) was accepted", bad)
		}
	}
}

func screenshot(t *testing.T, sb runtime.Display) image.Image {
	t.Helper()
	b, err := sb.Screenshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("screenshot is not a PNG: %v", err)
	}
	return img
}

func samePixels(a, b image.Image) bool {
	if a.Bounds() != b.Bounds() {
		return false
	}
	for y := a.Bounds().Min.Y; y < a.Bounds().Max.Y; y++ {
		for x := a.Bounds().Min.X; x < a.Bounds().Max.X; x++ {
			if a.At(x, y) != b.At(x, y) {
				return false
			}
		}
	}
	return true
}

// waitFor polls cond until it holds or the test's context ends: what it
// waits on happens in the guest, which says nothing when it is done.
func waitFor(t *testing.T, ctx context.Context, cond func() bool) {
	t.Helper()
	for !cond() {
		if ctx.Err() != nil {
			t.Fatal("condition never held")
		}
	}
}

// TestSnapshotDisk: a sandbox's disk written out as a new image boots
// as a sandbox of its own, which finds the file written before the
// snapshot; the source sandbox runs on.
func TestSnapshotDisk(t *testing.T) {
	b, _ := backend(t)
	src := create(t, newSpec(t))
	sh(t, src, "echo before-snapshot > /root/marker")
	out := filepath.Join(t.TempDir(), "snap.qcow2")
	if err := src.SnapshotDisk(t.Context(), out); err != nil {
		t.Fatal(err)
	}
	sh(t, src, "echo after-snapshot > /root/marker")
	digest, err := fileDigest(out)
	if err != nil {
		t.Fatal(err)
	}
	spec := newSpec(t)
	spec.Layers = []runtime.Layer{{Digest: digest, Path: out}}
	ctx, cancel := context.WithTimeout(t.Context(), b.BootTimeout())
	defer cancel()
	sb, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(context.Background()) })
	if got := strings.TrimSpace(sh(t, sb, "cat /root/marker")); got != "before-snapshot" {
		t.Errorf("/root/marker in a sandbox of the snapshot: %q, want before-snapshot", got)
	}
	if info, err := os.Stat(out); err != nil || info.Size() == 0 {
		t.Errorf("snapshot file: %v", err)
	}
}
