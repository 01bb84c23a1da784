package scratchfs_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/runtime/container/scratchfs"
	"github.com/dsec-dev/dsec/internal/testutil"
)

func open(t *testing.T, size int64) (*scratchfs.FS, string) {
	t.Helper()
	testutil.RequireRoot(t)
	if _, err := exec.LookPath("mkfs.btrfs"); err != nil {
		t.Skip("mkfs.btrfs not installed (scripts/deps.sh installs btrfs-progs)")
	}
	root := t.TempDir()
	fs, err := scratchfs.Open(scratchfs.Options{Image: filepath.Join(root, "scratch.img"), Dir: filepath.Join(root, "sandboxes"), Size: size})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fs.Close() })
	return fs, root
}

// fill writes a file of up to n bytes in 1 MiB writes and returns how
// much was written and the error that stopped it.
func fill(path string, n int64) (int64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i*7 + 1) // not zeros: nothing may be stored sparsely
	}
	var done int64
	for done < n {
		k, err := f.Write(buf)
		done += int64(k)
		if err != nil {
			return done, err
		}
	}
	return done, f.Sync()
}

func TestLimitHolds(t *testing.T) {
	fs, _ := open(t, 1<<30)
	v, err := fs.NewVolume(filepath.Join(fs.Dir(), "a"), 32<<20)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(v.Path); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("volume dir: %v %v", st, err)
	}
	n, err := fill(filepath.Join(v.Path, "f"), 64<<20)
	if !errors.Is(err, syscall.EDQUOT) && !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("wrote %d bytes of 64 MiB into a 32 MiB volume: err %v, want EDQUOT or ENOSPC", n, err)
	}
	if n > 32<<20 || n < 24<<20 {
		t.Fatalf("wrote %d bytes before the limit stopped it, want 24-32 MiB", n)
	}
	if !fs.Full(v.ID) {
		used, limit, err := fs.Usage(v.ID)
		t.Fatalf("volume not reported full: used %d limit %d err %v", used, limit, err)
	}
	// Another volume is not affected by the first being full.
	w, err := fs.NewVolume(filepath.Join(fs.Dir(), "b"), 32<<20)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Full(w.ID) {
		t.Fatal("an empty volume is reported full")
	}
	if n, err := fill(filepath.Join(w.Path, "f"), 8<<20); err != nil {
		t.Fatalf("write to a second volume after the first filled: %d bytes, %v", n, err)
	}
	// Deleting frees the space.
	if err := os.Remove(filepath.Join(v.Path, "f")); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	if n, err := fill(filepath.Join(v.Path, "g"), 16<<20); err != nil {
		t.Fatalf("after deleting the file, 16 MiB do not fit: %d bytes, %v", n, err)
	}
}

func TestSetAndClearLimit(t *testing.T) {
	fs, _ := open(t, 1<<30)
	v, err := fs.NewVolume(filepath.Join(fs.Dir(), "a"), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, limit, err := fs.Usage(v.ID); err != nil || limit != 8<<20 {
		t.Fatalf("limit %d, %v; want 8 MiB", limit, err)
	}
	if _, err := fill(filepath.Join(v.Path, "f"), 16<<20); err == nil {
		t.Fatal("16 MiB fit in an 8 MiB volume")
	}
	// Raised: the rest fits.
	if err := fs.SetLimit(v.ID, 64<<20); err != nil {
		t.Fatal(err)
	}
	if n, err := fill(filepath.Join(v.Path, "g"), 16<<20); err != nil {
		t.Fatalf("after raising the limit to 64 MiB: %d bytes, %v", n, err)
	}
	// Cleared: no limit at all.
	if err := fs.SetLimit(v.ID, 0); err != nil {
		t.Fatal(err)
	}
	if _, limit, err := fs.Usage(v.ID); err != nil || limit != 0 {
		t.Fatalf("after clearing: limit %d, %v", limit, err)
	}
	if n, err := fill(filepath.Join(v.Path, "h"), 96<<20); err != nil {
		t.Fatalf("without a limit: %d bytes, %v", n, err)
	}
	if err := fs.SetLimit(v.ID, -1); err == nil {
		t.Fatal("a negative limit was accepted")
	}
}

// TestNoReuse: a volume made after another was deleted, under the same
// name, is a new qgroup: no usage or limit carries over.
func TestNoReuse(t *testing.T) {
	fs, _ := open(t, 1<<30)
	seen := map[uint64]bool{}
	for i := range 3 {
		v, err := fs.NewVolume(filepath.Join(fs.Dir(), "s"), 16<<20)
		if err != nil {
			t.Fatal(err)
		}
		if seen[v.ID] {
			t.Fatalf("round %d: volume ID %d reused", i, v.ID)
		}
		seen[v.ID] = true
		if used, _, err := fs.Usage(v.ID); err != nil || used > 1<<20 {
			t.Fatalf("round %d: a new volume uses %d bytes (%v)", i, used, err)
		}
		if err := os.MkdirAll(filepath.Join(v.Path, "upper", "d"), 0o755); err != nil {
			t.Fatal(err)
		}
		if _, err := fill(filepath.Join(v.Path, "upper", "d", "f"), 32<<20); err == nil {
			t.Fatalf("round %d: 32 MiB fit in 16", i)
		}
		if err := fs.DeleteVolume(filepath.Join(fs.Dir(), "s")); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(v.Path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("round %d: volume still there after delete: %v", i, err)
		}
	}
	if err := fs.DeleteVolume(filepath.Join(fs.Dir(), "s")); err != nil {
		t.Fatalf("deleting a volume twice: %v", err)
	}
	// A plain directory goes too (stale state of an older layout).
	if err := os.MkdirAll(filepath.Join(fs.Dir(), "plain", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := fs.DeleteVolume(filepath.Join(fs.Dir(), "plain")); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{fs.Dir(), "/tmp/elsewhere", filepath.Join(fs.Dir(), "..", "x")} {
		if _, err := fs.NewVolume(bad, 0); err == nil {
			t.Errorf("volume name %q accepted", bad)
		}
	}
}

// TestNested: volumes inside an unlimited volume (the container backend's
// layout: one per generation of a sandbox's root) each have their own
// usage and limit, one full does not stop the next from being made or
// written, and deleting the outer volume deletes them all.
func TestNested(t *testing.T) {
	fs, _ := open(t, 1<<30)
	outer, err := fs.NewVolume(filepath.Join(fs.Dir(), "o"), 0)
	if err != nil {
		t.Fatal(err)
	}
	g0, err := fs.NewVolume(filepath.Join(outer.Path, "g.0"), 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fill(filepath.Join(g0.Path, "f"), 16<<20); err == nil {
		t.Fatal("16 MiB fit in 8")
	}
	g1, err := fs.NewVolume(filepath.Join(outer.Path, "g.1"), 16<<20)
	if err != nil {
		t.Fatalf("a volume beside a full one: %v", err)
	}
	if g1.ID == g0.ID || g1.ID == outer.ID {
		t.Fatal("nested volumes share an ID")
	}
	if n, err := fill(filepath.Join(g1.Path, "f"), 12<<20); err != nil {
		t.Fatalf("second volume: %d bytes, %v", n, err)
	}
	if err := fs.DeleteVolume(outer.Path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(outer.Path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("outer volume left: %v", err)
	}
}

// TestCloseLeavesNothing: no mount, no loop device, no file.
func TestCloseLeavesNothing(t *testing.T) {
	fs, root := open(t, 512<<20)
	img := filepath.Join(root, "scratch.img")
	if _, err := fs.NewVolume(filepath.Join(fs.Dir(), "a"), 0); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(loops(t), img) {
		t.Fatalf("no loop device over %s: %s", img, loops(t))
	}
	if err := fs.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("image left after Close: %v", err)
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mi), fs.Dir()) {
		t.Fatalf("still mounted after Close")
	}
	if l := loops(t); strings.Contains(l, img) {
		t.Fatalf("loop device left after Close: %s", l)
	}
}

// TestReuseMounted: a file system a crashed process left mounted is
// reused as it is (its stale entries are the backend's to remove).
func TestReuseMounted(t *testing.T) {
	fs, root := open(t, 512<<20)
	if _, err := fs.NewVolume(filepath.Join(fs.Dir(), "stale"), 0); err != nil {
		t.Fatal(err)
	}
	again, err := scratchfs.Open(scratchfs.Options{Image: filepath.Join(root, "scratch.img"), Dir: fs.Dir(), Size: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if _, err := os.Stat(filepath.Join(again.Dir(), "stale")); err != nil {
		t.Fatalf("the reused file system lost its entries: %v", err)
	}
	if err := again.DeleteVolume(filepath.Join(again.Dir(), "stale")); err != nil {
		t.Fatal(err)
	}
}

func TestTooSmall(t *testing.T) {
	testutil.RequireRoot(t)
	root := t.TempDir()
	_, err := scratchfs.Open(scratchfs.Options{Image: filepath.Join(root, "i"), Dir: filepath.Join(root, "d"), Size: 1 << 20})
	if err == nil || !strings.Contains(err.Error(), "minimum") {
		t.Fatalf("1 MiB file system: %v", err)
	}
}

// loops lists the attached loop devices' backing files.
func loops(t *testing.T) string {
	var b strings.Builder
	m, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range m {
		d, _ := os.ReadFile(f)
		b.Write(d)
	}
	return b.String()
}

// TestFullFileSystem: a volume without a limit that fills the whole file
// system gets ENOSPC, and Full says so (the node's file system is full:
// every sandbox's next write fails).
func TestFullFileSystem(t *testing.T) {
	fs, _ := open(t, scratchfs.MinSize)
	v, err := fs.NewVolume(filepath.Join(fs.Dir(), "a"), 0)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Full(v.ID) {
		t.Fatal("an empty file system is reported full")
	}
	n, err := fill(filepath.Join(v.Path, "f"), 2*scratchfs.MinSize)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("filling a %d MiB file system: %d bytes, %v; want ENOSPC", scratchfs.MinSize>>20, n, err)
	}
	if !fs.Full(v.ID) {
		avail, err := fs.Available()
		t.Fatalf("a full file system is not reported full (available %d, %v)", avail, err)
	}
}
