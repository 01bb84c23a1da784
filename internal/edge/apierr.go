package edge

import (
	"context"
	"errors"
	"strconv"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
)

// This file is the edge's service boundary for errors: the edge's logic
// returns errors of package fail (or of the shared request checks in
// package limits, which are Connect errors already), and they become
// Connect errors here, once, on their way out of EdgeService (apiErrors)
// or into a batch item, a job result or a trajectory record. Nothing else
// in the package builds a Connect error.

// codes maps each kind to the API code callers see.
var codes = map[fail.Kind]connect.Code{
	fail.Unknown:            connect.CodeUnknown,
	fail.InvalidArgument:    connect.CodeInvalidArgument,
	fail.NotFound:           connect.CodeNotFound,
	fail.AlreadyExists:      connect.CodeAlreadyExists,
	fail.FailedPrecondition: connect.CodeFailedPrecondition,
	fail.ResourceExhausted:  connect.CodeResourceExhausted,
	fail.Unavailable:        connect.CodeUnavailable,
	fail.Internal:           connect.CodeInternal,
	fail.Canceled:           connect.CodeCanceled,
	fail.DeadlineExceeded:   connect.CodeDeadlineExceeded,
	fail.Aborted:            connect.CodeAborted,
	fail.PermissionDenied:   connect.CodePermissionDenied,
	fail.Unimplemented:      connect.CodeUnimplemented,
	fail.OutOfRange:         connect.CodeOutOfRange,
	fail.DataLoss:           connect.CodeDataLoss,
	fail.Unauthenticated:    connect.CodeUnauthenticated,
}

// apiError is err as EdgeService answers it. A classified error becomes a
// Connect error of its kind's code whose message is the classified error's
// (what wraps it outside adds nothing, as Connect itself treats a wrapped
// Connect error); a Connect error passes as it is; anything else too, and
// Connect answers it as Unknown.
func apiError(err error) error {
	if err == nil {
		return nil
	}
	var fe *fail.Error
	var ce *connect.Error
	switch {
	case errors.As(err, &fe):
		if errors.As(err, &ce) && !errors.As(fe, &ce) {
			return err // a Connect error outside the classified one wins, as before
		}
		out := connect.NewError(codes[fe.Kind], fe)
		if fe.RetryAfter > 0 {
			out.Meta().Set("Retry-After", strconv.Itoa(max(1, int(fe.RetryAfter.Round(time.Second)/time.Second))))
		}
		return out
	}
	return err
}

// apiCode is the code EdgeService answers err with.
func apiCode(err error) connect.Code { return connect.CodeOf(apiError(err)) }

// classified reports whether err carries an API code already (a kind, or
// a Connect code from the shared request checks).
func classified(err error) bool {
	var ce *connect.Error
	return fail.KindOf(err) != fail.Unknown || errors.As(err, &ce)
}

// apiMessage is err's message without the "code: " prefix a Connect
// error's Error adds (what a trajectory record keeps).
func apiMessage(err error) string {
	var ce *connect.Error
	if errors.As(apiError(err), &ce) {
		return ce.Message()
	}
	return err.Error()
}

// itemError turns an error of one batch item or job target into its wire
// form, as the call's own error would read, host paths redacted (the
// interceptor that redacts a call's error does not see its items).
func (e *Edge) itemError(err error) *dsecv1.ItemError {
	err = apiError(err)
	return &dsecv1.ItemError{Code: connect.CodeOf(err).String(), Message: e.redact.String(err.Error())}
}

// apiText is err as a string the way callers read it ("code: message"),
// for results that carry an error as text.
func apiText(err error) string { return apiError(err).Error() }

// apiErrors is the interceptor that maps every error EdgeService returns.
type apiErrors struct{}

func (apiErrors) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, apiError(err)
	}
}

func (apiErrors) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (apiErrors) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return apiError(next(ctx, conn))
	}
}
