package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// cancelWait bounds how long a canceled Exec waits for the agent to report
// that it killed the process tree; the agent answers within milliseconds
// unless it is wedged, and a wedged agent must not hang the caller.
const cancelWait = 5 * time.Second

var errClientClosed = errors.New("agent client closed")

// Client is the edge's end of one agent connection. Its methods are safe
// for concurrent use. Once the connection breaks (the agent died, the
// sandbox was destroyed) every pending and later call returns an error
// wrapping ErrDisconnected.
type Client struct {
	m      *mux
	nextID atomic.Uint64
}

// NewClient starts serving conn; Close stops it.
func NewClient(conn io.ReadWriteCloser) *Client {
	c := &Client{m: newMux(conn)}
	go func() { c.m.fail(c.m.readLoop()) }()
	return c
}

// Close closes the connection; calls in flight return ErrDisconnected.
func (c *Client) Close() error {
	c.m.fail(errClientClosed)
	return nil
}

// Done is closed when the connection has ended.
func (c *Client) Done() <-chan struct{} { return c.m.closed }

func (c *Client) open(op string, req *request) (*stream, error) {
	select {
	case <-c.m.closed:
		return nil, goneError(op, c.m.connErr())
	default:
	}
	s, err := c.m.register(c.nextID.Add(1))
	if err != nil {
		return nil, err
	}
	if err := c.m.send(&frame{stream: s.id, request: req}); err != nil {
		c.m.remove(s)
		return nil, c.wrap(op, err)
	}
	return s, nil
}

// wrap turns a transport failure into ErrDisconnected; context errors and
// agent errors pass through.
func (c *Client) wrap(op string, err error) error {
	var ae *Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &ae), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	}
	select {
	case <-c.m.closed:
		return goneError(op, c.m.connErr())
	default:
		return fmt.Errorf("agent %s: %w", op, err)
	}
}

// cancel tells the agent to abandon stream s; best effort.
func (c *Client) cancel(s *stream) {
	_ = c.m.send(&frame{stream: s.id, cancel: &cancelMsg{}})
}

// finish waits for the response of a stream whose data the caller does not
// expect (or has consumed), handling cancellation.
func (c *Client) finish(ctx context.Context, op string, s *stream, onData func(*dataMsg) error) (*response, error) {
	for {
		it, err := s.next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				c.cancel(s)
				return nil, fmt.Errorf("agent %s: %w", op, ctx.Err())
			}
			return nil, c.wrap(op, err)
		}
		if it.resp != nil {
			if err := fromWire(it.resp.err); err != nil {
				return nil, err
			}
			return it.resp, nil
		}
		if onData != nil {
			if err := onData(it.data); err != nil {
				c.cancel(s)
				return nil, err
			}
		}
		s.consumed(len(it.data.chunk))
	}
}

// Ping round-trips an empty request.
func (c *Client) Ping(ctx context.Context) error {
	s, err := c.open("ping", &request{ping: &pingRequest{}})
	if err != nil {
		return err
	}
	defer c.m.remove(s)
	_, err = c.finish(ctx, "ping", s, nil)
	return err
}

// Exec runs req in the sandbox. Output reaches out (if not nil) as it is
// produced, from the calling goroutine, so a slow out slows only this exec.
// A process killed by a signal reports Signal and ExitCode 128+signal, as a
// shell would. If ctx ends, the process tree is killed and the error wraps
// ctx.Err(); the result then holds what was collected.
func (c *Client) Exec(ctx context.Context, req ExecRequest, out OutputFunc) (ExecResult, error) {
	var res ExecResult
	if len(req.Argv) == 0 && req.Shell == "" {
		return res, errorf(CodeInvalidArgument, "exec: argv and shell are both empty")
	}
	limit := req.MaxOutputBytes
	if limit <= 0 {
		limit = DefaultMaxOutputBytes
	}
	s, err := c.open("exec", &request{exec: &execRequest{
		argv:           req.Argv,
		shell:          req.Shell,
		env:            req.Env,
		cwd:            req.Cwd,
		user:           req.User,
		timeoutNanos:   int64(req.Timeout),
		maxOutputBytes: limit,
		streamOutput:   out != nil,
		hasStdin:       len(req.Stdin) > 0,
	}})
	if err != nil {
		return res, err
	}
	// Deferred in this order so the stream is removed first, which ends
	// the stdin sender if it is still waiting for credit.
	var stdin sync.WaitGroup
	defer stdin.Wait()
	defer c.m.remove(s)
	if len(req.Stdin) > 0 {
		stdin.Add(1)
		go func() {
			defer stdin.Done()
			// Ends early when the response arrives or the connection fails.
			_ = s.sendData(ctx, chBody, req.Stdin, true)
		}()
	}

	var ctxErr error
	waitCtx := ctx
	for {
		it, err := s.next(waitCtx)
		if err != nil {
			if ctxErr == nil && ctx.Err() != nil {
				// Kill the remote tree and wait, bounded, for the agent to
				// confirm so the caller can rely on it being gone.
				ctxErr = ctx.Err()
				c.cancel(s)
				var stop context.CancelFunc
				waitCtx, stop = context.WithTimeout(context.Background(), cancelWait)
				defer stop()
				continue
			}
			if ctxErr != nil {
				return res, fmt.Errorf("agent exec %s: %w", execName(req), ctxErr)
			}
			return res, c.wrap("exec "+execName(req), err)
		}
		if d := it.data; d != nil {
			switch d.channel {
			case chStdout:
				if out != nil {
					out(Stdout, d.chunk)
				}
				res.Stdout = appendCapped(res.Stdout, d.chunk, limit)
			case chStderr:
				if out != nil {
					out(Stderr, d.chunk)
				}
				res.Stderr = appendCapped(res.Stderr, d.chunk, limit)
			}
			s.consumed(len(d.chunk))
			continue
		}
		if err := fromWire(it.resp.err); err != nil {
			return res, err
		}
		if r := it.resp.exec; r != nil {
			res.ExitCode = int(r.exitCode)
			res.Signal = int(r.signal)
			res.Duration = time.Duration(r.durationNanos)
			res.TimedOut = r.timedOut
			res.StdoutTruncated = r.stdoutTruncated
			res.StderrTruncated = r.stderrTruncated
			res.PidsExhausted = r.pidsExhausted
			res.OOMKilled = r.oomKilled
			res.DiskFull = r.diskFull
		}
		if ctxErr != nil {
			return res, fmt.Errorf("agent exec %s: %w", execName(req), ctxErr)
		}
		return res, nil
	}
}

func execName(req ExecRequest) string {
	if len(req.Argv) > 0 {
		return req.Argv[0]
	}
	return "/bin/sh -c"
}

func appendCapped(b, p []byte, limit int64) []byte {
	room := limit - int64(len(b))
	if room <= 0 {
		return b
	}
	if int64(len(p)) > room {
		p = p[:room]
	}
	return append(b, p...)
}

// WriteFile writes data to path (parent directories are created) with the
// given permission bits (0 means 0644).
func (c *Client) WriteFile(ctx context.Context, path string, data []byte, mode uint32) error {
	op := "write file " + path
	s, err := c.open(op, &request{writeFile: &writeFileRequest{path: path, mode: mode}})
	if err != nil {
		return err
	}
	defer c.m.remove(s)
	if err := s.sendData(ctx, chBody, data, true); err != nil && !errors.Is(err, errStreamDone) {
		if ctx.Err() != nil {
			c.cancel(s)
		}
		return c.wrap(op, err)
	}
	_, err = c.finish(ctx, op, s, nil)
	return err
}

// ReadFile returns the contents of path; a file larger than maxBytes (0
// means DefaultMaxReadBytes) is an error with code CODE_TOO_LARGE.
func (c *Client) ReadFile(ctx context.Context, path string, maxBytes int64) ([]byte, error) {
	op := "read file " + path
	s, err := c.open(op, &request{readFile: &readFileRequest{path: path, maxBytes: maxBytes}})
	if err != nil {
		return nil, err
	}
	defer c.m.remove(s)
	var buf []byte
	_, err = c.finish(ctx, op, s, func(d *dataMsg) error {
		buf = append(buf, d.chunk...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if buf == nil {
		buf = []byte{}
	}
	return buf, nil
}

// PutArchive extracts the tar stream r under dir (created if missing).
// Entries cannot land outside dir.
func (c *Client) PutArchive(ctx context.Context, dir string, r io.Reader) error {
	op := "put archive " + dir
	s, err := c.open(op, &request{putArchive: &putArchiveRequest{dir: dir}})
	if err != nil {
		return err
	}
	defer c.m.remove(s)
	buf := make([]byte, MaxChunk)
	for {
		n, rerr := r.Read(buf)
		eof := rerr == io.EOF
		if rerr != nil && !eof {
			c.cancel(s)
			return fmt.Errorf("agent %s: reading the archive: %w", op, rerr)
		}
		if n > 0 || eof {
			if err := s.sendData(ctx, chBody, buf[:n], eof); err != nil {
				if errors.Is(err, errStreamDone) {
					break // the agent answered early (an error): read it
				}
				if ctx.Err() != nil {
					c.cancel(s)
				}
				return c.wrap(op, err)
			}
		}
		if eof {
			break
		}
	}
	_, err = c.finish(ctx, op, s, nil)
	return err
}

// Diff writes what the sandbox changed over its layers to w, as a tar
// stream with OCI whiteouts (see DiffRequest in agent.proto). An agent that
// does not serve it answers with CodeInvalidArgument.
func (c *Client) Diff(ctx context.Context, w io.Writer) error {
	const op = "diff"
	s, err := c.open(op, &request{diff: &diffRequest{}})
	if err != nil {
		return err
	}
	defer c.m.remove(s)
	_, err = c.finish(ctx, op, s, func(d *dataMsg) error {
		if _, err := w.Write(d.chunk); err != nil {
			return fmt.Errorf("agent %s: writing the archive: %w", op, err)
		}
		return nil
	})
	return err
}

// GetArchive writes dir as a tar stream to w.
func (c *Client) GetArchive(ctx context.Context, dir string, w io.Writer) error {
	op := "get archive " + dir
	s, err := c.open(op, &request{getArchive: &getArchiveRequest{dir: dir}})
	if err != nil {
		return err
	}
	defer c.m.remove(s)
	_, err = c.finish(ctx, op, s, func(d *dataMsg) error {
		if _, err := w.Write(d.chunk); err != nil {
			return fmt.Errorf("agent %s: writing the archive: %w", op, err)
		}
		return nil
	})
	return err
}
