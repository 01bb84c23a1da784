package container_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/layer"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// env is a real node in miniature: a blob store holding a busybox EROFS
// layer, the shared layer mount cache, and the container backend.
type env struct {
	backend *container.Backend
	layer   rt.Layer
	root    string
	n       atomic.Int64
}

func newEnv(t *testing.T, warm int) *env {
	t.Helper()
	testutil.RequireRoot(t)
	agentBin := testutil.BuildBinary(t, "./cmd/dsec-agent")
	// Not t.TempDir: the state lives on the same file system as a real
	// node's, and its removal is checked by the leak snapshot, not by the
	// testing package.
	root, err := os.MkdirTemp("", "dsec-container-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	store, err := blobstore.NewDir(filepath.Join(root, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	desc, err := layer.Build(ctx, store, testsuite.BusyboxRootfs(t))
	if err != nil {
		t.Fatal(err)
	}
	path, err := store.Path(desc.Digest)
	if err != nil {
		t.Fatal(err)
	}
	// The linger the edge runs with: sandboxes of one image reuse its mount.
	mounts, err := layer.NewMounts(filepath.Join(root, "layers"), layer.WithLinger(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mounts.Close() })
	b, err := container.New(container.Options{
		StateDir:     filepath.Join(root, "sandboxes"),
		AgentPath:    agentBin,
		Layers:       mounts,
		CgroupParent: "dsec-test-" + filepath.Base(root),
		Warm:         warm,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		b.Close()
		for _, d := range b.CgroupDirs() {
			os.Remove(d)
		}
	})
	return &env{backend: b, layer: rt.Layer{Digest: desc.Digest, Path: path}, root: root}
}

func (e *env) spec(t *testing.T) rt.Spec {
	return rt.Spec{
		ID:     fmt.Sprintf("t%d", e.n.Add(1)),
		Layers: []rt.Layer{e.layer},
		Env:    []string{"DSEC_TEST=1"},
	}
}

func TestConformance(t *testing.T) {
	e := newEnv(t, 0)
	testsuite.Run(t, testsuite.Harness{
		Backend: e.backend,
		NewSpec: e.spec,
		Leaks: testsuite.HostLeaks(e.backend.CgroupDirs(),
			[]string{e.backend.StateDir(), filepath.Join(e.root, "layers")}),
		AgentName: "dsec-agent",
	})
}

// TestConformanceWarm runs the suite with sandboxes built from pre-started
// agents, the path creates take on a busy edge. The leak checks need a
// quiet backend (the pool refills in the background), so they run above.
func TestConformanceWarm(t *testing.T) {
	e := newEnv(t, 4)
	testsuite.Run(t, testsuite.Harness{
		Backend:    e.backend,
		NewSpec:    e.spec,
		AgentName:  "dsec-agent",
		LeakCycles: 10,
	})
}

// TestWarmPoolCleanup checks that Close removes the pre-started agents:
// their processes, cgroups and directories.
func TestWarmPoolCleanup(t *testing.T) {
	e := newEnv(t, 3)
	leaks := testsuite.HostLeaks(e.backend.CgroupDirs(), []string{e.backend.StateDir()})
	before := leaks(t) // may already hold some warm agents
	ctx := context.Background()
	// A create takes a warm agent when one is ready; either way it works.
	sb, err := e.backend.Create(ctx, e.spec(t))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := sb.Exec(ctx, rt.ExecRequest{Shell: "echo warm"}, nil); err != nil || string(res.Stdout) != "warm\n" {
		t.Fatalf("exec: %v %q", err, res.Stdout)
	}
	if err := sb.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.backend.Close(); err != nil {
		t.Fatal(err)
	}
	after := leaks(t)
	if len(after.Processes) != 0 || len(after.Cgroups) != 0 {
		t.Fatalf("after Close: processes %v cgroups %v (before: %v)", after.Processes, after.Cgroups, before.Processes)
	}
	entries, _ := os.ReadDir(e.backend.StateDir())
	if len(entries) != 0 {
		t.Fatalf("after Close the state dir holds %d entries", len(entries))
	}
}
