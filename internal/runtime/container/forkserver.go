package container

// Fork servers (runtime.Forker): one long-lived process per sandbox that
// runs execs as forks of itself, kept across Resets.
//
// Protocol, over a SOCK_SEQPACKET connection (one message per datagram):
//
//	edge -> server: "run\0" CWD "\0" ARGC "\0" ARGV...
//	                with SCM_RIGHTS: the child's stdin, stdout and stderr
//	                (the child keeps the server's environment: ForkExec
//	                requires the exec's to be the server's)
//	server -> edge: "pid N" with SCM_RIGHTS a pidfd of the child, then
//	                "exit S" (S: its wait status) once it has exited; or
//	                "error MESSAGE" if it could not run the request; or
//	                "nofork ERRNO MESSAGE" if its fork failed (the
//	                sandbox's process or memory limit: a failed result).
//
// The server is started through the agent like any exec (so it is born in
// the sandbox's namespaces, cgroup, seccomp filter and capability set),
// with the name of an abstract Unix socket as its last argument. It
// listens there, writes "ready\n" to stdout, accepts exactly one
// connection (ours: we connect from a thread that joined the sandbox's
// network namespace) and closes the listener, so nothing started later in
// the sandbox can reach it. The child's pipes are the edge's own: output
// is read here, without the agent in the way.
//
// Why a Reset may spare it: the server makes itself non-dumpable before it
// serves (it changes its effective group and back, which resets the flag to
// fs.suid_dumpable, checked to be 0), so later processes of the sandbox,
// which lack CAP_SYS_PTRACE, cannot ptrace it or open its /proc/PID/mem or
// fds; nothing else of it is writable from outside but what a process of
// the same user may change about another (its rlimits, nice value,
// scheduling, affinity, I/O priority and OOM score), which Reset puts back
// as they were when it started, and signals, which can only stop or end
// it: Reset ends a server that is not running or sleeping, and one that
// died is started again by the next ForkExec. Its file system view moves
// with the agent's at Reset's pivot_root (its root and working directory
// are the sandbox's root), and it opens nothing after it starts.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

var _ rt.Forker = (*sandbox)(nil)

// forkServerStart bounds a fork server's start-up (an interpreter's).
const forkServerStart = 30 * time.Second

// outputGrace is how long the output of an exec that has exited is read
// for: a background process it left may hold the pipes open.
const outputGrace = 100 * time.Millisecond

// forkServer is a sandbox's running fork server.
type forkServer struct {
	key  string // what it was started from (argv and env)
	conn *net.UnixConn
	pid  int // in the host's PID namespace
	// pidfd is -1 but on kernels without SO_PEERPIDFD (before Linux 6.5),
	// where it is the server's pidfd, kept: see pidFD.
	pidfd int
	attrs *agentAttrs
	// userDir is the sandbox's user cgroup, where the server and its
	// children live.
	userDir string
	// done is closed when the exec that runs it returned.
	done chan struct{}
}

// close drops the connection (the server then exits) and the pidfd.
func (f *forkServer) close() {
	f.conn.Close()
	if f.pidfd >= 0 {
		unix.Close(f.pidfd)
	}
}

// pidFD returns a pidfd of the server, to be closed after use (release).
// It comes from the connection (SO_PEERPIDFD: the process that listened,
// the server, whose struct pid the kernel keeps with the socket, so the
// pidfd names the server even once its PID was reused), made for each
// use, so that a sandbox's fork server costs the edge one descriptor, its
// connection, between execs; on older kernels it is the one kept since
// the server started.
func (f *forkServer) pidFD() (fd int, release func(), err error) {
	if f.pidfd >= 0 {
		return f.pidfd, func() {}, nil
	}
	if fd, err = peerPidfd(f.conn); err != nil {
		return -1, nil, err
	}
	return fd, func() { unix.Close(fd) }, nil
}

// peerPidfd asks the kernel for a pidfd of c's peer (close-on-exec).
func peerPidfd(c *net.UnixConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd, serr := -1, error(nil)
	if err := rc.Control(func(s uintptr) { fd, serr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, unix.SO_PEERPIDFD) }); err != nil {
		return -1, err
	}
	return fd, serr
}

// kill sends the server SIGKILL.
func (f *forkServer) kill() {
	if fd, release, err := f.pidFD(); err == nil {
		unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		release()
	}
}

// alive reports whether the server process still exists.
func (f *forkServer) alive() bool {
	select {
	case <-f.done:
		return false
	default:
	}
	fd, release, err := f.pidFD()
	if err != nil {
		return false // gone: no pidfd for a process that was reaped
	}
	defer release()
	// A pidfd polls readable once the process has exited.
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n == 0
}

func forkServerKey(d rt.ForkServer) string {
	return strings.Join(d.Argv, "\x00") + "\x01" + strings.Join(d.Env, "\x00")
}

// ForkExec implements runtime.Forker.
func (s *sandbox) ForkExec(ctx context.Context, d rt.ForkServer, req rt.ExecRequest) (rt.ExecResult, error) {
	switch {
	case len(d.Argv) == 0:
		return rt.ExecResult{}, fmt.Errorf("%w: fork server: argv is empty", rt.ErrInvalidSpec)
	case len(req.Argv) == 0 || req.Shell != "":
		return rt.ExecResult{}, fmt.Errorf("%w: fork exec: needs argv, not a shell string", rt.ErrInvalidSpec)
	case req.User != "":
		return rt.ExecResult{}, fmt.Errorf("%w: fork exec: runs as the fork server's user; user %q cannot be set", rt.ErrInvalidSpec, req.User)
	case !slices.Equal(req.Env, d.Env):
		return rt.ExecResult{}, fmt.Errorf("%w: fork exec: the environment must be the fork server's", rt.ErrInvalidSpec)
	}
	s.begin()
	defer s.end()
	s.forkMu.Lock()
	defer s.forkMu.Unlock()
	f, err := s.forkServerFor(ctx, d)
	if err != nil {
		if errors.Is(err, rt.ErrSandboxGone) || ctx.Err() != nil {
			return rt.ExecResult{}, err
		}
		if err := s.gone(err); errors.Is(err, rt.ErrSandboxGone) {
			return rt.ExecResult{}, err
		}
		return rt.ExecResult{}, fmt.Errorf("%w: %v", rt.ErrForkServer, err)
	}
	if req.Cwd == "" {
		req.Cwd = s.spec.Workdir
	}
	if req.Cwd == "" {
		req.Cwd = "/"
	}
	before, evErr := s.cg.files().execStart(s.openUserFile)
	res, err := f.run(ctx, req)
	after, afterErr := s.cg.files().execEnd(s.openUserFile, evErr == nil && err == nil)
	if errors.Is(err, errServerLost) {
		// The program stopped or ended the server it was forked from:
		// its own doing, reported as its failure, not the sandbox's.
		s.b.log.Info("fork server lost during an exec; the exec is reported killed", "sandbox", s.id, "err", err)
		s.dropForkServer()
		return res, nil
	}
	if err != nil {
		// Whatever state it is in, it is not trusted with the next exec.
		s.dropForkServer()
		return res, s.gone(err)
	}
	if evErr == nil && afterErr == nil {
		noteEvents(&res, before, after)
	}
	return res, nil
}

// forkServerFor returns the running server started from d, starting it if
// there is none (or one started from something else, which is ended).
func (s *sandbox) forkServerFor(ctx context.Context, d rt.ForkServer) (*forkServer, error) {
	key := forkServerKey(d)
	s.forkSrvMu.Lock()
	f := s.forkSrv
	s.forkSrvMu.Unlock()
	if f != nil && f.key == key && f.alive() {
		return f, nil
	}
	s.dropForkServer()
	f, err := s.startForkServer(ctx, d, key)
	if err != nil {
		return nil, err
	}
	s.forkSrvMu.Lock()
	s.forkSrv = f
	s.forkSrvMu.Unlock()
	return f, nil
}

// dropForkServer ends the sandbox's fork server, if any.
func (s *sandbox) dropForkServer() {
	s.forkSrvMu.Lock()
	f := s.forkSrv
	s.forkSrv = nil
	s.forkSrvMu.Unlock()
	if f == nil {
		return
	}
	f.kill()
	f.close()
}

// forkServerPid is the host PID of the running fork server, or 0.
func (s *sandbox) forkServerPid() int {
	s.forkSrvMu.Lock()
	defer s.forkSrvMu.Unlock()
	if s.forkSrv == nil {
		return 0
	}
	return s.forkSrv.pid
}

// checkForkServer runs in Reset once the user's processes are gone: the
// server is kept only if it is healthy (alive, not stopped or traced) and
// its attributes could be put back as they were when it started.
func (s *sandbox) checkForkServer() {
	s.forkSrvMu.Lock()
	f := s.forkSrv
	s.forkSrvMu.Unlock()
	if f == nil {
		return
	}
	ok := f.healthy()
	if ok {
		ok = f.attrs.restore(f.pid) == nil
	}
	if !ok {
		s.b.log.Debug("fork server not kept", "sandbox", s.id, "pid", f.pid)
		s.dropForkServer()
	}
}

// procStat is /proc/PID/stat's fields after the command name: state,
// ppid, pgrp, session, ...
func procStat(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 4 {
		return nil, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	return fields, nil
}

// procState is the state letter of /proc/PID/stat.
func procState(pid int) (byte, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	return f[0][0], nil
}

// cgroupPids lists the processes of the cgroup directory dir.
func cgroupPids(dir string) ([]int, error) {
	b, err := os.ReadFile(dir + "/cgroup.procs")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// startForkServer starts d through the agent and connects to it.
func (s *sandbox) startForkServer(ctx context.Context, d rt.ForkServer, key string) (*forkServer, error) {
	// The kernel leaves a process dumpable across the server's group
	// change when fs.suid_dumpable is 1 ("debug"): then nothing would keep
	// later processes of the sandbox out of its memory.
	if b, err := os.ReadFile("/proc/sys/fs/suid_dumpable"); err != nil || strings.TrimSpace(string(b)) == "1" {
		return nil, errors.New("fork server: fs.suid_dumpable is 1 (or unreadable), which would leave the server readable by later processes")
	}
	var nb [12]byte
	rand.Read(nb[:])
	name := "dsec-fork-" + hex.EncodeToString(nb[:])
	f := &forkServer{key: key, pidfd: -1, userDir: s.cg.userDir(), done: make(chan struct{})}
	ready := make(chan struct{})
	var (
		readyOnce sync.Once
		mu        sync.Mutex
		stderr    []byte
		exitRes   rt.ExecResult
		exitErr   error
	)
	go func() {
		defer close(f.done)
		// Not ctx: the server outlives this call. It ends with its
		// connection, or with the sandbox.
		// Without the limits' events: the exec runs as long as the
		// server does, and their files would stay open for it.
		res, err := s.exec(context.Background(), rt.ExecRequest{Argv: append(append([]string(nil), d.Argv...), name), Env: d.Env, Cwd: "/"}, false,
			func(st rt.Stream, data []byte) {
				if st == rt.Stdout && bytes.Contains(data, []byte("ready\n")) {
					readyOnce.Do(func() { close(ready) })
				}
				if st == rt.Stderr {
					mu.Lock()
					stderr = append(stderr, data...)
					if len(stderr) > 4096 {
						stderr = stderr[len(stderr)-4096:]
					}
					mu.Unlock()
				}
			})
		mu.Lock()
		exitRes, exitErr = res, err
		mu.Unlock()
	}()
	failed := func(why string) error {
		mu.Lock()
		defer mu.Unlock()
		msg := fmt.Sprintf("fork server %q: %s", d.Argv[0], why)
		if exitErr != nil {
			msg += fmt.Sprintf(" (%v)", exitErr)
		} else if exitRes.Signal != 0 || exitRes.ExitCode != 0 {
			msg += fmt.Sprintf(" (exit code %d, signal %d)", exitRes.ExitCode, exitRes.Signal)
		}
		if e := strings.TrimSpace(string(stderr)); e != "" {
			msg += ": " + e
		}
		return errors.New(msg)
	}
	timer := time.NewTimer(forkServerStart)
	defer timer.Stop()
	select {
	case <-ready:
	case <-f.done:
		return nil, failed("exited before it was ready")
	case <-ctx.Done():
		s.killStarting(name)
		return nil, fmt.Errorf("fork server: %w", ctx.Err())
	case <-timer.C:
		s.killStarting(name)
		return nil, failed(fmt.Sprintf("not ready after %v", forkServerStart))
	}
	conn, pid, err := s.dialAbstract(name)
	if err != nil {
		s.killStarting(name)
		return nil, failed(err.Error())
	}
	f.conn, f.pid = conn, pid
	if fd, err := peerPidfd(conn); err == nil {
		unix.Close(fd)
	} else if !errors.Is(err, unix.ENOPROTOOPT) {
		conn.Close()
		return nil, failed(fmt.Sprintf("pidfd of %d: %v", pid, err))
	} else if f.pidfd, err = unix.PidfdOpen(pid, 0); err != nil {
		conn.Close()
		return nil, failed(fmt.Sprintf("pidfd of %d: %v", pid, err))
	}
	if f.attrs, err = captureAgent(pid); err != nil {
		f.kill()
		f.close()
		return nil, failed(err.Error())
	}
	return f, nil
}

// killStarting kills a fork server that never connected: the processes of
// the user cgroup whose command line names the socket.
func (s *sandbox) killStarting(name string) {
	pids, _ := cgroupPids(s.cg.userDir())
	for _, pid := range pids {
		cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
		if err == nil && bytes.Contains(cmdline, []byte(name)) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// dialAbstract connects to the abstract Unix socket name in the sandbox's
// network namespace, from a thread that joins it, and returns the
// connection and the host PID of the process listening there.
func (s *sandbox) dialAbstract(name string) (*net.UnixConn, int, error) {
	fd := -1
	err := onThrowawayThread(func() error {
		err := s.withNS("net", func(fd int) error { return unix.Setns(fd, unix.CLONE_NEWNET) })
		if err != nil {
			return fmt.Errorf("join the sandbox's network namespace: %w", err)
		}
		if fd, err = unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0); err != nil {
			return fmt.Errorf("socket: %w", err)
		}
		if err := unix.Connect(fd, &unix.SockaddrUnix{Name: "@" + name}); err != nil {
			return fmt.Errorf("connect: %w", err)
		}
		return nil
	})
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, 0, err
	}
	// The peer's credentials as of its listen(), its PID translated into
	// ours: the server's host PID.
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		unix.Close(fd)
		return nil, 0, fmt.Errorf("peer credentials: %w", err)
	}
	file := os.NewFile(uintptr(fd), "fork-server")
	c, err := net.FileConn(file)
	file.Close()
	if err != nil {
		return nil, 0, err
	}
	return c.(*net.UnixConn), int(cred.Pid), nil
}

// errServerLost: the server ended or was stopped while a child of it ran
// (only that child's processes could have done it); the child was killed.
var errServerLost = errors.New("fork server lost during the exec")

// healthy reports whether the server is alive and not stopped or traced:
// running, or sleeping (interruptibly or not, as in a page fault).
func (f *forkServer) healthy() bool {
	if !f.alive() {
		return false
	}
	state, err := procState(f.pid)
	return err == nil && (state == 'S' || state == 'R' || state == 'D')
}

// run sends one exec to the server and collects its result.
func (f *forkServer) run(ctx context.Context, req rt.ExecRequest) (rt.ExecResult, error) {
	var res rt.ExecResult
	maxOut := req.MaxOutputBytes
	if maxOut <= 0 {
		maxOut = agent.DefaultMaxOutputBytes
	}
	var (
		pipes  [6]*os.File // stdin r, w; stdout r, w; stderr r, w
		closed [6]bool
	)
	closeAll := func() {
		for i, p := range pipes {
			if p != nil && !closed[i] {
				p.Close()
				closed[i] = true
			}
		}
	}
	defer closeAll()
	for i := 0; i < 6; i += 2 {
		r, w, err := os.Pipe()
		if err != nil {
			return res, fmt.Errorf("fork exec: pipe: %w", err)
		}
		pipes[i], pipes[i+1] = r, w
	}
	// The child's ends: Fd() puts them in blocking mode, what a program
	// expects of its standard streams.
	child := []int{int(pipes[0].Fd()), int(pipes[3].Fd()), int(pipes[5].Fd())}
	msg := []byte("run\x00" + req.Cwd + "\x00" + strconv.Itoa(len(req.Argv)))
	for _, a := range req.Argv {
		msg = append(append(msg, 0), a...)
	}
	if _, _, err := f.conn.WriteMsgUnix(msg, unix.UnixRights(child...), nil); err != nil {
		return res, fmt.Errorf("fork exec: send: %w", err)
	}
	for _, i := range []int{0, 3, 5} {
		pipes[i].Close()
		closed[i] = true
	}

	// Until the server's "pid" answer, only ctx may cut the wait short.
	f.conn.SetReadDeadline(time.Time{})
	stopWatch := context.AfterFunc(ctx, func() { f.conn.SetReadDeadline(time.Now()) })
	defer stopWatch()
	reply, rights, err := readMsg(f.conn)
	if err != nil {
		return res, fmt.Errorf("fork exec: %w", errors.Join(err, ctx.Err()))
	}
	if msg, ok := strings.CutPrefix(reply, "error "); ok {
		return res, fmt.Errorf("fork exec: the server refused the request: %s", msg)
	}
	if msg, ok := strings.CutPrefix(reply, "nofork "); ok {
		// As the agent reports a fork its limits refused: exit code 126,
		// the reason on stderr.
		errno, text, _ := strings.Cut(msg, " ")
		res.ExitCode = 126
		res.PidsExhausted = errno == strconv.Itoa(int(syscall.EAGAIN))
		res.Stderr = []byte("dsec: cannot start " + req.Argv[0] + ": fork: " + text + "\n")
		return res, nil
	}
	if !strings.HasPrefix(reply, "pid ") || len(rights) != 1 {
		for _, fd := range rights {
			unix.Close(fd)
		}
		return res, fmt.Errorf("fork exec: unexpected answer %q", reply)
	}
	childFd := rights[0]
	defer unix.Close(childFd)
	start := time.Now()
	// The child's PID is its session's ID; read now, while the child
	// exists: once it is killed and reaped its pidfd names no PID (-1),
	// and what it started would be left running by the time limit.
	// A child already gone has 0 here: its session is left to Reset.
	sid, _ := pidfdPid(childFd)

	// stdin, then EOF; a program that exits without reading it breaks the
	// pipe, which is not an error.
	stdin := pipes[1]
	closed[1] = true
	go func() {
		stdin.Write(req.Stdin)
		stdin.Close()
	}()
	outs := [2]*capture{{limit: maxOut}, {limit: maxOut}}
	var readers sync.WaitGroup
	for i, p := range []*os.File{pipes[2], pipes[4]} {
		c := outs[i]
		readers.Go(func() { c.readFrom(p) })
	}

	// The exit status, with the time limit and ctx as deadlines. A child
	// that stops or ends its server leaves its status unreported: that
	// shows as the end of the connection, or as a server found stopped
	// when the time limit kills the child.
	var deadline time.Time // of the time limit, then of the kill
	if req.Timeout > 0 {
		deadline = start.Add(req.Timeout)
	}
	// collect takes the output once the readers stopped: at EOF, unless
	// something the exec left behind holds the pipes open; then what is
	// there after outputGrace.
	collect := func() {
		done := make(chan struct{})
		go func() { readers.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(outputGrace):
			pipes[2].SetReadDeadline(time.Now())
			pipes[4].SetReadDeadline(time.Now())
			<-done
		}
		res.Stdout, res.StdoutTruncated = outs[0].result()
		res.Stderr, res.StderrTruncated = outs[1].result()
	}
	lost := func(err error) (rt.ExecResult, error) {
		state, _ := procState(f.pid)
		why := fmt.Errorf("%w (%v; server alive %v, state %q)", errServerLost, err, f.alive(), state)
		killTree(f.userDir, childFd, sid)
		res.Duration = time.Since(start)
		res.Signal, res.ExitCode = int(syscall.SIGKILL), 128+int(syscall.SIGKILL)
		collect()
		return res, why
	}
	var status string
	for {
		f.conn.SetReadDeadline(deadline)
		if ctx.Err() != nil {
			f.conn.SetReadDeadline(time.Now())
		}
		reply, rights, err = readMsg(f.conn)
		for _, fd := range rights {
			unix.Close(fd)
		}
		switch {
		case err == nil:
			status = reply
		case errors.Is(err, io.EOF):
			return lost(err)
		case !errors.Is(err, os.ErrDeadlineExceeded):
			return res, fmt.Errorf("fork exec: %w", err)
		case ctx.Err() != nil:
			killTree(f.userDir, childFd, sid)
			return res, fmt.Errorf("fork exec: %w", ctx.Err())
		case res.TimedOut:
			return lost(fmt.Errorf("no exit status %v after the kill", killTimeout))
		default:
			// The time limit: kill the exec's process tree (its session),
			// then wait for the status.
			res.TimedOut = true
			killTree(f.userDir, childFd, sid)
			if !f.healthy() {
				return lost(err)
			}
			deadline = time.Now().Add(killTimeout)
			continue
		}
		break
	}
	res.Duration = time.Since(start)
	rest, ok := strings.CutPrefix(status, "exit ")
	ws, err := strconv.Atoi(rest)
	if !ok || err != nil {
		return res, fmt.Errorf("fork exec: unexpected answer %q", status)
	}
	w := syscall.WaitStatus(ws)
	switch {
	case w.Signaled():
		res.Signal = int(w.Signal())
		res.ExitCode = 128 + res.Signal
	default:
		res.ExitCode = w.ExitStatus()
	}
	collect()
	return res, nil
}

// readMsg reads one message and the descriptors that came with it.
func readMsg(c *net.UnixConn) (string, []int, error) {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return "", nil, err
	}
	if n == 0 {
		return "", nil, io.EOF
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err == nil {
			for _, m := range msgs {
				if r, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, r...)
				}
			}
		}
	}
	return string(buf[:n]), fds, nil
}

// killTree SIGKILLs the exec's session (the child called setsid, so its
// session ID is its PID): every process of the user cgroup (dir; nothing
// in it can leave) still in it, until none is left. The child is named by
// its pidfd; the session by its host PID, sid, read while the child
// existed.
func killTree(dir string, pidfd, sid int) {
	unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
	if sid <= 0 {
		return
	}
	session := strconv.Itoa(sid)
	for range 100 {
		pids, err := cgroupPids(dir)
		if err != nil {
			return
		}
		found := false
		for _, pid := range pids {
			if f, err := procStat(pid); err == nil && f[3] == session && f[0] != "Z" {
				syscall.Kill(pid, syscall.SIGKILL)
				found = true
			}
		}
		if !found {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// pidfdPid is the PID (in our namespace) of the process a pidfd names.
func pidfdPid(pidfd int) (int, error) {
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(pidfd))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Pid:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, errors.New("pidfd: no Pid in fdinfo")
}

// capture keeps up to limit bytes of a stream and reads the rest away.
type capture struct {
	limit     int64
	buf       []byte
	truncated bool
}

func (c *capture) readFrom(r io.Reader) {
	b := make([]byte, 32<<10)
	for {
		n, err := r.Read(b)
		if n > 0 {
			room := c.limit - int64(len(c.buf))
			if int64(n) > room {
				c.buf = append(c.buf, b[:max(room, 0)]...)
				c.truncated = true
			} else {
				c.buf = append(c.buf, b[:n]...)
			}
		}
		if err != nil {
			return
		}
	}
}

func (c *capture) result() ([]byte, bool) { return c.buf, c.truncated }
