package controlplane

import (
	"context"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/spec"
)

// SetNetwork changes or reads a sandbox's egress policy on its node
// (internal/aether decides connections there).
func (ss *sandboxService) SetNetwork(ctx context.Context, req *connect.Request[dsecv1.SetNetworkRequest]) (*connect.Response[dsecv1.SetNetworkResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// A bad rule is InvalidArgument naming it, whatever node holds the
	// sandbox.
	if _, err := spec.Network("", req.Msg.GetAllow(), req.Msg.GetDeny()); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	rt, err := ss.s.live(p, req.Msg.GetSandboxId(), 0)
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := ss.s.edges.get(rt.url).SetNetworkOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeSetNetworkRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

// Verify grades a sandbox's work in a verifier on its node (see
// dsecv1.VerifyRequest).
func (ss *sandboxService) Verify(ctx context.Context, req *connect.Request[dsecv1.VerifyRequest]) (*connect.Response[dsecv1.VerifyResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// A numbered request goes to its node even when invalid: the node
	// records the refusal under its number, as for an exec.
	if err := limits.Verify("", req.Msg); err != nil && req.Msg.GetSeq() == 0 {
		return nil, err
	}
	rt, err := ss.s.live(p, req.Msg.GetSandboxId(), 0)
	if err != nil {
		return nil, err
	}
	// No deadline of the server's own: the grading command runs as long
	// as its timeout says, after the verifier's create and the copies.
	resp, err := ss.s.edges.get(rt.url).VerifyOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeVerifyRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}
