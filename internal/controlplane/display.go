package controlplane

import (
	"context"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/limits"
)

// Screenshot and Input reach the screen, keyboard and mouse of a sandbox
// that has them (fullvm), on its node.

func (ss *sandboxService) Screenshot(ctx context.Context, req *connect.Request[dsecv1.ScreenshotRequest]) (*connect.Response[dsecv1.ScreenshotResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rt, err := ss.s.live(p, req.Msg.GetSandboxId(), 0)
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := ss.s.edges.get(rt.url).ScreenshotOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: callerOf(p), SandboxId: req.Msg.GetSandboxId()}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (ss *sandboxService) Input(ctx context.Context, req *connect.Request[dsecv1.InputRequest]) (*connect.Response[dsecv1.InputResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// Refused here already, before the sandbox is looked up: a caller's
	// bad event is InvalidArgument naming it, whatever node holds it.
	if err := limits.Input("", req.Msg); err != nil {
		return nil, err
	}
	rt, err := ss.s.live(p, req.Msg.GetSandboxId(), 0)
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := ss.s.edges.get(rt.url).InputOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeInputRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}
