package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"syscall"

	"github.com/dsec-dev/dsec/internal/rawfile"
)

// Sentinels for errors.Is. The io/fs ones cover the rest: an *Error with
// CodeNotFound is fs.ErrNotExist, CodePermissionDenied fs.ErrPermission,
// CodeAlreadyExists fs.ErrExist, CodeInvalidArgument fs.ErrInvalid.
var (
	// ErrDisconnected: the connection to the agent ended (the agent exited,
	// the sandbox was destroyed, the channel broke, or Close was called).
	// Every pending and later call of the Client fails with it.
	ErrDisconnected = errors.New("agent connection ended")
	// ErrTooLarge: a file to read is larger than the caller's bound
	// (CodeTooLarge).
	ErrTooLarge = errors.New("file is larger than the bound")
	// ErrFailedPrecondition: the sandbox's own state refused the operation
	// (CodeFailedPrecondition): a file that is not a regular file, an I/O
	// error of its file system, a full disk. The caller's or the workload's
	// doing, not the platform's.
	ErrFailedPrecondition = errors.New("failed precondition")
)

// Error is a failure the agent reported for one operation: the operation
// reached the agent and was refused or failed there (the sandbox is fine).
type Error struct {
	Code    Code
	Message string
}

func (e *Error) Error() string { return e.Message }

// Is lets callers test agent errors against the io/fs sentinels
// (errors.Is(err, fs.ErrNotExist)) and this package's.
func (e *Error) Is(target error) bool {
	switch e.Code {
	case CodeNotFound:
		return target == fs.ErrNotExist
	case CodePermissionDenied:
		return target == fs.ErrPermission
	case CodeAlreadyExists:
		return target == fs.ErrExist
	case CodeInvalidArgument:
		return target == fs.ErrInvalid
	case CodeTooLarge:
		return target == ErrTooLarge
	case CodeFailedPrecondition:
		return target == ErrFailedPrecondition
	}
	return false
}

func errorf(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// codeOf classifies a local error for the wire.
func codeOf(err error) Code {
	var ae *Error
	switch {
	case errors.As(err, &ae):
		return ae.Code
	case errors.Is(err, fs.ErrNotExist):
		return CodeNotFound
	case errors.Is(err, fs.ErrPermission):
		return CodePermissionDenied
	case errors.Is(err, fs.ErrExist):
		return CodeAlreadyExists
	case errors.Is(err, fs.ErrInvalid), errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR),
		errors.Is(err, syscall.ENAMETOOLONG), errors.Is(err, syscall.ELOOP):
		return CodeInvalidArgument
	case errors.Is(err, errCanceled):
		return CodeCanceled
	case errors.Is(err, syscall.EROFS):
		return CodePermissionDenied
	case errors.Is(err, syscall.EINVAL):
		return CodeInvalidArgument
	case errors.Is(err, rawfile.ErrNotRegular), errors.Is(err, rawfile.ErrTooLarge), errors.Is(err, errors.ErrUnsupported),
		errors.Is(err, syscall.EIO), errors.Is(err, syscall.ENXIO), errors.Is(err, syscall.ENODEV),
		errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT), errors.Is(err, syscall.EFBIG),
		errors.Is(err, syscall.ETXTBSY), errors.Is(err, syscall.EBUSY), errors.Is(err, syscall.EMLINK),
		errors.Is(err, syscall.EXDEV), errors.Is(err, syscall.EAGAIN), errors.Is(err, syscall.EOVERFLOW),
		errors.Is(err, syscall.ESPIPE), errors.Is(err, syscall.ESTALE):
		// The sandbox's own files and file systems (an I/O error, a device
		// that is not there, a full disk, a FIFO, a file in use): what it
		// or its workload did, never the platform's failure.
		return CodeFailedPrecondition
	}
	return CodeUnknown
}

var errCanceled = errors.New("operation canceled")

// The message is made valid UTF-8 (a path in it need not be), as proto3
// requires of strings; otherwise the response could not be sent at all.
func errResponse(err error) *response {
	return &response{err: &wireError{code: codeOf(err), message: strings.ToValidUTF8(err.Error(), "\uFFFD")}}
}

// fromWire turns a response's error into a Go error (nil if none).
func fromWire(e *wireError) error {
	if e == nil || e.code == CodeOK {
		return nil
	}
	return &Error{Code: e.code, Message: e.message}
}

// goneError wraps the reason a connection ended so callers can test it with
// errors.Is(err, ErrDisconnected).
func goneError(op string, cause error) error {
	return fmt.Errorf("agent %s: %w: %v", op, ErrDisconnected, cause)
}
