package controlplane

import (
	"context"
	"sort"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Snapshot, checkpoint, rollback, freeze and thaw are answered by the
// sandbox's node; the server routes them and, for snapshots, names the new
// image in the caller's namespace.

func (ss *sandboxService) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// A ref the caller may not use is refused here, numbered or not: the
	// edge writes whatever name it is given (the SDKs check refs before
	// they take a number).
	r, err := checkUserRef(p, "ref", req.Msg.GetRef())
	if err != nil {
		return nil, err
	}
	internal := r.String()
	if !p.Admin {
		internal = tenantScope(p.Tenant) + internal
	}
	rt, err := s.live(p, req.Msg.GetSandboxId(), req.Msg.GetSeq())
	if err != nil {
		return nil, err
	}
	// Packing a large writable layer takes a while: the call gets the
	// exec deadline rather than the short one of control calls.
	cctx, cancel := callContext(ctx, execSlack+edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).SnapshotOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{
		Caller: callerOf(p), Request: req.Msg, InternalRef: internal}))
	if err != nil {
		s.metrics.fail("snapshot", err)
		return nil, edgeFailure(rt.node, err)
	}
	if img := resp.Msg.GetImage(); img != nil && !p.Admin {
		img.Tenant = p.Tenant
	}
	return connect.NewResponse(resp.Msg), nil
}

func (ss *sandboxService) Checkpoint(ctx context.Context, req *connect.Request[dsecv1.CheckpointRequest]) (*connect.Response[dsecv1.CheckpointResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rt, err := s.live(p, req.Msg.GetSandboxId(), req.Msg.GetSeq())
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, execSlack+edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).CheckpointOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		s.metrics.fail("checkpoint", err)
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (ss *sandboxService) Rollback(ctx context.Context, req *connect.Request[dsecv1.RollbackRequest]) (*connect.Response[dsecv1.RollbackResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if req.Msg.GetCheckpointId() == "" && req.Msg.GetSeq() == 0 {
		return nil, errf(connect.CodeInvalidArgument, "checkpoint_id: required")
	}
	rt, err := s.live(p, req.Msg.GetSandboxId(), req.Msg.GetSeq())
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, execSlack+edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).RollbackOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		s.metrics.fail("rollback", err)
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (ss *sandboxService) DeleteCheckpoint(ctx context.Context, req *connect.Request[dsecv1.DeleteCheckpointRequest]) (*connect.Response[dsecv1.DeleteCheckpointResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rt, err := s.live(p, req.Msg.GetSandboxId(), 0)
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).DeleteCheckpointOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeDeleteCheckpointRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (ss *sandboxService) Freeze(ctx context.Context, req *connect.Request[dsecv1.FreezeRequest]) (*connect.Response[dsecv1.FreezeResponse], error) {
	sb, err := ss.s.freezeThaw(ctx, req.Msg.GetSandboxId(), true)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.FreezeResponse{Sandbox: sb}), nil
}

func (ss *sandboxService) Thaw(ctx context.Context, req *connect.Request[dsecv1.ThawRequest]) (*connect.Response[dsecv1.ThawResponse], error) {
	sb, err := ss.s.freezeThaw(ctx, req.Msg.GetSandboxId(), false)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ThawResponse{Sandbox: sb}), nil
}

// freezeThaw freezes (or thaws) one sandbox on its node and returns it as
// the caller sees it.
func (s *Server) freezeThaw(ctx context.Context, id string, freeze bool) (*dsecv1.Sandbox, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rt, err := s.live(p, id, 0)
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	edge, req := s.edges.get(rt.url), connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: callerOf(p), SandboxId: id})
	var sb *dsecv1.Sandbox
	if freeze {
		var resp *connect.Response[dsecv1.FreezeResponse]
		if resp, err = edge.FreezeOnEdge(cctx, req); err == nil {
			sb = resp.Msg.GetSandbox()
		}
	} else {
		var resp *connect.Response[dsecv1.ThawResponse]
		if resp, err = edge.ThawOnEdge(cctx, req); err == nil {
			sb = resp.Msg.GetSandbox()
		}
	}
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return toUser(sb), nil
}

func (ss *sandboxService) FreezeJob(ctx context.Context, req *connect.Request[dsecv1.JobRequest]) (*connect.Response[dsecv1.JobResponse], error) {
	return ss.s.job(ctx, req.Msg, true)
}

func (ss *sandboxService) ThawJob(ctx context.Context, req *connect.Request[dsecv1.JobRequest]) (*connect.Response[dsecv1.JobResponse], error) {
	return ss.s.job(ctx, req.Msg, false)
}

// job freezes or thaws a job's sandboxes on every live node at once. A node
// that does not answer is reported as one failed item naming it, so the
// trainer knows the pause is incomplete.
func (s *Server) job(ctx context.Context, r *dsecv1.JobRequest, freeze bool) (*connect.Response[dsecv1.JobResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	labels := r.GetLabels()
	if len(labels) == 0 {
		return nil, errf(connect.CodeInvalidArgument, "labels: a job needs at least one label to select its sandboxes")
	}
	for k := range labels {
		if k == "" {
			return nil, errf(connect.CodeInvalidArgument, "labels: a label key must not be empty")
		}
	}
	live, _ := s.reg.snapshot()
	var (
		mu  sync.Mutex
		out []*dsecv1.JobResult
		wg  sync.WaitGroup
	)
	for _, e := range live {
		wg.Go(func() {
			cctx, cancel := callContext(ctx, execSlack+edgeCallTimeout)
			defer cancel()
			call := s.edges.get(e.url).ThawJobOnEdge
			if freeze {
				call = s.edges.get(e.url).FreezeJobOnEdge
			}
			resp, err := call(cctx, connect.NewRequest(&dsecv1.EdgeListRequest{Caller: callerOf(p), Labels: labels}))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				out = append(out, &dsecv1.JobResult{Id: "node/" + e.id, Error: s.itemError(edgeFailure(e.id, err))})
				return
			}
			out = append(out, resp.Msg.GetResults()...)
		})
	}
	wg.Wait()
	sort.Slice(out, func(i, j int) bool { return out[i].GetId() < out[j].GetId() })
	return connect.NewResponse(&dsecv1.JobResponse{Results: out}), nil
}
