package fullvm_test

import (
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fullvm"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// The package's tests share one backend (so one boot template per
// machine: one cold boot for the whole run) in a state directory made by
// TestMain and removed after every test.
var (
	stateRoot string
	fix       struct {
		once    sync.Once
		backend *fullvm.Backend
		disk    string
		digest  string
		err     error
		skip    string
	}
)

func TestMain(m *testing.M) {
	flag.Parse()
	// Short: QEMU's socket paths under it are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "fvm")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	stateRoot = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// repoRoot is the module's root (the tests run in the package directory).
func repoRoot() string { return filepath.Join("..", "..", "..") }

// backend returns the shared backend and the Debian disk image
// (scripts/vm-disk-image.sh, cached outside the clone), skipping when this
// host cannot run them: not root (debootstrap, loop devices), no QEMU.
func backend(t testing.TB) (*fullvm.Backend, string) {
	t.Helper()
	fix.once.Do(func() {
		switch {
		case os.Geteuid() != 0:
			fix.skip = "needs root (scripts/vm-disk-image.sh: debootstrap, a loop device)"
			return
		case !qemu.Available():
			fix.skip = "QEMU not installed (scripts/deps.sh)"
			return
		}
		disk := os.Getenv("DSEC_VM_DISK")
		if disk == "" {
			out, err := exec.Command(filepath.Join(repoRoot(), "scripts", "vm-disk-image.sh")).Output()
			if err != nil {
				fix.err = fmt.Errorf("scripts/vm-disk-image.sh: %w", err)
				return
			}
			disk = strings.TrimSpace(string(out))
		}
		fix.disk = disk
		fix.digest, fix.err = fileDigest(disk)
		if fix.err != nil {
			return
		}
		agentBin := filepath.Join(stateRoot, "dsec-agent")
		build := exec.Command("go", "build", "-o", agentBin, "./cmd/dsec-agent")
		build.Dir = repoRoot()
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			fix.err = fmt.Errorf("build dsec-agent: %v: %s", err, out)
			return
		}
		fix.backend, fix.err = fullvm.New(fullvm.Options{
			StateDir:  filepath.Join(stateRoot, "state"),
			AgentPath: agentBin,
		})
	})
	if fix.skip != "" {
		t.Skip(fix.skip)
	}
	if fix.err != nil {
		t.Fatal(fix.err)
	}
	return fix.backend, fix.disk
}

func fileDigest(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

var idSeq struct {
	sync.Mutex
	n int
}

// newSpec is a spec over the Debian disk with a fresh ID.
func newSpec(t testing.TB) runtime.Spec {
	_, disk := backend(t)
	idSeq.Lock()
	idSeq.n++
	n := idSeq.n
	idSeq.Unlock()
	return runtime.Spec{
		ID:     fmt.Sprintf("fvm-%d", n),
		Layers: []runtime.Layer{{Digest: fix.digest, Path: disk}},
	}
}

// sandboxDir is where the backend keeps its sandboxes (what must be
// empty when none is alive).
func sandboxDir() string { return filepath.Join(stateRoot, "state", "sandboxes") }
