package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// Issue 6's targets.
const (
	targetP50Ratio = 1.5 // fncall p50 at most this times the host's
	targetPerSec   = 200 // fncall calls/s with targetC callers
	targetC        = 64
)

// Report is one run.
type Report struct {
	Config      config  `json:"config"`
	Host        string  `json:"host"`
	UpPID       int     `json:"dsec_up_pid,omitempty"`
	WallSeconds float64 `json:"wall_seconds"`
	// ImportSeconds is how long importing the language rootfs took (by
	// server path: packing it into an EROFS layer on the server).
	ImportSeconds float64 `json:"import_seconds,omitempty"`
	ImageBytes    int64   `json:"image_bytes,omitempty"`
	// Rows are every round's; Summary pools each row's complete rounds.
	Rows    []Row         `json:"rows"`
	Summary []Row         `json:"summary"`
	Ratios  *Ratios       `json:"ratios,omitempty"`
	Leaks   *dsecup.Leaks `json:"leaks,omitempty"`
	Errors  []string      `json:"errors,omitempty"`
}

// Ratios compare the rows; 0 means a side is missing.
type Ratios struct {
	// FncallHostP50 is fncall's sequential p50 over the host's (target
	// at most 1.5); RunCodeHostP50 the same for /run_code, FreshHostP50
	// for a fresh container.
	FncallHostP50  float64 `json:"fncall_host_p50"`
	RunCodeHostP50 float64 `json:"run_code_host_p50"`
	FreshHostP50   float64 `json:"fresh_host_p50"`
	// FncallFreshPerSec is fncall's concurrent throughput over a fresh
	// container's; FncallHostPerSec over the host's; RunCodeFreshPerSec
	// /run_code's over a fresh container's.
	FncallFreshPerSec  float64 `json:"fncall_fresh_per_sec"`
	FncallHostPerSec   float64 `json:"fncall_host_per_sec"`
	RunCodeFreshPerSec float64 `json:"run_code_fresh_per_sec"`
	// PerRound are the two headline ratios of each round with both
	// sides complete: how much the ratios themselves move.
	PerRound []RoundRatios `json:"per_round,omitempty"`
}

// RoundRatios are one round's fncall/host p50 and fncall/fresh container
// throughput.
type RoundRatios struct {
	Round             int     `json:"round"`
	FncallHostP50     float64 `json:"fncall_host_p50"`
	FncallFreshPerSec float64 `json:"fncall_fresh_per_sec"`
}

// row is the pooled row of that name, or nil.
func (rep *Report) row(name string) *Row {
	return find(rep.Summary, name, 0)
}

func find(rows []Row, name string, round int) *Row {
	for i := range rows {
		if rows[i].Name == name && rows[i].Round == round && rows[i].complete() {
			return &rows[i]
		}
	}
	return nil
}

func p50(r *Row) float64 {
	if r == nil || r.Seq == nil {
		return 0
	}
	return r.Seq.MedianMs
}

func perSec(r *Row) float64 {
	if r == nil || r.Conc == nil {
		return 0
	}
	return r.Conc.PerSec
}

func div(a, b float64) float64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	return a / b
}

func (rep *Report) summarize() {
	rep.Summary = nil
	for _, name := range rep.Config.Rows {
		if r := pool(rep.Rows, name); r != nil {
			rep.Summary = append(rep.Summary, *r)
		}
	}
	host, fn, rc, fresh := rep.row(rowHost), rep.row(rowFncall), rep.row(rowRunCode), rep.row(rowFresh)
	rep.Ratios = &Ratios{
		FncallHostP50:      div(p50(fn), p50(host)),
		RunCodeHostP50:     div(p50(rc), p50(host)),
		FreshHostP50:       div(p50(fresh), p50(host)),
		FncallFreshPerSec:  div(perSec(fn), perSec(fresh)),
		FncallHostPerSec:   div(perSec(fn), perSec(host)),
		RunCodeFreshPerSec: div(perSec(rc), perSec(fresh)),
	}
	for round := 1; round <= rep.Config.Rounds; round++ {
		host, fn, fresh := find(rep.Rows, rowHost, round), find(rep.Rows, rowFncall, round), find(rep.Rows, rowFresh, round)
		if fn != nil && (host != nil || fresh != nil) {
			rep.Ratios.PerRound = append(rep.Ratios.PerRound, RoundRatios{Round: round,
				FncallHostP50: div(p50(fn), p50(host)), FncallFreshPerSec: div(perSec(fn), perSec(fresh))})
		}
	}
}

// rowLabels say what each row ran.
var rowLabels = map[string]string{
	rowHost:    "host python3 -c",
	rowFncall:  "fncall RunCode",
	rowRunCode: "POST /run_code",
	rowFresh:   "fresh container",
}

func (rep *Report) print(w io.Writer) {
	c := rep.Config
	fmt.Fprintf(w, "host: %s\n", rep.Host)
	fmt.Fprintf(w, "print(1) in python, %d rounds; per row and round %d sequential calls (after %d warm-up), %d calls with %d callers in flight; fncall pool: --fn-warm %d --fn-max %d\n",
		c.Rounds, c.N, c.Warmup, c.Total, c.C, c.FnWarm, c.FnMax)
	if rep.ImportSeconds > 0 {
		fmt.Fprintf(w, "language image %s imported from %s in %.1f s (%d MiB)\n", c.Image, c.Rootfs, rep.ImportSeconds, rep.ImageBytes>>20)
	}
	fmt.Fprintf(w, "total wall time %s\n\n", time.Duration(rep.WallSeconds*float64(time.Second)).Round(time.Second))

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "round\trow\tseq n\tp50 ms\tp90 ms\tmean ms\trun p50 ms\tC\tcalls\twall s\tcalls/s\tconc p50 ms\tconc p90 ms\t")
	for _, r := range rep.Rows {
		printRow(tw, fmt.Sprint(r.Round), r)
	}
	for _, r := range rep.Summary {
		printRow(tw, "all", r)
	}
	tw.Flush()
	fmt.Fprintln(w, "run p50: the program's own run time as the sandbox measured it (sequential); the rest of a call is the way there and back")
	for _, r := range rep.Rows {
		if r.Err != "" {
			fmt.Fprintf(w, "round %d %s: ERROR %s\n", r.Round, r.Name, r.Err)
		}
	}
	if rep.Leaks != nil {
		fmt.Fprintf(w, "LEAKED (removed): %s\n", rep.Leaks)
	}
	for _, e := range rep.Errors {
		fmt.Fprintf(w, "error: %s\n", e)
	}

	x := rep.Ratios
	if x == nil {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "ratios:")
	fmt.Fprintf(w, "  p50 vs host (sequential):  fncall %s  run_code %s  fresh container %s\n",
		dsecup.FmtX(x.FncallHostP50), dsecup.FmtX(x.RunCodeHostP50), dsecup.FmtX(x.FreshHostP50))
	fmt.Fprintf(w, "  throughput (C=%d):  fncall/fresh container %s  run_code/fresh container %s  fncall/host %s\n",
		c.C, dsecup.FmtX(x.FncallFreshPerSec), dsecup.FmtX(x.RunCodeFreshPerSec), dsecup.FmtX(x.FncallHostPerSec))
	for _, pr := range x.PerRound {
		fmt.Fprintf(w, "  round %d:  fncall/host p50 %s  fncall/fresh container throughput %s\n", pr.Round, dsecup.FmtX(pr.FncallHostP50), dsecup.FmtX(pr.FncallFreshPerSec))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "targets (issue 6):")
	fmt.Fprintf(w, "  fncall p50 <= %.1fx host: %s\n", targetP50Ratio, verdict(x.FncallHostP50 > 0, x.FncallHostP50 <= targetP50Ratio, dsecup.FmtX(x.FncallHostP50)))
	fn := rep.row(rowFncall)
	switch {
	case c.C != targetC:
		fmt.Fprintf(w, "  fncall >= %d calls/s with %d callers: n/a (this run used C=%d)\n", targetPerSec, targetC, c.C)
	default:
		v := perSec(fn)
		fmt.Fprintf(w, "  fncall >= %d calls/s with %d callers: %s\n", targetPerSec, targetC, verdict(v > 0, v >= targetPerSec, fmt.Sprintf("%.1f/s", v)))
	}
}

func printRow(tw io.Writer, round string, r Row) {
	cells := fmt.Sprintf("%s\t%s\t", round, rowLabels[r.Name])
	if r.Seq != nil {
		run := "-"
		if r.Seq.RunMedianMs > 0 {
			run = fmt.Sprintf("%.2f", r.Seq.RunMedianMs)
		}
		cells += fmt.Sprintf("%d\t%.2f\t%.2f\t%.2f\t%s\t", r.Seq.N, r.Seq.MedianMs, r.Seq.P90Ms, r.Seq.MeanMs, run)
	} else {
		cells += "-\t-\t-\t-\t-\t"
	}
	if r.Conc != nil {
		cells += fmt.Sprintf("%d\t%d\t%.2f\t%.1f\t%.1f\t%.1f\t", r.Conc.C, r.Conc.Total, r.Conc.Seconds, r.Conc.PerSec, r.Conc.MedianMs, r.Conc.P90Ms)
	} else {
		cells += "-\t-\t-\t-\t-\t-\t"
	}
	fmt.Fprintln(tw, cells)
}

func verdict(measured, met bool, value string) string {
	switch {
	case !measured:
		return "not measured"
	case met:
		return value + " (met)"
	}
	return value + " (NOT met)"
}
