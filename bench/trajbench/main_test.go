package main

import (
	"os/exec"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup/dsecuptest"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// harness builds this command and returns a runner for it with TMPDIR set
// to a fresh directory (everything it makes goes there).
func harness(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	return dsecuptest.Harness(t, "./bench/trajbench", args...)
}

func TestHarnessEndToEnd(t *testing.T) {
	cmd, tmp := harness(t, "-sandboxes", "4", "-execs", "3", "-rounds", "1", "-json")
	var rep Report
	dsecuptest.RunJSON(t, cmd, &rep)
	if len(rep.Rounds) != 2 || rep.Rounds[0].Mode != modeOff || rep.Rounds[1].Mode != modeOn {
		t.Fatalf("rounds %+v, want off then on", rep.Rounds)
	}
	var pids []int
	for _, r := range rep.Rounds {
		pids = append(pids, r.UpPID)
		if r.Err != "" || r.Leaks != nil {
			t.Errorf("round %s: %s (leaks %+v)", r.Mode, r.Err, r.Leaks)
		}
		if r.Execs != 12 || r.Failed != 0 || r.WallSeconds <= 0 || r.PerSec <= 0 ||
			r.MedianMs <= 0 || r.P90Ms < r.MedianMs || r.P99Ms < r.P90Ms || r.MaxMs < r.P99Ms {
			t.Errorf("round %s: bad figures %+v", r.Mode, r)
		}
		// Every exec recorded with the log on, none with it off.
		wantRecs := map[string]int{modeOff: 0, modeOn: 12}[r.Mode]
		// With the log on: per sandbox a creation record, 3 execs, a destroy.
		wantWAL := map[string]int{modeOff: 0, modeOn: 4 * 5}[r.Mode]
		if r.ExecRecords != wantRecs || r.WALRecords != wantWAL || (r.Mode == modeOn) != (r.WALBytes > 0) {
			t.Errorf("round %s: %d exec records, %d WAL records, %d WAL bytes; want %d and %d records",
				r.Mode, r.ExecRecords, r.WALRecords, r.WALBytes, wantRecs, wantWAL)
		}
	}
	if len(rep.Modes) != 2 || rep.Modes[0].Execs != 12 || rep.Modes[1].Execs != 12 {
		t.Errorf("mode summaries %+v", rep.Modes)
	}
	if o := rep.Overhead; o == nil || o.Median <= 0 || o.P90 <= 0 || o.P99 <= 0 || o.Throughput <= 0 || len(o.PairMedians) != 1 {
		t.Errorf("overhead %+v", rep.Overhead)
	}
	dsecuptest.AssertNoLeaks(t, tmp, pids)
}

// TestHarnessInterrupt stops a run while its sandboxes are executing, as
// Ctrl-C would, and checks that everything is removed.
func TestHarnessInterrupt(t *testing.T) {
	// Prebuilt binaries this time (the end-to-end test covers the build).
	cmd, tmp := harness(t, "-sandboxes", "4", "-execs", "1000000", "-rounds", "1",
		"-dsec", testutil.BuildBinary(t, "./cmd/dsec"), "-agent", testutil.BuildBinary(t, "./cmd/dsec-agent"))
	dsecuptest.Interrupt(t, cmd, tmp, "sandboxes created", 500*time.Millisecond)
}
