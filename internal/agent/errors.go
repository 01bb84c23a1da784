package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"syscall"

	"github.com/dsec-dev/dsec/internal/agent/agentpb"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Error is a failure the agent reported for one operation: the operation
// reached the agent and was refused or failed there (the sandbox is fine).
type Error struct {
	Code    agentpb.Code
	Message string
}

func (e *Error) Error() string { return e.Message }

// Is lets callers test agent errors against the io/fs sentinels
// (errors.Is(err, fs.ErrNotExist)).
func (e *Error) Is(target error) bool {
	switch e.Code {
	case agentpb.Code_CODE_NOT_FOUND:
		return target == fs.ErrNotExist
	case agentpb.Code_CODE_PERMISSION_DENIED:
		return target == fs.ErrPermission
	case agentpb.Code_CODE_ALREADY_EXISTS:
		return target == fs.ErrExist
	case agentpb.Code_CODE_INVALID_ARGUMENT:
		return target == fs.ErrInvalid
	}
	return false
}

func errorf(code agentpb.Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// codeOf classifies a local error for the wire.
func codeOf(err error) agentpb.Code {
	var ae *Error
	switch {
	case errors.As(err, &ae):
		return ae.Code
	case errors.Is(err, fs.ErrNotExist):
		return agentpb.Code_CODE_NOT_FOUND
	case errors.Is(err, fs.ErrPermission):
		return agentpb.Code_CODE_PERMISSION_DENIED
	case errors.Is(err, fs.ErrExist):
		return agentpb.Code_CODE_ALREADY_EXISTS
	case errors.Is(err, fs.ErrInvalid), errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR),
		errors.Is(err, syscall.ENAMETOOLONG), errors.Is(err, syscall.ELOOP):
		return agentpb.Code_CODE_INVALID_ARGUMENT
	case errors.Is(err, errCanceled):
		return agentpb.Code_CODE_CANCELED
	}
	return agentpb.Code_CODE_UNKNOWN
}

var errCanceled = errors.New("operation canceled")

func errResponse(err error) *agentpb.Response {
	return &agentpb.Response{Error: &agentpb.Error{Code: codeOf(err), Message: err.Error()}}
}

// fromWire turns a response's error into a Go error (nil if none).
func fromWire(e *agentpb.Error) error {
	if e == nil || e.GetCode() == agentpb.Code_CODE_OK {
		return nil
	}
	return &Error{Code: e.GetCode(), Message: e.GetMessage()}
}

// goneError wraps the reason a connection ended so callers can test it with
// errors.Is(err, runtime.ErrSandboxGone).
func goneError(op string, cause error) error {
	return fmt.Errorf("agent %s: %w: %v", op, runtime.ErrSandboxGone, cause)
}
