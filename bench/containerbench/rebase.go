package main

// The "dsec-rebase" row: every cycle's spec is one no earlier cycle had
// (its own ID and environment, and a workspace layer on top of the busybox
// one that differs from the one the sandbox it gets had), the case of an
// RL job whose every task has its own workspace, where a same-spec pool
// ("dsec-pool") never hits. The cycle takes a sandbox another cycle handed
// back, quiesced (rt.Rebaser: its processes killed in the background), and
// rebases it onto the new spec on the caller's path: a new overlay, root
// swap, hostname and resources; when none is ready it creates one as the
// "dsec" row does. The workspace layers are rebaseLayers small ones,
// rotated, so their EROFS mounts are shared and kept (as a node holding
// its job's images keeps them): what is measured is the sandbox's own
// work. The hand-back is a Put to a recycling pool (internal/pool,
// Options.Reset = Quiesce), as the edge's rebase pools do. The pool starts
// with -pool-size sandboxes handed back by earlier tasks, as on a node
// that has been serving the job for a while.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// dsecRebase is dsecPool with another pool: its Reset is Quiesce (timed
// into resets), its takes never create, and hits and misses are counted
// here.
type dsecRebase struct {
	dsecPool
	hits, misses atomic.Int64
	// workspaces are the rotated workspace layers; last is the index of
	// the one each sandbox (by ID) was last given.
	workspaces []rt.Layer
	lastMu     sync.Mutex
	last       map[string]int
}

// rebaseLayers is how many workspace layers the dsec-rebase row rotates.
const rebaseLayers = 4

func newDSecRebase() System {
	return &dsecRebase{dsecPool: dsecPool{dsecSystem: dsecSystem{name: "dsec-rebase", warm: edgeWarm}}}
}

func (d *dsecRebase) Setup(ctx context.Context, env Env) error {
	if env.PoolSize < 1 {
		return fmt.Errorf("pool size %d: want at least 1", env.PoolSize)
	}
	if err := d.dsecSystem.Setup(ctx, env); err != nil {
		return err
	}
	store, err := blobstore.NewDir(filepath.Join(env.WorkDir, "blobs"))
	if err != nil {
		return err
	}
	d.last = map[string]int{}
	for i := range rebaseLayers {
		dir := filepath.Join(env.WorkDir, "workspace"+strconv.Itoa(i))
		if err := os.MkdirAll(filepath.Join(dir, "task"), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "task", "id"), []byte(strconv.Itoa(i)), 0o644); err != nil {
			return err
		}
		desc, err := layer.Build(ctx, store, dir)
		if err != nil {
			return err
		}
		path, err := store.Path(desc.Digest)
		if err != nil {
			return err
		}
		d.workspaces = append(d.workspaces, rt.Layer{Digest: desc.Digest, Path: path})
	}
	d.pool = pool.New(pool.Options{
		Recycle: true,
		Size:    env.PoolSize,
		Reset: func(ctx context.Context, sb rt.Sandbox) error {
			q, ok := sb.(rt.Rebaser)
			if !ok {
				return errors.New("container sandbox does not implement rt.Rebaser")
			}
			start := time.Now()
			err := q.Quiesce(ctx)
			if err == nil {
				d.mu.Lock()
				d.resets = append(d.resets, time.Since(start))
				d.mu.Unlock()
			}
			return err
		},
	})
	for range env.PoolSize {
		sb, err := d.create(ctx)
		if err != nil {
			return err
		}
		d.pool.Put(sb)
	}
	return d.Settle(ctx)
}

// spec is the spec of the cycle whose sandbox ID is id (no earlier cycle
// had it: TASK=<id> too), with workspace layer ws.
func (d *dsecRebase) spec(id string, ws int) rt.Spec {
	return rt.Spec{ID: id, Layers: []rt.Layer{d.layer, d.workspaces[ws]}, Env: []string{"TASK=" + id}, Resources: benchResources}
}

// nextWorkspace is the workspace layer after the one sandbox id was last
// given (so that every rebase changes layers), and records it.
func (d *dsecRebase) nextWorkspace(id string) int {
	d.lastMu.Lock()
	defer d.lastMu.Unlock()
	ws := (d.last[id] + 1) % len(d.workspaces)
	d.last[id] = ws
	return ws
}

func (d *dsecRebase) Cycle(ctx context.Context) error {
	id := "b" + strconv.FormatInt(d.n.Add(1), 10)
	sb, err := d.pool.TakeWarm(ctx)
	if err != nil {
		return err
	}
	if sb != nil {
		d.hits.Add(1)
		if err := sb.(rt.Rebaser).Rebase(ctx, d.spec(id, d.nextWorkspace(sb.ID()))); err != nil {
			d.pool.Discard(sb)
			return err
		}
	} else {
		d.misses.Add(1)
		// A fresh sandbox's runtime ID is its spec's.
		if sb, err = d.backend.Create(ctx, d.spec(id, d.nextWorkspace(id))); err != nil {
			return err
		}
	}
	return runTrueAndPut(ctx, d.pool, sb) // a fresh one is adopted (or destroyed when the pool is full)
}

// StartIdle is not used: the harness skips the idle phase for this row
// (entry.noIdle).
func (d *dsecRebase) StartIdle(context.Context, int) (func(context.Context) error, error) {
	return nil, errors.New("dsec-rebase has no idle figure (an idle rebased sandbox is the dsec row's)")
}

// Settle waits until nothing handed back is still being quiesced or
// destroyed. A recycling pool never creates, so "full" is not waited for.
func (d *dsecRebase) Settle(ctx context.Context) error { return settlePool(ctx, d.pool, false) }

// PoolCounters: Hits are cycles that rebased a handed-back sandbox, Misses
// cycles that created one; Resets are the pool's quiesces.
func (d *dsecRebase) PoolCounters() PoolCounters {
	st := d.pool.Stats()
	d.mu.Lock()
	defer d.mu.Unlock()
	return PoolCounters{
		Hits: d.hits.Load(), Misses: d.misses.Load(), Resets: st.Resets, ResetFailures: st.ResetFailures,
		Destroyed: st.Destroyed, ResetTimes: append([]time.Duration(nil), d.resets...),
	}
}
