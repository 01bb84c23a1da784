package controlplane

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"net/http"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
)

type principalKey struct{}

func withPrincipal(ctx context.Context, p iam.Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// principal returns the caller the auth interceptor put in ctx. Handlers
// run only behind that interceptor, so a missing principal is a bug; it is
// treated as unauthenticated rather than as anyone in particular.
func principal(ctx context.Context) (iam.Principal, error) {
	p, ok := ctx.Value(principalKey{}).(iam.Principal)
	if !ok {
		return iam.Principal{}, connect.NewError(connect.CodeUnauthenticated, iam.ErrUnauthenticated)
	}
	return p, nil
}

func callerOf(p iam.Principal) *dsecv1.Caller {
	return &dsecv1.Caller{Tenant: p.Tenant, Admin: p.Admin}
}

// bearerAuth authenticates public calls with iam.
type bearerAuth struct{ iam *iam.IAM }

func (a *bearerAuth) authenticate(ctx context.Context, h http.Header) (context.Context, error) {
	tok, ok := iam.BearerToken(h.Get("Authorization"))
	if !ok {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing Authorization: Bearer <token> header"))
	}
	p, err := a.iam.Authenticate(ctx, tok)
	if errors.Is(err, iam.ErrUnauthenticated) {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	return withPrincipal(ctx, p), nil
}

func (a *bearerAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		ctx, err := a.authenticate(ctx, req.Header())
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a *bearerAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a *bearerAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := a.authenticate(ctx, conn.RequestHeader())
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}

// clusterAuth admits only holders of the cluster token (edges).
type clusterAuth struct{ token string }

func (a *clusterAuth) check(h http.Header) error {
	tok, ok := iam.BearerToken(h.Get("Authorization"))
	want := sha256.Sum256([]byte(a.token))
	got := sha256.Sum256([]byte(tok))
	if !ok || subtle.ConstantTimeCompare(want[:], got[:]) != 1 {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("missing or wrong cluster token"))
	}
	return nil
}

func (a *clusterAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if err := a.check(req.Header()); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a *clusterAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a *clusterAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := a.check(conn.RequestHeader()); err != nil {
			return err
		}
		return next(ctx, conn)
	}
}
