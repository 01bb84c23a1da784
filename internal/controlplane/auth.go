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

// authenticated serves next only to callers with a valid bearer token,
// whose principal it puts in the request's context. It runs before
// anything reads the body: Connect reads and inflates a request before its
// interceptors run, so an interceptor checking the token let anyone make
// the server read (and gunzip) a body first.
func (s *Server) authenticated(next http.Handler) http.Handler {
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, err := s.authenticate(r.Context(), r.Header)
		if err != nil {
			ew.Write(w, r, err)
			return
		}
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

func (s *Server) authenticate(ctx context.Context, h http.Header) (context.Context, error) {
	tok, ok := iam.BearerToken(h.Get("Authorization"))
	if !ok {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing Authorization: Bearer <token> header"))
	}
	p, err := s.iam.Authenticate(ctx, tok)
	if errors.Is(err, iam.ErrUnauthenticated) {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	return withPrincipal(ctx, p), nil
}

// requireClusterToken serves next only to holders of the cluster token
// (edges), checked before the body is read, as authenticated does.
func requireClusterToken(token string, next http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, ok := iam.BearerToken(r.Header.Get("Authorization"))
		got := sha256.Sum256([]byte(tok))
		if !ok || subtle.ConstantTimeCompare(want[:], got[:]) != 1 {
			ew.Write(w, r, connect.NewError(connect.CodeUnauthenticated, errors.New("missing or wrong cluster token")))
			return
		}
		next.ServeHTTP(w, r)
	})
}
