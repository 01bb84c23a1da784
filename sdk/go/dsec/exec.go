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
	// the server's default. ExecStream writers still get everything.
	MaxOutputBytes int64
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
	resp, err := s.c.sandboxes.Exec(ctx, connect.NewRequest(opts.proto(s.ID)))
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
	stream, err := s.c.sandboxes.ExecStream(ctx, connect.NewRequest(opts.proto(s.ID)))
	if err != nil {
		return nil, fmt.Errorf("exec in sandbox %s: %w", s.ID, err)
	}
	defer stream.Close()
	var result *ExecResult
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *dsecv1.ExecStreamResponse_Stdout:
			if err := write(stdout, ev.Stdout); err != nil {
				return nil, fmt.Errorf("exec in sandbox %s: copy stdout: %w", s.ID, err)
			}
		case *dsecv1.ExecStreamResponse_Stderr:
			if err := write(stderr, ev.Stderr); err != nil {
				return nil, fmt.Errorf("exec in sandbox %s: copy stderr: %w", s.ID, err)
			}
		case *dsecv1.ExecStreamResponse_Result:
			result = resultFromProto(ev.Result)
		}
	}
	if err := stream.Err(); err != nil {
		return nil, fmt.Errorf("exec in sandbox %s: %w", s.ID, err)
	}
	if result == nil {
		return nil, fmt.Errorf("exec in sandbox %s: %w", s.ID,
			connect.NewError(connect.CodeInternal, errors.New("stream ended without a result")))
	}
	return result, nil
}

func write(w io.Writer, b []byte) error {
	if w == nil || len(b) == 0 {
		return nil
	}
	_, err := w.Write(b)
	return err
}
