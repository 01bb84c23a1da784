package container_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/swap"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// v1Dir is the directory of sandbox id's cgroup in the v1 hierarchy ctrl
// (from its agent's /proc/PID/cgroup). The QoS tests read v1 files (the
// CI machines are v1); on a v2 host they skip.
func v1Dir(t *testing.T, e *env, id, ctrl string) string {
	t.Helper()
	pid, ok := e.backend.AgentPID(id)
	if !ok {
		t.Fatalf("no agent for sandbox %s", id)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == ctrl {
				return filepath.Join("/sys/fs/cgroup", c, parts[2])
			}
		}
	}
	t.Skipf("no cgroup v1 %s hierarchy (cgroup v2 host): the QoS tests read v1 files", ctrl)
	return ""
}

func readFile(t *testing.T, file string) string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// memStat returns key of a v1 memory cgroup's memory.stat.
func memStat(t *testing.T, dir, key string) int64 {
	t.Helper()
	for _, line := range strings.Split(readFile(t, filepath.Join(dir, "memory.stat")), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Fatalf("%s/memory.stat has no %s", dir, key)
	return 0
}

// waitFor polls cond (bounded) until it holds.
func waitFor(t *testing.T, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// heldExec is an exec kept in flight until released.
type heldExec struct {
	sb   rt.Sandbox
	name string
	res  chan execOutcome
}

type execOutcome struct {
	res rt.ExecResult
	err error
}

// hold starts shell script in sb, which must print "held" once it is
// ready and then wait for a line on the FIFO /tmp/<name>, and returns once
// "held" arrived.
func hold(t *testing.T, sb rt.Sandbox, name, script string) *heldExec {
	t.Helper()
	h, ready := startHold(sb, name, script)
	h.wait(t, ready)
	return h
}

// startHold starts what hold waits for; ready is closed once "held" came.
func startHold(sb rt.Sandbox, name, script string) (*heldExec, <-chan struct{}) {
	h := &heldExec{sb: sb, name: name, res: make(chan execOutcome, 1)}
	ready := make(chan struct{})
	var once sync.Once
	var out bytes.Buffer
	var mu sync.Mutex
	go func() {
		res, err := sb.Exec(context.Background(), rt.ExecRequest{Shell: "mkfifo /tmp/" + name + " && " + script, Timeout: 5 * time.Minute},
			func(_ rt.Stream, data []byte) {
				mu.Lock()
				out.Write(data)
				if bytes.Contains(out.Bytes(), []byte("held")) {
					once.Do(func() { close(ready) })
				}
				mu.Unlock()
			})
		h.res <- execOutcome{res, err}
	}()
	return h, ready
}

func (h *heldExec) wait(t *testing.T, ready <-chan struct{}) {
	t.Helper()
	select {
	case <-ready:
	case o := <-h.res:
		t.Fatalf("held exec %s ended early: %v exit %d oom %v stdout %q stderr %q", h.name, o.err, o.res.ExitCode, o.res.OOMKilled, o.res.Stdout, o.res.Stderr)
	case <-time.After(2 * time.Minute):
		t.Fatalf("held exec %s did not start", h.name)
	}
}

// release ends the held exec (a second exec writes its FIFO) and returns
// its result.
func (h *heldExec) release(t *testing.T) rt.ExecResult {
	t.Helper()
	if res, err := h.sb.Exec(context.Background(), rt.ExecRequest{Shell: "echo go > /tmp/" + h.name}, nil); err != nil || res.ExitCode != 0 {
		t.Fatalf("release %s: %v %+v", h.name, err, res)
	}
	select {
	case o := <-h.res:
		if o.err != nil {
			t.Fatalf("held exec %s: %v", h.name, o.err)
		}
		return o.res
	case <-time.After(2 * time.Minute):
		t.Fatalf("held exec %s did not end once released", h.name)
	}
	return rt.ExecResult{}
}

// leftovers lists the threads of sandbox id's user cpu cgroup that are
// not its agent's (the agent's spawner thread lives there on v1).
func leftovers(t *testing.T, e *env, id string) []int {
	t.Helper()
	agent, _ := e.backend.AgentPID(id)
	var tids []int
	for _, f := range strings.Fields(readFile(t, filepath.Join(v1Dir(t, e, id, "cpu"), "user", "tasks"))) {
		tid, _ := strconv.Atoi(f)
		if _, err := os.Stat(fmt.Sprintf("/proc/%d/task/%d", agent, tid)); err != nil {
			tids = append(tids, tid)
		}
	}
	return tids
}

func policy(t *testing.T, tid int) uint32 {
	t.Helper()
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		t.Fatalf("sched_getattr %d: %v", tid, err)
	}
	return a.Policy
}

// TestIdleCPU: a sandbox with no request in flight has the least CPU
// weight and what its execs left running is SCHED_IDLE, so a busy loop
// left behind yields to every other sandbox's exec (the kernel shares a
// contended CPU by weight: 2 against 1024, and any runnable normal task
// preempts a SCHED_IDLE one at once); a request puts the weight back
// while it runs, and the leftover stays SCHED_IDLE.
func TestIdleCPU(t *testing.T) {
	testutil.RequireRoot(t)
	e := newEnvRootfs(t, 0, testsuite.BusyboxRootfs(t), func(o *container.Options) { o.IdleAfter = 100 * time.Millisecond })
	ctx := context.Background()
	a, b := e.create(t), e.create(t)
	sharesA := filepath.Join(v1Dir(t, e, a.ID(), "cpu"), "cpu.shares")
	sharesB := filepath.Join(v1Dir(t, e, b.ID(), "cpu"), "cpu.shares")

	res, err := a.Exec(ctx, rt.ExecRequest{Shell: `setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & echo started`}, nil)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("start the loop: %v %+v", err, res)
	}
	waitFor(t, "the idle sandbox's cpu.shares to drop to 2", time.Minute, func() bool { return readFile(t, sharesA) == "2" })
	loop := leftovers(t, e, a.ID())
	if len(loop) != 1 {
		t.Fatalf("threads left running in the user cgroup: %v, want the loop's one", loop)
	}
	if p := policy(t, loop[0]); p != unix.SCHED_IDLE {
		t.Fatalf("the loop left running has policy %d, want SCHED_IDLE (%d)", p, unix.SCHED_IDLE)
	}
	// The agent is not touched: its threads keep SCHED_OTHER.
	agent, _ := e.backend.AgentPID(a.ID())
	if p := policy(t, agent); p != unix.SCHED_NORMAL {
		t.Fatalf("the agent's policy is %d, want SCHED_OTHER", p)
	}

	// An exec in B: while it runs, B has the normal weight and A the least.
	hb := hold(t, b, "b", "echo held; cat /tmp/b >/dev/null")
	if sa, sb := readFile(t, sharesA), readFile(t, sharesB); sa != "2" || sb != "1024" {
		t.Fatalf("during B's exec: cpu.shares A %s, B %s; want 2 and 1024", sa, sb)
	}
	if res := hb.release(t); res.ExitCode != 0 {
		t.Fatalf("B's exec: %+v", res)
	}

	// An exec in A gets A's weight back while it runs; the loop left by
	// the earlier exec stays SCHED_IDLE.
	ha := hold(t, a, "a", "echo held; cat /tmp/a >/dev/null")
	if s := readFile(t, sharesA); s != "1024" {
		t.Fatalf("during A's exec: cpu.shares %s, want 1024", s)
	}
	if p := policy(t, loop[0]); p != unix.SCHED_IDLE {
		t.Fatalf("during A's next exec the old loop has policy %d, want SCHED_IDLE", p)
	}
	if res := ha.release(t); res.ExitCode != 0 {
		t.Fatalf("A's exec: %+v", res)
	}
	waitFor(t, "A idle again", time.Minute, func() bool { return readFile(t, sharesA) == "2" })
	if st := e.backend.QoSStats(); st.IdleLowered < 3 || st.LeftoversIdled < 1 {
		t.Fatalf("QoS stats %+v: want at least 3 idle transitions and 1 leftover idled", st)
	}
}

// TestHogWeight: with more sandboxes busy than the node has CPUs, one
// that has used more than its budget of CPU time in its active period
// gets the hog weight (128) until its requests end.
func TestHogWeight(t *testing.T) {
	testutil.RequireRoot(t)
	e := newEnvRootfs(t, 0, testsuite.BusyboxRootfs(t), func(o *container.Options) { o.IdleAfter = 100 * time.Millisecond })
	n := runtime.NumCPU() + 1
	var held []*heldExec
	var shares []string
	for i := range n {
		sb := e.create(t)
		shares = append(shares, filepath.Join(v1Dir(t, e, sb.ID(), "cpu"), "cpu.shares"))
		name := fmt.Sprintf("h%d", i)
		// Busy until the FIFO has a writer: a read on a non-blocking
		// descriptor would need more than busybox sh; a flag file works.
		held = append(held, hold(t, sb, name, `echo held; while [ ! -e /tmp/stop ]; do :; done; cat /tmp/`+name+` >/dev/null`))
	}
	hogs := func() int {
		c := 0
		for _, f := range shares {
			if readFile(t, f) == "128" {
				c++
			}
		}
		return c
	}
	waitFor(t, "a busy sandbox to get the hog weight", 2*time.Minute, func() bool { return hogs() > 0 })
	for _, h := range held {
		if err := h.sb.WriteFile(context.Background(), "/tmp/stop", nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if res := h.release(t); res.ExitCode != 0 {
			t.Fatalf("busy exec: %+v", res)
		}
	}
	waitFor(t, "every sandbox idle", time.Minute, func() bool {
		for _, f := range shares {
			if readFile(t, f) != "2" {
				return false
			}
		}
		return true
	})
	if st := e.backend.QoSStats(); st.Hogs < 1 {
		t.Fatalf("QoS stats %+v: no hog", st)
	}
}

// TestMemoryOvercommit is the node of issue 14 in miniature: its
// sandboxes bounded together by a small cgroup (Options.MemoryBytes, the
// edge's --memory) with a small swap file, more sandboxes than the bound
// could hold if each touched its whole limit, idle ones holding memory and
// then active ones touching more than the node has left. Nobody within its
// limit is OOM-killed, the idle ones' processes live on, and it is their
// memory that went to swap.
func TestMemoryOvercommit(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"); err != nil {
		t.Skipf("needs cgroup v1 memory with swap accounting: %v", err)
	}
	const (
		node     = 192 << 20
		swapSize = 128 << 20
		limit    = 128 << 20 // each sandbox's: 8 of them, 1 GiB, against 320 MiB
		idleN    = 5
		idleMiB  = 24
		activeN  = 3
		touchMiB = 32
	)
	// The swap area goes last: registered before the backend, whose
	// cleanups (and the sandboxes') run first.
	area, err := swap.Open(swap.Options{File: filepath.Join(t.TempDir(), "swap.img"), Size: swapSize})
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EINVAL) {
		t.Skipf("cannot swapon a file here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := area.Close(); err != nil {
			t.Error(err)
		}
	})
	e := newEnvRootfs(t, 0, testsuite.BusyboxRootfs(t), func(o *container.Options) {
		o.MemoryBytes = node
		o.IdleAfter = 200 * time.Millisecond
	})
	ctx := context.Background()
	var idle, active []rt.Sandbox
	for i := 0; i < idleN+activeN; i++ {
		spec := e.newSpec()
		spec.Resources.MemoryBytes = limit
		sb, err := e.backend.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Destroy(ctx) })
		if i < idleN {
			idle = append(idle, sb)
		} else {
			active = append(active, sb)
		}
	}
	user := func(sb rt.Sandbox) string { return filepath.Join(v1Dir(t, e, sb.ID(), "memory"), "user") }
	// RAM and swap together are bounded at the limit.
	if got := readFile(t, filepath.Join(user(idle[0]), "memory.memsw.limit_in_bytes")); got != strconv.Itoa(limit) {
		t.Fatalf("user memsw limit %s, want %d", got, limit)
	}

	// The idle ones: a process holding touched memory, left running.
	for _, sb := range idle {
		res, err := sb.Exec(ctx, rt.ExecRequest{Shell: fmt.Sprintf(`(dd if=/dev/zero bs=%dM count=1 | sleep 3600) >/dev/null 2>&1 &`, idleMiB)}, nil)
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("start holder: %v %+v", err, res)
		}
	}
	for _, sb := range idle {
		waitFor(t, "the holders to touch their memory", time.Minute, func() bool {
			n, _ := strconv.ParseInt(readFile(t, filepath.Join(user(sb), "memory.usage_in_bytes")), 10, 64)
			return n >= idleMiB<<20
		})
		cpu := filepath.Join(v1Dir(t, e, sb.ID(), "cpu"), "cpu.shares")
		waitFor(t, "the holders' sandboxes to be idle", time.Minute, func() bool { return readFile(t, cpu) == "2" })
	}

	// The active ones touch more than the node has left, all at once,
	// and hold it.
	var held []*heldExec
	var ready []<-chan struct{}
	for i, sb := range active {
		h, r := startHold(sb, fmt.Sprintf("m%d", i), fmt.Sprintf(
			`dd if=/dev/zero bs=%dM count=1 2>/dev/null | { head -c 1 >/dev/null; echo held; cat /tmp/m%d >/dev/null; }`, touchMiB, i))
		held, ready = append(held, h), append(ready, r)
	}
	for i, h := range held {
		h.wait(t, ready[i])
	}
	parent := filepath.Dir(v1Dir(t, e, idle[0].ID(), "memory"))
	// The loop brings the node back above its low watermark (an eighth of
	// it) by reclaiming idle sandboxes.
	waitFor(t, "the node's free memory back above its low watermark", time.Minute, func() bool {
		n, _ := strconv.ParseInt(readFile(t, filepath.Join(parent, "memory.usage_in_bytes")), 10, 64)
		return node-n >= node/8
	})
	var idleSwap, activeSwap int64
	for _, sb := range idle {
		idleSwap += memStat(t, user(sb), "swap")
	}
	for _, sb := range active {
		activeSwap += memStat(t, user(sb), "swap")
	}
	st := e.backend.QoSStats()
	t.Logf("swap: idle sandboxes %d MiB, active %d MiB; QoS %+v", idleSwap>>20, activeSwap>>20, st)
	if idleSwap < node/8 {
		t.Errorf("the idle sandboxes have %d MiB in swap; want at least %d (the node's low watermark)", idleSwap>>20, node/8>>20)
	}
	if activeSwap >= idleSwap {
		t.Errorf("the active sandboxes have %d MiB in swap, the idle ones %d: idle ones were not reclaimed first", activeSwap>>20, idleSwap>>20)
	}
	if st.Reclaims == 0 {
		t.Errorf("the QoS loop reclaimed nothing: %+v", st)
	}

	for _, h := range held {
		res := h.release(t)
		if res.OOMKilled || res.ExitCode != 0 {
			t.Errorf("active exec within its limit: exit %d, OOMKilled %v (%s)", res.ExitCode, res.OOMKilled, res.Stderr)
		}
	}
	for _, sb := range idle {
		res, err := sb.Exec(ctx, rt.ExecRequest{Shell: "pidof dd"}, nil)
		if err != nil || res.ExitCode != 0 || res.OOMKilled {
			t.Errorf("idle sandbox %s: its holder is gone: %v %+v", sb.ID(), err, res)
		}
	}
	// v1 counts an OOM kill in the victim's own cgroup: the user's, or
	// the sandbox's (its agent).
	for _, sb := range append(idle, active...) {
		for _, dir := range []string{user(sb), filepath.Dir(user(sb))} {
			if oc := readFile(t, filepath.Join(dir, "memory.oom_control")); !strings.Contains(oc, "oom_kill 0") {
				t.Errorf("sandbox %s: OOM kills in %s: %q", sb.ID(), dir, oc)
			}
		}
	}
	if oc := readFile(t, filepath.Join(parent, "memory.oom_control")); !strings.Contains(oc, "oom_kill 0") {
		t.Errorf("the node's cgroup: OOM kills: %q", oc)
	}
}
