package agent

import (
	"bytes"
	"os"
	"strconv"
	"syscall"
	"time"
)

// Each exec runs in its own session (Setsid), so its session id is its pid.
// Killing the process group gets most of a tree at once; anything that moved
// to another process group but stayed in the session (a fork bomb, a shell's
// job control, setpgid) is found by scanning /proc for the session id, and
// the scan repeats until a pass finds nobody alive, so a process forked
// between two passes is caught by the next one. A process that starts a new
// session with setsid(2) leaves the exec's tree; sandbox teardown (cgroup
// kill) is the backstop for those.

// killGiveUp bounds the sweep: a process stuck in uninterruptible sleep
// cannot die until the kernel lets it, and Destroy of the sandbox will get it.
const killGiveUp = 10 * time.Second

// nsLevel is the depth of the agent's pid namespace in the NSpid lists of
// the /proc it sees: 0 when /proc belongs to the agent's own pid namespace
// (the normal case in a sandbox), more when /proc is an outer namespace's.
// Reading ids at this level keeps the sweep right either way.
func nsLevel() int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	if ids := statusField(b, "NSpid:"); len(ids) > 0 {
		return len(ids) - 1
	}
	return 0
}

// killSession SIGKILLs every process in session sid.
func killSession(sid, level int, log Logger) {
	_ = syscall.Kill(-sid, syscall.SIGKILL)
	start := time.Now()
	for round := 0; ; round++ {
		if sweepSession(sid, level) == 0 {
			return
		}
		if time.Since(start) > killGiveUp {
			log.Warn("processes of an exec session survive SIGKILL; leaving them to sandbox teardown", "sid", sid)
			return
		}
		// The ones we hit are dying; give them a moment before re-checking.
		time.Sleep(time.Duration(min(round+1, 10)) * time.Millisecond)
	}
}

// sweepSession sends SIGKILL to every live (non-zombie) process of session
// sid and returns how many it found.
func sweepSession(sid, level int) int {
	d, err := os.Open("/proc")
	if err != nil {
		return 0
	}
	names, _ := d.Readdirnames(-1)
	d.Close()
	found := 0
	for _, name := range names {
		if name[0] < '0' || name[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + name + "/status")
		if err != nil {
			continue // exited meanwhile
		}
		if st := statusField(b, "State:"); len(st) > 0 && (st[0] == "Z" || st[0] == "X") {
			continue
		}
		sids, pids := statusField(b, "NSsid:"), statusField(b, "NSpid:")
		if len(sids) <= level || len(pids) <= level {
			continue // lives in an outer pid namespace: not ours
		}
		if s, _ := strconv.Atoi(sids[level]); s != sid {
			continue
		}
		pid, _ := strconv.Atoi(pids[level])
		if pid > 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			found++
		}
	}
	return found
}

// statusField returns the whitespace-separated values of one
// /proc/PID/status line.
func statusField(status []byte, key string) []string {
	for line := range bytes.SplitSeq(status, []byte{'\n'}) {
		if v, ok := bytes.CutPrefix(line, []byte(key)); ok {
			var out []string
			for f := range bytes.FieldsSeq(v) {
				out = append(out, string(f))
			}
			return out
		}
	}
	return nil
}
