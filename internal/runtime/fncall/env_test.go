package fncall_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/container/containertest"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// The language rootfs is built by scripts/langimage.sh into a cache that
// outlives the test run (the first build takes ~2 minutes and needs the
// Debian mirror); DSEC_LANG_ROOTFS overrides where.
const defaultLangRootfs = "/var/cache/dsec/lang-rootfs"

// env is a node in miniature, shared by every test of the binary: the
// language image as an EROFS layer, the layer mount cache and the real
// container backend. Building the layer takes seconds, so it is done once.
type env struct {
	backend *container.Backend
	layer   rt.Layer
	n       atomic.Int64
}

var (
	sharedOnce sync.Once
	shared     *env
	sharedErr  error
	// cleanups run in TestMain after every test, in reverse order.
	cleanups []func()
)

func TestMain(m *testing.M) {
	code := m.Run()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	os.Exit(code)
}

// newEnv returns the shared environment, building it on first use; it
// skips the test when not root.
func newEnv(t testing.TB) *env {
	t.Helper()
	testutil.RequireRoot(t)
	sharedOnce.Do(func() { shared, sharedErr = buildEnv(t) })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared
}

func buildEnv(t testing.TB) (*env, error) {
	rootfs := os.Getenv("DSEC_LANG_ROOTFS")
	if rootfs == "" {
		rootfs = defaultLangRootfs
	}
	script := filepath.Join(testutil.RepoRoot(t), "scripts", "langimage.sh")
	start := time.Now()
	if out, err := exec.Command(script, rootfs).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("%s %s: %v\n%s", script, rootfs, err, out)
	}
	t.Logf("language rootfs %s ready in %v", rootfs, time.Since(start).Round(time.Millisecond))
	start = time.Now()
	ce, err := containertest.New(t, "dsec-fncall-test-", rootfs)
	cleanups = append(cleanups, ce.Close)
	if err != nil {
		return nil, err
	}
	t.Logf("language layer built in %v", time.Since(start).Round(time.Millisecond))
	return &env{backend: ce.Backend, layer: ce.Layer}, nil
}

// sandbox creates a fresh sandbox of the language image, destroyed when t
// ends. It implements runtime.Updater: the backend's own Update if it has
// one, else memoryUpdater.
func (e *env) sandbox(t testing.TB) rt.Sandbox {
	t.Helper()
	ctx := context.Background()
	id := fmt.Sprintf("fn%d", e.n.Add(1))
	sb, err := e.backend.Create(ctx, rt.Spec{ID: id, Layers: []rt.Layer{e.layer}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sb.Destroy(context.Background()); err != nil {
			t.Errorf("destroy %s: %v", id, err)
		}
	})
	if _, ok := sb.(rt.Updater); ok {
		return sb
	}
	return &memoryUpdater{Sandbox: sb, dir: memoryCgroup(t, e.backend, id)}
}

// memoryUpdater gives a container sandbox a memory limit through its own
// memory cgroup, for as long as the container backend does not implement
// runtime.Updater itself: the tests then still check that Call sets the
// limit and restores it, against a real cgroup.
type memoryUpdater struct {
	rt.Sandbox
	dir string
}

func (u *memoryUpdater) Update(ctx context.Context, r rt.Resources) error {
	limit := "max"
	if strings.HasSuffix(memoryLimitFile(u.dir), "limit_in_bytes") {
		limit = "-1"
	}
	if r.MemoryBytes > 0 {
		limit = strconv.FormatInt(r.MemoryBytes, 10)
	}
	return os.WriteFile(memoryLimitFile(u.dir), []byte(limit), 0)
}

// memoryLimitFile is the limit's file in a v1 or a v2 memory cgroup.
func memoryLimitFile(dir string) string {
	if strings.HasPrefix(dir, "/sys/fs/cgroup/memory/") {
		return filepath.Join(dir, "memory.limit_in_bytes")
	}
	return filepath.Join(dir, "memory.max")
}

// readMemoryLimit reads the memory limit of a cgroup (0: none).
func readMemoryLimit(t testing.TB, dir string) int64 {
	t.Helper()
	b, err := os.ReadFile(memoryLimitFile(dir))
	if err != nil {
		t.Fatal(err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	// cgroup v1 spells "no limit" as the largest page-aligned int64.
	if n >= 1<<62 {
		return 0
	}
	return n
}

// memoryCgroup finds the memory cgroup directory of sandbox id from its
// agent's /proc/PID/cgroup.
func memoryCgroup(t testing.TB, b *container.Backend, id string) string {
	t.Helper()
	pid, ok := b.AgentPID(id)
	if !ok {
		t.Fatalf("no agent for sandbox %s", id)
	}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	unified := ""
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				// The sandbox's limit is its user processes' cgroup's.
				return filepath.Join("/sys/fs/cgroup/memory", parts[2], "user")
			}
		}
		if parts[0] == "0" && parts[1] == "" {
			unified = filepath.Join("/sys/fs/cgroup", filepath.Dir(parts[2]), "user")
		}
	}
	if unified == "" {
		t.Fatalf("no memory cgroup in /proc/%d/cgroup:\n%s", pid, data)
	}
	return unified
}
