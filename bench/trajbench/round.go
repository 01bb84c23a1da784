package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// nodeID names the edge; sandbox IDs start with it.
const nodeID = "trajbench"

// Round is one `dsec up` process's figures. Latencies are in milliseconds.
type Round struct {
	Round     int    `json:"round"`
	Mode      string `json:"mode"`
	UpPID     int    `json:"dsec_up_pid"`
	Sandboxes int    `json:"sandboxes"`
	// Execs is how many execs returned exit 0; Failed how many did not
	// (an error, or another exit); a sandbox stops at its first failure.
	Execs         int     `json:"execs"`
	Failed        int     `json:"failed"`
	CreateSeconds float64 `json:"create_seconds"`
	WallSeconds   float64 `json:"wall_seconds"`
	PerSec        float64 `json:"execs_per_sec"`
	MedianMs      float64 `json:"median_ms"`
	P90Ms         float64 `json:"p90_ms"`
	P99Ms         float64 `json:"p99_ms"`
	MaxMs         float64 `json:"max_ms"`
	// ExecRecords counts execs acknowledged with a step number, i.e.
	// recorded in the trajectory (0 with the log off).
	ExecRecords int `json:"exec_records"`
	// WALBytes is the size of the trajectory write-ahead log after the
	// sandboxes were destroyed (0 with the log off).
	WALBytes int64 `json:"wal_bytes"`
	// WALRecords counts all its records: creation, exec and destroy.
	WALRecords int           `json:"wal_records"`
	Leaks      *dsecup.Leaks `json:"leaks,omitempty"`
	Err        string        `json:"error,omitempty"`

	latencies []time.Duration
}

// runRound runs one mode on its own dsec up and always tears it down.
func runRound(ctx context.Context, cfg config, bins dsecup.Binaries, rootfs, dir string, round int, mode string, keep bool) (res Round) {
	res = Round{Round: round, Mode: mode, Sandboxes: cfg.Sandboxes}
	var errs []error
	defer func() {
		if err := errors.Join(errs...); err != nil {
			res.Err = err.Error()
		}
	}()
	dataDir := filepath.Join(dir, "data")
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		errs = append(errs, err)
		return res
	}
	var args []string
	if mode != modeOn {
		args = append(args, "--trajectory=false")
	}
	up, err := dsecup.Start(ctx, dsecup.Options{Bins: bins, DataDir: dataDir, Rootfs: rootfs, NodeID: nodeID,
		Args: args, LogAttrs: []any{"trajectory", mode == modeOn}})
	if up != nil {
		res.UpPID = up.PID()
		defer func() {
			// Teardown runs whatever happened above, Ctrl-C included.
			if err := up.Stop(); err != nil {
				errs = append(errs, err)
			}
			leaks, err := dsecup.Reclaim(bins, up.PID(), dataDir)
			if err != nil {
				errs = append(errs, fmt.Errorf("cleanup: %w", err))
			}
			if !leaks.Empty() {
				res.Leaks = &leaks
				errs = append(errs, fmt.Errorf("dsec up left %s (removed)", leaks))
			}
			if keep {
				if err := os.WriteFile(filepath.Join(dir, "dsec-up.log"), []byte(up.Log()), 0o644); err != nil {
					errs = append(errs, err)
				}
				return
			}
			if err := dsecup.RemoveDir(dir); err != nil {
				errs = append(errs, fmt.Errorf("remove %s: %w", dir, err))
			}
		}()
	}
	if err != nil {
		errs = append(errs, err)
		return res
	}
	errs = append(errs, measure(ctx, cfg, up, mode, &res))
	return res
}

// measure creates the sandboxes, runs the execs, destroys the sandboxes.
func measure(ctx context.Context, cfg config, up *dsecup.Up, mode string, res *Round) error {
	c := dsec.New(up.Endpoint, up.Token)
	if _, err := c.Images().Get(ctx, "busybox:latest"); err != nil {
		return fmt.Errorf("seeded image: %w", err)
	}

	var ids []string
	defer func() {
		// Destroyed even when the run was interrupted; dsec up would
		// destroy the rest on SIGTERM, but a clean destroy is the normal
		// path and what the WAL size below should include.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		for start := 0; start < len(ids); start += cfg.Batch {
			if err := c.DestroyMany(dctx, ids[start:min(start+cfg.Batch, len(ids))]...); err != nil {
				slog.Error("destroy sandboxes", "err", err)
			}
		}
		if mode == modeOn {
			res.WALBytes, res.WALRecords = walStats(up.DataDir)
		}
	}()

	t0 := time.Now()
	handles := make([]*dsec.Sandbox, 0, cfg.Sandboxes)
	spec := dsec.Spec{Image: "busybox:latest", Labels: map[string]string{"bench": "trajbench"}}
	for len(handles) < cfg.Sandboxes {
		n := min(cfg.Batch, cfg.Sandboxes-len(handles))
		sbs, err := c.CreateMany(ctx, spec, n)
		for _, sb := range sbs {
			ids = append(ids, sb.ID)
			h := sb // numbered: its next operation is step 1
			if mode == modeOff {
				h = c.Sandbox(sb.ID, dsec.Unnumbered())
			}
			handles = append(handles, h)
		}
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
	}
	res.CreateSeconds = time.Since(t0).Seconds()
	slog.Info("sandboxes created", "n", len(handles), "took", time.Since(t0).Round(time.Millisecond))

	type outcome struct {
		lat      []time.Duration
		recorded int
		failed   int
		err      error
	}
	outs := make([]outcome, len(handles))
	var (
		ready, wg sync.WaitGroup
		start     = make(chan struct{})
	)
	ready.Add(len(handles))
	for i, h := range handles {
		wg.Go(func() {
			o := &outs[i]
			o.lat = make([]time.Duration, 0, cfg.Execs)
			ready.Done()
			<-start
			for k := 1; k <= cfg.Execs; k++ {
				t := time.Now()
				r, err := h.ExecWith(ctx, dsec.ExecOptions{Argv: []string{"/bin/true"}})
				d := time.Since(t)
				switch {
				case err != nil:
					o.err = err
				case r.Outcome != dsec.OutcomeOK || r.ExitCode != 0:
					o.err = fmt.Errorf("exec %d in %s: outcome %s, exit %d %s", k, h.ID, r.Outcome, r.ExitCode, r.InfraError)
				case mode == modeOn && (r.Seq != uint64(k) || r.Replayed):
					o.err = fmt.Errorf("exec %d in %s: step %d replayed %v, want step %d run now", k, h.ID, r.Seq, r.Replayed, k)
				case mode == modeOff && r.Seq != 0:
					o.err = fmt.Errorf("exec %d in %s: step %d with the log off", k, h.ID, r.Seq)
				}
				if o.err != nil {
					o.failed++
					return
				}
				if r.Seq != 0 {
					o.recorded++
				}
				o.lat = append(o.lat, d)
			}
		})
	}
	ready.Wait()
	t1 := time.Now()
	close(start)
	wg.Wait()
	wall := time.Since(t1)

	var errs []error
	for _, o := range outs {
		res.latencies = append(res.latencies, o.lat...)
		res.ExecRecords += o.recorded
		res.Failed += o.failed
		if o.err != nil && len(errs) < 5 {
			errs = append(errs, o.err)
		}
	}
	res.Execs = len(res.latencies)
	res.WallSeconds = wall.Seconds()
	if wall > 0 {
		res.PerSec = float64(res.Execs) / wall.Seconds()
	}
	st := dsecup.Summarize(res.latencies)
	res.MedianMs, res.P90Ms, res.P99Ms, res.MaxMs = dsecup.Ms(st.Median), dsecup.Ms(st.P90), dsecup.Ms(st.P99), dsecup.Ms(st.Max)
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted after %d execs: %w", res.Execs, ctx.Err())
	}
	if res.Failed > 0 {
		errs = append([]error{fmt.Errorf("%d of %d sandboxes failed an exec; first errors:", res.Failed, len(handles))}, errs...)
		return errors.Join(errs...)
	}
	return nil
}

// walStats sums the trajectory log's segment files: bytes and records
// (one JSON line each).
func walStats(dataDir string) (bytes int64, records int) {
	m, _ := filepath.Glob(filepath.Join(dataDir, "trajectory", "wal-*.jsonl"))
	for _, p := range m {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		bytes += int64(len(b))
		for _, c := range b {
			if c == '\n' {
				records++
			}
		}
	}
	return bytes, records
}
