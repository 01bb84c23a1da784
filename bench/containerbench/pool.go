package main

// The "dsec-pool" row: the same cycle as "dsec", but create is a Take from
// a warm pool (internal/pool) of container sandboxes and destroy is a Put,
// which resets the sandbox in place (rt.Resetter) in the background. The
// reset still costs CPU, only off the caller's path: the throughput rows
// show whether resets keep up, and the pool figures (hits, misses, reset
// times, and how long the pool takes to settle after the last cycle) show
// what was deferred.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// defaultPoolSize is the pool's ready target unless -pool-size says
// otherwise. The pool has no Max (a Take that finds it empty creates on the
// caller's path, as the edge's pools do) and the pool's default background
// concurrency (pool.DefaultFill, what the edge's pools use).
const defaultPoolSize = 16

// settleTimeout bounds the wait for a pool to finish its deferred work.
const settleTimeout = 5 * time.Minute

type dsecPool struct {
	dsecSystem
	pool *pool.Pool

	mu     sync.Mutex
	resets []time.Duration // every successful Reset's wall time, in order
}

func newDSecPool() System {
	return &dsecPool{dsecSystem: dsecSystem{name: "dsec-pool", warm: edgeWarm}}
}

// timedSandbox times the pool's Resets of one sandbox.
type timedSandbox struct {
	rt.Sandbox
	p *dsecPool
}

func (s timedSandbox) Reset(ctx context.Context) error {
	r, ok := s.Sandbox.(rt.Resetter)
	if !ok {
		return errors.New("container sandbox does not implement rt.Resetter")
	}
	start := time.Now()
	err := r.Reset(ctx)
	if err == nil {
		d := time.Since(start)
		s.p.mu.Lock()
		s.p.resets = append(s.p.resets, d)
		s.p.mu.Unlock()
	}
	return err
}

func (d *dsecPool) Setup(ctx context.Context, env Env) error {
	if env.PoolSize < 1 {
		return fmt.Errorf("pool size %d: want at least 1", env.PoolSize)
	}
	if err := d.dsecSystem.Setup(ctx, env); err != nil {
		return err
	}
	d.pool = pool.New(pool.Options{
		New: func(ctx context.Context) (rt.Sandbox, error) {
			sb, err := d.create(ctx)
			if err != nil {
				return nil, err
			}
			return timedSandbox{Sandbox: sb, p: d}, nil
		},
		Size: env.PoolSize,
	})
	// Timing starts with a full pool, as a pool created ahead of a job.
	return d.Settle(ctx)
}

func (d *dsecPool) Cycle(ctx context.Context) error {
	sb, err := d.pool.Take(ctx)
	if err != nil {
		return err
	}
	return runTrueAndPut(ctx, d.pool, sb)
}

// runTrueAndPut runs /bin/true in sb and hands sb to p.
func runTrueAndPut(ctx context.Context, p *pool.Pool, sb rt.Sandbox) error {
	res, err := sb.Exec(ctx, rt.ExecRequest{Argv: []string{"/bin/true"}}, nil)
	if err != nil {
		// A failed exec may have left it broken: never reuse it.
		p.Discard(sb)
		return err
	}
	p.Put(sb)
	if res.ExitCode != 0 {
		return fmt.Errorf("/bin/true exited %d", res.ExitCode)
	}
	return nil
}

// StartIdle is not used: the harness skips the idle phase for this row
// (entry.noIdle). An idle pooled sandbox is the dsec row's sandbox.
func (d *dsecPool) StartIdle(context.Context, int) (func(context.Context) error, error) {
	return nil, errors.New("dsec-pool has no idle figure (an idle pooled sandbox is the dsec row's)")
}

// Settle waits until the pool has no reset, create or destroy in flight and
// its ready target is met: the work the last cycles deferred is done.
func (d *dsecPool) Settle(ctx context.Context) error { return settlePool(ctx, d.pool, true) }

// settlePool waits until p has no reset, create or destroy in flight and
// nothing in use, and, if full, its ready target is met.
func settlePool(ctx context.Context, p *pool.Pool, full bool) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	for {
		st := p.Stats()
		if st.Resetting == 0 && st.Creating == 0 && st.Destroying == 0 && st.InUse == 0 && (!full || st.Ready >= st.Target) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pool did not settle (%+v): %w", st, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// PoolCounters is a cumulative picture of the pool since Setup.
func (d *dsecPool) PoolCounters() PoolCounters {
	st := d.pool.Stats()
	d.mu.Lock()
	defer d.mu.Unlock()
	return PoolCounters{
		Hits: st.Hits, Misses: st.Misses, Resets: st.Resets, ResetFailures: st.ResetFailures,
		CreateFailures: st.CreateFailures, Destroyed: st.Destroyed,
		ResetTimes: append([]time.Duration(nil), d.resets...),
	}
}

func (d *dsecPool) Teardown(ctx context.Context) error {
	var errs []error
	if d.pool != nil {
		if err := d.pool.Close(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, d.dsecSystem.Teardown(ctx))
	return errors.Join(errs...)
}
