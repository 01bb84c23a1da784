package testsuite

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testLimits(t *testing.T) {
	t.Run("memory", s.testMemoryLimit)
	t.Run("pids", s.testPidsLimit)
	t.Run("cpu", s.testCPUQuota)
	t.Run("cpu-strays", s.testCPUStrays)
}

// awkAlloc makes busybox awk double a string n times: the last copy holds
// 2^n bytes and awk touches every byte, so resident memory really grows to
// about 2^(n+1) bytes (measured: n=28 peaks at ~540 MB RSS).
func awkAlloc(n int) string {
	return fmt.Sprintf(`awk 'BEGIN{s="x"; for(i=0;i<%d;i++) s=s s; print length(s)}'`, n)
}

func (s *suite) testMemoryLimit(t *testing.T) {
	s.need(t, MemoryLimit)
	const limit = 64 << 20
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.MemoryBytes = limit })

	// Control: a small allocation (4 MiB string, ~12 MB peak) fits.
	res := s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(22)})
	requireExit(t, res, 0, "awk 4 MiB")
	if got := strings.TrimSpace(string(res.Stdout)); got != "4194304" {
		t.Fatalf("awk 4 MiB printed %q", got)
	}

	// 128 MiB string, ~270 MB peak: over the limit. Without a limit it ends
	// normally in seconds, so the check is bounded on a broken backend too.
	res = s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(27), Timeout: 2 * time.Minute})
	if !res.OOMKilled {
		t.Errorf("allocating ~270 MB under a %d MiB limit: OOMKilled not set (%s, stdout %q)",
			limit>>20, resultSummary(res), clip(res.Stdout))
	}
	if res.ExitCode == 0 && res.Signal == 0 {
		t.Errorf("allocating ~270 MB under a %d MiB limit exited normally: limit not enforced", limit>>20)
	}

	// The sandbox survives its process's OOM kill and stays usable.
	if got := s.sh(t, sb, `echo ok`); got != "ok\n" {
		t.Errorf("after the OOM kill, echo ok printed %q", got)
	}
	res = s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(22)})
	requireExit(t, res, 0, "awk 4 MiB after the OOM kill")
}

func (s *suite) testPidsLimit(t *testing.T) {
	s.need(t, PidsLimit)
	const limit = 64
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.Pids = limit })

	// Bounded spawn first: it proves the limit without endangering the host
	// if the limit is missing (200 sleeps). The spawning loop runs in the
	// background while the exec's own process becomes a sleep (exec, no
	// fork), so the exec lasts until its timeout kills the whole tree: a
	// backend may let an exec's background processes outlive it when it
	// ends normally, as servers started with & must. ash exits at its first
	// failed fork, so the last number printed is how many processes it got.
	const spawnMarker = "3605"
	spawn := `(n=0; while [ $n -lt 200 ]; do sleep ` + spawnMarker + ` & n=$((n+1)); echo $n; done; echo all-spawned) & exec sleep 3607`
	res := s.exec(t, sb, runtime.ExecRequest{Shell: spawn, Timeout: 5 * time.Second})
	lines := strings.Fields(string(res.Stdout))
	if len(lines) == 0 {
		t.Fatalf("spawn loop printed nothing (%s, stderr %q)", resultSummary(res), clip(res.Stderr))
	}
	last := lines[len(lines)-1]
	if last == "all-spawned" {
		t.Fatalf("200 processes spawned under a pids limit of %d: limit not enforced", limit)
	}
	if n, err := strconv.Atoi(last); err != nil || n >= limit || n < 1 {
		t.Fatalf("spawned %q processes under a pids limit of %d", last, limit)
	}
	s.waitUsable(t, sb)
	s.waitProcsGone(t, sb, spawnMarker)

	// A real fork bomb, bounded by the exec timeout, must be contained: the
	// call returns, and the same sandbox runs commands again afterwards.
	const bombMarker = "3606"
	bomb := `bomb() { bomb | bomb & }; bomb; exec sleep ` + bombMarker
	res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Shell: bomb, Timeout: 5 * time.Second}, nil)
	if err != nil {
		t.Fatalf("fork bomb exec: %v", err)
	}
	t.Logf("fork bomb: %s", resultSummary(res))
	s.waitUsable(t, sb)
	s.waitProcsGone(t, sb, bombMarker)
	if got := s.sh(t, sb, `echo ok`); got != "ok\n" {
		t.Errorf("after the fork bomb, echo ok printed %q", got)
	}
}

// waitUsable polls until `echo ok` runs in sb: right after a fork bomb the
// pids limit can still be exhausted by dying processes.
func (s *suite) waitUsable(t *testing.T, sb runtime.Sandbox) {
	t.Helper()
	var last string
	ok := poll(t.Context(), time.Minute, func() bool {
		res, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Shell: "echo ok"}, nil)
		if err != nil {
			last = err.Error()
			return false
		}
		last = resultSummary(res) + " " + string(res.Stdout) + string(res.Stderr)
		return res.ExitCode == 0 && string(res.Stdout) == "ok\n"
	})
	if !ok {
		t.Fatalf("sandbox did not become usable again: last attempt %s", last)
	}
}

func (s *suite) testCPUQuota(t *testing.T) {
	s.need(t, CPUQuota)
	const milli = 200
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.MilliCPU = milli })

	// An unlimited busy loop on the host runs alongside as the reference: on
	// a busy host even an unlimited loop gets well under a core (measured
	// 0.3-0.6 here while other builds ran), and only the comparison tells a
	// quota from contention.
	ref := exec.Command("sh", "-c", "while :; do :; done")
	if err := ref.Start(); err != nil {
		t.Fatalf("start reference loop: %v", err)
	}
	refDone := false
	stopRef := func() {
		if !refDone {
			refDone = true
			_ = ref.Process.Kill()
			_ = ref.Wait()
		}
	}
	t.Cleanup(stopRef)

	// In the sandbox a busy loop runs for ~2 s of wall time; its CPU time
	// and age come from /proc (utime+stime and starttime in clock ticks,
	// against /proc/uptime), so no timing tool is needed and no wall clock
	// is asserted, only ratios of CPU to wall time.
	script := `while :; do :; done &
p=$!
sleep 2
s=$(cat /proc/$p/stat)
u=$(cat /proc/uptime)
kill $p
echo "$s"
echo "$u"`
	out := s.sh(t, sb, script)
	refStat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", ref.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	refUptime, err := os.ReadFile("/proc/uptime")
	if err != nil {
		t.Fatal(err)
	}
	stopRef()

	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("cpu script printed %q", out)
	}
	ratio, err := cpuRatio(lines[0], lines[1])
	if err != nil {
		t.Fatal(err)
	}
	refRatio, err := cpuRatio(string(refStat), string(refUptime))
	if err != nil {
		t.Fatal(err)
	}
	checkQuotaRatio(t, milli, "a sandbox busy loop", ratio, refRatio)
	// Unlimited, both loops get about the same share; the quota holds the
	// sandbox's well below the reference.
	if ratio >= 0.6*refRatio {
		t.Errorf("with MilliCPU=%d the sandbox loop got %.2f of a core, an unlimited host loop %.2f: no quota", milli, ratio, refRatio)
	}
}

// cpuRatio is CPU time over age of the process whose /proc/PID/stat line is
// given, with /proc/uptime read at the same moment.
func cpuRatio(stat, uptime string) (float64, error) {
	cpu, start, err := parseStat(stat)
	if err != nil {
		return 0, err
	}
	f := strings.Fields(uptime)
	if len(f) == 0 {
		return 0, fmt.Errorf("empty /proc/uptime")
	}
	up, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/uptime %q: %w", uptime, err)
	}
	const clkTck = 100 // USER_HZ on every Linux architecture DSec runs on
	wall := up - float64(start)/clkTck
	if wall <= 0.5 {
		return 0, fmt.Errorf("process ran %.2fs of wall time; measurement broken (stat %q, uptime %q)", wall, stat, uptime)
	}
	return float64(cpu) / clkTck / wall, nil
}

// parseStat returns utime+stime and starttime (clock ticks) of a
// /proc/PID/stat line. The comm field may contain spaces, so fields are
// counted after its closing parenthesis.
func parseStat(line string) (cpu, start uint64, err error) {
	i := strings.LastIndexByte(line, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("bad /proc/PID/stat line %q", line)
	}
	f := strings.Fields(line[i+1:])
	// f[0] is field 3 (state); utime, stime, starttime are fields 14, 15, 22.
	if len(f) < 20 {
		return 0, 0, fmt.Errorf("short /proc/PID/stat line %q", line)
	}
	var v [3]uint64
	for j, idx := range []int{11, 12, 19} {
		if v[j], err = strconv.ParseUint(f[idx], 10, 64); err != nil {
			return 0, 0, fmt.Errorf("/proc/PID/stat field %d %q: %w", idx+3, f[idx], err)
		}
	}
	return v[0] + v[1], v[2], nil
}

// testCPUStrays checks that the CPU limit holds processes that outlive
// the exec that started them, in sessions of their own (as a fork bomb's
// or a careless server's do), and that it holds them together: three
// busy loops left behind share one limit. Their CPU time is read from
// /proc over an interval by a later exec, so no clock is asserted, only
// CPU over wall time; an unlimited loop on the host beside them tells a
// quota from contention.
func (s *suite) testCPUStrays(t *testing.T) {
	s.need(t, CPUQuota)
	const milli = 200
	sb := s.create(t, func(sp *runtime.Spec) { sp.Resources.MilliCPU = milli })
	ref := exec.Command("sh", "-c", "while :; do :; done")
	if err := ref.Start(); err != nil {
		t.Fatalf("start reference loop: %v", err)
	}
	t.Cleanup(func() { _ = ref.Process.Kill(); _ = ref.Wait() })

	const marker = "spin3630"
	s.sh(t, sb, `for i in 1 2 3; do setsid sh -c 'while :; do :; done' `+marker+` >/dev/null 2>&1 & done; echo started`)
	// Both snapshots: the loops' utime+stime summed (clock ticks), then
	// /proc/uptime, for the loops found by their command line.
	// The pattern matches the marker but not itself, so not this script.
	script := `P=$(grep -l '` + marker[:len(marker)-1] + `[` + marker[len(marker)-1:] + `]' /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3)
snap() { t=0; n=0; for p in $P; do s=$(cat /proc/$p/stat 2>/dev/null) || continue; set -- ${s##*)}; t=$((t + ${12} + ${13})); n=$((n+1)); done; read up _ </proc/uptime; echo "$n $t $up"; }
snap; sleep 2; snap`
	refStart, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", ref.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	upStart, err := os.ReadFile("/proc/uptime")
	if err != nil {
		t.Fatal(err)
	}
	out := s.sh(t, sb, script)
	refEnd, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", ref.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	upEnd, err := os.ReadFile("/proc/uptime")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("stray CPU script printed %q", out)
	}
	var n [2]int
	var cpu [2]uint64
	var up [2]float64
	for i, l := range lines {
		if _, err := fmt.Sscanf(l, "%d %d %g", &n[i], &cpu[i], &up[i]); err != nil {
			t.Fatalf("stray CPU script line %q: %v", l, err)
		}
	}
	if n[0] != 3 || n[1] != 3 {
		t.Fatalf("found %d and %d of the 3 busy loops left behind: %q", n[0], n[1], out)
	}
	const clkTck = 100
	ratio := float64(cpu[1]-cpu[0]) / clkTck / (up[1] - up[0])
	refRatio, err := intervalRatio(string(refStart), string(refEnd), string(upStart), string(upEnd))
	if err != nil {
		t.Fatal(err)
	}
	checkQuotaRatio(t, milli, "three busy loops left behind by an exec", ratio, refRatio)
}

// checkQuotaRatio holds what of a core the sandbox's loops (what) used,
// ratio, to a quota of milli=200 (0.2 plus at most a period's slack),
// beside refRatio, what an unlimited loop on the host got meanwhile: when
// the host is too busy for that loop, a quota cannot be told from
// contention and the test skips.
func checkQuotaRatio(t *testing.T, milli int64, what string, ratio, refRatio float64) {
	t.Helper()
	t.Logf("MilliCPU=%d: %s used %.2f of a core; an unlimited host loop beside it %.2f", milli, what, ratio, refRatio)
	if ratio < 0.02 {
		t.Fatalf("%s used only %.3f of a core: the loops did not run or the measurement is broken", what, ratio)
	}
	if ratio >= 0.35 {
		t.Errorf("with MilliCPU=%d %s used %.2f of a core; want at most ~0.2", milli, what, ratio)
	}
	if refRatio < 0.4 {
		t.Skipf("host too busy to tell a quota from contention: an unlimited loop got only %.2f of a core", refRatio)
	}
}

// intervalRatio is the CPU time over wall time of a process between two
// /proc/PID/stat lines, with /proc/uptime read beside each.
func intervalRatio(stat0, stat1, up0, up1 string) (float64, error) {
	c0, _, err := parseStat(stat0)
	if err != nil {
		return 0, err
	}
	c1, _, err := parseStat(stat1)
	if err != nil {
		return 0, err
	}
	var u [2]float64
	for i, s := range []string{up0, up1} {
		f := strings.Fields(s)
		if len(f) == 0 {
			return 0, fmt.Errorf("empty /proc/uptime")
		}
		if u[i], err = strconv.ParseFloat(f[0], 64); err != nil {
			return 0, err
		}
	}
	if u[1]-u[0] <= 0.5 {
		return 0, fmt.Errorf("interval of %.2fs of wall time; measurement broken", u[1]-u[0])
	}
	return float64(c1-c0) / 100 / (u[1] - u[0]), nil
}
