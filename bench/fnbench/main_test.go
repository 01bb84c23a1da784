package main

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/bench/internal/dsecup/dsecuptest"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// langRootfs returns the language rootfs the fncall tests build (or
// DSEC_LANG_ROOTFS), skipping the test when it is missing: building it
// takes minutes and the Debian mirror, which is the fncall tests' job, not
// this harness's.
func langRootfs(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("DSEC_LANG_ROOTFS")
	if dir == "" {
		dir = DefaultLangRootfs
	}
	if err := checkRootfs(dir); err != nil {
		t.Skipf("no language rootfs (run the fncall tests, or `sudo scripts/langimage.sh %s`, first): %v", dir, err)
	}
	return dir
}

// harness builds this command and returns a runner for it with TMPDIR set
// to a fresh directory (everything it makes goes there).
func harness(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	return dsecuptest.Harness(t, "./bench/fnbench", args...)
}

func TestHarnessEndToEnd(t *testing.T) {
	rootfs := langRootfs(t)
	const rounds, n, total = 2, 3, 8
	cmd, tmp := harness(t, "-rootfs", rootfs, "-rounds", strconv.Itoa(rounds), "-n", strconv.Itoa(n), "-warmup", "1",
		"-total", strconv.Itoa(total), "-c", "3", "-fn-warm", "1", "-fn-max", "2", "-json")
	var rep Report
	dsecuptest.RunJSON(t, cmd, &rep)
	if len(rep.Errors) != 0 || rep.Leaks != nil {
		t.Errorf("errors %q, leaks %+v", rep.Errors, rep.Leaks)
	}
	if len(rep.Rows) != rounds*len(allRows) {
		t.Fatalf("%d rows, want %d rounds of %v", len(rep.Rows), rounds, allRows)
	}
	for i, r := range rep.Rows {
		if want := allRows[i%len(allRows)]; r.Name != want || r.Round != 1+i/len(allRows) || r.Err != "" {
			t.Errorf("row %d: %q round %d, error %q; want %q round %d without error", i, r.Name, r.Round, r.Err, want, 1+i/len(allRows))
			continue
		}
		checkRow(t, r, n, total)
	}
	if len(rep.Summary) != len(allRows) {
		t.Fatalf("summary %+v, want one row each of %v", rep.Summary, allRows)
	}
	for _, r := range rep.Summary {
		// Pooled over the rounds.
		checkRow(t, r, rounds*n, rounds*total)
	}
	if x := rep.Ratios; x == nil || x.FncallHostP50 <= 0 || x.RunCodeHostP50 <= 0 || x.FreshHostP50 <= 0 ||
		x.FncallFreshPerSec <= 0 || x.FncallHostPerSec <= 0 || x.RunCodeFreshPerSec <= 0 || len(x.PerRound) != rounds {
		t.Errorf("ratios %+v", rep.Ratios)
	}
	if rep.ImportSeconds <= 0 || rep.ImageBytes <= 0 {
		t.Errorf("language image import: %.1f s, %d bytes", rep.ImportSeconds, rep.ImageBytes)
	}
	dsecuptest.AssertNoLeaks(t, tmp, []int{rep.UpPID})
}

// checkRow checks one row's figures: n sequential calls, total concurrent
// ones with 3 callers, percentiles in order.
func checkRow(t *testing.T, r Row, n, total int) {
	t.Helper()
	if r.Seq == nil || r.Seq.N != n || r.Seq.MedianMs <= 0 || r.Seq.P90Ms < r.Seq.MedianMs {
		t.Errorf("%s round %d: bad sequential figures %+v", r.Name, r.Round, r.Seq)
	}
	// The sandbox's own run time is part of each call's round trip; the
	// host row has none.
	if r.Seq != nil && ((r.Name == rowHost) != (r.Seq.RunMedianMs == 0) || r.Seq.RunMedianMs > r.Seq.MedianMs) {
		t.Errorf("%s round %d: run time %.2f ms against round trips p50 %.2f ms", r.Name, r.Round, r.Seq.RunMedianMs, r.Seq.MedianMs)
	}
	if r.Conc == nil || r.Conc.C != 3 || r.Conc.Total != total || r.Conc.PerSec <= 0 || r.Conc.P90Ms < r.Conc.MedianMs {
		t.Errorf("%s round %d: bad concurrent figures %+v", r.Name, r.Round, r.Conc)
	}
}

// TestHarnessInterrupt stops a run while fresh containers are being
// created, used and destroyed by several callers, as Ctrl-C would, and
// checks that everything is removed.
func TestHarnessInterrupt(t *testing.T) {
	rootfs := langRootfs(t)
	// Prebuilt binaries this time (the end-to-end test covers the build).
	cmd, tmp := harness(t, "-rootfs", rootfs, "-rows", "fresh", "-rounds", "1", "-n", "1", "-warmup", "0", "-total", "1000000", "-c", "4",
		"-dsec", testutil.BuildBinary(t, "./cmd/dsec"), "-agent", testutil.BuildBinary(t, "./cmd/dsec-agent"))
	dsecuptest.Interrupt(t, cmd, tmp, "concurrent calls", 0)
}

// TestBadRootfs: a missing or wrong language rootfs is refused at once,
// naming the path and how to build one.
func TestBadRootfs(t *testing.T) {
	for _, dir := range []string{"/nonexistent/lang-rootfs", t.TempDir()} {
		err := checkRootfs(dir)
		if err == nil || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "langimage.sh") {
			t.Errorf("checkRootfs(%s) = %v, want an error naming it and scripts/langimage.sh", dir, err)
		}
	}
}
