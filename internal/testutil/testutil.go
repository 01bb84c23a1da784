// Package testutil holds helpers shared by DSec's tests: skipping tests that
// need root, and building the binaries that tests run for real.
package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
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
func BuildBinary(t testing.TB, pkg string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := buildCache[pkg]; ok {
		return p
	}
	dir, err := os.MkdirTemp("", "dsec-testbin-")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, pkg)
	cmd.Dir = RepoRoot(t)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	buildCache[pkg] = out
	return out
}
