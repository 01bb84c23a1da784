package agent

import (
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Defaults the server applies when a request leaves a bound at zero.
const (
	// DefaultMaxOutputBytes bounds captured stdout and stderr each.
	DefaultMaxOutputBytes = 1 << 20
	// DefaultMaxReadBytes bounds ReadFile.
	DefaultMaxReadBytes = 64 << 20
	// DefaultOutputGrace is how long an exec's output is still collected
	// after its main process exited. Background children that inherited
	// stdout/stderr (`server &`) would otherwise keep the exec open for as
	// long as they live; after the grace the agent takes what is already in
	// the pipes and finishes.
	DefaultOutputGrace = 100 * time.Millisecond
)

// defaultPath is used when neither the sandbox nor the request sets PATH.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Options configures Serve. The zero value is ready to use.
type Options struct {
	// ReapAll makes the agent the single owner of wait4(-1): it reaps every
	// child, including orphans re-parented to it. It is forced on when the
	// agent is PID 1. Leave it off when Serve runs inside a process that
	// waits for its own children (tests), or their statuses would be stolen.
	ReapAll bool
	// Env, Workdir and User are defaults for every exec (the image config,
	// Init's exec defaults); request env entries override Env by key.
	Env     []string
	Workdir string
	User    string
	// EtcDir holds the passwd and group files users are resolved from;
	// default /etc.
	EtcDir string
	// OutputGrace overrides DefaultOutputGrace.
	OutputGrace time.Duration
	// Logger receives warnings; a *slog.Logger fits. Default: StderrLogger.
	Logger Logger
	// OnIdle, if set, is called (from a handler goroutine) each time the
	// last request in flight finishes; dsec-agent uses it to hand memory
	// back to the kernel while the sandbox sits idle.
	OnIdle func()
	// Fork, if set, wraps every process start: it may adjust attr and must
	// call start exactly once. The container runtime uses it to have user
	// processes born in a child cgroup whose pids limit excludes the agent,
	// so a fork bomb cannot starve the agent of threads.
	Fork func(attr *syscall.SysProcAttr, start func() error) error
	// Verdict, if set, is called once a command has ended, before its
	// result is sent: what it returns is added to the result (DiskFull only
	// to a command that failed: non-zero exit, or a signal). A VM guest's agent sets it, because
	// there the host can read neither the sandbox's cgroups nor its disk.
	Verdict func() Verdict
	// Diff, if set, serves the diff request: it writes what the sandbox
	// changed over its layers to w as a tar stream with OCI whiteouts. A
	// VM guest's agent sets it.
	Diff func(ctx context.Context, w io.Writer) error
}

// Verdict is what Options.Verdict reports about a failed command.
type Verdict struct {
	// OOMKilled: the memory limit killed a process since the last call.
	OOMKilled bool
	// PidsExhausted: the pids limit refused a fork since the last call.
	PidsExhausted bool
	// DiskFull: the writable layer is full now.
	DiskFull bool
}

type server struct {
	opts  Options
	log   Logger
	procs *procTable
	level int  // see nsLevel
	oom   bool // reset children's oom_score_adj to 0
	home  homeCache
	// egress holds the proxy listeners EgressAccept relays from.
	egress egressListeners
}

// Serve answers requests on conn until conn fails or ctx ends. On return
// every exec still running has had its process tree killed. A clean end of
// the connection (EOF) returns nil.
func Serve(ctx context.Context, conn io.ReadWriteCloser, opts Options) error {
	if opts.Workdir == "" {
		opts.Workdir = "/"
	}
	if opts.EtcDir == "" {
		opts.EtcDir = "/etc"
	}
	if opts.OutputGrace <= 0 {
		opts.OutputGrace = DefaultOutputGrace
	}
	log := opts.Logger
	if log == nil {
		log = StderrLogger()
	}
	srv := &server{
		opts:  opts,
		log:   log,
		procs: newProcTable(opts.ReapAll || os.Getpid() == 1, log),
		level: nsLevel(),
	}
	// The runtime shields the agent from the OOM killer; its children must
	// not inherit that, or a runaway process would take the agent's place
	// at the back of the queue. /proc/<pid> only names our children when
	// /proc is our own pid namespace's.
	if b, err := os.ReadFile("/proc/self/oom_score_adj"); err == nil && strings.TrimSpace(string(b)) == "-1000" && srv.level == 0 {
		srv.oom = true
	}

	connCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	m := newMux(conn)
	var handlers sync.WaitGroup
	var inFlight atomic.Int64
	m.onRequest = func(s *stream, req *request) {
		s.ctx, s.cancel = context.WithCancel(connCtx)
		handlers.Add(1)
		inFlight.Add(1)
		go func() {
			defer handlers.Done()
			defer func() {
				if inFlight.Add(-1) == 0 && opts.OnIdle != nil {
					opts.OnIdle()
				}
			}()
			defer s.cancel()
			resp := srv.handle(s, req)
			// If the connection is gone there is nobody to tell.
			_ = m.send(&frame{stream: s.id, response: resp})
			m.remove(s)
			s.bg.Wait()
		}()
	}
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-ctx.Done():
			m.fail(ctx.Err())
		case <-stop:
		}
	}()

	err := m.readLoop()
	select {
	case <-m.closed:
		// A failed write ended the connection first (the edge went away
		// while a handler answered): that is why reading stopped.
		err = m.err
	default:
	}
	m.fail(err)
	cancel()
	srv.egress.close()
	handlers.Wait()
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, io.EOF), errors.Is(err, syscall.EPIPE), errors.Is(err, syscall.ECONNRESET):
		// The edge closed its end: a clean end, whichever side noticed.
		return nil
	}
	return err
}

func (srv *server) handle(s *stream, req *request) *response {
	var err error
	switch {
	case req.exec != nil:
		return srv.exec(s, req.exec)
	case req.writeFile != nil:
		err = srv.writeFile(s, req.writeFile)
	case req.readFile != nil:
		err = srv.readFile(s, req.readFile)
	case req.putArchive != nil:
		err = srv.putArchive(s, req.putArchive)
	case req.getArchive != nil:
		err = srv.getArchive(s, req.getArchive)
	case req.ping != nil:
	case req.egress != nil:
		err = srv.egressAccept(s, req.egress)
	case req.diff != nil:
		if srv.opts.Diff == nil {
			err = errorf(CodeInvalidArgument, "diff: this agent does not serve its sandbox's writable layer")
		} else {
			err = srv.opts.Diff(s.ctx, bodyWriter{ctx: s.ctx, s: s})
		}
	case req.init != nil:
		err = errorf(CodeFailedPrecondition, "init: the sandbox is set up already (init must be the first request)")
	default:
		err = errorf(CodeInvalidArgument, "request on stream %d names no operation", s.id)
	}
	if err != nil {
		if s.ctx.Err() != nil && codeOf(err) == CodeUnknown {
			err = errCanceled
		}
		return errResponse(err)
	}
	return &response{}
}
