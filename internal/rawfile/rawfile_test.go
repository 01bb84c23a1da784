package rawfile

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
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

// TestReadRegular: what a workload can put where the agent reads (a FIFO
// nobody writes to, a link to /dev/zero, a huge file) is refused at once
// instead of blocking its reader or having it read without end.
func TestReadRegular(t *testing.T) {
	dir := t.TempDir()
	want := bytes.Repeat([]byte("0123456789"), 1000)
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, want, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadRegular(p, len(want)); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("ReadRegular: %d bytes, %v; want %d bytes", len(got), err, len(want))
	}
	if _, err := ReadRegular(p, len(want)-1); !errors.Is(err, ErrTooLarge) {
		t.Errorf("ReadRegular over its limit: %v, want ErrTooLarge", err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	zero := filepath.Join(dir, "zero")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{fifo, zero, dir} {
		if _, err := ReadRegular(p, 1<<20); !errors.Is(err, ErrNotRegular) {
			t.Errorf("ReadRegular(%s): %v, want ErrNotRegular", p, err)
		}
	}
	// procfs files are regular, report size 0 and are read whole.
	if b, err := ReadRegular("/proc/self/status", 1<<20); err != nil || !bytes.Contains(b, []byte("VmRSS")) {
		t.Errorf("ReadRegular /proc/self/status: %q, %v", b, err)
	}
	if _, err := ReadRegular("/proc/self/status", 16); !errors.Is(err, ErrTooLarge) {
		t.Errorf("ReadRegular /proc/self/status with limit 16: %v, want ErrTooLarge", err)
	}
}

func TestMeminfo(t *testing.T) {
	m, err := Meminfo()
	if err != nil {
		t.Fatal(err)
	}
	if m["MemTotal"] < 1<<20 || m["MemAvailable"] <= 0 || m["MemAvailable"] > m["MemTotal"] || m["SwapFree"] > m["SwapTotal"] {
		t.Fatalf("meminfo %v", m)
	}
	if _, ok := m["SwapTotal"]; !ok {
		t.Fatal("no SwapTotal")
	}
}
