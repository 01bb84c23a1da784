package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// Report is one run: every round, each mode's pooled figures, and the
// overhead of the log as ratios.
type Report struct {
	Config      config        `json:"config"`
	Host        string        `json:"host"`
	WallSeconds float64       `json:"wall_seconds"`
	Rounds      []Round       `json:"rounds"`
	Modes       []ModeSummary `json:"modes"`
	Overhead    *Overhead     `json:"overhead,omitempty"`
}

// ModeSummary pools the complete rounds of one mode: latency percentiles
// over every exec of those rounds, throughput over their summed wall time.
type ModeSummary struct {
	Mode        string  `json:"mode"`
	Rounds      int     `json:"rounds"`
	Execs       int     `json:"execs"`
	WallSeconds float64 `json:"wall_seconds"`
	PerSec      float64 `json:"execs_per_sec"`
	MedianMs    float64 `json:"median_ms"`
	P90Ms       float64 `json:"p90_ms"`
	P99Ms       float64 `json:"p99_ms"`
	MaxMs       float64 `json:"max_ms"`
	MeanMs      float64 `json:"mean_ms"`
	ExecRecords int     `json:"exec_records"`
	WALBytes    int64   `json:"wal_bytes"`
	WALRecords  int     `json:"wal_records"`
}

// Overhead compares "on" with "off"; above 1 means logging costs that much
// (latency on/off, throughput off/on). The target is at most 1.10.
type Overhead struct {
	Median     float64 `json:"median_on_off"`
	P90        float64 `json:"p90_on_off"`
	P99        float64 `json:"p99_on_off"`
	Mean       float64 `json:"mean_on_off"`
	Throughput float64 `json:"throughput_off_on"`
	// PairMedians is median on/off of each round pair (round i off vs
	// round i on): how much the ratio itself moves between rounds.
	PairMedians []float64 `json:"pair_median_on_off,omitempty"`
}

// complete reports whether a round ran every exec, so its figures count.
func (r Round) complete(cfg config) bool {
	return r.Failed == 0 && r.Execs == cfg.Sandboxes*cfg.Execs
}

func (rep *Report) summarize() {
	byMode := map[string]*ModeSummary{}
	lats := map[string][]time.Duration{}
	for _, mode := range []string{modeOff, modeOn} {
		s := &ModeSummary{Mode: mode}
		for _, r := range rep.Rounds {
			if r.Mode != mode || !r.complete(rep.Config) {
				continue
			}
			s.Rounds++
			s.Execs += r.Execs
			s.WallSeconds += r.WallSeconds
			s.ExecRecords += r.ExecRecords
			s.WALBytes += r.WALBytes
			s.WALRecords += r.WALRecords
			lats[mode] = append(lats[mode], r.latencies...)
		}
		if s.Rounds == 0 {
			continue
		}
		st := dsecup.Summarize(lats[mode])
		s.MedianMs, s.P90Ms, s.P99Ms, s.MaxMs, s.MeanMs = dsecup.Ms(st.Median), dsecup.Ms(st.P90), dsecup.Ms(st.P99), dsecup.Ms(st.Max), dsecup.Ms(st.Mean)
		if s.WallSeconds > 0 {
			s.PerSec = float64(s.Execs) / s.WallSeconds
		}
		rep.Modes = append(rep.Modes, *s)
		byMode[mode] = s
	}
	off, on := byMode[modeOff], byMode[modeOn]
	if off == nil || on == nil {
		return
	}
	o := &Overhead{
		Median:     div(on.MedianMs, off.MedianMs),
		P90:        div(on.P90Ms, off.P90Ms),
		P99:        div(on.P99Ms, off.P99Ms),
		Mean:       div(on.MeanMs, off.MeanMs),
		Throughput: div(off.PerSec, on.PerSec),
	}
	for i := 1; i <= rep.Config.Rounds; i++ {
		var a, b *Round
		for j := range rep.Rounds {
			r := &rep.Rounds[j]
			if r.Round == i && r.complete(rep.Config) {
				if r.Mode == modeOff {
					a = r
				} else {
					b = r
				}
			}
		}
		if a != nil && b != nil {
			o.PairMedians = append(o.PairMedians, div(b.MedianMs, a.MedianMs))
		}
	}
	rep.Overhead = o
}

func div(a, b float64) float64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	return a / b
}

func (rep *Report) print(w io.Writer) {
	fmt.Fprintf(w, "host: %s\n", rep.Host)
	fmt.Fprintf(w, "%d sandboxes x %d execs of /bin/true each, all sandboxes in flight; %d rounds per mode; total wall time %s\n\n",
		rep.Config.Sandboxes, rep.Config.Execs, rep.Config.Rounds, time.Duration(rep.WallSeconds*float64(time.Second)).Round(time.Second))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "round\tmode\texecs\twall s\texecs/s\tmedian ms\tp90 ms\tp99 ms\tmax ms\tcreate s\trecords\tWAL recs\tWAL KiB\t")
	for _, r := range rep.Rounds {
		if r.Execs == 0 {
			fmt.Fprintf(tw, "%d\t%s\t0\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t\n", r.Round, r.Mode)
			continue
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%.2f\t%.1f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t%d\t%.0f\t\n",
			r.Round, r.Mode, r.Execs, r.WallSeconds, r.PerSec, r.MedianMs, r.P90Ms, r.P99Ms, r.MaxMs, r.CreateSeconds,
			r.ExecRecords, r.WALRecords, float64(r.WALBytes)/1024)
	}
	for _, s := range rep.Modes {
		fmt.Fprintf(tw, "all\t%s\t%d\t%.2f\t%.1f\t%.2f\t%.2f\t%.2f\t%.2f\t-\t%d\t%d\t%.0f\t\n",
			s.Mode, s.Execs, s.WallSeconds, s.PerSec, s.MedianMs, s.P90Ms, s.P99Ms, s.MaxMs, s.ExecRecords, s.WALRecords, float64(s.WALBytes)/1024)
	}
	tw.Flush()
	for _, r := range rep.Rounds {
		if r.Err != "" {
			fmt.Fprintf(w, "round %d %s: ERROR %s\n", r.Round, r.Mode, r.Err)
		}
	}
	fmt.Fprintln(w)
	o := rep.Overhead
	if o == nil {
		fmt.Fprintln(w, "overhead: n/a, no complete round of both modes")
		return
	}
	pairs := make([]string, len(o.PairMedians))
	for i, v := range o.PairMedians {
		pairs[i] = dsecup.FmtX(v)
	}
	fmt.Fprintf(w, "overhead of the trajectory log (on/off for latency, off/on for throughput; target <= 1.10x):\n")
	fmt.Fprintf(w, "  median %s  p90 %s  p99 %s  mean %s  throughput %s\n", dsecup.FmtX(o.Median), dsecup.FmtX(o.P90), dsecup.FmtX(o.P99), dsecup.FmtX(o.Mean), dsecup.FmtX(o.Throughput))
	fmt.Fprintf(w, "  median per round pair: %s\n", strings.Join(pairs, " "))
}
