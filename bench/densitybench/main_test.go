package main

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/bench/internal/dsecup/dsecuptest"
	"github.com/dsec-dev/dsec/bench/internal/peer"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// harness builds this command and returns a runner for it with TMPDIR set
// to a fresh directory, using prebuilt dsec binaries (the build is covered
// by the other harnesses' tests).
func harness(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	testutil.RequireRoot(t)
	args = append(args, "-dsec", testutil.BuildBinary(t, "./cmd/dsec"), "-agent", testutil.BuildBinary(t, "./cmd/dsec-agent"))
	return dsecuptest.Harness(t, "./bench/densitybench", args...)
}

// assertClean checks what every run may leave: the TMPDIR, mounts and
// processes under it, dsec up's sandbox cgroups (dsecuptest), and the
// harness's own cgroups (the crun peer's, dockerd's parent).
func assertClean(t *testing.T, cmd *exec.Cmd, tmp string, upPIDs []int) {
	t.Helper()
	dsecuptest.AssertNoLeaks(t, tmp, upPIDs)
	if cgs, err := dsecup.HarnessCgroups(cgroupPrefix, cmd.Process.Pid); err != nil || len(cgs) > 0 {
		t.Errorf("harness left cgroups %v (%v)", cgs, err)
	}
	if pids := peer.PidsNaming(tmp + "/"); len(pids) > 0 {
		t.Errorf("processes naming the harness's TMPDIR left running: %v", pids)
	}
}

func TestIdle(t *testing.T) {
	if _, err := exec.LookPath("crun"); err != nil {
		t.Skip("crun not installed (DSEC_BENCH_DEPS=1 scripts/deps.sh)")
	}
	cmd, tmp := harness(t, "-phases", "idle", "-n", "3", "-peer-n", "2", "-create-wait", "3s", "-json")
	var rep Report
	dsecuptest.RunJSON(t, cmd, &rep)
	if rep.Idle == nil || rep.Wave != nil || rep.Pressure != nil {
		t.Fatalf("phases: %+v", rep)
	}
	d := rep.Idle.DSec
	if d.Requested != 3 || d.Held < 1 || d.Held > 3 || d.Err != "" {
		t.Errorf("dsec row %+v", d)
	}
	// Today the node holds 2 sandboxes of cpu 4 / 8 GiB; the target is
	// every one. Either way a short count must say why.
	if d.Held < d.Requested && !strings.Contains(d.StopReason, "resource_exhausted") && !strings.Contains(d.StopReason, "unavailable") {
		t.Errorf("dsec held %d of %d without a refusal: %q", d.Held, d.Requested, d.StopReason)
	}
	if d.ExecOK != d.Held || d.ExecFailed != 0 || d.ExecP50Ms <= 0 || d.ExecP99Ms < d.ExecP50Ms || d.CreatesPerSec <= 0 ||
		d.DaemonFDsPerSandbox == nil || d.DaemonRSSMiBPerSandbox == nil || d.CgroupMiBPerSandbox == nil {
		t.Errorf("dsec figures %+v", d)
	}
	p := rep.Idle.Peer
	if p == nil || p.System != "crun" || p.Requested != 2 || p.Held != 2 || p.ExecOK != 2 || p.Err != "" ||
		p.ExecP50Ms <= 0 || p.CgroupMiBPerSandbox == nil {
		t.Errorf("crun row %+v", p)
	}
	if rep.Idle.Leaks != nil || rep.Idle.UpPID == 0 || len(rep.UpPIDs) != 1 {
		t.Errorf("leaks %+v, dsec up %d %v", rep.Idle.Leaks, rep.Idle.UpPID, rep.UpPIDs)
	}
	assertClean(t, cmd, tmp, rep.UpPIDs)
}

// dockerHostState is what dockerd may create outside its work dir.
func dockerHostState() map[string]bool {
	m := map[string]bool{}
	if _, err := net.InterfaceByName("docker0"); err == nil {
		m["docker0"] = true
	}
	for _, p := range []string{"/etc/docker/key.json", "/run/docker", "/run/containerd", "/var/lib/docker", "/var/lib/containerd"} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			m[p] = true
		}
	}
	return m
}

func TestWave(t *testing.T) {
	if err := exec.Command(python, "-c", "import httpx").Run(); err != nil {
		t.Skipf("%s with python3-httpx needed: %v", python, err)
	}
	args := []string{"-phases", "wave", "-r", "3", "-steps", "2-3", "-think", "100ms-300ms", "-empty", "1", "-empty-steps", "2",
		"-docker-r", "2", "-json"}
	docker := peer.DockerMissing() == ""
	if !docker {
		// The DSec side still runs: wave.py is exercised without Docker.
		t.Logf("Docker's wave not run: %s", peer.DockerMissing())
		args = append(args, "-wave-peer", "none")
	}
	before := dockerHostState()
	cmd, tmp := harness(t, args...)
	var rep Report
	dsecuptest.RunJSON(t, cmd, &rep)
	w := rep.Wave
	if w == nil || w.DSec == nil || rep.Idle != nil {
		t.Fatalf("phases: %+v", rep)
	}
	check := func(x *WaveRow, r int) {
		t.Helper()
		if x.R != r || x.Completed != r || x.Created != r || x.PeakAlive < 1 || x.PeakAlive > r || x.InfraErrors != 0 ||
			x.Failures != 0 || x.StepsRun != x.StepsPlanned || x.StepsPlanned < 2*r || x.StepsPlanned > 3*r || x.Err != "" {
			t.Errorf("%s counts %+v", x.Backend, x)
		}
		if x.WallS <= 0 || x.IdealS <= 0 || x.WallOverIdeal <= 0 || x.RolloutsPerS <= 0 || x.StepP50Ms <= 0 ||
			x.StepP99Ms < x.StepP50Ms || x.Empty.Steps != 2 || x.Empty.StepP50Ms <= 0 || x.CreateP50Ms <= 0 {
			t.Errorf("%s figures %+v", x.Backend, x)
		}
	}
	check(w.DSec, 3)
	if docker {
		if w.Docker == nil {
			t.Fatal("no Docker row")
		}
		check(w.Docker, 2)
	}
	if w.Leaks != nil {
		t.Errorf("leaks %+v", w.Leaks)
	}
	assertClean(t, cmd, tmp, rep.UpPIDs)
	if after := dockerHostState(); len(after) != len(before) {
		t.Errorf("dockerd's host state before %v, after %v", before, after)
	}
}

func TestPressure(t *testing.T) {
	// Not bounded by a cgroup today, so only with -allow-unbounded and
	// sizes the host does not notice; no swap.
	cmd, tmp := harness(t, "-phases", "pressure", "-swap", "0", "-pressure-n", "4", "-touchers", "1",
		"-pressure-mem", "128m", "-touch", "32m", "-hold", "3s", "-pressure-steps", "2", "-allow-unbounded", "-json")
	var rep Report
	dsecuptest.RunJSON(t, cmd, &rep)
	p := rep.Pressure
	if p == nil {
		t.Fatalf("phases: %+v", rep)
	}
	if p.Skipped != "" || p.Err != "" || p.Held != 4 || p.TouchersOK != 1 || p.OOMKillsCgroup != 0 || p.OOMKillsResult != 0 {
		t.Errorf("pressure %+v", p)
	}
	if p.Before.Steps != 6 || p.Under.Steps != 6 || p.Before.P50Ms <= 0 || p.Under.P50Ms <= 0 || p.TouchersChargePeakMiB < 16 {
		t.Errorf("pressure figures %+v", p)
	}
	assertClean(t, cmd, tmp, rep.UpPIDs)
}

// TestPressureSkips: without the swap flag (named here so that it never
// exists) the phase says so and starts nothing.
func TestPressureSkips(t *testing.T) {
	cmd, tmp := harness(t, "-phases", "pressure", "-swap-flag", "--no-such-swap-flag", "-json")
	var rep Report
	dsecuptest.RunJSON(t, cmd, &rep)
	if p := rep.Pressure; p == nil || !strings.Contains(p.Skipped, "no --no-such-swap-flag flag") || p.Held != 0 || len(rep.UpPIDs) != 0 {
		t.Errorf("pressure %+v, dsec up %v", rep.Pressure, rep.UpPIDs)
	}
	if ents, err := os.ReadDir(tmp); err != nil || len(ents) != 0 {
		t.Errorf("harness left %d entries in its TMPDIR (%v)", len(ents), err)
	}
}

// TestWaveInterrupt stops a run in the middle of its wave, as Ctrl-C
// would: wave.py, dsec up and their sandboxes must all go.
func TestWaveInterrupt(t *testing.T) {
	if err := exec.Command(python, "-c", "import httpx").Run(); err != nil {
		t.Skipf("%s with python3-httpx needed: %v", python, err)
	}
	cmd, tmp := harness(t, "-phases", "wave", "-r", "4", "-steps", "3-3", "-think", "5s-10s", "-empty", "1", "-empty-steps", "1",
		"-wave-peer", "none")
	dsecuptest.Interrupt(t, cmd, tmp, "msg=wave backend=dsec", 3*time.Second)
	if cgs, err := dsecup.HarnessCgroups(cgroupPrefix, cmd.Process.Pid); err != nil || len(cgs) > 0 {
		t.Errorf("harness left cgroups %v (%v)", cgs, err)
	}
	if pids := peer.PidsNaming(tmp + "/"); len(pids) > 0 {
		t.Errorf("processes naming the harness's TMPDIR left running: %v", pids)
	}
}

func TestRanges(t *testing.T) {
	if lo, hi, err := parseIntRange("steps", "3-10"); err != nil || lo != 3 || hi != 10 {
		t.Errorf("3-10: %d %d %v", lo, hi, err)
	}
	if lo, hi, err := parseIntRange("steps", "4"); err != nil || lo != 4 || hi != 4 {
		t.Errorf("4: %d %d %v", lo, hi, err)
	}
	for _, bad := range []string{"0-3", "5-2", "x", "1-y"} {
		if _, _, err := parseIntRange("steps", bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if lo, hi, err := parseDurRange("think", "1s-10s"); err != nil || lo != 1 || hi != 10 {
		t.Errorf("1s-10s: %v %v %v", lo, hi, err)
	}
	for _, bad := range []string{"2s-1s", "1-2", "-1s"} {
		if _, _, err := parseDurRange("think", bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
