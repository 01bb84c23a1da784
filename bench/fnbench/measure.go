package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// Row is one way of running the program in one round (Round 0: every
// complete round pooled): its sequential and concurrent figures.
// Latencies are in milliseconds.
type Row struct {
	Name  string      `json:"name"`
	Round int         `json:"round"`
	Seq   *SeqResult  `json:"sequential,omitempty"`
	Conc  *ConcResult `json:"concurrent,omitempty"`
	Err   string      `json:"error,omitempty"`

	// The samples, for pooling rounds.
	seq, runs, conc []time.Duration
}

// SeqResult is one call at a time, after Warmup untimed ones.
type SeqResult struct {
	N        int     `json:"n"`
	Warmup   int     `json:"warmup"`
	MedianMs float64 `json:"median_ms"`
	P90Ms    float64 `json:"p90_ms"`
	MeanMs   float64 `json:"mean_ms"`
	// RunMedianMs is the median time the program itself ran, as the
	// sandbox measured it (0: the host row has none); the rest of a call
	// is the way there and back.
	RunMedianMs float64 `json:"run_median_ms,omitempty"`
}

// ConcResult is Total calls with C callers in flight, each starting its
// next call when the last returns.
type ConcResult struct {
	C        int     `json:"c"`
	Total    int     `json:"total"`
	Seconds  float64 `json:"seconds"`
	PerSec   float64 `json:"per_sec"`
	MedianMs float64 `json:"median_ms"`
	P90Ms    float64 `json:"p90_ms"`
}

// complete reports whether the row has both phases' figures.
func (r *Row) complete() bool { return r.Err == "" && r.Seq != nil && r.Conc != nil }

// measureRow runs a row's sequential phase, then its concurrent one; the
// first failed call stops the row (a rate with failures in it compares
// with nothing), keeping what was measured.
func measureRow(ctx context.Context, cfg config, round int, name string, call callFunc) Row {
	row := Row{Name: name, Round: round}
	if err := row.measureSequential(ctx, call, cfg.Warmup, cfg.N); err != nil {
		row.Err = err.Error()
		return row
	}
	slog.Info("concurrent calls", "round", round, "row", name, "c", cfg.C, "total", cfg.Total)
	if err := row.measureConcurrent(ctx, call, cfg.C, cfg.Total); err != nil {
		row.Err = err.Error()
	}
	return row
}

// timedCall returns the call's round trip and the program's own run time.
func timedCall(ctx context.Context, call callFunc) (time.Duration, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	start := time.Now()
	run, err := call(ctx)
	return time.Since(start), run, err
}

func (r *Row) measureSequential(ctx context.Context, call callFunc, warmup, n int) error {
	for i := range warmup {
		if _, _, err := timedCall(ctx, call); err != nil {
			return fmt.Errorf("warm-up call %d: %w", i, err)
		}
	}
	for i := range n {
		d, run, err := timedCall(ctx, call)
		if err != nil {
			return fmt.Errorf("sequential call %d: %w", i, err)
		}
		r.seq = append(r.seq, d)
		r.runs = append(r.runs, run)
	}
	r.Seq = seqResult(r.seq, r.runs, warmup)
	return nil
}

func seqResult(ds, runs []time.Duration, warmup int) *SeqResult {
	st := dsecup.Summarize(ds)
	return &SeqResult{N: len(ds), Warmup: warmup, MedianMs: dsecup.Ms(st.Median), P90Ms: dsecup.Ms(st.P90), MeanMs: dsecup.Ms(st.Mean),
		RunMedianMs: dsecup.Ms(dsecup.Summarize(runs).Median)}
}

// measureConcurrent runs total calls with c callers pulling from a shared
// counter, so exactly c are in flight until the tail.
func (r *Row) measureConcurrent(ctx context.Context, call callFunc, c, total int) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next atomic.Int64
	ds := make([]time.Duration, total)
	var wg sync.WaitGroup
	start := time.Now()
	for range c {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= total || ctx.Err() != nil {
					return
				}
				d, _, err := timedCall(ctx, call)
				if err != nil {
					cancel(fmt.Errorf("concurrent call %d (C=%d): %w", i, c, err))
					return
				}
				ds[i] = d
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := context.Cause(ctx); err != nil {
		return err
	}
	r.conc = ds
	r.Conc = concResult(ds, c, elapsed)
	return nil
}

func concResult(ds []time.Duration, c int, elapsed time.Duration) *ConcResult {
	st := dsecup.Summarize(ds)
	return &ConcResult{C: c, Total: len(ds), Seconds: elapsed.Seconds(), PerSec: float64(len(ds)) / elapsed.Seconds(),
		MedianMs: dsecup.Ms(st.Median), P90Ms: dsecup.Ms(st.P90)}
}

// pool pools the complete rows of one name over rounds: percentiles over
// every sample, throughput over the summed wall time. It returns nil when
// no round of that row is complete.
func pool(rows []Row, name string) *Row {
	out := &Row{Name: name}
	var wall time.Duration
	var c, warmup int
	for i := range rows {
		r := &rows[i]
		if r.Name != name || !r.complete() {
			continue
		}
		out.seq = append(out.seq, r.seq...)
		out.runs = append(out.runs, r.runs...)
		out.conc = append(out.conc, r.conc...)
		wall += time.Duration(r.Conc.Seconds * float64(time.Second))
		c, warmup = r.Conc.C, r.Seq.Warmup
	}
	if len(out.seq) == 0 {
		return nil
	}
	out.Seq = seqResult(out.seq, out.runs, warmup)
	out.Conc = concResult(out.conc, c, wall)
	return out
}
