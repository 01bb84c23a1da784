package controlplane

import (
	"context"
	"errors"
	"strconv"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

func (ss *sandboxService) SubmitReward(ctx context.Context, req *connect.Request[dsecv1.SubmitRewardRequest]) (*connect.Response[dsecv1.SubmitRewardResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rt, err := s.locate(p, "sandbox_id", req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	// A reward may come after the sandbox ended (scored once it is gone):
	// only a dead node cannot take it.
	if !rt.alive {
		return nil, errf(connect.CodeUnavailable, "node %s of sandbox %q is not responding", rt.node, req.Msg.GetSandboxId())
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).SubmitRewardOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeSubmitRewardRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		s.metrics.fail("reward", err)
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

// GetTrajectory asks the sandbox's node, which has every record; when the
// node no longer knows the sandbox (destroyed and forgotten) or is gone, the
// trajectory shipped to the blob store answers.
func (ss *sandboxService) GetTrajectory(ctx context.Context, req *connect.Request[dsecv1.GetTrajectoryRequest]) (*connect.Response[dsecv1.GetTrajectoryResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	size, from, err := edge.PageBounds(req.Msg)
	if err != nil {
		return nil, err
	}
	rt, err := s.locate(p, "sandbox_id", req.Msg.GetSandboxId())
	switch {
	case err == nil && rt.alive:
		cctx, cancel := callContext(ctx, edgeCallTimeout)
		defer cancel()
		resp, err := s.edges.get(rt.url).GetTrajectoryOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeGetTrajectoryRequest{Caller: callerOf(p), Request: req.Msg}))
		if err == nil {
			return connect.NewResponse(resp.Msg), nil
		}
		if connect.CodeOf(err) != connect.CodeNotFound && !unreachable(err) {
			return nil, err
		}
	case err != nil && connect.CodeOf(err) != connect.CodeNotFound:
		return nil, err
	}
	out, err := s.shippedTrajectory(ctx, p, req.Msg.GetSandboxId(), from, size, req.Msg.GetIncludeData())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(out), nil
}

// shippedTrajectory pages through the trajectory a node shipped to the blob
// store: the sandbox's lines of the blob its ref names. Its creation record
// names the tenant that may read it.
func (s *Server) shippedTrajectory(ctx context.Context, p iam.Principal, id string, from, size int, withData bool) (*dsecv1.GetTrajectoryResponse, error) {
	digest, err := s.cfg.Store.Refs().Get(ctx, trajectory.ShipRef(id))
	if errors.Is(err, blobstore.ErrNotFound) || errors.Is(err, blobstore.ErrInvalidRef) {
		return nil, notFound(id)
	}
	if err != nil {
		return nil, errf(connect.CodeUnavailable, "trajectory of sandbox %q: %w", id, err)
	}
	blob, err := blobstore.ReadAll(ctx, s.cfg.Store, digest)
	if err != nil {
		return nil, errf(connect.CodeUnavailable, "trajectory of sandbox %q: %w", id, err)
	}
	// The blob may be a pack: several sandboxes' trajectories (of one
	// tenant) one after the other. Only id's lines are its trajectory.
	lines, err := trajectory.LinesOf(blob, id)
	if err != nil {
		return nil, errf(connect.CodeDataLoss, "trajectory of sandbox %q: blob %s: %w", id, digest, err)
	}
	first, err := trajectory.Parse(lines[0])
	if err != nil {
		return nil, errf(connect.CodeDataLoss, "trajectory of sandbox %q: first record: %w", id, err)
	}
	if first.Environment == nil || !visible(p, first.Environment.Tenant) {
		return nil, notFound(id)
	}
	if from > len(lines) {
		return nil, errf(connect.CodeInvalidArgument, "page_token %d is past the trajectory's %d records", from, len(lines))
	}
	out := &dsecv1.GetTrajectoryResponse{}
	end := min(len(lines), from+size)
	for _, line := range lines {
		rec, err := trajectory.Parse(line)
		if err != nil {
			return nil, errf(connect.CodeDataLoss, "trajectory of sandbox %q: %w", id, err)
		}
		out.NextSeq = max(out.NextSeq, rec.Seq+1)
	}
	held := 0
	for i, line := range lines[from:end] {
		if held >= limits.MaxPageBytes {
			// A page ends at its byte bound too (see trajectory.PageBytes).
			end = from + i
			break
		}
		if withData {
			rec, _ := trajectory.Parse(line)
			if err := trajectory.LoadData(ctx, s.cfg.Store, rec); err != nil {
				return nil, errf(connect.CodeUnavailable, "trajectory of sandbox %q: %w", id, err)
			}
			if line, err = rec.Marshal(); err != nil {
				return nil, errf(connect.CodeInternal, "trajectory of sandbox %q: %w", id, err)
			}
		}
		out.Records = append(out.Records, string(line))
		held += len(line)
	}
	if end < len(lines) {
		out.NextPageToken = strconv.Itoa(end)
	}
	return out, nil
}
