package testsuite

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testIsolation(t *testing.T) {
	t.Run("pid-namespace", s.testPIDNamespace)
	t.Run("hostname", s.testHostname)
	t.Run("host-files-hidden", s.testHostFilesHidden)
	t.Run("files-private", s.testFilesPrivate)
	t.Run("network", s.testNetwork)
	t.Run("sys-read-only", s.testSysReadOnly)
	t.Run("proc-sys-read-only", s.testProcSysReadOnly)
	t.Run("sandboxes-see-no-other-processes", s.testCrossSandboxProcesses)
}

func (s *suite) testPIDNamespace(t *testing.T) {
	// A host process with a unique command line: it must not be visible
	// inside. Fractional seconds make the marker unlikely to occur elsewhere.
	const marker = "3603.25"
	host := exec.Command("sleep", marker)
	if err := host.Start(); err != nil {
		t.Fatalf("start host sleep: %v", err)
	}
	t.Cleanup(func() {
		_ = host.Process.Kill()
		_ = host.Wait()
	})
	// Positive control: the marker really is in the host process's cmdline,
	// so its absence inside means something.
	// Start returns once execve has begun, but the new command line is set
	// a moment later, so poll.
	var cmdline []byte
	if !poll(t.Context(), 10*time.Second, func() bool {
		cmdline, _ = os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", host.Process.Pid))
		return strings.Contains(string(cmdline), marker)
	}) {
		t.Fatalf("host control process %d: cmdline %q lacks %q", host.Process.Pid, cmdline, marker)
	}

	sb := s.create(t, nil)
	out := strings.TrimSpace(s.sh(t, sb, `echo $$`))
	pid, err := strconv.Atoi(out)
	if err != nil {
		t.Fatalf("echo $$ printed %q", out)
	}
	// In a fresh PID namespace the agent is 1 and an exec gets a small PID;
	// on the host it would be one among thousands.
	if pid <= 1 || pid >= 1000 {
		t.Errorf("exec's PID inside the sandbox is %d; want a small PID (>1) of the sandbox's own PID namespace", pid)
	}

	init := strings.TrimSpace(s.sh(t, sb, `tr '\0' ' ' < /proc/1/cmdline`))
	if init == "" {
		t.Errorf("/proc/1/cmdline inside the sandbox is empty; want the agent")
	}
	hostInit, err := os.ReadFile("/proc/1/cmdline")
	if err == nil && init == strings.TrimSpace(strings.ReplaceAll(string(hostInit), "\x00", " ")) {
		t.Errorf("PID 1 inside the sandbox is the host's init (%q): no PID namespace", init)
	}
	if s.h.AgentName != "" && !strings.Contains(init, s.h.AgentName) {
		t.Errorf("PID 1 inside the sandbox is %q; want the agent (%q)", init, s.h.AgentName)
	}

	ps := s.procs(t, sb)
	if len(ps) == 0 {
		t.Fatal("process listing inside the sandbox is empty: /proc not mounted?")
	}
	if got := withMarker(ps, marker); len(got) > 0 {
		t.Errorf("host process %q (pid %d) is visible inside the sandbox: %v", marker, host.Process.Pid, got)
	}
	for _, p := range ps {
		if p.pid == host.Process.Pid {
			t.Errorf("the host process's PID %d is visible inside the sandbox as %q", p.pid, p.cmd)
		}
	}
}

func (s *suite) testHostname(t *testing.T) {
	const name = "dsec-suite-host"
	named := s.create(t, func(sp *runtime.Spec) { sp.Hostname = name })
	if got := strings.TrimSpace(s.sh(t, named, `hostname`)); got != name {
		t.Errorf("hostname with Spec.Hostname=%q: got %q", name, got)
	}
	if got := strings.TrimSpace(s.sh(t, named, `cat /proc/sys/kernel/hostname`)); got != name {
		t.Errorf("/proc/sys/kernel/hostname with Spec.Hostname=%q: got %q", name, got)
	}

	var id string
	byID := s.create(t, func(sp *runtime.Spec) { sp.Hostname = ""; id = sp.ID })
	if got := strings.TrimSpace(s.sh(t, byID, `hostname`)); got != id {
		t.Errorf("hostname without Spec.Hostname: got %q, want the ID %q", got, id)
	}
	hostHost, _ := os.Hostname()
	if hostHost == name || hostHost == id {
		t.Fatalf("host's own hostname %q collides with the test's names", hostHost)
	}
}

func (s *suite) testHostFilesHidden(t *testing.T) {
	dir, err := os.MkdirTemp("", "dsec-suite-marker-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	marker := filepath.Join(dir, "host-marker")
	if err := os.WriteFile(marker, []byte("host secret\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sb := s.create(t, nil)
	res := s.exec(t, sb, runtime.ExecRequest{Shell: fmt.Sprintf(`test -e %s || test -e %s`, marker, dir)})
	if res.ExitCode == 0 {
		t.Errorf("host path %s is visible inside the sandbox", marker)
	}
	if _, err := sb.ReadFile(s.ctx(t), marker, 1<<20); err == nil {
		t.Errorf("ReadFile(%s) of a host file succeeded", marker)
	}
}

func (s *suite) testFilesPrivate(t *testing.T) {
	a := s.create(t, nil)
	b := s.create(t, nil)
	s.sh(t, a, `echo a > /a-root-marker && echo a > /tmp/a-tmp-marker && mkdir -p /root/x && echo a > /root/x/m`)
	for _, p := range []string{"/a-root-marker", "/tmp/a-tmp-marker", "/root/x/m"} {
		// Positive control in A, then absence in B.
		s.sh(t, a, "test -f "+p)
		res := s.exec(t, b, runtime.ExecRequest{Shell: "test -e " + p})
		if res.ExitCode == 0 {
			t.Errorf("file %s written in sandbox A is visible in sandbox B", p)
		}
	}
}

func (s *suite) testNetwork(t *testing.T) {
	s.need(t, NetworkIsolation)
	sb := s.create(t, nil)

	// Only lo: /proc/net/dev lists the interfaces of the exec's network namespace.
	dev := s.sh(t, sb, `cat /proc/net/dev`)
	var ifaces []string
	for _, line := range strings.Split(dev, "\n") {
		name, _, ok := strings.Cut(line, ":")
		if !ok {
			continue // the two header lines have no ':'
		}
		ifaces = append(ifaces, strings.TrimSpace(name))
	}
	if len(ifaces) != 1 || ifaces[0] != "lo" {
		t.Errorf("network interfaces inside the sandbox: %v; want only lo\n%s", ifaces, dev)
	}

	// lo is up: a connection over it works. Connecting on a down lo fails
	// with "network unreachable". The listener may not be ready when the
	// client first tries, so the client retries a bounded number of times;
	// under heavy load busybox nc has been seen to deliver nothing on a
	// connection that did open, so the whole exchange is retried on a fresh
	// port a few times (a down lo fails every attempt).
	const loScript = `for try in 1 2 3 4 5; do
  p=$((17000+try))
  nc -l -p $p > /tmp/lo-got & l=$!
  i=0
  until echo ping | nc -w 2 127.0.0.1 $p; do
    i=$((i+1)); [ $i -gt 100 ] && { kill $l; break; }
    usleep 20000
  done
  wait $l
  [ "$(cat /tmp/lo-got)" = ping ] && { echo ping; exit 0; }
done
echo "lo never delivered" >&2; exit 3`
	if got := strings.TrimSpace(s.sh(t, sb, loScript)); got != "ping" {
		t.Errorf("loopback round trip inside the sandbox delivered %q, want %q", got, "ping")
	}
	// Where sysfs is mounted it must be the sandbox's own: lo alone, flagged up.
	res := s.exec(t, sb, runtime.ExecRequest{Shell: `test -d /sys/class/net && ls /sys/class/net && cat /sys/class/net/lo/flags`})
	if res.ExitCode == 0 {
		fields := strings.Fields(string(res.Stdout))
		if len(fields) != 2 || fields[0] != "lo" {
			t.Errorf("/sys/class/net inside the sandbox lists %v; want only lo", fields[:len(fields)-1])
		} else if flags, err := strconv.ParseUint(strings.TrimPrefix(fields[1], "0x"), 16, 32); err != nil || flags&1 == 0 {
			t.Errorf("lo flags %q inside the sandbox: IFF_UP not set (err %v)", fields[1], err)
		}
	}

	// A host listener on 127.0.0.1 is unreachable from inside.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var accepted atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	res = s.exec(t, sb, runtime.ExecRequest{Shell: fmt.Sprintf(`echo hi | nc -w 3 127.0.0.1 %d`, port)})
	if res.ExitCode == 0 || accepted.Load() > 0 {
		t.Errorf("connecting from the sandbox to the host's 127.0.0.1:%d succeeded (%s, host accepted %d)",
			port, resultSummary(res), accepted.Load())
	}
}

func (s *suite) testSysReadOnly(t *testing.T) {
	s.need(t, ReadOnlySystem)
	sb := s.create(t, nil)
	// Creating a file fails on a read-only sysfs and on a missing sysfs over a
	// read-only rootfs dir, but would succeed on a plain writable /sys dir.
	if res := s.exec(t, sb, runtime.ExecRequest{Shell: `touch /sys/dsec-probe`}); res.ExitCode == 0 {
		t.Errorf("creating /sys/dsec-probe inside the sandbox succeeded")
	}
	// sysfs refuses file creation even when writable, so also write an
	// existing attribute: lo's MTU, written back unchanged (harmless if the
	// write wrongly succeeds, and per network namespace).
	res := s.exec(t, sb, runtime.ExecRequest{Shell: `f=/sys/class/net/lo/mtu; test -f $f || exit 100; v=$(cat $f); echo $v > $f`})
	switch {
	case res.ExitCode == 100:
		t.Logf("sysfs not mounted inside the sandbox; attribute write not checked")
	case res.ExitCode == 0:
		t.Errorf("writing /sys/class/net/lo/mtu inside the sandbox succeeded: /sys is writable")
	}
}

func (s *suite) testProcSysReadOnly(t *testing.T) {
	s.need(t, ReadOnlySystem)
	sb := s.create(t, nil)
	// Writing the current value back: a no-op on the host if the write
	// wrongly goes through.
	for _, f := range []string{"/proc/sys/vm/overcommit_memory", "/proc/sys/kernel/randomize_va_space"} {
		script := fmt.Sprintf(`f=%s; test -f $f || exit 100; v=$(cat $f); echo "$v" > $f`, f)
		res := s.exec(t, sb, runtime.ExecRequest{Shell: script})
		switch res.ExitCode {
		case 100:
			t.Errorf("%s missing inside the sandbox: /proc not mounted?", f)
		case 0:
			t.Errorf("writing %s inside the sandbox succeeded: /proc/sys is writable", f)
		}
	}
}

func (s *suite) testCrossSandboxProcesses(t *testing.T) {
	a := s.create(t, nil)
	b := s.create(t, nil)
	const marker = "3602"
	ctx, cancel := context.WithCancel(s.ctx(t))
	defer cancel()
	out, started := signalOn("started")
	done := make(chan error, 1)
	go func() {
		_, err := a.Exec(ctx, runtime.ExecRequest{Shell: "sleep " + marker + " & echo started; wait"}, out)
		done <- err
	}()
	select {
	case <-started:
	case err := <-done:
		t.Fatalf("background exec in A ended before starting: %v", err)
	case <-ctx.Done():
		t.Fatal("background exec in A never started")
	}
	// Positive control: A sees its own process.
	if len(withMarker(s.procs(t, a), marker)) == 0 {
		t.Fatalf("sandbox A does not see its own %q process", marker)
	}
	if got := withMarker(s.procs(t, b), marker); len(got) > 0 {
		t.Errorf("sandbox B sees sandbox A's process: %v", got)
	}
	cancel()
	<-done
}
