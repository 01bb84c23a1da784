package controlplane

import (
	"context"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/limits"
)

// The batch API (issue 6): Acquire, BatchExec, BatchRollback, Release.
// Items are checked and routed one by one; the items bound for one node go
// to it in one edge call, so a batch of 1,000 execs over 4 nodes costs 4
// edge round trips, not 1,000. One item's failure is that item's result.

func (ss *sandboxService) Acquire(ctx context.Context, req *connect.Request[dsecv1.AcquireRequest]) (*connect.Response[dsecv1.AcquireResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	results, err := ss.s.batchCreate(ctx, p, req.Msg.GetSpec(), req.Msg.GetCount())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.AcquireResponse{Results: results}), nil
}

func (ss *sandboxService) Release(ctx context.Context, req *connect.Request[dsecv1.ReleaseRequest]) (*connect.Response[dsecv1.ReleaseResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	results, err := ss.s.batchDestroy(ctx, p, req.Msg.GetIds())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ReleaseResponse{Results: results}), nil
}

// nodeGroup is the items of one batch bound for one node.
type nodeGroup struct {
	rt    route
	index []int // positions in the batch
}

// groupByNode routes each item; check returns the route of item i or an
// error, which becomes that item's result through fail.
func groupByNode(n int, check func(i int) (route, error), fail func(i int, err error)) map[string]*nodeGroup {
	groups := map[string]*nodeGroup{}
	for i := range n {
		rt, err := check(i)
		if err != nil {
			fail(i, err)
			continue
		}
		g := groups[rt.url]
		if g == nil {
			g = &nodeGroup{rt: rt}
			groups[rt.url] = g
		}
		g.index = append(g.index, i)
	}
	return groups
}

// eachGroup calls f for every group concurrently (fanout at a time).
func eachGroup(groups map[string]*nodeGroup, f func(g *nodeGroup)) {
	sem := make(chan struct{}, fanout)
	var wg sync.WaitGroup
	for _, g := range groups {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			f(g)
		}()
	}
	wg.Wait()
}

func (ss *sandboxService) BatchExec(ctx context.Context, req *connect.Request[dsecv1.BatchExecRequest]) (*connect.Response[dsecv1.BatchExecResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	reqs := req.Msg.GetRequests()
	if len(reqs) > maxBatch {
		return nil, errf(connect.CodeInvalidArgument, "requests: %d given, at most %d allowed", len(reqs), maxBatch)
	}
	out := make([]*dsecv1.BatchExecItem, len(reqs))
	for i, r := range reqs {
		out[i] = &dsecv1.BatchExecItem{SandboxId: r.GetSandboxId()}
	}
	var longest time.Duration
	groups := groupByNode(len(reqs), func(i int) (route, error) {
		r := reqs[i]
		if r == nil {
			return route{}, errf(connect.CodeInvalidArgument, "requests[%d]: empty", i)
		}
		// As in Exec: a numbered request goes to its node even when
		// invalid, so the node records the refusal under its number.
		if err := limits.Exec(fmt.Sprintf("requests[%d].", i), r); err != nil && r.GetSeq() == 0 {
			return route{}, err
		}
		rt, err := s.locate(p, fmt.Sprintf("requests[%d].sandbox_id", i), r.GetSandboxId())
		if err != nil {
			return route{}, err
		}
		if rt.lostReason != "" && !(rt.alive && r.GetSeq() != 0) {
			out[i].Result = infraResult(rt.lostReason)
			return route{}, nil
		}
		if d := min(r.GetTimeout().AsDuration(), limits.MaxExecTimeout); d > longest {
			longest = d
		}
		return rt, nil
	}, func(i int, err error) {
		if err != nil {
			s.metrics.fail("exec", err)
			out[i].Error = s.itemError(err)
		}
	})
	delete(groups, "") // items answered without a node (lost sandboxes)
	eachGroup(groups, func(g *nodeGroup) {
		items := make([]*dsecv1.ExecRequest, len(g.index))
		for j, i := range g.index {
			items[j] = reqs[i]
		}
		cctx, cancel := ctx, context.CancelFunc(func() {})
		if longest > 0 {
			cctx, cancel = context.WithTimeout(ctx, longest+execSlack)
		}
		defer cancel()
		resp, err := s.edges.get(g.rt.url).BatchExecOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeBatchExecRequest{
			Caller: callerOf(p), Request: &dsecv1.BatchExecRequest{Requests: items},
		}))
		for j, i := range g.index {
			switch {
			case err != nil && unreachable(err) && ctx.Err() == nil:
				out[i].Result = infraResult(edgeFault(g.rt.node, err))
			case err != nil:
				out[i].Error = s.itemError(err)
			case j >= len(resp.Msg.GetResults()):
				out[i].Result = infraResult(fmt.Sprintf("node %s returned %d results for %d requests", g.rt.node, len(resp.Msg.GetResults()), len(items)))
			default:
				r := resp.Msg.GetResults()[j]
				out[i].Result, out[i].Error = r.GetResult(), r.GetError()
			}
		}
	})
	return connect.NewResponse(&dsecv1.BatchExecResponse{Results: out}), nil
}

func (ss *sandboxService) BatchRollback(ctx context.Context, req *connect.Request[dsecv1.BatchRollbackRequest]) (*connect.Response[dsecv1.BatchRollbackResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	reqs := req.Msg.GetRequests()
	if len(reqs) > maxBatch {
		return nil, errf(connect.CodeInvalidArgument, "requests: %d given, at most %d allowed", len(reqs), maxBatch)
	}
	out := make([]*dsecv1.BatchRollbackItem, len(reqs))
	for i, r := range reqs {
		out[i] = &dsecv1.BatchRollbackItem{SandboxId: r.GetSandboxId()}
	}
	groups := groupByNode(len(reqs), func(i int) (route, error) {
		r := reqs[i]
		if r == nil {
			return route{}, errf(connect.CodeInvalidArgument, "requests[%d]: empty", i)
		}
		if r.GetCheckpointId() == "" && r.GetSeq() == 0 {
			return route{}, errf(connect.CodeInvalidArgument, "requests[%d].checkpoint_id: required", i)
		}
		return s.live(p, r.GetSandboxId(), r.GetSeq())
	}, func(i int, err error) {
		s.metrics.fail("rollback", err)
		out[i].Error = s.itemError(err)
	})
	eachGroup(groups, func(g *nodeGroup) {
		items := make([]*dsecv1.RollbackRequest, len(g.index))
		for j, i := range g.index {
			items[j] = reqs[i]
		}
		cctx, cancel := callContext(ctx, execSlack+edgeCallTimeout)
		defer cancel()
		resp, err := s.edges.get(g.rt.url).BatchRollbackOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeBatchRollbackRequest{
			Caller: callerOf(p), Request: &dsecv1.BatchRollbackRequest{Requests: items},
		}))
		for j, i := range g.index {
			switch {
			case err != nil:
				out[i].Error = s.itemError(edgeFailure(g.rt.node, err))
			case j >= len(resp.Msg.GetResults()):
				out[i].Error = s.itemError(errf(connect.CodeInternal, "node %s returned %d results for %d requests", g.rt.node, len(resp.Msg.GetResults()), len(items)))
			default:
				r := resp.Msg.GetResults()[j]
				out[i].Result, out[i].Error = r.GetResult(), r.GetError()
			}
		}
	})
	return connect.NewResponse(&dsecv1.BatchRollbackResponse{Results: out}), nil
}

// batchDestroy destroys (or, for pooled specs, releases back to their
// pool: the edge decides) every sandbox named.
func (s *Server) batchDestroy(ctx context.Context, p iam.Principal, ids []string) ([]*dsecv1.BatchDestroyResult, error) {
	if len(ids) > maxBatch {
		return nil, errf(connect.CodeInvalidArgument, "ids: %d given, at most %d allowed", len(ids), maxBatch)
	}
	results := make([]*dsecv1.BatchDestroyResult, len(ids))
	sem := make(chan struct{}, fanout)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			results[i] = &dsecv1.BatchDestroyResult{Id: id}
			if err := s.destroy(ctx, p, id); err != nil {
				s.metrics.fail("destroy", err)
				results[i].Error = s.itemError(err)
			}
		}()
	}
	wg.Wait()
	return results, nil
}
