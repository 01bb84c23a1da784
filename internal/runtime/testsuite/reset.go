package testsuite

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// testReset checks runtime.Resetter, run when the backend's sandboxes
// implement it. Warm pools and fncall hand one sandbox to user after user
// with a Reset in between, so every check assumes a hostile previous user
// and compares what the next user sees with what a fresh sandbox shows.
func (s *suite) testReset(t *testing.T) {
	probe := s.create(t, nil)
	_, ok := probe.(runtime.Resetter)
	s.destroy(t, probe)
	if !ok {
		t.Skip("the backend's sandboxes do not implement runtime.Resetter")
	}
	t.Run("processes", s.testResetProcesses)
	t.Run("rootfs", s.testResetRootfs)
	t.Run("scratch", s.testResetScratch)
	t.Run("times", s.testResetTimes)
	t.Run("ipc", s.testResetIPC)
	t.Run("unchanged", s.testResetUnchanged)
	t.Run("agent", s.testResetAgent)
	t.Run("frozen", s.testResetFrozen)
	t.Run("exec-running", s.testResetExecRunning)
	t.Run("repeated", s.testResetRepeated)
	t.Run("destroy", s.testResetDestroy)
}

// tryReset calls Reset with a watchdog: a backend that hangs fails the
// test instead of hanging it.
func (s *suite) tryReset(t *testing.T, sb runtime.Sandbox) error {
	t.Helper()
	r, ok := sb.(runtime.Resetter)
	if !ok {
		t.Fatalf("sandbox %q does not implement runtime.Resetter", sb.ID())
	}
	ch := make(chan error, 1)
	ctx := s.ctx(t)
	go func() { ch <- r.Reset(ctx) }()
	select {
	case err := <-ch:
		return err
	case <-time.After(s.h.OpTimeout + 30*time.Second):
		t.Fatalf("Reset(%q) did not return within 30s after its context expired", sb.ID())
		return nil
	}
}

func (s *suite) reset(t *testing.T, sb runtime.Sandbox) {
	t.Helper()
	if err := s.tryReset(t, sb); err != nil {
		t.Fatalf("Reset(%q): %v", sb.ID(), err)
	}
}

// psEntry is one process seen inside a sandbox, from /proc/PID/stat.
type psEntry struct {
	pid, ppid int
	state     string
	cmd       string
}

func (p psEntry) String() string {
	return fmt.Sprintf("%d(ppid %d, %s) %q", p.pid, p.ppid, p.state, p.cmd)
}

// psTreeScript prints its own PID, then one "stat line<TAB>cmdline" per
// process (zombies included: their cmdline is empty). Command lines are
// flattened to one line: this very script's has newlines.
const psTreeScript = `echo $$
for d in /proc/[0-9]*; do
  s=$(cat $d/stat 2>/dev/null) || continue
  c=$(tr '\0\n' '  ' < $d/cmdline 2>/dev/null)
  printf '%s\t%s\n' "$s" "$c"
done`

// psTree lists sb's processes with states and parents, and the PID of the
// listing shell.
func (s *suite) psTree(t *testing.T, sb runtime.Sandbox) (self int, ps []psEntry) {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(s.sh(t, sb, psTreeScript)), "\n")
	self, err := strconv.Atoi(lines[0])
	if err != nil {
		t.Fatalf("process listing: bad first line %q", lines[0])
	}
	for _, line := range lines[1:] {
		stat, cmd, _ := strings.Cut(line, "\t")
		i := strings.LastIndexByte(stat, ')')
		f := strings.Fields(stat)
		if i < 0 || len(f) < 1 {
			t.Fatalf("process listing: bad line %q", line)
		}
		rest := strings.Fields(stat[i+1:])
		if len(rest) < 2 {
			t.Fatalf("process listing: bad line %q", line)
		}
		pid, err1 := strconv.Atoi(f[0])
		ppid, err2 := strconv.Atoi(rest[1])
		if err1 != nil || err2 != nil {
			t.Fatalf("process listing: bad line %q", line)
		}
		ps = append(ps, psEntry{pid: pid, ppid: ppid, state: rest[0], cmd: strings.TrimSpace(cmd)})
	}
	return self, ps
}

// leftovers returns the processes other than PID 1 (the agent) and the
// listing shell with its own children.
func leftovers(self int, ps []psEntry) []psEntry {
	parent := map[int]int{}
	for _, p := range ps {
		parent[p.pid] = p.ppid
	}
	var out []psEntry
	for _, p := range ps {
		if p.pid == 1 {
			continue
		}
		listing := false
		for q, n := p.pid, 0; q > 1 && n < 64; q, n = parent[q], n+1 {
			if q == self {
				listing = true
				break
			}
		}
		if !listing {
			out = append(out, p)
		}
	}
	return out
}

func (s *suite) testResetProcesses(t *testing.T) {
	sb := s.create(t, nil)
	// Every way a process can try to outlive its user: in the background,
	// in a new session (setsid), double-forked into a new session, immune
	// to hangups (busybox has no nohup applet), stopped, ignoring every
	// catchable signal, and a parent that never reaps its exited child (a
	// zombie). The stop waits for the exec, so that the stopped process is
	// the sleep and not the shell about to become it.
	hostile := `sleep 3701 >/dev/null 2>&1 &
setsid sleep 3702 >/dev/null 2>&1 &
( setsid sh -c 'sleep 3703 >/dev/null 2>&1 & exec sleep 3704' >/dev/null 2>&1 & )
sh -c 'trap "" HUP; exec sleep 3705' >/dev/null 2>&1 &
sleep 3706 >/dev/null 2>&1 &
p=$!
until [ "$(cat /proc/$p/comm)" = sleep ]; do :; done
kill -STOP $p
sh -c 'trap "" HUP INT TERM QUIT USR1 USR2; true & exec sleep 3707' >/dev/null 2>&1 &
echo started`
	s.sh(t, sb, hostile)
	// The agent stays: a user may signal PID 1 with anything catchable.
	s.sh(t, sb, `for s in HUP INT QUIT ILL TRAP ABRT BUS FPE SEGV USR1 USR2 PIPE ALRM TERM STKFLT XCPU XFSZ VTALRM IO PWR SYS; do kill -$s 1; done; true`)
	markers := []string{"3701", "3702", "3703", "3704", "3705", "3706", "3707"}
	if _, lacks := s.h.Lacks[Users]; !lacks {
		res := s.exec(t, sb, runtime.ExecRequest{Shell: "setsid sleep 3708 >/dev/null 2>&1 &", User: "65534"})
		requireExit(t, res, 0, "background sleep as nobody")
		markers = append(markers, "3708")
	}
	// Positive control: all of them run (the double fork takes a moment),
	// one is stopped and one is a zombie, so their absence later means
	// something. Command lines must match exactly: the scripts that start
	// them contain the markers too.
	var last []psEntry
	if !poll(t.Context(), 20*time.Second, func() bool {
		_, last = s.psTree(t, sb)
		found, stopped, zombie := 0, false, false
		for _, m := range markers {
			for _, p := range last {
				if p.cmd == "sleep "+m {
					found++
					break
				}
			}
		}
		for _, p := range last {
			stopped = stopped || p.state == "T" && p.cmd == "sleep 3706"
			zombie = zombie || p.state == "Z"
		}
		return found == len(markers) && stopped && zombie
	}) {
		t.Fatalf("the hostile processes did not all start (want %v running, 3706 stopped, a zombie): %v", markers, last)
	}

	s.reset(t, sb)

	select {
	case <-sb.Done():
		t.Fatal("the sandbox's init exited during Reset")
	default:
	}
	// Reset returns once they are gone and reaped: no polling.
	self, ps := s.psTree(t, sb)
	if left := leftovers(self, ps); len(left) > 0 {
		t.Errorf("processes survive Reset: %v", left)
	}
	agentSeen := false
	for _, p := range ps {
		if p.state == "Z" {
			t.Errorf("zombie after Reset: %v", p)
		}
		if p.pid == 1 {
			agentSeen = true
			if s.h.AgentName != "" && !strings.Contains(p.cmd, s.h.AgentName) {
				t.Errorf("PID 1 after Reset is %q; want the agent (%q)", p.cmd, s.h.AgentName)
			}
		}
	}
	if !agentSeen {
		t.Errorf("no PID 1 after Reset: %v", ps)
	}
	if got := s.sh(t, sb, "echo ok"); got != "ok\n" {
		t.Errorf("after Reset, echo ok printed %q", got)
	}
}

// fsExclude keeps the mount points of the kernel's and the sandbox's own
// file systems out of a root file system listing.
const fsExclude = `\( -path /proc -o -path /sys -o -path /dev \) -prune -o`

// fsScript fingerprints the root file system: every entry's name (and
// link target), mode, type, owner, size and link count, and every regular
// file's contents.
const fsScript = `find / -xdev ` + fsExclude + ` -exec stat -c '%N %a %F %u %g %s %h' {} + | sort
find / -xdev ` + fsExclude + ` -type f -exec md5sum {} + | sort`

// devScript fingerprints /dev (device numbers included) and /tmp.
const devScript = `find /dev /tmp -exec stat -c '%N %a %F %u %g %t:%T %s' {} + | sort`

func (s *suite) testResetRootfs(t *testing.T) {
	sb := s.create(t, nil)
	fresh := s.sh(t, sb, fsScript)
	// Add, change, delete (files and directories of the base image), change
	// modes, move, link: copy-ups, whiteouts and opaque directories.
	s.sh(t, sb, `set -e
echo new > /dsec-new-file
mkdir -p /dsec-new-dir/sub && echo x > /dsec-new-dir/sub/f
echo tampered >> /etc/hosts
rm `+BaseMarkerPath+`
rm -rf /home
rm /bin/true
chmod 700 /mnt
mv /run /run-moved
mkdir /var/opaque && rm -rf /var/tmp && mkdir /var/tmp && echo y > /var/tmp/f
ln -s /etc /root/etc-link
echo t > /tmp/dsec-tmp-file`)
	changed := s.sh(t, sb, fsScript)
	if changed == fresh {
		t.Fatal("the changes are not visible in the fingerprint: the check below could not fail")
	}

	s.reset(t, sb)

	if got := s.sh(t, sb, fsScript); got != fresh {
		t.Errorf("root file system after Reset differs from the fresh sandbox's:\n%s", lineDiff(fresh, got))
	}
	data, err := sb.ReadFile(s.ctx(t), BaseMarkerPath, 1<<20)
	if err != nil || string(data) != BaseMarkerContent {
		t.Errorf("after Reset, ReadFile(%s) = %q, %v; want the base layer's %q", BaseMarkerPath, data, err, BaseMarkerContent)
	}
}

func (s *suite) testResetScratch(t *testing.T) {
	sb := s.create(t, nil)
	fresh := s.sh(t, sb, devScript)
	// POSIX shared memory lives in /dev/shm; the user is root and may also
	// litter /dev, change device modes and delete device nodes.
	s.sh(t, sb, `set -e
echo x > /dev/shm/dsec-posix-shm
mkdir /dev/shm/dir
mkdir /dev/dsec-dir && echo y > /dev/dsec-dir/f
ln -s /etc /dev/dsec-link
echo z > /dev/dsec-file
chmod 600 /dev/zero
mkdir -p /tmp/a/b && echo t > /tmp/a/b/f
rm /dev/null`)
	if changed := s.sh(t, sb, devScript); changed == fresh {
		t.Fatal("the changes are not visible in the /dev and /tmp listing: the check below could not fail")
	}

	s.reset(t, sb)

	if got := s.sh(t, sb, devScript); got != fresh {
		t.Errorf("/dev and /tmp after Reset differ from the fresh sandbox's:\n%s", lineDiff(fresh, got))
	}
	s.sh(t, sb, `echo discard > /dev/null && test -z "$(ls -A /dev/shm)" && test -z "$(ls -A /tmp)"`)
}

// testResetTimes checks that times the previous user set do not survive:
// a change of times alone (nothing added, removed or rewritten) is a
// change, on the root file system, /tmp and /dev alike. A backend that
// keeps what was not written must see it.
func (s *suite) testResetTimes(t *testing.T) {
	sb := s.create(t, nil)
	const paths = "/ /tmp /etc/hosts /dev /dev/shm"
	const probe = "stat -c '%n %Y' " + paths
	fresh := s.sh(t, sb, probe)
	// 2001-02-03 04:05:06 UTC.
	const stamp = "981173106"
	s.sh(t, sb, "touch -d '2001-02-03 04:05:06' "+paths)
	if got := s.sh(t, sb, probe); strings.Count(got, " "+stamp+"\n") != 5 {
		t.Fatalf("touch did not set the times (the check below could not fail): %q", got)
	}

	s.reset(t, sb)

	got := s.sh(t, sb, probe)
	if strings.Contains(got, " "+stamp+"\n") {
		t.Errorf("times set by the previous user survive Reset:\n%s", lineDiff(fresh, got))
	}
	// A file of the image gets the image's times back.
	hosts := func(listing string) string {
		for _, l := range strings.Split(listing, "\n") {
			if strings.HasPrefix(l, "/etc/hosts ") {
				return l
			}
		}
		return ""
	}
	if hosts(got) != hosts(fresh) {
		t.Errorf("/etc/hosts after Reset: %q; fresh: %q", hosts(got), hosts(fresh))
	}
}

func (s *suite) testResetIPC(t *testing.T) {
	// busybox cannot make System V IPC objects or POSIX message queues: a
	// small static helper does.
	bin, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/ipcprobe"))
	if err != nil {
		t.Fatal(err)
	}
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	const probe = "/tmp/ipcprobe"
	install := func() {
		if err := sb.WriteFile(ctx, probe, bin, 0o755); err != nil {
			t.Fatalf("WriteFile(%s): %v", probe, err)
		}
	}
	const none = "shm 0 sem 0 msg 0 mqueue 0\n"
	install()
	if got := s.sh(t, sb, probe+" count"); got != none {
		t.Fatalf("a fresh sandbox's IPC namespace holds %q; want %q", got, none)
	}
	s.sh(t, sb, probe+" make && "+probe+" make")
	if got := s.sh(t, sb, probe+" count"); got != "shm 2 sem 2 msg 2 mqueue 1\n" {
		t.Fatalf("after making IPC objects: %q", got)
	}

	s.reset(t, sb)

	install() // /tmp is fresh too
	if got := s.sh(t, sb, probe+" count"); got != none {
		t.Errorf("IPC objects survive Reset: %q; want %q", got, none)
	}
}

func (s *suite) testResetUnchanged(t *testing.T) {
	_, memLimit := s.h.Lacks[MemoryLimit]
	memLimit = !memLimit
	const limit = 64 << 20
	sb := s.create(t, func(sp *runtime.Spec) {
		sp.Hostname = "dsec-reset-host"
		sp.Env = append(sp.Env, "DSEC_RESET_ENV=kept")
		if memLimit {
			sp.Resources.MemoryBytes = limit
		}
	})
	const probe = `hostname; echo "env=$DSEC_RESET_ENV"; grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status; ulimit -a; id; pwd`
	before := s.sh(t, sb, probe)
	if !strings.HasPrefix(before, "dsec-reset-host\nenv=kept\n") {
		t.Fatalf("spec hostname and env not in effect before Reset: %q", before)
	}

	s.reset(t, sb)

	if after := s.sh(t, sb, probe); after != before {
		t.Errorf("hostname, environment, capabilities, seccomp or rlimits of new processes changed across Reset:\n%s", lineDiff(before, after))
	}
	if memLimit {
		res := s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(27), Timeout: 2 * time.Minute})
		if !res.OOMKilled || res.ExitCode == 0 && res.Signal == 0 {
			t.Errorf("after Reset, allocating ~270 MB under a %d MiB limit: %s; want an OOM kill", limit>>20, resultSummary(res))
		}
		requireExit(t, s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(22)}), 0, "awk 4 MiB after Reset")
	}

	// File operations work on the new root.
	ctx := s.ctx(t)
	if err := sb.WriteFile(ctx, "/tmp/dsec-reset-file", []byte("after reset\n"), 0o644); err != nil {
		t.Fatalf("WriteFile after Reset: %v", err)
	}
	if got, err := sb.ReadFile(ctx, "/tmp/dsec-reset-file", 1<<20); err != nil || string(got) != "after reset\n" {
		t.Errorf("ReadFile after Reset: %q, %v", got, err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: "in.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3}); err != nil {
		t.Fatal(err)
	}
	tw.Write([]byte("in\n"))
	tw.Close()
	if err := sb.PutArchive(ctx, "/tmp/dsec-arch", &buf); err != nil {
		t.Fatalf("PutArchive after Reset: %v", err)
	}
	if got := s.sh(t, sb, "cat /tmp/dsec-arch/in.txt"); got != "in\n" {
		t.Errorf("archive extracted after Reset holds %q", got)
	}
	var back bytes.Buffer
	if err := sb.GetArchive(ctx, "/tmp/dsec-arch", &back); err != nil {
		t.Fatalf("GetArchive after Reset: %v", err)
	}
	found := false
	tr := tar.NewReader(&back)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("GetArchive after Reset: %v", err)
		}
		found = found || strings.HasSuffix(h.Name, "in.txt")
	}
	if !found {
		t.Error("GetArchive after Reset lacks in.txt")
	}
}

// testResetAgent checks what the previous user could do to PID 1, which a
// reset sandbox keeps: what every process it starts inherits (nice,
// scheduling, CPU list, I/O priority, resource limits, OOM score,
// coredump filter) and its own OOM score and autogroup nice must be back
// as they were, Reset must succeed whatever was tried (a hard limit
// lowered on the agent cannot be raised again without CAP_SYS_RESOURCE:
// every Reset failed and the sandbox was destroyed, so any tenant could
// force a cold create per call), and its memory must be out of reach.
func (s *suite) testResetAgent(t *testing.T) {
	bin, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/pid1probe"))
	if err != nil {
		t.Fatal(err)
	}
	sb := s.create(t, nil)
	// What a process started now gets, and what of PID 1 the sandbox can
	// read (a backend may hide PID 1's /proc files: then they stay hidden).
	const probe = `cut -d' ' -f19 /proc/self/stat; grep Cpus_allowed_list /proc/self/status; ionice
cat /proc/self/limits /proc/self/oom_score_adj /proc/self/coredump_filter
for f in oom_score_adj autogroup coredump_filter limits; do cat /proc/1/$f 2>/dev/null || echo "no /proc/1/$f"; done`
	fresh := s.sh(t, sb, probe)
	if err := sb.WriteFile(s.ctx(t), "/tmp/pid1probe", bin, 0o755); err != nil {
		t.Fatal(err)
	}
	// Every way the user owning PID 1 may try, on every thread of it that
	// /proc shows and on the low thread IDs a Go agent's threads get.
	// RLIMIT_NOFILE (7) and RLIMIT_CORE (4) are lowered, hard limits too.
	s.sh(t, sb, `{ tids=$(ls /proc/1/task 2>/dev/null); for t in 1 2 3 4 5 6 7 8 $tids; do
renice 15 -p $t; taskset -p 1 $t; ionice -c 3 -p $t; /tmp/pid1probe prlimit $t 7 64 64; /tmp/pid1probe prlimit $t 4 0 0
done
echo 1000 > /proc/1/oom_score_adj; echo 19 > /proc/1/autogroup; echo 0 > /proc/1/coredump_filter; } >/dev/null 2>&1; true`)
	if tampered := s.sh(t, sb, probe); tampered == fresh {
		t.Log("the user could not change what PID 1 hands down or shows; checking Reset keeps it anyway")
	} else {
		t.Logf("the user changed:\n%s", lineDiff(fresh, tampered))
	}

	if err := s.tryReset(t, sb); err != nil {
		t.Fatalf("Reset after the user tampered with PID 1 failed (the sandbox is lost for the next user): %v", err)
	}

	if got := s.sh(t, sb, probe); got != fresh {
		t.Errorf("after Reset, new processes or the agent keep what the previous user set:\n%s", lineDiff(fresh, got))
	}
	// ptrace, /proc/1/mem and pidfd_getfd share one permission check: a
	// process that may open /proc/1/mem for reading may take the agent over.
	if got := s.sh(t, sb, `if (exec 3</proc/1/mem) 2>/dev/null; then echo open; else echo denied; fi`); got != "denied\n" {
		t.Errorf("a sandbox process can open the agent's memory (/proc/1/mem): %q", got)
	}
}

func (s *suite) testResetFrozen(t *testing.T) {
	sb := s.create(t, nil)
	s.sh(t, sb, "sleep 3711 >/dev/null 2>&1 & setsid sleep 3712 >/dev/null 2>&1 &")
	if err := sb.Freeze(s.ctx(t)); err != nil {
		t.Fatalf("freeze: %v", err)
	}

	s.reset(t, sb)

	if got := s.sh(t, sb, "echo ok"); got != "ok\n" {
		t.Errorf("after Reset of a frozen sandbox, echo ok printed %q", got)
	}
	self, ps := s.psTree(t, sb)
	if left := leftovers(self, ps); len(left) > 0 {
		t.Errorf("processes of a frozen sandbox survive Reset: %v", left)
	}
}

// testResetExecRunning resets while an exec still runs. Callers must not
// do that, but the sandbox must come out working, or Reset must fail so the
// caller destroys it; nothing may hang.
func (s *suite) testResetExecRunning(t *testing.T) {
	sb := s.create(t, nil)
	out, started := signalOn("started")
	type result struct {
		res runtime.ExecResult
		err error
	}
	ch := make(chan result, 1)
	ctx := s.ctx(t)
	go func() {
		res, err := sb.Exec(ctx, runtime.ExecRequest{Shell: "sleep 3714 >/dev/null 2>&1 & echo started; exec sleep 3713"}, out)
		ch <- result{res, err}
	}()
	select {
	case <-started:
	case r := <-ch:
		t.Fatalf("exec ended before Reset: %s %v", resultSummary(r.res), r.err)
	case <-time.After(s.h.OpTimeout):
		t.Fatal("exec did not start")
	}

	err := s.tryReset(t, sb)

	select {
	case r := <-ch:
		t.Logf("the exec in flight ended with %s, err %v", resultSummary(r.res), r.err)
	case <-time.After(s.h.OpTimeout):
		t.Fatal("the exec in flight still runs after Reset returned")
	}
	if err != nil {
		t.Logf("Reset with an exec in flight failed (the caller destroys the sandbox): %v", err)
		return
	}
	if got := s.sh(t, sb, "echo ok"); got != "ok\n" {
		t.Errorf("after Reset with an exec in flight, echo ok printed %q", got)
	}
	self, ps := s.psTree(t, sb)
	if left := leftovers(self, ps); len(left) > 0 {
		t.Errorf("processes survive Reset: %v", left)
	}
}

// mountsScript lists the sandbox's mounts as "mount point, type".
const mountsScript = `awk '{for(i=7;i<=NF;i++) if($i=="-"){print $5, $(i+1); break}}' /proc/self/mountinfo | sort`

func (s *suite) testResetRepeated(t *testing.T) {
	const resets = 20
	sb := s.create(t, nil)
	freshMounts, freshFS, freshDev := s.sh(t, sb, mountsScript), s.sh(t, sb, fsScript), s.sh(t, sb, devScript)
	// The first reset may create what the sandbox keeps for later ones,
	// and finish its work in the background.
	s.reset(t, sb)
	var before Snapshot
	if s.h.Leaks != nil {
		before = s.steadyState(t)
	}
	for i := range resets {
		s.sh(t, sb, fmt.Sprintf(`set -e
echo %[1]d > /dsec-round-%[1]d
mkdir -p /tmp/round/%[1]d && seq 1 200 > /tmp/round/%[1]d/f
echo %[1]d > /dev/shm/round-%[1]d
rm -f /bin/echo
setsid sleep 37%02[1]d >/dev/null 2>&1 &
sleep 3799 >/dev/null 2>&1 &`, i))
		s.reset(t, sb)
	}
	if got := s.sh(t, sb, mountsScript); got != freshMounts {
		t.Errorf("mounts inside the sandbox after %d resets differ from a fresh sandbox's:\n%s", resets, lineDiff(freshMounts, got))
	}
	if got := s.sh(t, sb, fsScript); got != freshFS {
		t.Errorf("root file system after %d resets differs from the fresh sandbox's:\n%s", resets, lineDiff(freshFS, got))
	}
	if got := s.sh(t, sb, devScript); got != freshDev {
		t.Errorf("/dev and /tmp after %d resets differ from the fresh sandbox's:\n%s", resets, lineDiff(freshDev, got))
	}
	self, ps := s.psTree(t, sb)
	if left := leftovers(self, ps); len(left) > 0 {
		t.Errorf("processes survive %d resets: %v", resets, left)
	}
	if s.h.Leaks == nil {
		return
	}
	// The sandbox lives on, so its own host resources stay; nothing may
	// pile up. Names may change from one reset to the next (a new overlay
	// gets new directories), so state directory entries are counted.
	var leaked []string
	if !poll(t.Context(), 30*time.Second, func() bool {
		leaked = resetLeaks(before, s.h.Leaks(t))
		return len(leaked) == 0
	}) {
		t.Errorf("%d resets leaked host resources:\n  %s", resets, strings.Join(leaked, "\n  "))
	}
}

// steadyState polls leak snapshots until several in a row agree and
// returns the union of all it saw (each item as often as the most any
// snapshot had it). A backend may finish a reset's work in the background,
// holding some resources while it runs (the old root) and others after it
// (whatever it prepares for the next reset): either is the steady state of
// a sandbox that is reset again and again.
func (s *suite) steadyState(t *testing.T) Snapshot {
	t.Helper()
	const stable = 5
	union := s.h.Leaks(t)
	prev, same := union, 0
	if !poll(t.Context(), 30*time.Second, func() bool {
		snap := s.h.Leaks(t)
		union = unionSnapshot(union, snap)
		if len(snap.Leaked(prev)) == 0 && len(prev.Leaked(snap)) == 0 {
			same++
		} else {
			same = 0
		}
		prev = snap
		return same >= stable
	}) {
		t.Fatalf("host resources keep changing while the sandbox is idle")
	}
	return union
}

// unionSnapshot is a and b merged kind by kind, each item as often as the
// one of them that has it more often.
func unionSnapshot(a, b Snapshot) Snapshot {
	u := func(x, y []string) []string { return append(append([]string(nil), x...), extra(y, x)...) }
	return Snapshot{
		Mounts:    u(a.Mounts, b.Mounts),
		Cgroups:   u(a.Cgroups, b.Cgroups),
		Files:     u(a.Files, b.Files),
		Processes: u(a.Processes, b.Processes),
		FDs:       u(fdTargets(a.FDs), fdTargets(b.FDs)),
		Other:     u(a.Other, b.Other),
	}
}

// resetLeaks is Leaked for a sandbox that lives on: every kind compared
// item by item, except state directory entries, compared by number, and
// descriptors, compared by what they refer to (a backend may close one and
// open another like it, under another number).
func resetLeaks(before, after Snapshot) []string {
	b, a := before, after
	b.Files, a.Files = nil, nil
	b.FDs, a.FDs = fdTargets(before.FDs), fdTargets(after.FDs)
	leaked := a.Leaked(b)
	if len(after.Files) > len(before.Files) {
		leaked = append(leaked, fmt.Sprintf("files: %d entries under the state directories, %d before; new:\n    %s",
			len(after.Files), len(before.Files), clip([]byte(strings.Join(extra(after.Files, before.Files), "\n    ")))))
	}
	return leaked
}

// fdTargets drops the numbers from "fd -> target" items (items without
// one are kept as they are).
func fdTargets(fds []string) []string {
	out := make([]string, len(fds))
	for i, f := range fds {
		if _, target, ok := strings.Cut(f, " -> "); ok {
			f = target
		}
		out[i] = f
	}
	return out
}

func (s *suite) testResetDestroy(t *testing.T) {
	var before Snapshot
	if s.h.Leaks != nil {
		before = s.h.Leaks(t)
	}
	sb := s.create(t, nil)
	for range 2 {
		s.sh(t, sb, `mkdir -p /dsec-big && for i in $(seq 1 300); do echo $i > /dsec-big/f$i; done
echo x > /dev/shm/x; setsid sleep 3721 >/dev/null 2>&1 &`)
		s.reset(t, sb)
	}
	s.sh(t, sb, `echo y > /dsec-after; sleep 3722 >/dev/null 2>&1 &`)
	s.destroy(t, sb)
	if err := s.tryReset(t, sb); !isGone(err) {
		t.Errorf("Reset after Destroy: %v; want an error wrapping runtime.ErrSandboxGone", err)
	}
	if s.h.Leaks != nil {
		s.expectNoLeaks(t, before)
	}
}

// testUpdate checks runtime.Updater: limits change while the sandbox runs.
func (s *suite) testUpdate(t *testing.T) {
	sb := s.create(t, nil)
	u, ok := sb.(runtime.Updater)
	if !ok {
		t.Skip("the backend's sandboxes do not implement runtime.Updater")
	}
	ctx := s.ctx(t)
	for _, r := range []runtime.Resources{{MemoryBytes: -1}, {MilliCPU: -1}, {Pids: -1}, {MemoryBytes: 1 << 10}} {
		if err := u.Update(ctx, r); !errors.Is(err, runtime.ErrInvalidSpec) {
			t.Errorf("Update(%+v): %v; want an error wrapping runtime.ErrInvalidSpec", r, err)
		}
	}
	s.need(t, MemoryLimit)
	// Control: without a limit, a 64 MiB string (~135 MB peak) fits.
	requireExit(t, s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(26), Timeout: 2 * time.Minute}), 0, "awk 64 MiB without a limit")

	const limit = 64 << 20
	if err := u.Update(ctx, runtime.Resources{MemoryBytes: limit}); err != nil {
		t.Fatalf("Update(memory %d MiB): %v", limit>>20, err)
	}
	res := s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(27), Timeout: 2 * time.Minute})
	if !res.OOMKilled || res.ExitCode == 0 && res.Signal == 0 {
		t.Errorf("after lowering the limit to %d MiB, allocating ~270 MB: %s; want an OOM kill", limit>>20, resultSummary(res))
	}
	requireExit(t, s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(22)}), 0, "awk 4 MiB under the lowered limit")

	// Zero lifts the limit again.
	if err := u.Update(ctx, runtime.Resources{}); err != nil {
		t.Fatalf("Update(no limits): %v", err)
	}
	requireExit(t, s.exec(t, sb, runtime.ExecRequest{Shell: awkAlloc(26), Timeout: 2 * time.Minute}), 0, "awk 64 MiB after lifting the limit")
}

// lineDiff shows the lines only in want (-) and only in got (+).
func lineDiff(want, got string) string {
	w, g := strings.Split(strings.TrimSpace(want), "\n"), strings.Split(strings.TrimSpace(got), "\n")
	var b strings.Builder
	for _, l := range extra(w, g) {
		b.WriteString("  - " + l + "\n")
	}
	for _, l := range extra(g, w) {
		b.WriteString("  + " + l + "\n")
	}
	if b.Len() == 0 {
		return "  (same lines, different order)\n"
	}
	return clip([]byte(b.String()))
}
