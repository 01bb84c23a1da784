package dsecup

// Report helpers: nearest-rank statistics, number formats, the host line.

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Stats summarizes a latency sample.
type Stats struct{ Median, P90, P99, Max, Mean time.Duration }

// Summarize computes nearest-rank percentiles of ds (not modified).
func Summarize(ds []time.Duration) Stats {
	if len(ds) == 0 {
		return Stats{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return Stats{
		Median: Percentile(s, 50),
		P90:    Percentile(s, 90),
		P99:    Percentile(s, 99),
		Max:    s[len(s)-1],
		Mean:   sum / time.Duration(len(s)),
	}
}

// Percentile is the nearest-rank p-th percentile of sorted s.
func Percentile(s []time.Duration, p float64) time.Duration {
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	rank = max(1, min(rank, len(s)))
	return s[rank-1]
}

// Ms is d in (fractional) milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// FmtMs formats milliseconds with about three significant digits.
func FmtMs(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f ms", v)
	case v >= 10:
		return fmt.Sprintf("%.1f ms", v)
	}
	return fmt.Sprintf("%.2f ms", v)
}

// FmtX formats a ratio as "1.23x", or "n/a" when there is none.
func FmtX(v float64) string {
	if v <= 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.2fx", v)
}

// HostLine describes the machine: kernel, CPUs, each of extra (", "
// before each), and the load average at start.
func HostLine(extra ...string) string {
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	var load string
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		const scale = 1 << 16 // SI_LOAD_SHIFT
		load = fmt.Sprintf(", load average at start %.2f %.2f %.2f",
			float64(si.Loads[0])/scale, float64(si.Loads[1])/scale, float64(si.Loads[2])/scale)
	}
	var more strings.Builder
	for _, e := range extra {
		more.WriteString(", " + e)
	}
	return fmt.Sprintf("Linux %s, %d CPUs%s%s", unix.ByteSliceToString(uts.Release[:]), runtime.NumCPU(), more.String(), load)
}
