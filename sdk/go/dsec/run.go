package dsec

import (
	"context"
	"errors"
	"fmt"
	"io"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// RunResult is what happened to a Run's command, plus the sandbox it ran
// in.
type RunResult struct {
	ExecResult
	// SandboxID is the sandbox the command ran in (destroyed by now).
	SandboxID string
	// DestroyError, when not empty, says why the sandbox could not be
	// destroyed cleanly. The result stands: the command ran.
	DestroyError string
}

// Run creates a sandbox from spec, runs the command described by opts in
// it and destroys it, in one call (one round trip; `dsec run`). The
// command's output is copied to stdout and stderr as it is produced; a nil
// writer collects that stream into the result's Stdout or Stderr instead.
// The sandbox is destroyed even when the command fails or ctx ends.
//
// Like Create, Run waits in the service's admission queue when every
// node is full, within ctx's deadline. A failure before the command could
// start (a bad spec, a quota, no room) is an error; a sandbox or node that
// fails afterwards gives a result whose Outcome is OutcomeInfraError.
// opts.Seq must be 0: the sandbox is new.
func (c *Client) Run(ctx context.Context, spec Spec, opts ExecOptions, stdout, stderr io.Writer) (*RunResult, error) {
	// The stream is cancelled if a writer fails, so the command's output
	// stops flowing to a caller that can no longer take it (the server
	// then stops the command and destroys the sandbox).
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req := connect.NewRequest(&dsecv1.RunRequest{Spec: spec.proto(), Exec: opts.proto("")})
	ctx, done := queued(ctx, req.Header())
	defer done()
	res, err := c.run(ctx, req, stdout, stderr)
	if err != nil {
		return nil, fmt.Errorf("run in a new sandbox from %q: %w", spec.Image, err)
	}
	return res, nil
}

func (c *Client) run(ctx context.Context, req *connect.Request[dsecv1.RunRequest], stdout, stderr io.Writer) (*RunResult, error) {
	stream, err := c.sandboxes.Run(ctx, req)
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	var (
		out, errOut []byte
		result      *RunResult
	)
	for stream.Receive() {
		msg := stream.Msg()
		switch ev := msg.GetEvent().(type) {
		case *dsecv1.RunResponse_Stdout:
			if stdout == nil {
				out = append(out, ev.Stdout...)
			} else if _, err := stdout.Write(ev.Stdout); err != nil {
				return nil, fmt.Errorf("copy stdout: %w", err)
			}
		case *dsecv1.RunResponse_Stderr:
			if stderr == nil {
				errOut = append(errOut, ev.Stderr...)
			} else if _, err := stderr.Write(ev.Stderr); err != nil {
				return nil, fmt.Errorf("copy stderr: %w", err)
			}
		case *dsecv1.RunResponse_Result:
			result = &RunResult{
				ExecResult:   *resultFromProto(ev.Result),
				SandboxID:    msg.GetSandboxId(),
				DestroyError: msg.GetDestroyError(),
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	if result == nil {
		return nil, connect.NewError(connect.CodeInternal, errors.New("stream ended without a result"))
	}
	if stdout == nil {
		result.Stdout = out
	}
	if stderr == nil {
		result.Stderr = errOut
	}
	return result, nil
}
