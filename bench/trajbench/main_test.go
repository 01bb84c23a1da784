package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/testutil"
)

func TestSummarize(t *testing.T) {
	var ds []time.Duration
	for v := 100; v >= 1; v-- {
		ds = append(ds, time.Duration(v)*time.Millisecond)
	}
	st := summarize(ds)
	want := stats{median: 50 * time.Millisecond, p90: 90 * time.Millisecond, p99: 99 * time.Millisecond,
		max: 100 * time.Millisecond, mean: 50500 * time.Microsecond}
	if st != want {
		t.Fatalf("summarize = %+v, want %+v", st, want)
	}
	if ds[0] != 100*time.Millisecond {
		t.Fatal("summarize sorted its input in place")
	}
	if one := summarize([]time.Duration{7}); one.median != 7 || one.p99 != 7 || one.max != 7 {
		t.Fatalf("summarize of one sample = %+v", one)
	}
}

func TestUnescapeMount(t *testing.T) {
	if got := unescapeMount(`/tmp/a\040b\134c`); got != `/tmp/a b\c` {
		t.Fatalf("unescapeMount = %q", got)
	}
}

// harness builds this command and returns a runner for it with TMPDIR set
// to a fresh directory (everything it makes goes there).
func harness(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, "./bench/trajbench")
	tmp := t.TempDir()
	cmd := exec.Command(bin, args...)
	cmd.Dir = testutil.RepoRoot(t)
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
	return cmd, tmp
}

// assertNoLeaks checks what a run may leave behind: files in its TMPDIR,
// mounts under it, processes started from binaries under it, and the
// sandbox cgroups of its dsec up processes (a cgroup can only be removed
// once no process is left in it, so a leaked sandbox shows up here too).
func assertNoLeaks(t *testing.T, tmp string, upPIDs []int) {
	t.Helper()
	if ents, err := os.ReadDir(tmp); err != nil || len(ents) != 0 {
		t.Errorf("harness left %d entries in its TMPDIR (%v)", len(ents), err)
	}
	if mps, err := mountsUnder(tmp); err != nil || len(mps) != 0 {
		t.Errorf("harness left mounts %v (%v)", mps, err)
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		if err == nil && strings.HasPrefix(exe, tmp+"/") {
			t.Errorf("process %s (%s) left running", e.Name(), exe)
		}
	}
	if len(upPIDs) == 0 {
		t.Error("no dsec up pid to check")
	}
	for _, pid := range upPIDs {
		if cgs, err := sandboxCgroups(pid); err != nil || len(cgs) != 0 {
			t.Errorf("dsec up %d left cgroups %v (%v)", pid, cgs, err)
		}
	}
}

func TestHarnessEndToEnd(t *testing.T) {
	cmd, tmp := harness(t, "-sandboxes", "4", "-execs", "3", "-rounds", "1", "-json")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("harness: %v\n%s\n%s", err, out, stderr.String())
	}
	var rep Report
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("harness JSON: %v\n%s", err, out)
	}
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
	assertNoLeaks(t, tmp, pids)
}

// TestHarnessInterrupt stops a run while its sandboxes are executing, as
// Ctrl-C would, and checks that everything is removed.
func TestHarnessInterrupt(t *testing.T) {
	// Prebuilt binaries this time (the end-to-end test covers the build).
	cmd, tmp := harness(t, "-sandboxes", "4", "-execs", "1000000", "-rounds", "1",
		"-dsec", testutil.BuildBinary(t, "./cmd/dsec"), "-agent", testutil.BuildBinary(t, "./cmd/dsec-agent"))
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pidRE := regexp.MustCompile(`started dsec up" pid=(\d+)`)
	var (
		log  strings.Builder
		pids []int
	)
	sc := bufio.NewScanner(stderr)
	created := false
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if m := pidRE.FindStringSubmatch(sc.Text()); m != nil {
			pid, _ := strconv.Atoi(m[1])
			pids = append(pids, pid)
		}
		if strings.Contains(sc.Text(), "sandboxes created") {
			created = true
			break
		}
	}
	if !created {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("harness never created its sandboxes:\n%s", log.String())
	}
	time.Sleep(500 * time.Millisecond) // execs in flight
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
	}
	if err := cmd.Wait(); err == nil {
		t.Errorf("interrupted harness exited 0")
	}
	if !strings.Contains(log.String(), "context canceled") {
		t.Errorf("harness did not report the interruption")
	}
	if strings.Contains(log.String(), "dsec up left") || strings.Contains(log.String(), "no clean stop") {
		t.Errorf("dsec up did not stop cleanly")
	}
	assertNoLeaks(t, tmp, pids)
	if t.Failed() {
		t.Logf("harness output:\n%s", log.String())
	}
}
