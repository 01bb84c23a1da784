package main

// The idle phase: hold as many idle sandboxes as the node lets us (up to
// -n), each with the reference's cpu 4 / 8 GiB limits, make every one
// answer an exec, and read what they cost the host.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// IdleRow is one system's idle figures.
type IdleRow struct {
	System    string `json:"system"`
	Requested int    `json:"requested"`
	// Held is how many were alive at once when creating stopped.
	Held int `json:"held"`
	// StopReason is the refusal that stopped creating before Requested
	// (the service's message), "" when all were held.
	StopReason    string  `json:"stop_reason,omitempty"`
	CreateSeconds float64 `json:"create_seconds"`
	CreatesPerSec float64 `json:"creates_per_sec"`
	// ExecOK counts held sandboxes whose exec (`echo ok`) ran and printed
	// ok; ExecFailed the others.
	ExecOK     int     `json:"exec_ok"`
	ExecFailed int     `json:"exec_failed"`
	ExecP50Ms  float64 `json:"exec_p50_ms"`
	ExecP99Ms  float64 `json:"exec_p99_ms"`
	ExecMaxMs  float64 `json:"exec_max_ms"`
	// HostMiBPerSandbox is the drop of MemAvailable from before the first
	// create to after the exec sweep, divided by Held.
	HostMiBPerSandbox float64 `json:"host_mib_per_sandbox"`
	// HostReleasedMiBPerSandbox is the rise of MemAvailable from there
	// to after every one was destroyed (DSec: and dsec up stopped), over
	// Held: a second reading of the same cost. Other work on the machine moves MemAvailable too;
	// when the two disagree, that is the noise.
	HostReleasedMiBPerSandbox float64 `json:"host_released_mib_per_sandbox"`
	// CgroupMiBPerSandbox is the memory charged to the sandboxes' cgroups
	// (summed) divided by Held.
	CgroupMiBPerSandbox *float64 `json:"cgroup_mib_per_sandbox,omitempty"`
	// DaemonFDsPerSandbox and DaemonRSSMiBPerSandbox are the growth of the
	// daemon's (dsecd's) open descriptors and resident memory over the
	// same span, per held sandbox (DSec only).
	DaemonFDsPerSandbox    *float64 `json:"daemon_fds_per_sandbox,omitempty"`
	DaemonRSSMiBPerSandbox *float64 `json:"daemon_rss_mib_per_sandbox,omitempty"`
	// DestroySeconds is the destroy calls' time (DSec: DestroyMany of 50
	// at a time, 4 calls in flight, which may return before the node has
	// torn everything down).
	DestroySeconds float64 `json:"destroy_seconds"`
	Err            string  `json:"error,omitempty"`
}

// IdleReport is the idle phase: DSec and its peer, same limits.
type IdleReport struct {
	MilliCPU int64         `json:"milli_cpu"`
	MemBytes int64         `json:"mem_bytes"`
	UpPID    int           `json:"dsec_up_pid"`
	DSec     IdleRow       `json:"dsec"`
	Peer     *IdleRow      `json:"peer,omitempty"`
	Leaks    *dsecup.Leaks `json:"leaks,omitempty"`
}

// idleBatch is how many sandboxes one DestroyMany call removes.
const idleBatch = 50

func (rn *run) idle(ctx context.Context) (*IdleReport, error) {
	cfg := rn.cfg.Idle
	rep := &IdleReport{MilliCPU: cfg.MilliCPU, MemBytes: cfg.MemBytes}
	rep.DSec = IdleRow{System: "dsec", Requested: cfg.N}
	var (
		errs   []error
		avail1 int64
	)
	leaks, err := rn.withUp(ctx, "idle", nil, func(up *dsecup.Up) error {
		rep.UpPID = up.PID()
		return idleDSec(ctx, cfg, up, &rep.DSec, &avail1)
	})
	rep.Leaks = leaks
	// Read once dsec up has stopped: a destroy returns before the node
	// has freed everything (it may keep destroyed sandboxes to recycle).
	if avail1 > 0 && rep.DSec.Held > 0 {
		debug.FreeOSMemory()
		if avail2, aerr := memAvailable(); aerr == nil {
			rep.DSec.HostReleasedMiBPerSandbox = toMiB(avail2-avail1) / float64(rep.DSec.Held)
		}
	}
	if err != nil {
		rep.DSec.Err = err.Error()
		errs = append(errs, fmt.Errorf("dsec: %w", err))
	}
	if cfg.Peer == "crun" && ctx.Err() == nil {
		row := rn.idleCrun(ctx)
		rep.Peer = &row
		if row.Err != "" {
			errs = append(errs, fmt.Errorf("crun: %s", row.Err))
		}
	}
	return rep, errors.Join(errs...)
}

// idleDSec fills the node through the API and always destroys what it
// made. It sets *avail1 to MemAvailable with every sandbox held.
func idleDSec(ctx context.Context, cfg idleConfig, up *dsecup.Up, row *IdleRow, avail1 *int64) (err error) {
	c := dsec.New(up.Endpoint, up.Token)
	if _, err := c.Images().Get(ctx, "busybox:latest"); err != nil {
		return fmt.Errorf("seeded image: %w", err)
	}
	spec := dsec.Spec{Image: "busybox:latest", Labels: map[string]string{"bench": "densitybench-idle"},
		Resources: dsec.Resources{MilliCPU: cfg.MilliCPU, MemoryBytes: cfg.MemBytes}}

	var (
		mu  sync.Mutex
		sbs []*dsec.Sandbox
	)
	defer func() {
		// Destroyed also when interrupted; dsec up would destroy the rest
		// on SIGTERM, but the destroy time is a figure too.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
		defer cancel()
		t0 := time.Now()
		if derr := destroyAll(dctx, c, sbs); derr != nil {
			err = errors.Join(err, derr)
		}
		row.DestroySeconds = time.Since(t0).Seconds()
	}()

	debug.FreeOSMemory()
	fds0, err := procFDs(up.PID())
	if err != nil {
		return err
	}
	rss0, err := procRSS(up.PID())
	if err != nil {
		return err
	}
	avail0, err := memAvailable()
	if err != nil {
		return err
	}

	// Creates, cfg.CreateC in flight, until -n or the first refusal.
	var (
		next    atomic.Int64
		stopped atomic.Bool
		wg      sync.WaitGroup
		firstMu sync.Mutex
		refusal error
		failure error
	)
	t0 := time.Now()
	lastOK := t0
	wait := time.Duration(cfg.CreateWait * float64(time.Second))
	for range cfg.CreateC {
		wg.Go(func() {
			for !stopped.Load() && ctx.Err() == nil {
				i := int(next.Add(1))
				if i > cfg.N {
					return
				}
				cctx, cancel := context.WithTimeout(ctx, wait)
				sb, err := c.Create(cctx, spec)
				cancel()
				if err != nil {
					if ctx.Err() != nil {
						return
					}
					stopped.Store(true)
					firstMu.Lock()
					if dsec.IsResourceExhausted(err) || dsec.IsUnavailable(err) {
						if refusal == nil {
							refusal = err
						}
					} else if failure == nil {
						failure = err
					}
					firstMu.Unlock()
					return
				}
				mu.Lock()
				sbs = append(sbs, sb)
				lastOK = time.Now()
				if len(sbs)%100 == 0 {
					slog.Info("idle sandboxes held", "n", len(sbs), "elapsed", time.Since(t0).Round(time.Millisecond))
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	created := time.Since(t0)
	row.Held = len(sbs)
	// The wait of the refused creates is not creation work: the rate is
	// over the time until the last success.
	row.CreateSeconds = lastOK.Sub(t0).Seconds()
	if refusal != nil {
		row.StopReason = refusal.Error()
	}
	if row.CreateSeconds > 0 {
		row.CreatesPerSec = float64(row.Held) / row.CreateSeconds
	}
	slog.Info("idle sandboxes created", "held", row.Held, "of", cfg.N, "took", created.Round(time.Millisecond), "stop", row.StopReason)
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted after %d sandboxes: %w", row.Held, ctx.Err())
	}
	if failure != nil {
		return fmt.Errorf("create failed (not a refusal): %w", failure)
	}

	// Every held sandbox answers an exec.
	lats, failed, firstErr := execAll(ctx, cfg.ExecC, sbs)
	row.ExecOK, row.ExecFailed = len(lats), failed
	st := dsecup.Summarize(lats)
	row.ExecP50Ms, row.ExecP99Ms, row.ExecMaxMs = dsecup.Ms(st.Median), dsecup.Ms(st.P99), dsecup.Ms(st.Max)
	slog.Info("idle sandboxes answered", "ok", row.ExecOK, "failed", failed, "p50_ms", row.ExecP50Ms, "p99_ms", row.ExecP99Ms)

	debug.FreeOSMemory()
	if *avail1, err = memAvailable(); err != nil {
		return err
	}
	if row.Held > 0 {
		n := float64(row.Held)
		row.HostMiBPerSandbox = toMiB(avail0-*avail1) / n
		if fds1, err := procFDs(up.PID()); err == nil {
			v := float64(fds1-fds0) / n
			row.DaemonFDsPerSandbox = &v
		}
		if rss1, err := procRSS(up.PID()); err == nil {
			v := toMiB(rss1-rss0) / n
			row.DaemonRSSMiBPerSandbox = &v
		}
		if cgs, err := sandboxMemCgroups(up.PID()); err != nil {
			slog.Warn("no cgroup memory figure", "err", err)
		} else if total, err := sumCgroups(cgs, cgroupUsage); err != nil {
			slog.Warn("no cgroup memory figure", "err", err)
		} else {
			v := toMiB(total) / n
			row.CgroupMiBPerSandbox = &v
		}
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted during the exec sweep: %w", ctx.Err())
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d held sandboxes failed their exec; first: %w", failed, row.Held, firstErr)
	}
	return nil
}

// execAll runs `echo ok` once in every sandbox, c at a time, and returns
// the latencies of the ones that printed ok.
func execAll(ctx context.Context, c int, sbs []*dsec.Sandbox) (lats []time.Duration, failed int, firstErr error) {
	var (
		mu   sync.Mutex
		next atomic.Int64
		wg   sync.WaitGroup
	)
	for range c {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(sbs) {
					return
				}
				ectx, cancel := context.WithTimeout(ctx, 2*time.Minute)
				t := time.Now()
				r, err := sbs[i].ExecWith(ectx, dsec.ExecOptions{Argv: []string{"echo", "ok"}})
				d := time.Since(t)
				cancel()
				if err == nil && (!r.OK() || string(r.Stdout) != "ok\n") {
					err = fmt.Errorf("exec in %s: outcome %s, exit %d, stdout %q %s", sbs[i].ID, r.Outcome, r.ExitCode, r.Stdout, r.InfraError)
				}
				mu.Lock()
				if err != nil {
					failed++
					if firstErr == nil {
						firstErr = err
					}
				} else {
					lats = append(lats, d)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return lats, failed, firstErr
}

// destroyAll destroys sbs in batches, four batches in flight.
func destroyAll(ctx context.Context, c *dsec.Client, sbs []*dsec.Sandbox) error {
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	sem := make(chan struct{}, 4)
	for start := 0; start < len(sbs); start += idleBatch {
		ids := make([]string, 0, idleBatch)
		for _, sb := range sbs[start:min(start+idleBatch, len(sbs))] {
			ids = append(ids, sb.ID)
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := c.DestroyMany(ctx, ids...); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(errs) > 3 {
		errs = append(errs[:3], fmt.Errorf("and %d more destroy errors", len(errs)-3))
	}
	return errors.Join(errs...)
}
