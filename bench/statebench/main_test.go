package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/bench/internal/dsecup/dsecuptest"
	"github.com/dsec-dev/dsec/internal/testutil"
)

func TestRatiosAndExtrapolation(t *testing.T) {
	rep := &Report{Config: config{K: 1000, PackMiB: 10}}
	rep.addRow(figFreeze, "dsec FreezeJob", true, []time.Duration{time.Second}, 1000, "")
	rep.addRow(figFreeze, "crun pause", false, []time.Duration{200 * time.Millisecond}, 100, "")
	rep.addRow(figPack, "dsec Snapshot", true, []time.Duration{60 * time.Millisecond}, 0, "")
	rep.addRow(figPack, "tar -cf", false, []time.Duration{30 * time.Millisecond}, 0, "")
	rep.summarize()
	if rep.Rows[0].Figure != figPack {
		t.Fatalf("rows not in figure order: %+v", rep.Rows)
	}
	if len(rep.Ratios) != 2 {
		t.Fatalf("ratios %+v", rep.Ratios)
	}
	if r := rep.Ratios[0]; r.Figure != figPack || r.Ratio != 2 {
		t.Errorf("pack ratio %+v, want 2x", r)
	}
	// 2 ms per container, 2000 ms for K=1000: DSec's 1000 ms is 0.5x.
	if r := rep.Ratios[1]; r.PeerMs != 2000 || r.Ratio != 0.5 || !r.Extrapolated {
		t.Errorf("freeze ratio %+v, want 0.5x against an extrapolated 2000 ms", r)
	}
	var out bytes.Buffer
	rep.print(&out)
	for _, s := range []string{"pack_diff 10 MiB", "vs tar -cf 30.0 ms: 2.00x", "2000.0*", "extrapolated"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, out.String())
		}
	}
}

// TestEndToEnd runs the harness with tiny parameters against a real dsec
// up and checks that every figure has its DSec row and a peer row, and
// that nothing is left behind.
func TestEndToEnd(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tool := range []string{"busybox", "mkfs.erofs", "tar", "cp"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	cmd, tmp := dsecuptest.Harness(t, "./bench/statebench", "-k", "5", "-peers", "3", "-reps", "2", "-json",
		"-dsec", testutil.BuildBinary(t, "./cmd/dsec"), "-agent", testutil.BuildBinary(t, "./cmd/dsec-agent"))
	var rep Report
	stderr := dsecuptest.RunJSON(t, cmd, &rep)
	if len(rep.Errors) > 0 || rep.Leaks != nil {
		t.Errorf("errors %q, leaks %+v", rep.Errors, rep.Leaks)
	}

	_, crunErr := exec.LookPath("crun")
	_, runcErr := exec.LookPath("runc")
	ociPeer := crunErr == nil || runcErr == nil
	want := map[string][]string{
		figPack:     {"dsec Snapshot", "tar -cf", "mkfs.erofs + fsync"},
		figCkpt:     {"dsec Checkpoint", "cp -a"},
		figRollback: {"dsec Rollback", "destroy+create"},
		figFreeze:   {"dsec FreezeJob", "cgroup freezer floor"},
		figThaw:     {"dsec ThawJob", "cgroup freezer floor"},
	}
	if ociPeer {
		want[figFreeze] = append(want[figFreeze], rep.Config.Runtime+" pause")
		want[figThaw] = append(want[figThaw], rep.Config.Runtime+" resume")
	}
	for fig, systems := range want {
		for _, sys := range systems {
			var row *Row
			for i := range rep.Rows {
				if rep.Rows[i].Figure == fig && rep.Rows[i].System == sys {
					row = &rep.Rows[i]
				}
			}
			switch {
			case row == nil:
				t.Errorf("no %s row for %s", fig, sys)
			case row.N != 2 || row.MedianMs <= 0 || row.P90Ms < row.MedianMs:
				t.Errorf("%s %s: bad figures %+v", fig, sys, *row)
			case row.DSec != strings.HasPrefix(sys, "dsec ") || (row.DSec && row.TargetMs <= 0):
				t.Errorf("%s %s: dsec=%v target=%v", fig, sys, row.DSec, row.TargetMs)
			}
		}
		ratios := 0
		for _, r := range rep.Ratios {
			if r.Figure == fig && r.Ratio > 0 {
				ratios++
			}
		}
		if ratios < len(systems)-1 {
			t.Errorf("%s: %d ratios, want at least %d", fig, ratios, len(systems)-1)
		}
	}
	for _, r := range rep.Rows {
		if r.Figure == figFreeze || r.Figure == figThaw {
			wantItems := 5
			if !r.DSec && r.System != "cgroup freezer floor" {
				wantItems = 3
			}
			if r.Items != wantItems || r.AtKMs <= 0 || r.Extrapolated != (wantItems != 5) {
				t.Errorf("%s %s: items %d at K %.2f extrapolated %v", r.Figure, r.System, r.Items, r.AtKMs, r.Extrapolated)
			}
		}
	}
	assertNoLeaks(t, tmp, rep.UpPID, rep.HarnessPID)
	if t.Failed() {
		t.Logf("harness log:\n%s", stderr)
	}
}

// TestInterrupt stops a run in the middle of the job phase, as Ctrl-C
// would (sandboxes frozen or thawed, containers paused or not), and checks
// that it reports what it measured, fails, and leaves nothing behind.
func TestInterrupt(t *testing.T) {
	cmd, tmp := dsecuptest.Harness(t, "./bench/statebench", "-k", "10", "-peers", "2", "-reps", "1000000", "-phases", "job", "-json",
		"-dsec", testutil.BuildBinary(t, "./cmd/dsec"), "-agent", testutil.BuildBinary(t, "./cmd/dsec-agent"))
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	sc := bufio.NewScanner(stderr)
	reps := 0
	for reps < 2 && sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "job repetition") {
			reps++
		}
	}
	if reps < 2 {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("harness never reached its job repetitions:\n%s", log.String())
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
	}
	if err := cmd.Wait(); err == nil {
		t.Errorf("interrupted harness exited 0")
	}
	var rep Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("harness JSON: %v\n%s\n%s", err, stdout.String(), log.String())
	}
	if !strings.Contains(strings.Join(rep.Errors, "\n"), "context canceled") {
		t.Errorf("harness did not report the interruption: %q", rep.Errors)
	}
	if rep.Leaks != nil {
		t.Errorf("leaks %+v", rep.Leaks)
	}
	measured := false
	for _, r := range rep.Rows {
		measured = measured || (r.Figure == figFreeze && r.DSec && r.N >= 2)
	}
	if !measured {
		t.Errorf("the repetitions done before the interruption are not reported: %+v", rep.Rows)
	}
	assertNoLeaks(t, tmp, rep.UpPID, rep.HarnessPID)
	if t.Failed() {
		t.Logf("harness log:\n%s", log.String())
	}
}

// assertNoLeaks checks what a run may leave behind (see
// dsecuptest.AssertNoLeaks), and the harness's own peer cgroups (a cgroup
// can only be removed once no process is left in it, so a leaked container
// or sleep shows up here too).
func assertNoLeaks(t *testing.T, tmp string, upPID, harnessPID int) {
	t.Helper()
	var upPIDs []int
	if upPID != 0 {
		upPIDs = append(upPIDs, upPID)
	}
	dsecuptest.AssertNoLeaks(t, tmp, upPIDs)
	if harnessPID == 0 {
		t.Error("no harness pid to check")
	} else if cgs, err := dsecup.HarnessCgroups(cgroupPrefix, harnessPID); err != nil || len(cgs) != 0 {
		t.Errorf("harness left cgroups %v (%v)", cgs, err)
	}
}
