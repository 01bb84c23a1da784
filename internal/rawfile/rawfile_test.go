package rawfile

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

func TestRead(t *testing.T) {
	dir := t.TempDir()
	want := bytes.Repeat([]byte("0123456789"), 1000) // larger than the first buffer
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, want, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, size := range []int{0, 16, 4096, 1 << 20} {
		got, err := Read(p, size)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("Read(size %d): %d bytes, %v; want %d bytes", size, len(got), err, len(want))
		}
	}
	if _, err := Read(filepath.Join(dir, "missing"), 16); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Read of a missing file: %v, want ErrNotExist", err)
	}
	// procfs reports size 0 and must still be read whole.
	if b, err := Read("/proc/self/status", 16); err != nil || !bytes.Contains(b, []byte("VmRSS")) {
		t.Fatalf("Read /proc/self/status: %q, %v", b, err)
	}
}
