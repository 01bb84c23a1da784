// Package dsecuptest holds the test helpers of the harnesses built on
// dsecup: running a harness binary with its own TMPDIR, and checking that
// it left nothing behind.
package dsecuptest

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

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// Harness requires root, builds the harness command pkg (e.g.
// "./bench/trajbench") and returns a runner for it from the repository
// root with TMPDIR set to a fresh directory (everything it makes goes
// there), and that directory.
func Harness(t *testing.T, pkg string, args ...string) (*exec.Cmd, string) {
	t.Helper()
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, pkg)
	tmp := t.TempDir()
	cmd := exec.Command(bin, args...)
	cmd.Dir = testutil.RepoRoot(t)
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp)
	return cmd, tmp
}

// AssertNoLeaks checks what a run may leave behind: files in its TMPDIR,
// mounts under it, processes started from binaries under it, and the
// sandbox cgroups of its dsec up processes (a cgroup can only be removed
// once no process is left in it, so a leaked sandbox shows up here too).
func AssertNoLeaks(t *testing.T, tmp string, upPIDs []int) {
	t.Helper()
	if ents, err := os.ReadDir(tmp); err != nil || len(ents) != 0 {
		t.Errorf("harness left %d entries in its TMPDIR (%v)", len(ents), err)
	}
	if mps, err := dsecup.MountsUnder(tmp); err != nil || len(mps) != 0 {
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
		if cgs, err := dsecup.SandboxCgroups(pid); err != nil || len(cgs) != 0 {
			t.Errorf("dsec up %d left cgroups %v (%v)", pid, cgs, err)
		}
	}
}

// RunJSON runs cmd (a harness with -json), fails the test unless it exits
// 0 and prints JSON, decodes that into rep, and returns its stderr (the
// harness log).
func RunJSON(t *testing.T, cmd *exec.Cmd, rep any) string {
	t.Helper()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("harness: %v\n%s\n%s", err, out, stderr.String())
	}
	if err := json.Unmarshal(out, rep); err != nil {
		t.Fatalf("harness JSON: %v\n%s", err, out)
	}
	return stderr.String()
}

// Interrupt starts cmd (from Harness), reads its log until a line
// containing ready, waits settle, sends SIGINT as Ctrl-C would, and
// checks that the harness reports the interruption, stops every dsec up it
// started cleanly and leaves nothing behind (AssertNoLeaks on tmp).
func Interrupt(t *testing.T, cmd *exec.Cmd, tmp, ready string, settle time.Duration) {
	t.Helper()
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
	reached := false
	for sc.Scan() {
		log.WriteString(sc.Text() + "\n")
		if m := pidRE.FindStringSubmatch(sc.Text()); m != nil {
			pid, _ := strconv.Atoi(m[1])
			pids = append(pids, pid)
		}
		if strings.Contains(sc.Text(), ready) {
			reached = true
			break
		}
	}
	if !reached {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("harness never logged %q:\n%s", ready, log.String())
	}
	time.Sleep(settle)
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
	AssertNoLeaks(t, tmp, pids)
	if t.Failed() {
		t.Logf("harness output:\n%s", log.String())
	}
}
