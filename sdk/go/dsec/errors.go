package dsec

import (
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Code returns the Connect code of err (connect.CodeUnknown for errors that
// did not come from the API, 0 for nil).
func Code(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.CodeOf(err)
}

// IsNotFound reports whether the object does not exist or belongs to
// another tenant (the API does not tell the two apart).
func IsNotFound(err error) bool { return Code(err) == connect.CodeNotFound }

// IsInvalidArgument reports whether the request was malformed; the message
// names the field.
func IsInvalidArgument(err error) bool { return Code(err) == connect.CodeInvalidArgument }

// IsPermissionDenied reports whether the token may not do this.
func IsPermissionDenied(err error) bool { return Code(err) == connect.CodePermissionDenied }

// IsUnauthenticated reports whether the token is missing or unknown.
func IsUnauthenticated(err error) bool { return Code(err) == connect.CodeUnauthenticated }

// IsResourceExhausted reports a quota overrun or no capacity left.
func IsResourceExhausted(err error) bool { return Code(err) == connect.CodeResourceExhausted }

// IsUnavailable reports that the service or the sandbox's node is down;
// retrying later may succeed.
func IsUnavailable(err error) bool { return Code(err) == connect.CodeUnavailable }

// IsFailedPrecondition reports an operation that the object's state forbids
// (for example writing to a lost sandbox).
func IsFailedPrecondition(err error) bool { return Code(err) == connect.CodeFailedPrecondition }

// itemError turns a per-item error of a batch call into a Connect error so
// that the Is* helpers work on it too.
func itemError(what string, e *dsecv1.ItemError) error {
	if e == nil {
		return nil
	}
	var code connect.Code
	if err := code.UnmarshalText([]byte(e.GetCode())); err != nil {
		code = connect.CodeUnknown
	}
	return connect.NewError(code, fmt.Errorf("%s: %s", what, e.GetMessage()))
}

// BatchError collects the failures of a batch call. The successes are
// returned beside it.
type BatchError struct {
	Errs []error
}

func (e *BatchError) Error() string {
	if len(e.Errs) == 1 {
		return e.Errs[0].Error()
	}
	return fmt.Sprintf("%d failures; first: %v", len(e.Errs), e.Errs[0])
}

// Unwrap lets errors.Is and errors.As see every failure.
func (e *BatchError) Unwrap() []error { return e.Errs }

// batchErr returns nil when errs is empty.
func batchErr(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return &BatchError{Errs: errs}
}
