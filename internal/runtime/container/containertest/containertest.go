// Package containertest builds a real container backend over one EROFS
// layer for tests of the packages above it (pools, fncall): a temporary
// root with a blob store, the layer mount cache and a state directory, as
// a node has them. It needs root, like the backend.
package containertest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/layer"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// Env is one backend and the layer its sandboxes are made of.
type Env struct {
	Backend *container.Backend
	Layer   rt.Layer
	// Root holds the store, mounts and state; Close removes it.
	Root    string
	closers []func()
}

// New builds an Env whose layer is rootfs, under a new temporary directory
// named after prefix. It is not tied to tb's lifetime (shared envs outlive
// the first test): the caller calls Close, even after an error.
func New(tb testing.TB, prefix, rootfs string) (*Env, error) {
	agentBin := testutil.BuildBinary(tb, "./cmd/dsec-agent")
	// Not t.TempDir: the state lives on the same file system as a real
	// node's, and it may outlive the test that built it.
	root, err := os.MkdirTemp("", prefix)
	if err != nil {
		return nil, err
	}
	e := &Env{Root: root}
	e.closers = append(e.closers, func() { os.RemoveAll(root) })
	store, err := blobstore.NewDir(filepath.Join(root, "blobs"))
	if err != nil {
		return e, err
	}
	desc, err := layer.Build(context.Background(), store, rootfs)
	if err != nil {
		return e, fmt.Errorf("build layer from %s: %w", rootfs, err)
	}
	path, err := store.Path(desc.Digest)
	if err != nil {
		return e, err
	}
	e.Layer = rt.Layer{Digest: desc.Digest, Path: path}
	mounts, err := layer.NewMounts(filepath.Join(root, "layers"), layer.WithLinger(time.Minute))
	if err != nil {
		return e, err
	}
	e.closers = append(e.closers, func() { mounts.Close() })
	b, err := container.New(container.Options{
		StateDir:     filepath.Join(root, "sandboxes"),
		AgentPath:    agentBin,
		Layers:       mounts,
		CgroupParent: "dsec-test-" + filepath.Base(root),
	})
	if err != nil {
		return e, err
	}
	e.Backend = b
	e.closers = append(e.closers, func() {
		b.Close()
		for _, d := range b.CgroupDirs() {
			os.Remove(d)
		}
	})
	return e, nil
}

// Close destroys what New made, in reverse order.
func (e *Env) Close() {
	for i := len(e.closers) - 1; i >= 0; i-- {
		e.closers[i]()
	}
	e.closers = nil
}
