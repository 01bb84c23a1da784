package swap

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/testutil"
)

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		"/var/lib/dsec/swap.img":  "/var/lib/dsec/swap.img",
		`/a\040b/swap`:            "/a b/swap",
		`/a\134b`:                 `/a\b`,
		`/trailing\04`:            `/trailing\04`,
		`/x\011y\012z`:            "/x\ty\nz",
		`/not\999octal/swap.img`:  `/not\999octal/swap.img`,
		`/end-with-backslash\`:    `/end-with-backslash\`,
		`/dsec data/swap\040.img`: "/dsec data/swap .img",
	} {
		if got := unescape(in); got != want {
			t.Errorf("unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestHeader(t *testing.T) {
	h := header(32<<20, 4096)
	if len(h) != 4096 || string(h[4086:]) != "SWAPSPACE2" {
		t.Fatalf("header: %d bytes, magic %q", len(h), h[4086:])
	}
	if v, last := nativeU32(h[1024:]), nativeU32(h[1028:]); v != 1 || last != 32<<20/4096-1 {
		t.Fatalf("version %d last_page %d", v, last)
	}
}

func nativeU32(b []byte) uint32 { return binary.NativeEndian.Uint32(b) }

// TestOpenClose makes a real swap area, finds it in /proc/swaps, opens it
// again (kept: an edge restarted after a crash), and removes it.
func TestOpenClose(t *testing.T) {
	testutil.RequireRoot(t)
	file := filepath.Join(t.TempDir(), "swap.img")
	a, err := Open(Options{File: file, Size: 32 << 20})
	if errors.Is(err, unix.EPERM) {
		t.Skipf("swapon refused here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	on, size, err := Enabled(file)
	if err != nil || !on || size != 32<<20-int64(os.Getpagesize()) {
		t.Fatalf("after Open: enabled %v, size %d, err %v", on, size, err)
	}
	total, free, err := Total()
	if err != nil || total < 32<<20-int64(os.Getpagesize()) || free > total {
		t.Fatalf("Total: %d free %d, %v", total, free, err)
	}
	st1, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	again, err := Open(Options{File: file, Size: 32 << 20})
	if err != nil {
		t.Fatal(err)
	}
	st2, err := os.Stat(file)
	if err != nil || !os.SameFile(st1, st2) {
		t.Fatalf("an enabled area of the same size was made again (%v)", err)
	}
	// Another size: turned off and made again.
	resized, err := Open(Options{File: file, Size: 16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if _, size, _ := Enabled(file); size != 16<<20-int64(os.Getpagesize()) {
		t.Fatalf("resized area is %d bytes in /proc/swaps", size)
	}
	if err := resized.Close(); err != nil {
		t.Fatal(err)
	}
	if on, _, _ := Enabled(file); on {
		t.Fatal("still enabled after Close")
	}
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("file left after Close: %v", err)
	}
	// Closing what is already off only removes the file.
	if err := again.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestOpenRefusesSmall(t *testing.T) {
	if _, err := Open(Options{File: filepath.Join(t.TempDir(), "s"), Size: 1 << 20}); err == nil {
		t.Fatal("a 1 MiB area was accepted")
	}
}
