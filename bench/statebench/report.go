package main

import (
	"fmt"
	"io"
	"maps"
	"os/exec"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// Figures, in report order.
const (
	figPack     = "pack_diff"
	figCkpt     = "checkpoint"
	figRollback = "rollback"
	figFreeze   = "freeze_job"
	figThaw     = "thaw_job"
)

var figures = []string{figPack, figCkpt, figRollback, figFreeze, figThaw}

// Report is one run: every row measured, the DSec/peer ratios, and what
// was skipped, failed or leaked.
type Report struct {
	Config      config            `json:"config"`
	Host        string            `json:"host"`
	Tools       map[string]string `json:"tools,omitempty"`
	HarnessPID  int               `json:"harness_pid"`
	UpPID       int               `json:"dsec_up_pid"`
	WallSeconds float64           `json:"wall_seconds"`
	// JobCreateSeconds is how long creating the job's K sandboxes took
	// (CreateMany in batches; not a compared figure).
	JobCreateSeconds float64       `json:"job_create_seconds,omitempty"`
	Rows             []Row         `json:"rows"`
	Ratios           []Ratio       `json:"ratios"`
	Skipped          []string      `json:"skipped,omitempty"`
	Leaks            *dsecup.Leaks `json:"leaks,omitempty"`
	Errors           []string      `json:"errors,omitempty"`
}

// Row is one system's figure. Latencies are in milliseconds, nearest-rank
// percentiles over the repetitions.
type Row struct {
	Figure string `json:"figure"`
	System string `json:"system"`
	DSec   bool   `json:"dsec"`
	N      int    `json:"n"`
	// Items is how many sandboxes, containers or cgroups one sample acts
	// on (job rows only).
	Items    int     `json:"items,omitempty"`
	MedianMs float64 `json:"median_ms"`
	P90Ms    float64 `json:"p90_ms"`
	MeanMs   float64 `json:"mean_ms"`
	// PerItemMs is MedianMs / Items; AtKMs is it times K: the figure
	// compared with DSec's job of K sandboxes. Extrapolated is true when
	// Items != K (the sequential OCI peer runs on fewer containers).
	PerItemMs    float64 `json:"per_item_ms,omitempty"`
	AtKMs        float64 `json:"at_k_ms,omitempty"`
	Extrapolated bool    `json:"extrapolated,omitempty"`
	TargetMs     float64 `json:"target_ms,omitempty"`
	Note         string  `json:"note,omitempty"`
	// SamplesMs are the repetitions in the order they ran.
	SamplesMs []float64 `json:"samples_ms"`
}

// compared is the figure a ratio uses: the median, scaled to K for the
// job rows.
func (r Row) compared() float64 {
	if r.Items > 0 {
		return r.AtKMs
	}
	return r.MedianMs
}

// Ratio is DSec's figure over a peer's: above 1x DSec is slower.
type Ratio struct {
	Figure string  `json:"figure"`
	Peer   string  `json:"peer"`
	DSecMs float64 `json:"dsec_ms"`
	PeerMs float64 `json:"peer_ms"`
	Ratio  float64 `json:"dsec_over_peer"`
	// Extrapolated is the peer's figure scaled from fewer items to K.
	Extrapolated bool `json:"extrapolated,omitempty"`
}

// targetsMs are issue 5's targets for DSec's rows.
var targetsMs = map[string]float64{figPack: 100, figCkpt: 20, figRollback: 50, figFreeze: 2000, figThaw: 2000}

// addRow summarizes samples as a row. items > 0 marks a job row acting on
// items things per sample, scaled to k.
func (rep *Report) addRow(figure, system string, isDSec bool, samples []time.Duration, items int, note string) {
	if len(samples) == 0 {
		return
	}
	st := dsecup.Summarize(samples)
	r := Row{Figure: figure, System: system, DSec: isDSec, N: len(samples), Items: items,
		MedianMs: dsecup.Ms(st.Median), P90Ms: dsecup.Ms(st.P90), MeanMs: dsecup.Ms(st.Mean), Note: note}
	for _, d := range samples {
		r.SamplesMs = append(r.SamplesMs, dsecup.Ms(d))
	}
	if items > 0 {
		r.PerItemMs = r.MedianMs / float64(items)
		r.AtKMs = r.PerItemMs * float64(rep.Config.K)
		r.Extrapolated = items != rep.Config.K
	}
	if isDSec {
		r.TargetMs = targetsMs[figure]
	}
	rep.Rows = append(rep.Rows, r)
}

func (rep *Report) addLeaks(l dsecup.Leaks) {
	if l.Empty() {
		return
	}
	if rep.Leaks == nil {
		rep.Leaks = &dsecup.Leaks{}
	}
	rep.Leaks.Mounts = append(rep.Leaks.Mounts, l.Mounts...)
	rep.Leaks.Cgroups = append(rep.Leaks.Cgroups, l.Cgroups...)
	rep.Leaks.Processes = append(rep.Leaks.Processes, l.Processes...)
}

// summarize sorts the rows by figure and computes every DSec/peer ratio.
func (rep *Report) summarize() {
	slices.SortStableFunc(rep.Rows, func(a, b Row) int {
		return slices.Index(figures, a.Figure) - slices.Index(figures, b.Figure)
	})
	rep.Ratios = nil
	for _, d := range rep.Rows {
		if !d.DSec || d.compared() <= 0 {
			continue
		}
		for _, p := range rep.Rows {
			if p.DSec || p.Figure != d.Figure || p.compared() <= 0 {
				continue
			}
			rep.Ratios = append(rep.Ratios, Ratio{Figure: d.Figure, Peer: p.System, DSecMs: d.compared(), PeerMs: p.compared(),
				Ratio: d.compared() / p.compared(), Extrapolated: p.Extrapolated})
		}
	}
}

// figureLabel names a figure with its size, as the issue states targets.
func (rep *Report) figureLabel(fig string) string {
	switch fig {
	case figPack:
		return fmt.Sprintf("pack_diff %d MiB", rep.Config.PackMiB)
	case figCkpt:
		return fmt.Sprintf("checkpoint %d MiB", rep.Config.CkptMiB)
	case figRollback:
		return fmt.Sprintf("rollback %d MiB", rep.Config.CkptMiB)
	case figFreeze:
		return fmt.Sprintf("job freeze K=%d", rep.Config.K)
	case figThaw:
		return fmt.Sprintf("job thaw K=%d", rep.Config.K)
	}
	return fig
}

func (rep *Report) print(w io.Writer) {
	fmt.Fprintf(w, "host: %s\n", rep.Host)
	for _, name := range slices.Sorted(maps.Keys(rep.Tools)) {
		fmt.Fprintf(w, "  %s: %s\n", name, rep.Tools[name])
	}
	fmt.Fprintf(w, "k=%d peers=%d reps=%d, total wall time %s", rep.Config.K, rep.Config.Peers, rep.Config.Reps,
		time.Duration(rep.WallSeconds*float64(time.Second)).Round(time.Second))
	if rep.JobCreateSeconds > 0 {
		fmt.Fprintf(w, " (creating the job's %d sandboxes: %.1f s)", rep.Config.K, rep.JobCreateSeconds)
	}
	fmt.Fprint(w, "\n\n")

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "figure\tsystem\tn\titems\tmedian ms\tp90 ms\tmean ms\tper item ms\tat K ms\ttarget ms\t")
	last := ""
	for _, r := range rep.Rows {
		label := ""
		if r.Figure != last {
			label = rep.figureLabel(r.Figure)
			last = r.Figure
		}
		items, per, atK, target := "-", "-", "-", "-"
		if r.Items > 0 {
			items = fmt.Sprint(r.Items)
			per = fmt.Sprintf("%.3f", r.PerItemMs)
			atK = fmt.Sprintf("%.1f", r.AtKMs)
			if r.Extrapolated {
				atK += "*"
			}
		}
		if r.TargetMs > 0 {
			target = fmt.Sprintf("%.0f", r.TargetMs)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%.2f\t%.2f\t%.2f\t%s\t%s\t%s\t\n", label, r.System, r.N, items,
			r.MedianMs, r.P90Ms, r.MeanMs, per, atK, target)
	}
	tw.Flush()
	if slices.ContainsFunc(rep.Rows, func(r Row) bool { return r.Extrapolated }) {
		fmt.Fprintf(w, "* extrapolated: the per-item median times K=%d (the peer ran on fewer items, one after another)\n", rep.Config.K)
	}
	var notes []string
	for _, r := range rep.Rows {
		if r.Note != "" {
			notes = append(notes, fmt.Sprintf("  %s / %s: %s", r.Figure, r.System, r.Note))
		}
	}
	if len(notes) > 0 {
		fmt.Fprintln(w, "notes:")
		for _, n := range notes {
			fmt.Fprintln(w, n)
		}
	}

	fmt.Fprintln(w)
	if len(rep.Ratios) == 0 {
		fmt.Fprintln(w, "ratios: n/a (no DSec row with a peer)")
	} else {
		fmt.Fprintln(w, "ratios, DSec/peer on the median (at K for the job rows; >1x means DSec is slower):")
		for _, r := range rep.Ratios {
			var d Row
			for _, x := range rep.Rows {
				if x.DSec && x.Figure == r.Figure {
					d = x
				}
			}
			verdict := "met"
			if d.compared() > d.TargetMs {
				verdict = "MISSED"
			}
			ext := ""
			if r.Extrapolated {
				ext = " (extrapolated)"
			}
			fmt.Fprintf(w, "  %s: median %s (target %s, %s) vs %s %s%s: %s\n", rep.figureLabel(r.Figure), dsecup.FmtMs(r.DSecMs),
				fmt.Sprintf("%.0f ms", d.TargetMs), verdict, r.Peer, dsecup.FmtMs(r.PeerMs), ext, dsecup.FmtX(r.Ratio))
		}
	}
	for _, s := range rep.Skipped {
		fmt.Fprintf(w, "skipped: %s\n", s)
	}
	if rep.Leaks != nil {
		fmt.Fprintf(w, "LEAKED (removed): %s\n", rep.Leaks)
	}
	for _, e := range rep.Errors {
		fmt.Fprintf(w, "ERROR: %s\n", e)
	}
}

// toolVersions records the peers' versions (first line of --version).
func toolVersions(rt string) map[string]string {
	out := map[string]string{}
	tools := [][]string{{"tar", "--version"}, {"cp", "--version"}, {"mkfs.erofs", "--version"}, {"mksquashfs", "-version"}}
	if rt != "" {
		tools = append(tools, []string{rt, "--version"})
	}
	for _, t := range tools {
		if _, err := exec.LookPath(t[0]); err != nil {
			continue
		}
		b, _ := exec.Command(t[0], t[1:]...).CombinedOutput()
		line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
		if t[0] == "mkfs.erofs" {
			// 1.5 has no version option; ask the package.
			v, _ := exec.Command("dpkg-query", "-W", "-f", "${Version}", "erofs-utils").Output()
			line = "erofs-utils " + strings.TrimSpace(string(v))
		}
		out[t[0]] = line
	}
	return out
}

// hostLine describes the machine, its cgroup layout included.
func hostLine() string { return dsecup.HostLine("cgroup " + cgroupLayout()) }
