package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
)

// Report is one run: the phases it ran.
type Report struct {
	Config      config  `json:"config"`
	Host        string  `json:"host"`
	Started     string  `json:"started"`
	WallSeconds float64 `json:"wall_seconds"`
	UpPIDs      []int   `json:"dsec_up_pids"`
	// PhaseLoads is the 1-minute load average as each phase started.
	PhaseLoads []PhaseLoad     `json:"phase_loads"`
	Idle       *IdleReport     `json:"idle,omitempty"`
	Wave       *WaveReport     `json:"wave,omitempty"`
	Pressure   *PressureReport `json:"pressure,omitempty"`
}

// PhaseLoad is the load average as a phase started.
type PhaseLoad struct {
	Phase string  `json:"phase"`
	Load  float64 `json:"load1"`
}

func (rep *Report) print(w io.Writer) {
	fmt.Fprintf(w, "host: %s\nstarted %s, total wall time %.0f s\n", rep.Host, rep.Started, rep.WallSeconds)
	if len(rep.PhaseLoads) > 0 {
		fmt.Fprint(w, "load average as each phase started:")
		for _, l := range rep.PhaseLoads {
			fmt.Fprintf(w, " %s %.1f", l.Phase, l.Load)
		}
		fmt.Fprintln(w)
	}
	if len(rep.Config.UpArgs) > 0 {
		fmt.Fprintf(w, "dsec up extra arguments: %s\n", strings.Join(rep.Config.UpArgs, " "))
	}
	if rep.Idle != nil {
		rep.Idle.print(w)
	}
	if rep.Wave != nil {
		rep.Wave.print(w, rep.Config.Wave)
	}
	if rep.Pressure != nil {
		rep.Pressure.print(w)
	}
}

func opt(v *float64, format string) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf(format, *v)
}

func (r *IdleReport) print(w io.Writer) {
	fmt.Fprintf(w, "\nidle: sandboxes created with cpu %s / memory %s limits, held at once, each then running `echo ok`\n",
		flagval.FormatCPU(r.MilliCPU), flagval.FormatSize(r.MemBytes))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "system\twanted\theld\tcreate s\tcreates/s\texec ok\texec p50 ms\texec p99 ms\thost MiB/sb\treleased MiB/sb\tcgroup MiB/sb\tdaemon fds/sb\tdaemon RSS MiB/sb\tdestroy s\t")
	rows := []*IdleRow{&r.DSec}
	if r.Peer != nil {
		rows = append(rows, r.Peer)
	}
	for _, x := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f\t%.1f\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%s\t%s\t%s\t%.1f\t\n", x.System, x.Requested, x.Held,
			x.CreateSeconds, x.CreatesPerSec, x.ExecOK, x.ExecP50Ms, x.ExecP99Ms, x.HostMiBPerSandbox, x.HostReleasedMiBPerSandbox,
			opt(x.CgroupMiBPerSandbox, "%.2f"), opt(x.DaemonFDsPerSandbox, "%.1f"), opt(x.DaemonRSSMiBPerSandbox, "%.3f"), x.DestroySeconds)
	}
	tw.Flush()
	for _, x := range rows {
		if x.Held < x.Requested && x.StopReason != "" {
			fmt.Fprintf(w, "%s stopped at %d: %s\n", x.System, x.Held, x.StopReason)
		}
		if x.Err != "" {
			fmt.Fprintf(w, "%s: ERROR %s\n", x.System, x.Err)
		}
	}
	fmt.Fprintf(w, "targets: >= 3000 held, <= 2 MiB host memory each; dsec held %d (%s), %.2f MiB each\n",
		r.DSec.Held, met(r.DSec.Held >= 3000), r.DSec.HostMiBPerSandbox)
	if p := r.Peer; p != nil && p.Err == "" && r.DSec.Held > 0 {
		fmt.Fprintf(w, "ratios crun/dsec (>1x: dsec better): host mem %s  exec p50 %s  exec p99 %s; creates/s dsec/crun %s; held dsec/crun %s\n",
			dsecup.FmtX(p.HostMiBPerSandbox/r.DSec.HostMiBPerSandbox), dsecup.FmtX(p.ExecP50Ms/r.DSec.ExecP50Ms),
			dsecup.FmtX(p.ExecP99Ms/r.DSec.ExecP99Ms), dsecup.FmtX(r.DSec.CreatesPerSec/p.CreatesPerSec),
			dsecup.FmtX(float64(r.DSec.Held)/float64(p.Held)))
	}
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "not met"
}

func (r *WaveReport) print(w io.Writer, cfg waveConfig) {
	fmt.Fprintf(w, "\nwave: rollouts started at once, each its own workspace over busybox, cpu %g / %d MiB, %d-%d steps, think %g-%g s before each step, seed %d\n",
		cfg.CPU, cfg.MemMB, cfg.StepsMin, cfg.StepsMax, cfg.ThinkMin, cfg.ThinkMax, cfg.Seed)
	rows := []*WaveRow{}
	for _, x := range []*WaveRow{r.DSec, r.Docker} {
		if x != nil {
			rows = append(rows, x)
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "system\tR\tpeak alive\tdone\twall s\tideal s\twall/ideal\trollouts/s\tempty step p50\tempty p99\tstep p50 ms\tstep p99 ms\tp99/empty\tcreate p50 ms\tcreate p99 ms\trefusals\tinfra err\tfailures\t")
	for _, x := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f\t%.1f\t%.2f\t%.2f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.0f\t%.0f\t%d\t%d\t%d\t\n",
			x.Backend, x.R, x.PeakAlive, x.Completed, x.WallS, x.IdealS, x.WallOverIdeal, x.RolloutsPerS,
			x.Empty.StepP50Ms, x.Empty.StepP99Ms, x.StepP50Ms, x.StepP99Ms, x.StepP99OverEmpty,
			x.CreateP50Ms, x.CreateP99Ms, x.CreateRefusals, x.InfraErrors, x.Failures)
	}
	tw.Flush()
	for _, x := range rows {
		fmt.Fprintf(w, "%s: last create returned %.1f s into the wave; the %d steps after it: p50 %.1f ms, p99 %.1f ms\n",
			x.Backend, x.LastCreateS, x.SteadySteps, x.SteadyStepP50Ms, x.SteadyStepP99Ms)
		for _, kinds := range []map[string]int{x.InfraErrorKinds, x.FailureKinds} {
			for _, k := range sortedKeys(kinds) {
				fmt.Fprintf(w, "%s: %d x %s\n", x.Backend, kinds[k], k)
			}
		}
		if x.Err != "" {
			fmt.Fprintf(w, "%s: ERROR %s\n", x.Backend, x.Err)
		}
	}
	if d := r.DSec; d != nil && d.WallS > 0 {
		fmt.Fprintf(w, "targets (dsec): all %d alive at once: %s (peak %d); wall <= 1.2x ideal: %s (%.2fx); step p99 <= 2x empty: %s (%.2fx); 0 infra errors: %s (%d)\n",
			d.R, met(d.PeakAlive == d.R), d.PeakAlive, met(d.WallOverIdeal <= 1.2), d.WallOverIdeal,
			met(d.StepP99OverEmpty <= 2), d.StepP99OverEmpty, met(d.InfraErrors == 0), d.InfraErrors)
		if k := r.Docker; k != nil && k.WallS > 0 {
			fmt.Fprintf(w, "ratios docker/dsec (>1x: dsec better): wall/ideal %s  step p50 %s  step p99 %s; rollouts/s dsec/docker %s\n",
				dsecup.FmtX(k.WallOverIdeal/d.WallOverIdeal), dsecup.FmtX(k.StepP50Ms/d.StepP50Ms),
				dsecup.FmtX(k.StepP99Ms/d.StepP99Ms), dsecup.FmtX(d.RolloutsPerS/k.RolloutsPerS))
		}
	}
}

func sortedKeys(m map[string]int) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func (r *PressureReport) print(w io.Writer) {
	fmt.Fprintf(w, "\npressure: node --memory %s, swap %s; %d sandboxes of %s wanted, %d touching %s each\n",
		r.NodeMemory, r.Swap, r.Requested, flagval.FormatSize(r.MemBytes), r.Touchers, flagval.FormatSize(r.TouchBytes))
	if r.Held > 0 {
		fmt.Fprintf(w, "held %d (limits %.2fx the node)", r.Held, r.LimitsOverNode)
		if r.StopReason != "" {
			fmt.Fprintf(w, ", stopped by: %s", r.StopReason)
		}
		fmt.Fprintln(w)
	}
	if r.Skipped != "" {
		fmt.Fprintf(w, "SKIPPED: %s\n", r.Skipped)
		if r.Err != "" {
			fmt.Fprintf(w, "ERROR %s\n", r.Err)
		}
		return
	}
	if r.NodeBoundBytes > 0 {
		fmt.Fprintf(w, "node bound %s at %s, swap total %s\n", flagval.FormatSize(r.NodeBoundBytes), r.NodeBoundCgroup, flagval.FormatSize(r.SwapTotalBytes))
	} else {
		fmt.Fprintf(w, "no node bound (-allow-unbounded), swap total %s\n", flagval.FormatSize(r.SwapTotalBytes))
	}
	fmt.Fprintf(w, "steps of the other sandboxes: before p50 %.1f ms p99 %.1f ms (%d); under pressure p50 %.1f ms p99 %.1f ms (%d); ratio p50 %s p99 %s\n",
		r.Before.P50Ms, r.Before.P99Ms, r.Before.Steps, r.Under.P50Ms, r.Under.P99Ms, r.Under.Steps,
		dsecup.FmtX(r.Under.P50Ms/r.Before.P50Ms), dsecup.FmtX(r.Under.P99Ms/r.Before.P99Ms))
	fmt.Fprintf(w, "touchers held their memory: %d of %d (%.0f MiB in all at the peak); OOM kills: %d in sandbox cgroups, %d results (host-wide counter +%d)\n",
		r.TouchersOK, r.Touchers, r.TouchersChargePeakMiB, r.OOMKillsCgroup, r.OOMKillsResult, r.OOMKillsHost)
	fmt.Fprintf(w, "paged out: host swap peak +%.0f MiB, %.0f MiB written to swap; sandboxes at the peak: %.0f MiB in swap over %d of them (largest %.0f MiB; touchers %.0f, others %.0f)\n",
		r.SwapPeakMiB, r.SwapOutMiB, r.SandboxSwapSumMiB, r.SandboxesInSwap, r.SandboxSwapMaxMiB, r.TouchersSwapMiB, r.OthersSwapMiB)
	for _, k := range sortedKeys(r.ToucherErrors) {
		fmt.Fprintf(w, "toucher: %d x %s\n", r.ToucherErrors[k], k)
	}
	if r.Err != "" {
		fmt.Fprintf(w, "ERROR %s\n", r.Err)
	}
}
