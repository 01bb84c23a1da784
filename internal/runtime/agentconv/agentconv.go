// Package agentconv translates between the runtime's types and the agent
// protocol's client (internal/agent), which depends on no backend. Every
// backend whose sandboxes run dsec-agent (the container backend over a
// socket, the VM backends over virtio-serial) talks to it through the same
// client, so the translation lives here once: requests and results field
// for field, and errors keeping the meaning the edge maps to API codes (a
// lost agent is runtime.ErrSandboxGone, a file over the caller's bound
// runtime.ErrTooLarge, the sandbox's own refusal
// runtime.ErrFailedPrecondition).
package agentconv

import (
	"errors"

	"github.com/dsec-dev/dsec/internal/agent"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// ExecRequest is req for the agent client.
func ExecRequest(req rt.ExecRequest) agent.ExecRequest {
	return agent.ExecRequest{
		Argv:           req.Argv,
		Shell:          req.Shell,
		Env:            req.Env,
		Cwd:            req.Cwd,
		User:           req.User,
		Stdin:          req.Stdin,
		Timeout:        req.Timeout,
		MaxOutputBytes: req.MaxOutputBytes,
	}
}

// ExecResult is the agent's result as the runtime's. OOMKilled and
// DiskFull come from agents that can tell (a VM guest's); the container
// backend adds them itself from its cgroup and disk.
func ExecResult(res agent.ExecResult) rt.ExecResult {
	return rt.ExecResult{
		ExitCode:        res.ExitCode,
		Signal:          res.Signal,
		Stdout:          res.Stdout,
		Stderr:          res.Stderr,
		StdoutTruncated: res.StdoutTruncated,
		StderrTruncated: res.StderrTruncated,
		Duration:        res.Duration,
		TimedOut:        res.TimedOut,
		PidsExhausted:   res.PidsExhausted,
		OOMKilled:       res.OOMKilled,
		DiskFull:        res.DiskFull,
	}
}

// Output adapts out for the agent client; nil stays nil, since the client
// asks the agent to stream only when there is someone to stream to.
func Output(out rt.OutputFunc) agent.OutputFunc {
	if out == nil {
		return nil
	}
	return func(s agent.Stream, data []byte) {
		switch s {
		case agent.Stdout:
			out(rt.Stdout, data)
		case agent.Stderr:
			out(rt.Stderr, data)
		}
	}
}

// Err gives an error of the agent client the runtime's meaning: the same
// message and chain (errors.As still finds the *agent.Error, errors.Is the
// io/fs sentinels), plus the runtime sentinel it stands for. Other errors
// pass through unchanged.
func Err(err error) error {
	if err == nil {
		return nil
	}
	var kind error
	switch {
	case errors.Is(err, agent.ErrDisconnected):
		kind = rt.ErrSandboxGone
	case errors.Is(err, agent.ErrTooLarge):
		kind = rt.ErrTooLarge
	case errors.Is(err, agent.ErrFailedPrecondition):
		kind = rt.ErrFailedPrecondition
	default:
		return err
	}
	return &runtimeError{err: err, kind: kind}
}

// runtimeError is an agent error that also is a runtime sentinel.
type runtimeError struct {
	err, kind error
}

func (e *runtimeError) Error() string   { return e.err.Error() }
func (e *runtimeError) Unwrap() []error { return []error{e.err, e.kind} }
