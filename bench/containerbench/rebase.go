package main

// The "dsec-rebase" row: every cycle's spec is one no earlier cycle had
// (its own ID and environment), the case of an RL job whose every task has
// its own workspace, where a same-spec pool ("dsec-pool") never hits. The
// cycle takes a sandbox another cycle handed back, quiesced (rt.Rebaser:
// its processes killed in the background), and rebases it onto the new
// spec on the caller's path: a new overlay, root swap, hostname and
// resources; when none is ready it creates one as the "dsec" row does. The
// hand-back is a Put to a recycling pool (internal/pool, Options.Reset =
// Quiesce), as the edge's rebase pools do. The pool starts with -pool-size
// sandboxes handed back by earlier tasks, as on a node that has been
// serving the job for a while.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// dsecRebase is dsecPool with another pool: its Reset is Quiesce (timed
// into resets), its takes never create, and hits and misses are counted
// here.
type dsecRebase struct {
	dsecPool
	hits, misses atomic.Int64
}

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

// spec is a spec no earlier cycle had.
func (d *dsecRebase) spec() rt.Spec {
	n := strconv.FormatInt(d.n.Add(1), 10)
	return rt.Spec{ID: "b" + n, Layers: []rt.Layer{d.layer}, Env: []string{"TASK=" + n}}
}

func (d *dsecRebase) Cycle(ctx context.Context) error {
	spec := d.spec()
	sb, err := d.pool.TakeWarm(ctx)
	if err != nil {
		return err
	}
	if sb != nil {
		d.hits.Add(1)
		if err := sb.(rt.Rebaser).Rebase(ctx, spec); err != nil {
			d.pool.Discard(sb)
			return err
		}
	} else {
		d.misses.Add(1)
		if sb, err = d.backend.Create(ctx, spec); err != nil {
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
