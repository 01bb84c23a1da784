package main

// DSec's own rows: the native container backend (internal/runtime/container)
// over the same busybox tree, packed as one EROFS layer. "dsec" is the
// edge's configuration (edgeWarm agents started ahead of demand);
// "dsec-cold" starts every sandbox's agent on the create path.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/layer"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/container/scratchfs"
)

// edgeWarm matches the edge's warm pool (cmd/dsec: warmAgents).
const edgeWarm = 8

type dsecSystem struct {
	name    string
	warm    int
	backend *container.Backend
	mounts  *layer.Mounts
	scratch *scratchfs.FS
	layer   rt.Layer
	parent  string
	n       atomic.Int64
}

func newDSec() System     { return &dsecSystem{name: "dsec", warm: edgeWarm} }
func newDSecCold() System { return &dsecSystem{name: "dsec-cold"} }

func (d *dsecSystem) Name() string { return d.name }

func (d *dsecSystem) Setup(ctx context.Context, env Env) error {
	agent := filepath.Join(env.WorkDir, "dsec-agent")
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", agent, "./cmd/dsec-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("build dsec-agent (run from the repository root): %v\n%s", err, out)
	}
	store, err := blobstore.NewDir(filepath.Join(env.WorkDir, "blobs"))
	if err != nil {
		return err
	}
	desc, err := layer.Build(ctx, store, env.Rootfs)
	if err != nil {
		return err
	}
	path, err := store.Path(desc.Digest)
	if err != nil {
		return err
	}
	mounts, err := layer.NewMounts(filepath.Join(env.WorkDir, "layers"), layer.WithLinger(time.Minute))
	if err != nil {
		return err
	}
	d.parent = "dsec-bench-" + strconv.Itoa(os.Getpid())
	// The edge's writable-layer file system (DSEC_BENCH_SCRATCH=off: plain
	// directories on the work directory's file system, no disk limits).
	if os.Getenv("DSEC_BENCH_SCRATCH") != "off" {
		if d.scratch, err = scratchfs.Open(scratchfs.Options{Image: filepath.Join(env.WorkDir, "scratch.img"),
			Dir: filepath.Join(env.WorkDir, "sandboxes"), Size: 8 << 30}); err != nil {
			mounts.Close()
			return err
		}
	}
	d.backend, err = container.New(container.Options{
		StateDir:     filepath.Join(env.WorkDir, "sandboxes"),
		Scratch:      d.scratch,
		AgentPath:    agent,
		Layers:       mounts,
		CgroupParent: d.parent,
		Warm:         d.warm,
	})
	if err != nil {
		if d.scratch != nil {
			d.scratch.Close()
		}
		return err
	}
	d.layer = rt.Layer{Digest: desc.Digest, Path: path}
	d.mounts = mounts
	return nil
}

func (d *dsecSystem) create(ctx context.Context) (rt.Sandbox, error) {
	return d.backend.Create(ctx, rt.Spec{
		ID:        "b" + strconv.FormatInt(d.n.Add(1), 10),
		Layers:    []rt.Layer{d.layer},
		Resources: benchResources,
	})
}

func (d *dsecSystem) Cycle(ctx context.Context) error {
	sb, err := d.create(ctx)
	if err != nil {
		return err
	}
	res, err := sb.Exec(ctx, rt.ExecRequest{Argv: []string{"/bin/true"}}, nil)
	derr := sb.Destroy(ctx)
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("/bin/true exited %d", res.ExitCode)
	}
	return derr
}

func (d *dsecSystem) StartIdle(ctx context.Context, _ int) (func(context.Context) error, error) {
	sb, err := d.create(ctx)
	if err != nil {
		return nil, err
	}
	return sb.Destroy, nil
}

// CgroupMemory sums the memory charged to every sandbox (v1 hierarchy, or
// the unified one on v2 hosts).
func (d *dsecSystem) CgroupMemory() (int64, error) {
	for _, f := range []string{
		filepath.Join("/sys/fs/cgroup/memory", d.parent, "memory.usage_in_bytes"),
		filepath.Join("/sys/fs/cgroup", d.parent, "memory.current"),
	} {
		b, err := os.ReadFile(f)
		if err == nil {
			return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		}
	}
	return 0, fmt.Errorf("no memory accounting for cgroup %s", d.parent)
}

func (d *dsecSystem) Teardown(context.Context) error {
	if d.backend == nil {
		return nil
	}
	d.backend.Close()
	for _, dir := range d.backend.CgroupDirs() {
		os.Remove(dir)
	}
	err := d.mounts.Close()
	if d.scratch != nil {
		err = errors.Join(err, d.scratch.Close())
	}
	return err
}
