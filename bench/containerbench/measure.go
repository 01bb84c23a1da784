package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime/debug"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Result is one system's figures from one run. Durations are in
// milliseconds and memory in bytes so the JSON is easy to post-process.
type Result struct {
	System string       `json:"system"`
	Seq    *SeqResult   `json:"sequential,omitempty"`
	Conc   []ConcResult `json:"concurrent,omitempty"`
	Idle   *IdleResult  `json:"idle,omitempty"`
	// IdleNA says why a system has no idle figure by design.
	IdleNA string `json:"idle_na,omitempty"`
	// Pool holds, per timed phase, what a pooled system deferred;
	// PoolSize is its ready target.
	Pool     []PoolPhase `json:"pool,omitempty"`
	PoolSize int         `json:"pool_size,omitempty"`
	Err      string      `json:"error,omitempty"`
}

// Pooled is implemented by systems whose cycle takes a sandbox from a warm
// pool and hands it back, to be reset off the caller's path. The harness
// then also reports, per phase, the pool's counters and how long the work
// deferred past the phase's last cycle took.
type Pooled interface {
	// Settle returns once the pool has nothing in flight and is full.
	Settle(ctx context.Context) error
	// PoolCounters is cumulative since Setup.
	PoolCounters() PoolCounters
}

// PoolCounters are a pool's cumulative counters.
type PoolCounters struct {
	Hits, Misses, Resets, ResetFailures, CreateFailures, Destroyed int64
	// ResetTimes is the wall time of every successful reset, in order.
	ResetTimes []time.Duration
}

// PoolPhase is what a pooled system did during one phase (warm-up
// included for the sequential one). Hits are takes served by a ready
// sandbox, Misses takes that created one on the caller's path.
type PoolPhase struct {
	Phase         string  `json:"phase"`
	Hits          int64   `json:"hits"`
	Misses        int64   `json:"misses"`
	Resets        int64   `json:"resets"`
	ResetFailures int64   `json:"reset_failures"`
	Destroyed     int64   `json:"destroyed"`
	ResetMedianMs float64 `json:"reset_median_ms"`
	ResetP90Ms    float64 `json:"reset_p90_ms"`
	// SettleSeconds is how long after the phase's last cycle the pool
	// still worked (resets, refills, destroys) before it was full and
	// idle again.
	SettleSeconds float64 `json:"settle_seconds"`
	// SettledPerSec is the phase's cycles over its wall time plus
	// SettleSeconds: the throughput with the deferred work paid for
	// (concurrent phases only).
	SettledPerSec float64 `json:"settled_per_sec,omitempty"`
}

// poolPhase measures a pooled system's deferred work after a phase that
// began at counters before: it waits for the pool to settle.
func poolPhase(ctx context.Context, p Pooled, phase string, before PoolCounters) (PoolPhase, error) {
	start := time.Now()
	err := p.Settle(ctx)
	settle := time.Since(start)
	after := p.PoolCounters()
	resets := append([]time.Duration(nil), after.ResetTimes[len(before.ResetTimes):]...)
	st := summarize(resets)
	return PoolPhase{
		Phase: phase, Hits: after.Hits - before.Hits, Misses: after.Misses - before.Misses,
		Resets: after.Resets - before.Resets, ResetFailures: after.ResetFailures - before.ResetFailures,
		Destroyed: after.Destroyed - before.Destroyed, ResetMedianMs: ms(st.median), ResetP90Ms: ms(st.p90),
		SettleSeconds: settle.Seconds(),
	}, err
}

// SeqResult is figure (a): one sandbox at a time.
type SeqResult struct {
	N        int     `json:"n"`
	Warmup   int     `json:"warmup"`
	MedianMs float64 `json:"median_ms"`
	P90Ms    float64 `json:"p90_ms"`
	MeanMs   float64 `json:"mean_ms"`
	MinMs    float64 `json:"min_ms"`
}

// ConcResult is figure (b): Total cycles with C in flight.
type ConcResult struct {
	C        int     `json:"c"`
	Total    int     `json:"total"`
	Seconds  float64 `json:"seconds"`
	PerSec   float64 `json:"per_sec"`
	MedianMs float64 `json:"median_ms"`
}

// IdleResult is figure (c): K idle sandboxes alive at once.
type IdleResult struct {
	K int `json:"k"`
	// HostPerSandbox is the growth of MemTotal-MemAvailable divided by K.
	HostPerSandbox float64 `json:"host_bytes_per_sandbox"`
	// CgroupPerSandbox is the growth of the sandboxes' cgroup memory
	// charge divided by K; nil when the system has no cgroup to read.
	CgroupPerSandbox *float64 `json:"cgroup_bytes_per_sandbox,omitempty"`
	StartSeconds     float64  `json:"start_seconds"`
}

// stats holds summary statistics of a latency sample.
type stats struct{ median, p90, mean, min time.Duration }

// summarize computes nearest-rank percentiles; ds is sorted in place.
func summarize(ds []time.Duration) stats {
	if len(ds) == 0 {
		return stats{}
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return stats{
		median: percentile(ds, 50),
		p90:    percentile(ds, 90),
		mean:   sum / time.Duration(len(ds)),
		min:    ds[0],
	}
}

// percentile is the nearest-rank p-th percentile of sorted ds.
func percentile(sorted []time.Duration, p float64) time.Duration {
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	if rank < 1 {
		rank = 1
	}
	return sorted[rank-1]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// cycleTimeout bounds one create->true->destroy so a wedged runtime fails
// the run instead of hanging it.
const cycleTimeout = time.Minute

func timedCycle(ctx context.Context, s System) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, cycleTimeout)
	defer cancel()
	start := time.Now()
	err := s.Cycle(ctx)
	return time.Since(start), err
}

// measureSequential runs warmup untimed cycles, then n timed ones.
func measureSequential(ctx context.Context, s System, warmup, n int) (*SeqResult, error) {
	for i := 0; i < warmup; i++ {
		if _, err := timedCycle(ctx, s); err != nil {
			return nil, fmt.Errorf("warm-up cycle %d: %w", i, err)
		}
	}
	ds := make([]time.Duration, 0, n)
	for i := 0; i < n; i++ {
		d, err := timedCycle(ctx, s)
		if err != nil {
			return nil, fmt.Errorf("sequential cycle %d: %w", i, err)
		}
		ds = append(ds, d)
	}
	st := summarize(ds)
	return &SeqResult{N: n, Warmup: warmup, MedianMs: ms(st.median), P90Ms: ms(st.p90), MeanMs: ms(st.mean), MinMs: ms(st.min)}, nil
}

// measureConcurrent runs total cycles with c goroutines pulling from a
// shared counter, so exactly c are in flight until the tail. The first
// error stops the phase: a rate with failures in it is not comparable.
func measureConcurrent(ctx context.Context, s System, c, total int) (ConcResult, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next atomic.Int64
	ds := make([]time.Duration, total)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < c; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= total || ctx.Err() != nil {
					return
				}
				d, err := timedCycle(ctx, s)
				if err != nil {
					cancel(fmt.Errorf("concurrent cycle %d (C=%d): %w", i, c, err))
					return
				}
				ds[i] = d
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := context.Cause(ctx); err != nil {
		return ConcResult{}, err
	}
	st := summarize(ds)
	return ConcResult{C: c, Total: total, Seconds: elapsed.Seconds(),
		PerSec: float64(total) / elapsed.Seconds(), MedianMs: ms(st.median)}, nil
}

// idleStartConcurrency only shortens the wall time of filling the node; it
// does not affect what is measured (memory once all K are up).
const idleStartConcurrency = 8

// measureIdle starts k idle sandboxes, reads memory before and after, and
// stops them all again (also on error).
func measureIdle(ctx context.Context, s System, k int) (res *IdleResult, err error) {
	meter, _ := s.(CgroupMeter)
	// Return the harness's own freed heap to the kernel first, so that
	// what the throughput phase left behind does not blur the delta.
	debug.FreeOSMemory()
	hostBefore, err := hostMemUsed()
	if err != nil {
		return nil, err
	}
	var cgBefore int64
	if meter != nil {
		// The parent cgroup may not exist before the first sandbox.
		cgBefore, _ = meter.CgroupMemory()
	}

	stops := make([]func(context.Context) error, k)
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
		defer cancel()
		if serr := stopAll(stopCtx, stops); serr != nil {
			err = errors.Join(err, fmt.Errorf("stop idle sandboxes: %w", serr))
		}
	}()

	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	for w := 0; w < idleStartConcurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= k || sctx.Err() != nil {
					return
				}
				stop, err := s.StartIdle(sctx, i)
				if err != nil {
					cancel(fmt.Errorf("start idle sandbox %d: %w", i, err))
					return
				}
				stops[i] = stop
				if (i+1)%100 == 0 {
					slog.Info("idle sandboxes started", "system", s.Name(), "n", i+1)
				}
			}
		}()
	}
	wg.Wait()
	if err := context.Cause(sctx); err != nil {
		return nil, err
	}
	startSecs := time.Since(start).Seconds()

	debug.FreeOSMemory()
	hostAfter, err := hostMemUsed()
	if err != nil {
		return nil, err
	}
	res = &IdleResult{K: k, StartSeconds: startSecs,
		HostPerSandbox: float64(hostAfter-hostBefore) / float64(k)}
	if meter != nil {
		// The cgroup figure is a bonus beside the host one: lacking it
		// (say, no memory controller in a v2 subtree) is not a failure.
		if cgAfter, err := meter.CgroupMemory(); err != nil {
			slog.Warn("no cgroup memory figure", "system", s.Name(), "err", err)
		} else {
			per := float64(cgAfter-cgBefore) / float64(k)
			res.CgroupPerSandbox = &per
		}
	}
	return res, nil
}

// stopAll runs every non-nil stop, a few at a time, and joins the errors.
func stopAll(ctx context.Context, stops []func(context.Context) error) error {
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	sem := make(chan struct{}, idleStartConcurrency)
	for _, stop := range stops {
		if stop == nil {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := stop(ctx); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
