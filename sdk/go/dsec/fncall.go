package dsec

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// RunCode statuses (RunCodeResponse.Status), as SandboxFusion's /run_code
// names them.
const (
	// RunSuccess: the program ran and exited 0.
	RunSuccess = "Success"
	// RunFailed: the code failed (compile error, non-zero exit, time or
	// memory limit).
	RunFailed = "Failed"
	// RunSandboxError: DSec failed, not the code: mask the sample.
	RunSandboxError = "SandboxError"
)

// Command statuses (CommandResult.Status).
const (
	// CommandFinished: the step ran to its end, whatever its exit code.
	CommandFinished = "Finished"
	// CommandTimeLimitExceeded: the step was killed at its time limit.
	CommandTimeLimitExceeded = "TimeLimitExceeded"
	// CommandError: the step could not be run.
	CommandError = "Error"
)

// RunCodeRequest is one stateless call: run Code in Language in a clean
// sandbox from a warm pool and return its output. Zero fields take the
// language's defaults.
type RunCodeRequest struct {
	Code string
	// Language is a name from the server's language table (python, bash,
	// c, cpp, go, nodejs, ...).
	Language string
	// CompileTimeout and RunTimeout default to 10 s each.
	CompileTimeout time.Duration
	RunTimeout     time.Duration
	// MemoryLimitMB bounds the call's sandbox.
	MemoryLimitMB int64
	Stdin         []byte
	// Files are written before compiling: path (relative to the working
	// directory, or absolute) -> content.
	Files map[string][]byte
	// FetchFiles are read back after the run (missing ones are left out).
	FetchFiles []string
	// Args are passed to the program.
	Args []string
	// Image overrides the language's image (NAME:TAG).
	Image string
	// MaxOutputBytes bounds the captured stdout and stderr each.
	MaxOutputBytes int64
}

// CommandResult is one step of a call: compiling or running.
type CommandResult struct {
	// Status is one of the Command constants.
	Status string
	// ExecutionTime is the step's wall time.
	ExecutionTime   time.Duration
	ReturnCode      int
	Stdout          []byte
	Stderr          []byte
	StdoutTruncated bool
	StderrTruncated bool
	OOMKilled       bool
	// Signal is non-zero when the step was killed by a signal.
	Signal int
}

// RunCodeResponse is what a RunCode call did.
type RunCodeResponse struct {
	// Status is one of the Run constants.
	Status  string
	Message string
	// CompileResult is nil when the language is not compiled; RunResult
	// is nil when compiling failed (or the call did not get that far).
	CompileResult *CommandResult
	RunResult     *CommandResult
	// Files are the FetchFiles that existed after the run.
	Files map[string][]byte
}

func commandFromProto(p *dsecv1.CommandResult) *CommandResult {
	if p == nil {
		return nil
	}
	return &CommandResult{
		Status:          p.GetStatus(),
		ExecutionTime:   time.Duration(p.GetExecutionTime() * float64(time.Second)),
		ReturnCode:      int(p.GetReturnCode()),
		Stdout:          p.GetStdout(),
		Stderr:          p.GetStderr(),
		StdoutTruncated: p.GetStdoutTruncated(),
		StderrTruncated: p.GetStderrTruncated(),
		OOMKilled:       p.GetOomKilled(),
		Signal:          int(p.GetSignal()),
	}
}

// RunCode runs one stateless call (see RunCodeRequest). A program that
// fails is not an error: look at the response's Status and RunResult. An
// error means the call was refused (unknown language, bad argument,
// Unavailable with a RetryAfter hint when the service is saturated).
func (c *Client) RunCode(ctx context.Context, req RunCodeRequest) (*RunCodeResponse, error) {
	switch {
	case req.Language == "":
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("run code: language: required"))
	case req.CompileTimeout < 0 || req.RunTimeout < 0:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("run code: timeouts must not be negative"))
	case req.MemoryLimitMB < 0 || req.MaxOutputBytes < 0:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("run code: limits must not be negative"))
	}
	p := &dsecv1.RunCodeRequest{
		Code:           req.Code,
		Language:       req.Language,
		MemoryLimitMb:  req.MemoryLimitMB,
		Stdin:          req.Stdin,
		Files:          req.Files,
		FetchFiles:     req.FetchFiles,
		Args:           req.Args,
		Image:          req.Image,
		MaxOutputBytes: req.MaxOutputBytes,
	}
	if req.CompileTimeout > 0 {
		p.CompileTimeout = durationpb.New(req.CompileTimeout)
	}
	if req.RunTimeout > 0 {
		p.RunTimeout = durationpb.New(req.RunTimeout)
	}
	creq := connect.NewRequest(p)
	ctx, done := queued(ctx, creq.Header())
	defer done()
	resp, err := c.fn.RunCode(ctx, creq)
	if err != nil {
		return nil, fmt.Errorf("run %s code: %w", req.Language, err)
	}
	m := resp.Msg
	return &RunCodeResponse{
		Status:        m.GetStatus(),
		Message:       m.GetMessage(),
		CompileResult: commandFromProto(m.GetCompileResult()),
		RunResult:     commandFromProto(m.GetRunResult()),
		Files:         m.GetFiles(),
	}, nil
}
