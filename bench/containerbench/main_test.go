package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/testutil"
)

func TestSummarize(t *testing.T) {
	var ds []time.Duration
	for _, v := range []int{7, 3, 10, 1, 9, 2, 8, 4, 6, 5} {
		ds = append(ds, time.Duration(v)*time.Millisecond)
	}
	st := summarize(ds)
	want := stats{median: 5 * time.Millisecond, p90: 9 * time.Millisecond, mean: 5500 * time.Microsecond, min: time.Millisecond}
	if st != want {
		t.Fatalf("summarize = %+v, want %+v", st, want)
	}
	one := summarize([]time.Duration{42})
	if one.median != 42 || one.p90 != 42 || one.mean != 42 {
		t.Fatalf("summarize of one sample = %+v", one)
	}
}

func TestBuildRootfs(t *testing.T) {
	if _, err := os.Stat(busyboxPath); err != nil {
		t.Skip("busybox-static not installed")
	}
	dir := t.TempDir()
	if err := buildRootfs(t.Context(), dir); err != nil {
		t.Fatal(err)
	}
	// Links must be relative so they resolve inside any chroot.
	if l, err := os.Readlink(filepath.Join(dir, "bin", "sleep")); err != nil || l != "busybox" {
		t.Fatalf("bin/sleep links to %q (%v), want busybox", l, err)
	}
	if err := exec.Command(filepath.Join(dir, "bin", "true")).Run(); err != nil {
		t.Fatalf("rootfs /bin/true: %v", err)
	}
	if err := exec.Command(filepath.Join(dir, "bin", "false")).Run(); err == nil {
		t.Fatal("rootfs /bin/false exited 0; applet links do not dispatch")
	}
	out, err := exec.Command(filepath.Join(dir, "bin", "sh"), "-c", "echo hi").Output()
	if err != nil || string(out) != "hi\n" {
		t.Fatalf("rootfs /bin/sh: %q, %v", out, err)
	}
}

func TestPrintRatios(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	results := []Result{
		{System: "dsec", Seq: &SeqResult{MedianMs: 2, MeanMs: 4}, Conc: []ConcResult{{C: 16, PerSec: 100}},
			Idle: &IdleResult{K: 10, HostPerSandbox: 1 << 20, CgroupPerSandbox: f(1 << 19)}},
		{System: "crun", Seq: &SeqResult{MedianMs: 20, MeanMs: 8}, Conc: []ConcResult{{C: 16, PerSec: 20}},
			Idle: &IdleResult{K: 10, HostPerSandbox: 3 << 20}},
	}
	var b bytes.Buffer
	printRatios(&b, results, "dsec")
	got := b.String()
	for _, want := range []string{"crun/dsec", "seq median 10.00x", "seq mean 2.00x", "C=16 5.00x", "host mem 3.00x", "cgroup mem n/a"} {
		if !strings.Contains(got, want) {
			t.Errorf("ratios lack %q:\n%s", want, got)
		}
	}

	b.Reset()
	printRatios(&b, []Result{{System: "dsec", Err: "not wired yet"}, results[1]}, "dsec")
	if !strings.Contains(b.String(), "n/a") || strings.Contains(b.String(), "x ") {
		t.Errorf("ratios against a baseline without figures should be n/a:\n%s", b.String())
	}
}

// installedSystems lists the systems whose tools exist here (docker is
// left out: a private dockerd takes minutes per run on these VMs).
func installedSystems(t *testing.T) []string {
	sys := []string{"host-exec", "ns-spawn"}
	for _, s := range []string{"bwrap", "crun", "runc"} {
		if _, err := exec.LookPath(s); err == nil {
			sys = append(sys, s)
		}
	}
	return sys
}

func dsecbenchCgroups(t *testing.T) map[string]bool {
	t.Helper()
	m, err := filepath.Glob("/sys/fs/cgroup/*/dsecbench-*")
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	for _, p := range m {
		set[p] = true
	}
	return set
}

// assertNoLeaks checks what a harness run may leave behind: files in its
// TMPDIR, mounts, and cgroups (a cgroup can only be removed once no
// process is left in it, so a leaked sandbox process shows up here too).
func assertNoLeaks(t *testing.T, tmp string, cgBefore map[string]bool) {
	t.Helper()
	if ents, err := os.ReadDir(tmp); err != nil || len(ents) != 0 {
		t.Errorf("harness left %d entries in its TMPDIR (%v)", len(ents), err)
	}
	if mps, err := mountsUnder(tmp); err != nil || len(mps) != 0 {
		t.Errorf("harness left mounts %v (%v)", mps, err)
	}
	for p := range dsecbenchCgroups(t) {
		if !cgBefore[p] {
			t.Errorf("harness left cgroup %s", p)
		}
	}
}

func TestHarnessEndToEnd(t *testing.T) {
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, "./bench/containerbench")
	systems := installedSystems(t)
	tmp := t.TempDir()
	cgBefore := dsecbenchCgroups(t)

	results, _ := runHarness(t, bin, tmp, "", "-systems", strings.Join(systems, ","),
		"-n", "3", "-warmup", "1", "-total", "6", "-c", "2,3", "-idle", "3", "-peer-idle", "3")
	if len(results) != len(systems) {
		t.Fatalf("got %d results for %d systems", len(results), len(systems))
	}
	for i, r := range results {
		if r.System != systems[i] {
			t.Errorf("result %d is %q, want %q", i, r.System, systems[i])
		}
		if r.Err != "" {
			t.Errorf("%s: %s", r.System, r.Err)
			continue
		}
		if r.Seq == nil || r.Seq.N != 3 || r.Seq.MedianMs <= 0 || r.Seq.P90Ms < r.Seq.MedianMs {
			t.Errorf("%s: bad sequential figures %+v", r.System, r.Seq)
		}
		if len(r.Conc) != 2 || r.Conc[0].C != 2 || r.Conc[1].C != 3 || r.Conc[0].PerSec <= 0 || r.Conc[1].Total != 6 {
			t.Errorf("%s: bad concurrent figures %+v", r.System, r.Conc)
		}
		if r.Idle == nil || r.Idle.K != 3 || r.Idle.CgroupPerSandbox == nil {
			t.Errorf("%s: bad idle figures %+v", r.System, r.Idle)
			continue
		}
		// Three live sandboxes, each at least a sleep process, must
		// show up in their cgroup; the floor rows' pre-move charges may
		// stay behind, so only the runtimes are held to this.
		if r.System != "host-exec" && r.System != "ns-spawn" && *r.Idle.CgroupPerSandbox <= 0 {
			t.Errorf("%s: idle sandboxes charged %v bytes each to their cgroup", r.System, *r.Idle.CgroupPerSandbox)
		}
	}
	assertNoLeaks(t, tmp, cgBefore)
}

// TestHarnessInterrupt stops a run in the middle of filling the node with
// idle sandboxes, as Ctrl-C would, and checks that everything is removed.
func TestHarnessInterrupt(t *testing.T) {
	testutil.RequireRoot(t)
	system := ""
	for _, s := range []string{"crun", "runc", "bwrap"} {
		if _, err := exec.LookPath(s); err == nil {
			system = s
			break
		}
	}
	if system == "" {
		t.Skip("no container runtime installed")
	}
	bin := testutil.BuildBinary(t, "./bench/containerbench")
	tmp := t.TempDir()
	cgBefore := dsecbenchCgroups(t)

	cmd := exec.Command(bin, "-systems", system, "-phases", "idle", "-peer-idle", "100000")
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Wait until sandboxes are really being held, then interrupt.
	sc := bufio.NewScanner(stderr)
	var log strings.Builder
	started := false
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "idle sandboxes started") {
			started = true
			break
		}
	}
	if !started {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("harness never started idle sandboxes:\n%s", log.String())
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
	}
	err = cmd.Wait()
	if err == nil {
		t.Errorf("interrupted harness exited 0")
	}
	if !strings.Contains(log.String(), "context canceled") {
		t.Errorf("harness did not report the interruption:\n%s", log.String())
	}
	assertNoLeaks(t, tmp, cgBefore)
	if t.Failed() {
		t.Logf("harness output:\n%s", log.String())
	}
}

// dsecCgroups lists the cgroup parents of the DSec rows' backends
// (dsec-bench-<worker PID>) in every hierarchy.
func dsecCgroups(t *testing.T) map[string]bool {
	t.Helper()
	m, err := filepath.Glob("/sys/fs/cgroup/*/dsec-bench-*")
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	for _, p := range m {
		set[p] = true
	}
	return set
}

// TestHarnessDSecPool runs the pooled DSec row: every sequential take must
// be served warm and every handed-back sandbox reset, also with more
// cycles in flight than the pool keeps ready (those takes may create on
// the caller's path), and nothing may be left behind.
func TestHarnessDSecPool(t *testing.T) {
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, "./bench/containerbench")
	tmp := t.TempDir()
	cgBefore := dsecbenchCgroups(t)
	dsecBefore := dsecCgroups(t)

	const n, warmup, total = 3, 1, 40
	c2 := defaultPoolSize + 4 // more in flight than the pool keeps ready
	// From the repository root: the row builds ./cmd/dsec-agent.
	results, stderr := runHarness(t, bin, tmp, testutil.RepoRoot(t), "-systems", "dsec-pool",
		"-n", strconv.Itoa(n), "-warmup", strconv.Itoa(warmup), "-total", strconv.Itoa(total),
		"-c", "2,"+strconv.Itoa(c2))
	if len(results) != 1 || results[0].System != "dsec-pool" {
		t.Fatalf("results %+v, want one dsec-pool row", results)
	}
	r := results[0]
	if r.Err != "" {
		t.Fatalf("dsec-pool: %s\n%s", r.Err, stderr)
	}
	if r.Seq == nil || r.Seq.N != n || r.Seq.MedianMs <= 0 || len(r.Conc) != 2 || r.Conc[1].Total != total {
		t.Errorf("bad cycle figures: seq %+v conc %+v", r.Seq, r.Conc)
	}
	if r.Idle != nil || r.IdleNA == "" {
		t.Errorf("idle figure %+v (n/a reason %q), want none with a reason", r.Idle, r.IdleNA)
	}
	if r.PoolSize != defaultPoolSize {
		t.Errorf("pool size %d, want the default %d", r.PoolSize, defaultPoolSize)
	}
	if len(r.Pool) != 3 {
		t.Fatalf("pool phases %+v, want seq, C=2, C=%d", r.Pool, c2)
	}
	seq := r.Pool[0]
	// A hand-back is destroyed instead of reset when the pool's refill
	// has already made its ready target (a slow, loaded machine: seen
	// with other suites running), so resets and destroys together
	// account for every take.
	if seq.Phase != "seq" || seq.Hits != n+warmup || seq.Misses != 0 || seq.Resets < 1 || seq.Resets+seq.Destroyed != n+warmup ||
		seq.ResetFailures != 0 || seq.ResetMedianMs <= 0 {
		t.Errorf("sequential pool figures %+v: want %d takes served warm, each hand-back reset or destroyed", seq, n+warmup)
	}
	for _, p := range r.Pool[1:] {
		// Every hand-back is reset, or destroyed at once when the pool
		// already has enough ready or coming.
		if p.Hits+p.Misses != total || p.Resets == 0 || p.Resets > total || p.Resets+p.Destroyed < total ||
			p.ResetFailures != 0 || p.SettledPerSec <= 0 {
			t.Errorf("phase %s: %+v: want %d takes, each hand-back reset or destroyed, none failed", p.Phase, p, total)
		}
	}
	assertNoLeaks(t, tmp, cgBefore)
	for p := range dsecCgroups(t) {
		if !dsecBefore[p] {
			t.Errorf("harness left cgroup %s", p)
		}
	}
}

// TestHarnessDSecRebase runs the dsec-rebase row end to end: with the pool
// started full, every sequential cycle rebases a handed-back sandbox onto
// a spec of its own and every hand-back is quiesced; with more in flight
// than the pool holds, every take is served (rebased, or created when
// nothing is ready or coming) and every hand-back is quiesced or, beyond
// the pool's size, destroyed; nothing is left behind.
func TestHarnessDSecRebase(t *testing.T) {
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, "./bench/containerbench")
	tmp := t.TempDir()
	cgBefore := dsecbenchCgroups(t)
	dsecBefore := dsecCgroups(t)

	const n, warmup, total, size = 3, 1, 30, 4
	results, stderr := runHarness(t, bin, tmp, testutil.RepoRoot(t), "-systems", "dsec-rebase", "-pool-size", strconv.Itoa(size),
		"-n", strconv.Itoa(n), "-warmup", strconv.Itoa(warmup), "-total", strconv.Itoa(total),
		"-c", strconv.Itoa(size+4), "-phases", "seq,conc")
	if len(results) != 1 || results[0].System != "dsec-rebase" || results[0].Err != "" {
		t.Fatalf("results %+v, want one dsec-rebase row without error\n%s", results, stderr)
	}
	r := results[0]
	if len(r.Pool) != 2 {
		t.Fatalf("pool phases %+v, want seq and one concurrent", r.Pool)
	}
	if seq := r.Pool[0]; seq.Hits != n+warmup || seq.Misses != 0 || seq.Resets != n+warmup || seq.ResetFailures != 0 {
		t.Errorf("sequential pool figures %+v: want %d rebases and as many quiesces", seq, n+warmup)
	}
	// How many of the extra takes create depends on timing (a take waits
	// for a quiesce in flight rather than creating).
	if c := r.Pool[1]; c.Hits+c.Misses != total || c.Hits == 0 || c.Resets+c.Destroyed != total || c.ResetFailures != 0 {
		t.Errorf("concurrent pool figures %+v: want %d takes, some rebased, each hand-back quiesced or destroyed", c, total)
	}
	assertNoLeaks(t, tmp, cgBefore)
	for p := range dsecCgroups(t) {
		if !dsecBefore[p] {
			t.Errorf("harness left cgroup %s", p)
		}
	}
}

// runHarness runs the harness binary with args and -json, with TMPDIR tmp
// and in dir (the test's directory when empty), and returns its results
// and its log.
func runHarness(t *testing.T, bin, tmp, dir string, args ...string) ([]Result, string) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), bin, append(args, "-json")...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("harness: %v\n%s", err, stderr.String())
	}
	var results []Result
	if err := json.Unmarshal(out, &results); err != nil {
		t.Fatalf("harness JSON: %v\n%s", err, out)
	}
	return results, stderr.String()
}
