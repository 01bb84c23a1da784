package controlplane

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/placement"
)

func asConnect(err error, target **connect.Error) bool { return errors.As(err, target) }

func errf(code connect.Code, format string, args ...any) error {
	return connect.NewError(code, fmt.Errorf(format, args...))
}

// toConnect maps an internal error to a Connect error; errors that already
// carry a code keep it.
func toConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	switch {
	case errors.As(err, &ce):
		return err
	case errors.Is(err, iam.ErrQuota), errors.Is(err, placement.ErrNoCapacity):
		return connect.NewError(connect.CodeResourceExhausted, err)
	case errors.Is(err, image.ErrNotFound), errors.Is(err, blobstore.ErrNotFound):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, image.ErrInvalidRef), errors.Is(err, blobstore.ErrInvalidRef),
		errors.Is(err, iam.ErrInvalid), errors.Is(err, placement.ErrInvalidRequest):
		return connect.NewError(connect.CodeInvalidArgument, err)
	case errors.Is(err, iam.ErrExists):
		return connect.NewError(connect.CodeAlreadyExists, err)
	case errors.Is(err, context.DeadlineExceeded):
		return connect.NewError(connect.CodeDeadlineExceeded, err)
	case errors.Is(err, context.Canceled):
		return connect.NewError(connect.CodeCanceled, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

// itemError is err as one batch item's result, host paths redacted (the
// interceptor that redacts a call's error does not see its items).
func (s *Server) itemError(err error) *dsecv1.ItemError {
	err = s.redact.Error(toConnect(err))
	var ce *connect.Error
	errors.As(err, &ce)
	return &dsecv1.ItemError{Code: ce.Code().String(), Message: ce.Message()}
}

// retryable reports whether a failed CreateOnEdge should be tried on
// another node: the edge refused admission or could not be reached. Any
// other failure (a bad image, say) would fail the same way elsewhere.
func retryable(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeResourceExhausted, connect.CodeUnavailable:
		return true
	}
	return false
}

// unreachable reports whether an edge call failed in transport (the edge
// is down or the connection broke) rather than with an answer.
func unreachable(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeUnknown:
		return true
	}
	return false
}

// edgeFault says how an edge call failed, for an infra_error result or an
// Unavailable error: the node did not answer, or it answered that the
// operation failed in a way it could not classify (which is no less a
// platform fault, but is no silence either).
func edgeFault(node string, err error) string {
	if connect.IsWireError(err) {
		return fmt.Sprintf("node %s failed the operation: %v", node, err)
	}
	return fmt.Sprintf("node %s is not responding: %v", node, err)
}
