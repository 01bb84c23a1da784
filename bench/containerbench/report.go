package main

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"runtime"
	"strings"
	"text/tabwriter"

	"golang.org/x/sys/unix"
)

// printHost records what the numbers were measured on and with: peers'
// versions matter as much as the machine.
func printHost(ctx context.Context, entries []entry) {
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	fmt.Printf("host: Linux %s, %d CPUs, cgroup v2 only: %v\n", unix.ByteSliceToString(uts.Release[:]), runtime.NumCPU(), cgroupV2())
	seen := map[string]bool{}
	for _, e := range entries {
		var argv []string
		switch {
		case e.name == "crun" || e.name == "runc":
			argv = []string{e.name, "--version"}
		case e.name == "bwrap":
			argv = []string{"bwrap", "--version"}
		case strings.HasPrefix(e.name, "docker"):
			argv = []string{"dockerd", "--version"}
		default:
			continue
		}
		if seen[argv[0]] {
			continue
		}
		seen[argv[0]] = true
		out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).Output()
		first := strings.SplitN(strings.TrimSpace(string(out)), "\n", 2)[0]
		if err != nil {
			first = "not available: " + err.Error()
		}
		fmt.Printf("  %s: %s\n", argv[0], first)
	}
}

func fmtMs(v float64) string { return fmt.Sprintf("%.2f", v) }

func fmtMiB(v float64) string { return fmt.Sprintf("%.2f", v/(1<<20)) }

// fmtOptMiB formats a figure that only some systems have.
func fmtOptMiB(v *float64) string {
	if v == nil {
		return "n/a"
	}
	return fmtMiB(*v)
}

// concLevels lists the C values present in any result, in first-seen order.
func concLevels(results []Result) []int {
	var cs []int
	seen := map[int]bool{}
	for _, r := range results {
		for _, c := range r.Conc {
			if !seen[c.C] {
				seen[c.C] = true
				cs = append(cs, c.C)
			}
		}
	}
	return cs
}

func concAt(r Result, c int) (ConcResult, bool) {
	for _, cr := range r.Conc {
		if cr.C == c {
			return cr, true
		}
	}
	return ConcResult{}, false
}

// printTable writes one row per system; "-" marks a figure not measured.
func printTable(w io.Writer, results []Result) {
	cs := concLevels(results)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	hdr := []string{"system", "seq n", "median ms", "p90 ms", "mean ms"}
	for _, c := range cs {
		hdr = append(hdr, fmt.Sprintf("C=%d /s", c))
	}
	hdr = append(hdr, "idle K", "host MiB/sb", "cgroup MiB/sb", "")
	fmt.Fprintln(tw, strings.Join(hdr, "\t"))
	for _, r := range results {
		row := []string{r.System}
		if r.Seq != nil {
			row = append(row, fmt.Sprint(r.Seq.N), fmtMs(r.Seq.MedianMs), fmtMs(r.Seq.P90Ms), fmtMs(r.Seq.MeanMs))
		} else {
			row = append(row, "-", "-", "-", "-")
		}
		for _, c := range cs {
			if cr, ok := concAt(r, c); ok {
				row = append(row, fmt.Sprintf("%.1f", cr.PerSec))
			} else {
				row = append(row, "-")
			}
		}
		switch {
		case r.Idle != nil:
			row = append(row, fmt.Sprint(r.Idle.K), fmtMiB(r.Idle.HostPerSandbox), fmtOptMiB(r.Idle.CgroupPerSandbox))
		case r.IdleNA != "":
			row = append(row, "n/a", "n/a", "n/a")
		default:
			row = append(row, "-", "-", "-")
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
	for _, r := range results {
		if r.IdleNA != "" {
			fmt.Fprintf(w, "%s: idle n/a: %s\n", r.System, r.IdleNA)
		}
		if r.Err != "" {
			fmt.Fprintf(w, "%s: ERROR %s\n", r.System, r.Err)
		}
	}
	fmt.Fprintf(w, "concurrent totals per level: ")
	for i, r := range results {
		if len(r.Conc) > 0 {
			if i > 0 {
				fmt.Fprint(w, " ")
			}
			fmt.Fprintf(w, "%s=%d", r.System, r.Conc[0].Total)
		}
	}
	fmt.Fprintln(w)
}

// ratio formats a/b as "17.3x", or n/a when either side is missing.
func ratio(a, b float64) string {
	if a <= 0 || b <= 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

// printRatios compares every system with the baseline, oriented so that a
// ratio above 1 always means the baseline is better: peer/base for latency
// and memory, base/peer for throughput.
func printRatios(w io.Writer, results []Result, baseline string) {
	var base *Result
	for i := range results {
		if results[i].System == baseline {
			base = &results[i]
		}
	}
	if base == nil {
		fmt.Fprintf(w, "ratios: baseline %q not in this run\n", baseline)
		return
	}
	if base.Seq == nil && len(base.Conc) == 0 && base.Idle == nil {
		fmt.Fprintf(w, "ratios against %s: n/a, it has no figures (%s)\n", baseline, base.Err)
		return
	}
	cs := concLevels(results)
	fmt.Fprintf(w, "ratios against %s (>1x means %s is better; latency and memory peer/%s, throughput %s/peer):\n", baseline, baseline, baseline, baseline)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range results {
		if r.System == baseline {
			continue
		}
		parts := []string{fmt.Sprintf("  %s/%s", r.System, baseline)}
		var seqMed, seqMean, bMed, bMean float64
		if r.Seq != nil {
			seqMed, seqMean = r.Seq.MedianMs, r.Seq.MeanMs
		}
		if base.Seq != nil {
			bMed, bMean = base.Seq.MedianMs, base.Seq.MeanMs
		}
		parts = append(parts, "seq median "+ratio(seqMed, bMed), "seq mean "+ratio(seqMean, bMean))
		for _, c := range cs {
			pr, _ := concAt(r, c)
			br, _ := concAt(*base, c)
			parts = append(parts, fmt.Sprintf("C=%d %s", c, ratio(br.PerSec, pr.PerSec)))
		}
		var ph, pc, bh, bc float64
		if r.Idle != nil {
			ph = r.Idle.HostPerSandbox
			if r.Idle.CgroupPerSandbox != nil {
				pc = *r.Idle.CgroupPerSandbox
			}
		}
		if base.Idle != nil {
			bh = base.Idle.HostPerSandbox
			if base.Idle.CgroupPerSandbox != nil {
				bc = *base.Idle.CgroupPerSandbox
			}
		}
		parts = append(parts, "host mem "+ratio(ph, bh), "cgroup mem "+ratio(pc, bc))
		fmt.Fprintln(tw, strings.Join(parts, "\t"))
	}
	tw.Flush()
}

// printPools writes what the pooled systems deferred in each phase: takes
// served warm (hits) or by a create on the caller's path (misses), resets
// and their wall time, and how long the pool kept working after the
// phase's last cycle. "settled /s" counts that time in: the throughput
// with the deferred resets paid for.
func printPools(w io.Writer, results []Result) {
	for _, r := range results {
		if len(r.Pool) == 0 {
			continue
		}
		fmt.Fprintf(w, "\n%s pool (%d ready; resets in the background, off the caller's path):\n", r.System, r.PoolSize)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "phase\thits\tmisses\tresets\treset fails\tdestroyed\treset median ms\treset p90 ms\tsettle s\tsettled /s\t")
		for _, p := range r.Pool {
			settled := "-"
			if p.SettledPerSec > 0 {
				settled = fmt.Sprintf("%.1f", p.SettledPerSec)
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%.2f\t%s\t\n", p.Phase, p.Hits, p.Misses, p.Resets,
				p.ResetFailures, p.Destroyed, fmtMs(p.ResetMedianMs), fmtMs(p.ResetP90Ms), p.SettleSeconds, settled)
		}
		tw.Flush()
	}
}
