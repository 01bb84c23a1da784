package main

// The pressure phase: a node bounded to -node-memory with -swap of swap
// (both passed to dsec up), more sandboxes than it could hold if each
// touched its whole limit, then a subset touching memory within their
// limits while the others run steps. Counts OOM kills, reads what went to
// swap, and compares the others' step latency with the same steps before.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// StepFigures summarizes step latencies.
type StepFigures struct {
	Steps  int     `json:"steps"`
	Failed int     `json:"failed"`
	P50Ms  float64 `json:"p50_ms"`
	P99Ms  float64 `json:"p99_ms"`
	MaxMs  float64 `json:"max_ms"`
}

// PressureReport is the pressure phase.
type PressureReport struct {
	// Skipped says why the phase did not run (the node bound or the swap
	// flag is missing); nothing else is set then but what was learnt.
	Skipped    string `json:"skipped,omitempty"`
	NodeMemory string `json:"node_memory"`
	Swap       string `json:"swap"`
	UpPID      int    `json:"dsec_up_pid,omitempty"`
	Requested  int    `json:"requested"`
	Held       int    `json:"held"`
	StopReason string `json:"stop_reason,omitempty"`
	MemBytes   int64  `json:"mem_bytes"`
	// LimitsOverNode is the held sandboxes' memory limits summed, over the
	// node bound: above 1, the node could not hold them all touching
	// their whole limit.
	LimitsOverNode float64 `json:"limits_over_node"`
	Touchers       int     `json:"touchers"`
	TouchBytes     int64   `json:"touch_bytes"`
	// NodeBoundBytes is the tightest memory limit above the sandboxes'
	// cgroups, and NodeBoundCgroup where it is set.
	NodeBoundBytes  int64  `json:"node_bound_bytes,omitempty"`
	NodeBoundCgroup string `json:"node_bound_cgroup,omitempty"`
	SwapTotalBytes  int64  `json:"swap_total_bytes,omitempty"`

	Before StepFigures `json:"steps_before"`
	Under  StepFigures `json:"steps_under_pressure"`

	TouchersOK     int            `json:"touchers_ok"`
	ToucherErrors  map[string]int `json:"toucher_errors,omitempty"`
	OOMKillsCgroup int64          `json:"oom_kills_cgroups"`
	OOMKillsResult int            `json:"oom_kills_results"`
	// OOMKillsHost is the host's oom_kill counter over the phase: any
	// process of anyone, so only an upper bound for ours.
	OOMKillsHost int64 `json:"oom_kills_host"`
	// SwapPeakMiB is the host's swap use at its peak over the hold, above
	// what it was before; SwapOutMiB the pages written to swap (pswpout).
	SwapPeakMiB float64 `json:"swap_peak_mib"`
	SwapOutMiB  float64 `json:"swap_out_mib"`
	// SandboxSwap*: per-sandbox swap (v1 memsw - usage, v2
	// memory.swap.current) at the sample where their sum peaked.
	SandboxSwapSumMiB float64 `json:"sandbox_swap_sum_mib"`
	SandboxSwapMaxMiB float64 `json:"sandbox_swap_max_mib"`
	SandboxesInSwap   int     `json:"sandboxes_in_swap"`
	// TouchersChargePeakMiB is the touchers' memory plus swap at its
	// peak: what they held, to check that they did.
	TouchersChargePeakMiB float64 `json:"touchers_charge_peak_mib"`
	// TouchersSwapMiB / OthersSwapMiB split that sum.
	TouchersSwapMiB float64       `json:"touchers_swap_mib"`
	OthersSwapMiB   float64       `json:"others_swap_mib"`
	Err             string        `json:"error,omitempty"`
	Leaks           *dsecup.Leaks `json:"leaks,omitempty"`
}

func (rn *run) pressure(ctx context.Context) (*PressureReport, error) {
	cfg := rn.cfg.Pressure
	rep := &PressureReport{NodeMemory: cfg.NodeMemory, Swap: cfg.Swap, Requested: cfg.N, MemBytes: cfg.MemBytes,
		Touchers: cfg.Touchers, TouchBytes: cfg.TouchBytes}
	if cfg.NodeMemory == "" {
		rep.Skipped = "no -node-memory: the phase runs only on a node bounded by a cgroup, never by pushing the whole host into pressure"
		return rep, nil
	}
	nodeBytes, err := flagval.ParseSize("node-memory", cfg.NodeMemory)
	if err != nil {
		return rep, err
	}
	args := []string{"--memory", cfg.NodeMemory}
	if cfg.Swap != "" && cfg.Swap != "0" {
		has, err := upHasFlag(ctx, rn.bins.Dsecd, cfg.SwapFlag)
		if err != nil {
			return rep, err
		}
		if !has {
			rep.Skipped = fmt.Sprintf("dsec up has no %s flag yet (issue 14: the edge's swap area is being added); "+
				"rerun when it lands, or pass -swap-flag with its name", cfg.SwapFlag)
			slog.Warn("pressure phase skipped", "why", rep.Skipped)
			return rep, nil
		}
		args = append(args, cfg.SwapFlag, cfg.Swap)
	}
	leaks, err := rn.withUp(ctx, "pressure", args, func(up *dsecup.Up) error {
		rep.UpPID = up.PID()
		return pressureRun(ctx, cfg, nodeBytes, up, rep)
	})
	rep.Leaks = leaks
	if err != nil {
		rep.Err = err.Error()
	}
	return rep, err
}

// upHasFlag reports whether `dsecd up --help` lists flag.
func upHasFlag(ctx context.Context, dsecd, flag string) (bool, error) {
	out, err := exec.CommandContext(ctx, dsecd, "up", "--help").CombinedOutput()
	if err != nil {
		return false, fmt.Errorf("%s up --help: %w\n%s", dsecd, err, out)
	}
	return bytes.Contains(out, []byte(flag+" ")) || bytes.Contains(out, []byte(flag+"=")), nil
}

func pressureRun(ctx context.Context, cfg pressureConfig, nodeBytes int64, up *dsecup.Up, rep *PressureReport) (err error) {
	c := dsec.New(up.Endpoint, up.Token)
	spec := dsec.Spec{Image: "busybox:latest", Labels: map[string]string{"bench": "densitybench-pressure"},
		Resources: dsec.Resources{MemoryBytes: cfg.MemBytes}}
	var sbs []*dsec.Sandbox
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
		defer cancel()
		if derr := destroyAll(dctx, c, sbs); derr != nil {
			err = errors.Join(err, derr)
		}
	}()
	for len(sbs) < cfg.N && ctx.Err() == nil {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		sb, err := c.Create(cctx, spec)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			if dsec.IsResourceExhausted(err) || dsec.IsUnavailable(err) {
				rep.StopReason = err.Error()
				break
			}
			return fmt.Errorf("create: %w", err)
		}
		sbs = append(sbs, sb)
	}
	rep.Held = len(sbs)
	rep.LimitsOverNode = float64(int64(rep.Held)*cfg.MemBytes) / float64(nodeBytes)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	cgs, err := sandboxMemCgroups(up.PID())
	if err != nil {
		return err
	}
	// More cgroups than sandboxes: the edge's pre-started agents have
	// theirs already.
	if len(cgs) < max(1, rep.Held) {
		return fmt.Errorf("found %d sandbox memory cgroups for %d sandboxes", len(cgs), rep.Held)
	}
	bound, where := nodeBound(cgs[0])
	rep.NodeBoundBytes, rep.NodeBoundCgroup = bound, where
	if (bound < 0 || float64(bound) > 1.05*float64(nodeBytes)) && !cfg.AllowUnbounded {
		rep.Skipped = fmt.Sprintf("dsec up --memory %s is not a cgroup bound yet: no cgroup above the sandboxes' (%s) is limited to it "+
			"(issue 14: the node bound is being made real); not touching memory, which would press on the whole host", cfg.NodeMemory, cgs[0])
		slog.Warn("pressure phase skipped", "why", rep.Skipped)
		return nil
	}
	if rep.Held <= cfg.Touchers {
		return fmt.Errorf("the node held %d sandboxes of %s, not more than the %d touchers (%s)",
			rep.Held, flagval.FormatSize(cfg.MemBytes), cfg.Touchers, rep.StopReason)
	}
	if m, err := meminfo("SwapTotal"); err == nil {
		rep.SwapTotalBytes = m["SwapTotal"]
	}
	// Which cgroup is whose is not known here, so the touchers' swap is
	// told apart from the others' by charge: memory plus swap past half
	// the touch size.
	touchers, others := sbs[:cfg.Touchers], sbs[cfg.Touchers:]

	rep.Before = runSteps(ctx, others, cfg.Steps)
	slog.Info("steps before pressure", "p50_ms", rep.Before.P50Ms, "p99_ms", rep.Before.P99Ms)
	if ctx.Err() != nil {
		return ctx.Err()
	}

	swap0, err := swapUsed()
	if err != nil {
		return err
	}
	out0, _ := vmstat("pswpout")
	oom0, _ := vmstat("oom_kill")

	// The touchers: each holds TouchBytes of random data in a dd buffer
	// (dd blocks writing it into a pipe nobody reads until the hold ends,
	// then it is drained); pipefail makes a killed dd a failed result.
	hold := time.Duration(cfg.HoldS * float64(time.Second))
	script := fmt.Sprintf("set -o pipefail; dd if=/dev/urandom bs=%d count=1 iflag=fullblock 2>/dev/null | { sleep %d; cat >/dev/null; } && echo held",
		cfg.TouchBytes, int(hold.Seconds()+0.5))
	var (
		twg     sync.WaitGroup
		tmu     sync.Mutex
		results = map[string]int{}
	)
	rep.ToucherErrors = map[string]int{}
	for _, sb := range touchers {
		twg.Go(func() {
			tctx, cancel := context.WithTimeout(ctx, hold+3*time.Minute)
			defer cancel()
			r, err := sb.ExecWith(tctx, dsec.ExecOptions{Argv: []string{"sh", "-c", script}})
			tmu.Lock()
			defer tmu.Unlock()
			switch {
			case err != nil:
				results["error: "+trunc(err.Error(), 160)]++
			case r.OOMKilled:
				rep.OOMKillsResult++
				results["oom killed"]++
			case !r.OK() || string(r.Stdout) != "held\n":
				results[fmt.Sprintf("outcome %s exit %d signal %d %s", r.Outcome, r.ExitCode, r.Signal, trunc(string(r.Stderr)+r.InfraError, 120))]++
			default:
				rep.TouchersOK++
			}
		})
	}

	// Sample swap while the touchers ramp up and hold.
	sampleDone := make(chan struct{})
	var swg sync.WaitGroup
	swg.Go(func() {
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			if s, err := swapUsed(); err == nil {
				rep.SwapPeakMiB = max(rep.SwapPeakMiB, toMiB(s-swap0))
			}
			var sum, most int64
			var in int
			var tsum, tcharge int64
			for _, cg := range cgs {
				s, err := cgroupSwap(cg)
				if err != nil {
					continue
				}
				sum += s
				most = max(most, s)
				if s > 0 {
					in++
				}
				if u, err := cgroupUsage(cg); err == nil && u+s >= cfg.TouchBytes/2 {
					tsum += s
					tcharge += u + s
				}
			}
			rep.TouchersChargePeakMiB = max(rep.TouchersChargePeakMiB, toMiB(tcharge))
			if toMiB(sum) > rep.SandboxSwapSumMiB || rep.SandboxSwapSumMiB == 0 {
				rep.SandboxSwapSumMiB, rep.SandboxSwapMaxMiB, rep.SandboxesInSwap = toMiB(sum), toMiB(most), in
				rep.TouchersSwapMiB, rep.OthersSwapMiB = toMiB(tsum), toMiB(sum-tsum)
			}
			select {
			case <-sampleDone:
				return
			case <-tick.C:
			}
		}
	})

	// Let the touchers fill their buffers (a third of the hold), then the
	// others run the same steps as before.
	select {
	case <-ctx.Done():
	case <-time.After(hold / 3):
	}
	rep.Under = runSteps(ctx, others, cfg.Steps)
	slog.Info("steps under pressure", "p50_ms", rep.Under.P50Ms, "p99_ms", rep.Under.P99Ms)
	twg.Wait()
	close(sampleDone)
	swg.Wait()
	for k, v := range results {
		rep.ToucherErrors[k] = v
	}
	if out1, err := vmstat("pswpout"); err == nil {
		rep.SwapOutMiB = float64(out1-out0) * float64(pageSize) / mib
	}
	if oom1, err := vmstat("oom_kill"); err == nil {
		rep.OOMKillsHost = oom1 - oom0
	}
	if rep.OOMKillsCgroup, err = sumCgroups(cgs, cgroupOOMKills); err != nil {
		slog.Warn("no per-cgroup OOM count", "err", err)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	var errs []error
	if rep.OOMKillsCgroup > 0 || rep.OOMKillsResult > 0 {
		errs = append(errs, fmt.Errorf("%d OOM kills in the sandboxes' cgroups, %d results OOM-killed, with touchers within their limits",
			rep.OOMKillsCgroup, rep.OOMKillsResult))
	}
	if rep.TouchersOK != cfg.Touchers {
		errs = append(errs, fmt.Errorf("%d of %d touchers held their memory: %v", rep.TouchersOK, cfg.Touchers, results))
	}
	if rep.Before.Failed+rep.Under.Failed > 0 {
		errs = append(errs, fmt.Errorf("%d steps failed before pressure, %d under", rep.Before.Failed, rep.Under.Failed))
	}
	return errors.Join(errs...)
}

var pageSize = int64(4096)

// runSteps runs n steps back to back in each sandbox, all sandboxes at once.
func runSteps(ctx context.Context, sbs []*dsec.Sandbox, n int) StepFigures {
	var (
		mu     sync.Mutex
		lats   []time.Duration
		failed int
		wg     sync.WaitGroup
	)
	for _, sb := range sbs {
		wg.Go(func() {
			for k := 0; k < n && ctx.Err() == nil; k++ {
				sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
				t := time.Now()
				r, err := sb.ExecWith(sctx, dsec.ExecOptions{Argv: []string{"sh", "-c", "echo x >>/root/p.txt && wc -l </root/p.txt"}})
				d := time.Since(t)
				cancel()
				ok := err == nil && r.OK() && strings.TrimSpace(string(r.Stdout)) != ""
				mu.Lock()
				if ok {
					lats = append(lats, d)
				} else {
					failed++
					if err == nil {
						err = fmt.Errorf("outcome %s exit %d %s", r.Outcome, r.ExitCode, r.InfraError)
					}
					slog.Warn("step failed", "sandbox", sb.ID, "err", err)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	st := dsecup.Summarize(lats)
	return StepFigures{Steps: len(lats), Failed: failed, P50Ms: dsecup.Ms(st.Median), P99Ms: dsecup.Ms(st.P99), MaxMs: dsecup.Ms(st.Max)}
}

func trunc(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}
