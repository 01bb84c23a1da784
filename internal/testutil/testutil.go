// Package testutil holds helpers shared by DSec's tests: skipping tests that
// need root, and building the binaries that tests run for real.
package testutil

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// RequireRoot skips the test unless it runs as root (CI runs as root, so the
// test runs there).
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (namespaces, mounts, cgroups); run the suite as root")
	}
}

// RepoRoot returns the module root directory.
func RepoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot locate testutil source file")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

var (
	buildMu    sync.Mutex
	buildCache = map[string]string{}
)

// BuildBinary builds the main package at pkg (e.g. "./cmd/dsec-agent") once
// per test process, statically (CGO off), and returns the binary's path.
// Building "./cmd/dsec" also builds "./cmd/dsecd" and "./cmd/dsec-cli"
// into the same directory: dsec is a front that hands its daemon commands
// (up, server, edge) over to the dsecd found next to it, and every client
// command but the common form of run to the dsec-cli next to it.
func BuildBinary(t testing.TB, pkg string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if pkg == "./cmd/dsec" {
		buildLocked(t, "./cmd/dsecd")
		buildLocked(t, "./cmd/dsec-cli")
	}
	return buildLocked(t, pkg)
}

// buildLocked is BuildBinary with buildMu held.
func buildLocked(t testing.TB, pkg string) string {
	t.Helper()
	if p, ok := buildCache[pkg]; ok {
		return p
	}
	// One directory per checkout, reused by every run, so test binaries do
	// not pile up in /tmp, and two checkouts (worktrees) testing at once
	// never run each other's binaries; each build lands under a temporary
	// name and is renamed into place, so packages testing in parallel
	// never see a half-written binary.
	sum := sha256.Sum256([]byte(RepoRoot(t)))
	dir := filepath.Join(os.TempDir(), "dsec-testbin", hex.EncodeToString(sum[:6]))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, filepath.Base(pkg))
	tmp, err := os.CreateTemp(dir, filepath.Base(pkg)+".*")
	if err != nil {
		t.Fatal(err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	cmd := exec.Command("go", "build", "-trimpath", "-o", tmp.Name(), pkg)
	cmd.Dir = RepoRoot(t)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	// Another test process may replace the file meanwhile: harmless, as
	// every build in a run comes from the same tree, and a running binary
	// keeps its own inode.
	if err := os.Rename(tmp.Name(), out); err != nil {
		t.Fatal(err)
	}
	buildCache[pkg] = out
	return out
}

// SetImmutable sets or clears the immutable attribute of dir (chattr +i):
// renames into it then fail even for root, a real failure to test
// error paths with.
func SetImmutable(dir string, on bool) error {
	const fsImmutableFL = 0x10 // FS_IMMUTABLE_FL of linux/fs.h
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	flags, err := unix.IoctlGetUint32(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		return err
	}
	if on {
		flags |= fsImmutableFL
	} else {
		flags &^= fsImmutableFL
	}
	return unix.IoctlSetPointerInt(int(f.Fd()), unix.FS_IOC_SETFLAGS, int(flags))
}
