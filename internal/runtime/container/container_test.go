package container_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

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

func newEnv(t *testing.T) *env {
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
	mounts, err := layer.NewMounts(filepath.Join(root, "layers"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := container.New(container.Options{
		StateDir:     filepath.Join(root, "sandboxes"),
		AgentPath:    agentBin,
		Layers:       mounts,
		CgroupParent: "dsec-test-" + filepath.Base(root),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
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
	e := newEnv(t)
	testsuite.Run(t, testsuite.Harness{
		Backend: e.backend,
		NewSpec: e.spec,
		Leaks: testsuite.HostLeaks(e.backend.CgroupDirs(),
			[]string{e.backend.StateDir(), filepath.Join(e.root, "layers")}),
		AgentName: "dsec-agent",
	})
}
