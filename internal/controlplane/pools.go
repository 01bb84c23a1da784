package controlplane

import (
	"context"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/ids"
)

// PoolService (issue 6): warm pools live on edges; the server places a new
// pool on a node like a sandbox (its ID names the node), lists them by
// asking every live edge, and learns their keys and ready counts from
// heartbeats to route matching creates (see Server.place).

type poolService struct{ s *Server }

// maxPoolSize is the edge's bound on a pool's size.
const maxPoolSize = 4096

// poolKeyOf is edge.PoolKey: servers and edges must agree on it.
func poolKeyOf(backend string, layers []string, res *dsecv1.Resources, env []string) string {
	return edge.PoolKey(backend, layers, res, env)
}

// poolToUser rewrites a pool from an edge for display (image names as its
// owner wrote them).
func poolToUser(p *dsecv1.Pool) *dsecv1.Pool {
	if p == nil || p.Spec == nil {
		return p
	}
	sb := toUser(&dsecv1.Sandbox{Tenant: p.Tenant, Spec: p.Spec})
	p.Spec = sb.Spec
	return p
}

func (ps *poolService) Create(ctx context.Context, req *connect.Request[dsecv1.CreatePoolRequest]) (*connect.Response[dsecv1.CreatePoolResponse], error) {
	s := ps.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if req.Msg.GetSize() < 1 {
		return nil, errf(connect.CodeInvalidArgument, "size: %d must be at least 1", req.Msg.GetSize())
	}
	prep, err := s.prepare(ctx, p, req.Msg.GetSpec())
	if err != nil {
		return nil, err
	}
	quota, err := s.quotaOf(ctx, p)
	if err != nil {
		return nil, err
	}
	if req.Msg.GetSize() > maxPoolSize {
		return nil, errf(connect.CodeInvalidArgument, "size: %d is above %d", req.Msg.GetSize(), maxPoolSize)
	}
	// Placed like one sandbox of the spec, but charged to the tenant's
	// quota for its whole size: a tenant's pool keeps that many
	// sandboxes ready besides those taken from it, and they count
	// against its quota for as long as the pool lives (heartbeats carry
	// the charge; this reservation covers the time until the first).
	// The edge charges the pool's sandboxes to its capacity itself.
	res, err := s.reserve(prep.placeReq(p, quota, int64(req.Msg.GetSize())))
	if err != nil {
		return nil, toConnect(err)
	}
	edgeReq := &dsecv1.CreatePoolRequest{
		Spec: prep.edge, Size: req.Msg.GetSize(), MinSize: req.Msg.GetMinSize(), IdleShrink: req.Msg.GetIdleShrink(),
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(res.url).CreatePoolOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeCreatePoolRequest{
		Caller: callerOf(p), PoolId: res.id, Request: edgeReq, Limits: prep.limits.Proto(), Resolved: prep.resolved,
	}))
	if err != nil {
		s.reg.release(res.id)
		return nil, edgeFailure(res.node, err)
	}
	s.reg.completed(res.id)
	return connect.NewResponse(&dsecv1.CreatePoolResponse{Pool: poolToUser(resp.Msg.GetPool())}), nil
}

func (ps *poolService) List(ctx context.Context, _ *connect.Request[dsecv1.ListPoolsRequest]) (*connect.Response[dsecv1.ListPoolsResponse], error) {
	s := ps.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	live, _ := s.reg.snapshot()
	var (
		mu    sync.Mutex
		pools []*dsecv1.Pool
		wg    sync.WaitGroup
		errs  []error
	)
	for _, ref := range live {
		wg.Go(func() {
			cctx, cancel := callContext(ctx, edgeCallTimeout)
			defer cancel()
			resp, err := s.edges.get(ref.url).ListPoolsOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeListRequest{Caller: callerOf(p)}))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, edgeFailure(ref.id, err))
				return
			}
			for _, pl := range resp.Msg.GetPools() {
				pools = append(pools, poolToUser(pl))
			}
		})
	}
	wg.Wait()
	if len(errs) > 0 && len(pools) == 0 {
		return nil, errs[0]
	}
	slices.SortFunc(pools, func(a, b *dsecv1.Pool) int { return strings.Compare(a.Id, b.Id) })
	return connect.NewResponse(&dsecv1.ListPoolsResponse{Pools: pools}), nil
}

func (ps *poolService) Delete(ctx context.Context, req *connect.Request[dsecv1.DeletePoolRequest]) (*connect.Response[dsecv1.DeletePoolResponse], error) {
	s := ps.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	id := req.Msg.GetId()
	if id == "" {
		return nil, errf(connect.CodeInvalidArgument, "id: required")
	}
	if _, err := ids.NodeOf(id); err != nil {
		return nil, errf(connect.CodeInvalidArgument, "id: %w", err)
	}
	rt, err := s.reg.route(id)
	if err != nil {
		return nil, errf(connect.CodeInvalidArgument, "id: %w", err)
	}
	if !rt.alive {
		return nil, errf(connect.CodeNotFound, "pool %q not found (its node %s is not responding)", id, rt.node)
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	if _, err := s.edges.get(rt.url).DeletePoolOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeDeletePoolRequest{Caller: callerOf(p), PoolId: id})); err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	s.reg.forgetPool(id)
	return connect.NewResponse(&dsecv1.DeletePoolResponse{}), nil
}
