package dsec

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

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

// RetryAfterHeader is the response header (and Connect error metadata) in
// which the service says, in seconds, when to try a refused call again.
const RetryAfterHeader = "Retry-After"

// RetryAfter returns how long the service asked the caller to wait before
// trying again, or 0 when err carries no such hint. The service gives one
// with Unavailable when its admission queue is full (capacity exhausted
// and too many calls already waiting): the call was not run, and the
// caller decides whether to come back after the hint, go elsewhere or give
// up. The hint is read from the Retry-After metadata of the error and,
// failing that (per-item errors of batch calls carry only a message), from
// the message ("retry after 2s").
func RetryAfter(err error) time.Duration {
	if err == nil {
		return 0
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		if d, ok := parseRetryAfter(ce.Meta().Get(RetryAfterHeader)); ok {
			return d
		}
	}
	if m := retryAfterText.FindStringSubmatch(err.Error()); m != nil {
		if d, ok := parseRetryAfter(m[1]); ok {
			return d
		}
	}
	return 0
}

// retryAfterText finds the hint in a message: "retry after 2s",
// "retry-after: 1.5", "retry_after=500ms".
var retryAfterText = regexp.MustCompile(`(?i)retry[-_ ]?after[:= ]*([0-9]+(?:\.[0-9]+)?(?:ns|us|µs|ms|s|m|h)?)\b`)

// parseRetryAfter reads seconds ("2", "0.5") or a Go duration ("1.5s").
// An HTTP date, which the header may hold in general, is not used by DSec.
func parseRetryAfter(v string) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		if f < 0 || f > 86400 {
			return 0, false
		}
		return time.Duration(f * float64(time.Second)), true
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return d, true
	}
	return 0, false
}

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
