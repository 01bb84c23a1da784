package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// execSpec is a validated exec request, ready to fork.
type execSpec struct {
	path string
	argv []string
	env  []string
	dir  string
	cred *syscall.Credential
	// notFound, when set, says the program is on no PATH entry: the
	// exec is a failed result (127, as a shell's), not an error.
	notFound string
}

func (srv *server) prepare(r *execRequest) (*execSpec, error) {
	argv := r.argv
	if len(argv) == 0 {
		if r.shell == "" {
			return nil, errorf(CodeInvalidArgument, "exec: argv and shell are both empty")
		}
		argv = []string{"/bin/sh", "-c", r.shell}
	}
	if argv[0] == "" {
		return nil, errorf(CodeInvalidArgument, "exec: argv[0] is empty")
	}
	if err := checkNUL(r); err != nil {
		return nil, err
	}
	dir := r.cwd
	if dir == "" {
		dir = srv.opts.Workdir
	} else if !filepath.IsAbs(dir) {
		dir = filepath.Join(srv.opts.Workdir, dir)
	}
	if mode, err := statMode(dir); err != nil {
		return nil, errorf(codeOf(err), "exec: cwd %s: %v", dir, err)
	} else if mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, errorf(CodeInvalidArgument, "exec: cwd %s is not a directory", dir)
	}

	sp := &execSpec{argv: argv, dir: dir}
	home := ""
	u := r.user
	if u == "" {
		u = srv.opts.User
	}
	if u != "" {
		id, err := lookupUser(srv.opts.EtcDir, u)
		if err != nil {
			return nil, err
		}
		sp.cred = &syscall.Credential{Uid: id.uid, Gid: id.gid, Groups: id.groups}
		home = id.home
	}
	sp.env = mergeEnv(srv.opts.Env, r.env)
	if envGet(sp.env, "PATH") == "" {
		sp.env = append(sp.env, "PATH="+defaultPath)
	}
	if envGet(sp.env, "HOME") == "" {
		if home == "" {
			home = srv.home.get(srv.opts.EtcDir, os.Getuid())
		}
		sp.env = append(sp.env, "HOME="+home)
	}
	path, err := lookPath(argv[0], envGet(sp.env, "PATH"), dir)
	if err != nil {
		sp.notFound = err.Error()
		return sp, nil
	}
	sp.path = path
	return sp, nil
}

// exec runs one command and streams its output. The response is the exit
// status, also for a command that could not start (startFailure: exit
// 127 or 126, as a shell); errors are reserved for requests that cannot
// be run as asked (bad input: a missing cwd or user, NUL bytes, E2BIG).
func (srv *server) exec(s *stream, r *execRequest) *response {
	sp, err := srv.prepare(r)
	if err != nil {
		return errResponse(err)
	}
	if sp.notFound != "" {
		return cannotRun(s, &execResult{exitCode: 127}, "dsec: "+sp.notFound+"\n", time.Now())
	}
	maxOut := r.maxOutputBytes
	if maxOut <= 0 {
		maxOut = DefaultMaxOutputBytes
	}

	pp, err := newExecPipes(r.hasStdin)
	if err != nil {
		return errResponse(errorf(CodeUnavailable, "exec %s: pipe: %v", sp.argv[0], err))
	}
	attr := &syscall.ProcAttr{
		Dir:   sp.dir,
		Env:   sp.env,
		Files: []uintptr{uintptr(pp.child[0]), uintptr(pp.child[1]), uintptr(pp.child[2])},
		Sys:   &syscall.SysProcAttr{Setsid: true, Credential: sp.cred},
	}
	started := time.Now()
	var pid int
	var wait <-chan syscall.WaitStatus
	start := func() (err error) {
		pid, wait, err = srv.procs.start(sp.path, sp.argv, attr)
		return err
	}
	if srv.opts.Fork != nil {
		err = srv.opts.Fork(attr.Sys, start)
	} else {
		err = start()
	}
	pp.closeChild()
	stdinW, outR, errR := pp.stdin, pp.stdout, pp.stderr
	if err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		outR.Close()
		errR.Close()
		if res, msg := startFailure(sp.argv[0], sp.path, err); res != nil {
			return cannotRun(s, res, msg, started)
		}
		return errResponse(startError(sp.argv[0], sp.path, err))
	}
	if srv.oom {
		if err := os.WriteFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", []byte("0"), 0); err != nil {
			srv.log.Warn("cannot reset oom_score_adj of exec", "pid", pid, "err", err)
		}
	}

	// stdin: feed the request body, then keep draining it after the
	// process stops reading so the client's sender never stalls.
	if stdinW != nil {
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			defer stdinW.Close()
			body := &bodyReader{ctx: s.ctx, s: s}
			buf := make([]byte, MaxChunk)
			broken := false
			for {
				n, err := body.Read(buf)
				if n > 0 && !broken {
					if _, werr := stdinW.Write(buf[:n]); werr != nil {
						broken = true
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}

	res := &execResult{}
	var readers sync.WaitGroup
	readers.Add(2)
	go func() {
		defer readers.Done()
		res.stdoutTruncated = srv.pump(s, outR, chStdout, r.streamOutput, maxOut)
	}()
	go func() {
		defer readers.Done()
		res.stderrTruncated = srv.pump(s, errR, chStderr, r.streamOutput, maxOut)
	}()

	var timeout <-chan time.Time
	if d := r.timeoutNanos; d > 0 {
		t := time.NewTimer(time.Duration(d))
		defer t.Stop()
		timeout = t.C
	}
	// Kill only while the main process has not been waited for: once it
	// has, its pid (the session id) may be recycled.
	var ws syscall.WaitStatus
	kill := func(timedOut bool) {
		select {
		case ws = <-wait:
		default:
			res.timedOut = timedOut
			killSession(pid, srv.level, srv.log)
			ws = <-wait
		}
	}
	select {
	case ws = <-wait:
	case <-timeout:
		kill(true)
	case <-s.ctx.Done():
		kill(false)
	}
	res.durationNanos = int64(time.Since(started))
	switch {
	case ws.Exited():
		res.exitCode = int32(ws.ExitStatus())
	case ws.Signaled():
		res.signal = int32(ws.Signal())
		res.exitCode = 128 + res.signal
	}

	deadline := time.Now().Add(srv.opts.OutputGrace)
	outR.SetReadDeadline(deadline)
	errR.SetReadDeadline(deadline)
	readers.Wait()
	outR.Close()
	errR.Close()
	if srv.opts.Verdict != nil {
		// A child the OOM killer picked need not fail the command; a full
		// disk only explains a failure.
		v := srv.opts.Verdict()
		res.oomKilled = v.OOMKilled
		res.diskFull = v.DiskFull && (res.exitCode != 0 || res.signal != 0)
		res.pidsExhausted = res.pidsExhausted || v.PidsExhausted
	}
	// A background child may hold stdin open without reading it; stop
	// writing to it (the stdin goroutine then just drains the body).
	if stdinW != nil {
		stdinW.SetWriteDeadline(time.Now())
	}
	return &response{exec: res}
}

// pump copies one output pipe to the client until end of file, or until the
// read deadline (set when the main process exits) passes; then it takes what
// is already buffered in the pipe without waiting and stops. Output beyond
// limit is counted but sent only when the client streams everything.
// It reports whether the output exceeded limit.
func (srv *server) pump(s *stream, f *os.File, ch channel, sendAll bool, limit int64) bool {
	// Most commands print little: start small, and take a whole chunk's
	// buffer only when a read fills the small one (every byte allocated per
	// exec is garbage the agent's eager GC then collects).
	buf := make([]byte, smallRead)
	var total int64
	sendFailed := false
	emit := func(p []byte) {
		send := p
		if !sendAll {
			send = send[:max(0, min(int64(len(p)), limit-total))]
		}
		total += int64(len(p))
		if len(send) > 0 && !sendFailed {
			// A canceled stream or dead connection: keep draining the pipe
			// so the writer is not blocked, but stop sending.
			sendFailed = s.sendData(s.ctx, ch, send, false) != nil
		}
	}
	for {
		n, err := f.Read(buf)
		if n > 0 {
			emit(buf[:n])
			if n == len(buf) && len(buf) < MaxChunk {
				buf = make([]byte, MaxChunk)
			}
		}
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			drainNow(f, buf, emit)
		}
		return total > limit
	}
}

// smallRead is the first read buffer of an exec's output pipe.
const smallRead = 2 << 10

// execPipes are an exec's standard streams. The child's ends are plain
// blocking descriptors that never enter the runtime poller (registering
// them and switching them back to blocking for the child cost five system
// calls each); the agent's ends are non-blocking *os.Files in the poller,
// so deadlines work. Without stdin the child gets the read end of a pipe
// whose write end is already closed: end of file at once.
type execPipes struct {
	child                 [3]int
	stdin, stdout, stderr *os.File // stdin nil without stdin
}

func newExecPipes(withStdin bool) (*execPipes, error) {
	pp := &execPipes{child: [3]int{-1, -1, -1}}
	fail := func(err error) (*execPipes, error) {
		pp.closeChild()
		for _, f := range []*os.File{pp.stdin, pp.stdout, pp.stderr} {
			if f != nil {
				f.Close()
			}
		}
		return nil, err
	}
	var p [2]int
	if withStdin {
		c, ours, err := pipeFor(true)
		if err != nil {
			return fail(err)
		}
		pp.child[0], pp.stdin = c, ours
	} else {
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			return fail(err)
		}
		unix.Close(p[1])
		pp.child[0] = p[0]
	}
	for i, f := range []**os.File{&pp.stdout, &pp.stderr} {
		c, ours, err := pipeFor(false)
		if err != nil {
			return fail(err)
		}
		pp.child[i+1], *f = c, ours
	}
	return pp, nil
}

// pipeFor makes a pipe and returns the child's end (the read end if
// childReads), blocking, and the agent's end, non-blocking in the poller.
func pipeFor(childReads bool) (int, *os.File, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return -1, nil, err
	}
	child, ours := p[1], p[0]
	if childReads {
		child, ours = p[0], p[1]
	}
	// F_SETFL changes only the status flags: this clears O_NONBLOCK.
	if _, err := unix.FcntlInt(uintptr(child), unix.F_SETFL, 0); err != nil {
		unix.Close(p[0])
		unix.Close(p[1])
		return -1, nil, err
	}
	return child, os.NewFile(uintptr(ours), "exec-pipe"), nil
}

// closeChild closes the child's ends (once it has them, or on failure).
func (pp *execPipes) closeChild() {
	for i, fd := range pp.child {
		if fd >= 0 {
			unix.Close(fd)
			pp.child[i] = -1
		}
	}
}

// drainNow reads what is in the pipe right now, without waiting for more,
// up to the pipe's capacity (a background writer could otherwise keep it
// going forever).
func drainNow(f *os.File, buf []byte, emit func([]byte)) {
	f.SetReadDeadline(time.Time{})
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	limit := 1 << 20
	rc.Control(func(fd uintptr) {
		if n, err := unix.FcntlInt(fd, unix.F_GETPIPE_SZ, 0); err == nil && n > 0 {
			limit = n
		}
	})
	for limit > 0 {
		var n int
		var rerr error
		// Returning true means "done": RawRead never parks on the poller.
		if err := rc.Read(func(fd uintptr) bool {
			n, rerr = unix.Read(int(fd), buf)
			return true
		}); err != nil || rerr != nil || n <= 0 {
			return
		}
		emit(buf[:n])
		limit -= n
	}
}

// cannotRun answers an exec whose command could not start with res, its
// failed result, and msg on its stderr (streamed, as a shell would print
// it): the command's failure, never an error the platform would be blamed
// for.
func cannotRun(s *stream, res *execResult, msg string, started time.Time) *response {
	_ = s.sendData(s.ctx, chStderr, []byte(msg), false)
	res.durationNanos = int64(time.Since(started))
	return &response{exec: res}
}

// startFailure turns a command that could not start because of the
// sandbox's own state into a failed result with the exit code a shell
// gives (127: no such program; 126: found but not runnable) and the
// message for its stderr: a missing program or interpreter, one that is
// not executable or not a program, and a fork that the sandbox's limits
// refused (EAGAIN is its process limit, the user pids cgroup or
// RLIMIT_NPROC; ENOMEM its memory). None is the platform's failure. Nil
// for any other error.
func startFailure(name, path string, err error) (*execResult, string) {
	switch {
	case errors.Is(err, syscall.ENOENT):
		return &execResult{exitCode: 127},
			"dsec: cannot start " + name + ": " + path + " not found (or its interpreter is missing)\n"
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM), errors.Is(err, syscall.ENOEXEC),
		errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.ELOOP), errors.Is(err, syscall.ETXTBSY):
		return &execResult{exitCode: 126},
			"dsec: cannot start " + name + ": " + path + ": " + err.Error() + "\n"
	case errors.Is(err, syscall.EAGAIN):
		return &execResult{exitCode: 126, pidsExhausted: true},
			"dsec: cannot start " + name + ": " + err.Error() + ": the sandbox's process limit is reached\n"
	case errors.Is(err, syscall.ENOMEM):
		return &execResult{exitCode: 126},
			"dsec: cannot start " + name + ": " + err.Error() + ": the sandbox is out of memory\n"
	}
	return nil, ""
}

// startError classifies a failed fork/exec. Whatever it is, it is about
// the command or the sandbox's files, never the platform: an errno the
// cases do not name is FailedPrecondition (an I/O error reading the
// program, say). What a shell would report as a command that cannot run
// (no such program, not executable, the limits refused the fork) is a
// failed result instead (startFailure).
func startError(name, path string, err error) error {
	switch {
	case errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ENAMETOOLONG):
		return errorf(CodeInvalidArgument, "exec %s: %v", name, err)
	case errors.Is(err, syscall.E2BIG):
		return errorf(CodeInvalidArgument, "exec %s: argv and env are too large for the kernel (E2BIG: at most 128 KiB per string, and a quarter of the stack limit in all)", name)
	}
	return errorf(CodeFailedPrecondition, "exec %s: %v", name, err)
}

// checkNUL refuses NUL bytes in the strings an exec hands the kernel,
// which cannot carry them (the fork would fail with EINVAL), naming the
// field.
func checkNUL(r *execRequest) error {
	bad := func(field, s string) error {
		if strings.IndexByte(s, 0) >= 0 {
			return errorf(CodeInvalidArgument, "exec: %s contains a NUL byte", field)
		}
		return nil
	}
	for i, a := range r.argv {
		if err := bad("argv["+strconv.Itoa(i)+"]", a); err != nil {
			return err
		}
	}
	for i, kv := range r.env {
		if err := bad("env["+strconv.Itoa(i)+"]", kv); err != nil {
			return err
		}
	}
	if err := bad("shell", r.shell); err != nil {
		return err
	}
	if err := bad("cwd", r.cwd); err != nil {
		return err
	}
	return bad("user", r.user)
}

// lookPath finds name in PATH the way a shell does; names with a slash are
// used as given (relative to dir, where the child chdirs before exec).
func lookPath(name, pathEnv, dir string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	for p := range strings.SplitSeq(pathEnv, ":") {
		if p == "" {
			p = "."
		}
		cand := filepath.Join(p, name)
		if !filepath.IsAbs(cand) {
			cand = filepath.Join(dir, cand)
		}
		if mode, err := statMode(cand); err == nil && mode&unix.S_IFMT == unix.S_IFREG && mode&0o111 != 0 {
			return cand, nil
		}
	}
	return "", errorf(CodeNotFound, "exec %s: executable file not found in PATH %q", name, pathEnv)
}

// statMode is the mode of path (symbolic links followed), from one stat
// system call that allocates nothing: prepare stats the working directory
// and every PATH candidate of every exec.
func statMode(path string) (uint32, error) {
	var st unix.Stat_t
	for {
		err := unix.Stat(path, &st)
		if err == unix.EINTR {
			continue
		}
		return st.Mode, err
	}
}

// mergeEnv appends extra to base, later entries replacing earlier ones with
// the same key.
func mergeEnv(base, extra []string) []string {
	out := make([]string, 0, len(base)+len(extra)+2)
	idx := make(map[string]int, len(base)+len(extra))
	for _, kv := range append(base[:len(base):len(base)], extra...) {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[k]; ok {
			out[i] = kv
			continue
		}
		idx[k] = len(out)
		out = append(out, kv)
	}
	return out
}

func envGet(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if k, v, _ := strings.Cut(env[i], "="); k == key {
			return v
		}
	}
	return ""
}
