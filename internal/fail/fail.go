// Package fail gives errors a kind — what went wrong from the caller's
// point of view (a bad argument, something missing, no room, a platform
// failure) — without tying the code that fails to an RPC framework.
//
// The edge's logic returns errors of this package (wrapped with %w as
// usual); its service boundary maps each kind to an API status code once
// (internal/edge's apierr.go), so that the mapping is written down in one
// place and code below the boundary can be called, and tested, without
// Connect. The kinds follow the API's status codes one to one, because
// that is the contract callers (the server's retry on ResourceExhausted,
// the SDKs) rely on.
package fail

import (
	"errors"
	"fmt"
	"time"
)

// Kind classifies an error. The zero Kind is Unknown: an error nobody
// classified.
type Kind int

// The kinds, each named after the API status code it maps to.
const (
	Unknown Kind = iota
	// InvalidArgument: the request is wrong; the message names the field.
	InvalidArgument
	NotFound
	AlreadyExists
	// FailedPrecondition: the request is fine but the target's state
	// refuses it now (a frozen sandbox, a lost one).
	FailedPrecondition
	// ResourceExhausted: no room or too busy; the server places a create
	// refused this way again elsewhere.
	ResourceExhausted
	// Unavailable: a dependency (the blob store, the node shutting down)
	// cannot serve now; retrying later may work.
	Unavailable
	// Internal: the platform failed.
	Internal
	Canceled
	DeadlineExceeded
	// Aborted: a concurrent operation got in the way (a rollback under an
	// exec, a destroy under a create).
	Aborted
	PermissionDenied
	Unimplemented
	// The API's remaining codes, so that every recorded code parses back.
	OutOfRange
	DataLoss
	Unauthenticated
)

var names = [...]string{
	Unknown: "unknown", InvalidArgument: "invalid_argument", NotFound: "not_found",
	AlreadyExists: "already_exists", FailedPrecondition: "failed_precondition",
	ResourceExhausted: "resource_exhausted", Unavailable: "unavailable", Internal: "internal",
	Canceled: "canceled", DeadlineExceeded: "deadline_exceeded", Aborted: "aborted",
	PermissionDenied: "permission_denied", Unimplemented: "unimplemented",
	OutOfRange: "out_of_range", DataLoss: "data_loss", Unauthenticated: "unauthenticated",
}

// String is the kind's name as the API spells the matching code
// ("failed_precondition").
func (k Kind) String() string {
	if k < 0 || int(k) >= len(names) {
		return fmt.Sprintf("kind(%d)", int(k))
	}
	return names[k]
}

// ParseKind is the inverse of String; an unknown name is Unknown.
func ParseKind(name string) Kind {
	for k, n := range names {
		if n == name {
			return Kind(k)
		}
	}
	return Unknown
}

// Error is an error of a kind. Its message is its cause's: the kind adds
// none, so a mapped error reads as the cause did.
type Error struct {
	Kind Kind
	Err  error
	// RetryAfter, when set, is how long the caller should wait before
	// trying again (the API sends it as a Retry-After header).
	RetryAfter time.Duration
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// New gives err kind k; a nil err stays nil.
func New(k Kind, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: k, Err: err}
}

// Errorf is New(k, fmt.Errorf(format, args...)).
func Errorf(k Kind, format string, args ...any) error {
	return &Error{Kind: k, Err: fmt.Errorf(format, args...)}
}

// RetryAfter is New(k, err) saying that a retry may succeed after d.
func RetryAfter(k Kind, err error, d time.Duration) error {
	return &Error{Kind: k, Err: err, RetryAfter: d}
}

// Invalid is an InvalidArgument error; its message should start with the
// field it is about ("spec.backend: ...").
func Invalid(format string, args ...any) error { return Errorf(InvalidArgument, format, args...) }

// KindOf is the kind of the outermost Error in err's chain, or Unknown.
func KindOf(err error) Kind {
	var fe *Error
	if errors.As(err, &fe) {
		return fe.Kind
	}
	return Unknown
}

// Is reports whether err is of kind k.
func Is(err error, k Kind) bool { return err != nil && KindOf(err) == k }
