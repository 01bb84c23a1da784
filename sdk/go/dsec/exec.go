package dsec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Exec outcomes. OutcomeInfraError means the sandbox or its node failed, not
// the command: trainers should mask such steps instead of learning from them.
const (
	OutcomeOK         = "ok"
	OutcomeFailed     = "failed"
	OutcomeTimeout    = "timeout"
	OutcomeInfraError = "infra_error"
)

// ExecOptions is one command to run in a sandbox.
type ExecOptions struct {
	// Argv is the command; if empty, Shell runs under /bin/sh -c.
	Argv  []string
	Shell string
	// Env (K=V) is added to the sandbox's environment.
	Env   []string
	Cwd   string
	User  string
	Stdin []byte
	// Timeout kills the command's whole process tree; zero means none.
	Timeout time.Duration
	// MaxOutputBytes bounds the captured stdout and stderr each; zero means
	// the server's default (1 MiB), and the server holds any bound to its
	// ceiling of 16 MiB (the result says truncated). ExecStream writers
	// still get everything.
	MaxOutputBytes int64
	// Seq is the operation's step in the sandbox's trajectory. Zero lets a
	// numbered handle take its next number (or, on an Unnumbered handle,
	// the server number it).
	Seq uint64
	// RequestID is kept in the trajectory record.
	RequestID string
}

func (o ExecOptions) proto(id string) *dsecv1.ExecRequest {
	r := &dsecv1.ExecRequest{
		SandboxId:      id,
		Argv:           o.Argv,
		Shell:          o.Shell,
		Env:            o.Env,
		Cwd:            o.Cwd,
		User:           o.User,
		Stdin:          o.Stdin,
		MaxOutputBytes: o.MaxOutputBytes,
		Seq:            o.Seq,
		RequestId:      o.RequestID,
	}
	if o.Timeout > 0 {
		r.Timeout = durationpb.New(o.Timeout)
	}
	return r
}

// ExecResult is what happened to one command.
type ExecResult struct {
	// Outcome is one of the Outcome constants.
	Outcome  string
	ExitCode int
	// Signal is non-zero when the command was killed by a signal.
	Signal          int
	Stdout          []byte
	Stderr          []byte
	StdoutTruncated bool
	StderrTruncated bool
	Duration        time.Duration
	TimedOut        bool
	OOMKilled       bool
	// InfraError says what failed when Outcome is OutcomeInfraError.
	InfraError string
	// Seq is the command's step in the sandbox's trajectory.
	Seq uint64
	// Replayed is true when the result was recorded earlier and returned
	// without running the command again.
	Replayed bool
}

// OK reports whether the command ran and exited 0.
func (r *ExecResult) OK() bool { return r.Outcome == OutcomeOK }

func resultFromProto(p *dsecv1.ExecResult) *ExecResult {
	r := &ExecResult{
		Outcome:         p.GetOutcome(),
		ExitCode:        int(p.GetExitCode()),
		Signal:          int(p.GetSignal()),
		Stdout:          p.GetStdout(),
		Stderr:          p.GetStderr(),
		StdoutTruncated: p.GetStdoutTruncated(),
		StderrTruncated: p.GetStderrTruncated(),
		TimedOut:        p.GetTimedOut(),
		OOMKilled:       p.GetOomKilled(),
		InfraError:      p.GetInfraError(),
		Seq:             p.GetSeq(),
		Replayed:        p.GetReplayed(),
	}
	if p.GetDuration() != nil {
		r.Duration = p.GetDuration().AsDuration()
	}
	return r
}

// Exec runs argv and returns its captured output and exit status. A
// non-zero exit is not an error: look at the result's Outcome and ExitCode.
func (s *Sandbox) Exec(ctx context.Context, argv ...string) (*ExecResult, error) {
	return s.ExecWith(ctx, ExecOptions{Argv: argv})
}

// ExecShell runs script with /bin/sh -c.
func (s *Sandbox) ExecShell(ctx context.Context, script string) (*ExecResult, error) {
	return s.ExecWith(ctx, ExecOptions{Shell: script})
}

// ExecWith runs the command described by opts.
func (s *Sandbox) ExecWith(ctx context.Context, opts ExecOptions) (*ExecResult, error) {
	opts.Seq = s.take(opts.Seq)
	req := opts.proto(s.ID)
	var resp *connect.Response[dsecv1.ExecResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.Exec(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("exec in sandbox %s: %w", s.ID, err)
	}
	return resultFromProto(resp.Msg.GetResult()), nil
}

// ExecStream runs the command described by opts and copies its output to
// stdout and stderr (either may be nil) as it is produced. The returned
// result carries the exit status; its Stdout and Stderr are whatever the
// server also captured.
func (s *Sandbox) ExecStream(ctx context.Context, opts ExecOptions, stdout, stderr io.Writer) (*ExecResult, error) {
	// The stream is cancelled if a writer fails, so the command's output
	// stops flowing to a caller that can no longer take it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	opts.Seq = s.take(opts.Seq)
	req := opts.proto(s.ID)
	// A re-send after a broken stream gets the whole recorded output again;
	// what the writers already have is skipped.
	out, errOut := &skipWriter{w: stdout}, &skipWriter{w: stderr}
	var result *ExecResult
	err := s.send(ctx, req.Seq, func() error {
		out.skip, errOut.skip = out.n, errOut.n
		out.seen, errOut.seen = 0, 0
		stream, err := s.c.sandboxes.ExecStream(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		defer stream.Close()
		for stream.Receive() {
			switch ev := stream.Msg().GetEvent().(type) {
			case *dsecv1.ExecStreamResponse_Stdout:
				if err := out.write(ev.Stdout); err != nil {
					return &writerError{fmt.Errorf("copy stdout: %w", err)}
				}
			case *dsecv1.ExecStreamResponse_Stderr:
				if err := errOut.write(ev.Stderr); err != nil {
					return &writerError{fmt.Errorf("copy stderr: %w", err)}
				}
			case *dsecv1.ExecStreamResponse_Result:
				result = resultFromProto(ev.Result)
			}
		}
		return stream.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("exec in sandbox %s: %w", s.ID, err)
	}
	if result == nil {
		return nil, fmt.Errorf("exec in sandbox %s: %w", s.ID,
			connect.NewError(connect.CodeInternal, errors.New("stream ended without a result")))
	}
	return result, nil
}

// skipWriter passes output on, skipping the first skip bytes of a
// re-sent stream that the writer already has; n counts what it passed.
type skipWriter struct {
	w       io.Writer
	n, skip int64
	seen    int64
}

func (s *skipWriter) write(b []byte) error {
	if s.seen < s.skip {
		drop := min(int64(len(b)), s.skip-s.seen)
		s.seen += drop
		b = b[drop:]
	}
	if s.w == nil || len(b) == 0 {
		return nil
	}
	s.seen += int64(len(b))
	n, err := s.w.Write(b)
	s.n += int64(n)
	return err
}
