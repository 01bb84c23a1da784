package edge

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/pool"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Warm pools (issue 6): a pool keeps sandboxes of one spec created and
// clean ahead of demand. A create whose spec has the pool's key takes one
// in the time of a map lookup; destroying it hands it back, and the pool
// resets it in place (runtime.Resetter) and keeps it if it wants more.

const (
	maxPoolSize        = 4096
	defaultIdleShrink  = 10 * time.Minute
	poolFillConcurrent = 2
)

// PoolKey is what makes two fresh sandboxes interchangeable: backend,
// layer digests (bottom first), resources and extra env. Callers pass the
// limits (defaults filled in: spec.Resolve), so that a spec that left
// them to the defaults and one that spelled out the same values share
// pools (the kernel holds them to the same limits; what each charges the
// node, its requests, is the sandbox's own, not the pool's). Labels, ttl and
// idle settings are a sandbox's own and not part of it. Servers compute
// the same key to route a create to a node holding a matching pool.
func PoolKey(backend string, layers []string, res *dsecv1.Resources, env []string) string {
	if backend == "" {
		backend = string(runtime.KindContainer)
	}
	h := sha256.New()
	field := func(s string) { fmt.Fprintf(h, "%d:%s;", len(s), s) }
	field(backend)
	for _, l := range layers {
		field(l)
	}
	field("|")
	field(strconv.FormatInt(res.GetMilliCpu(), 10))
	field(strconv.FormatInt(res.GetMemoryBytes(), 10))
	field(strconv.FormatInt(res.GetPids(), 10))
	field(strconv.FormatInt(res.GetDiskBytes(), 10))
	for _, e := range env {
		field(e)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// warmPool is one pool of this node. Fields never change after creation.
type warmPool struct {
	id, tenant, key string
	kind            runtime.Kind
	spec            *dsecv1.SandboxSpec
	layers          []string
	// req is what each sandbox the pool holds charges the node: the
	// requests of the spec it was created with (its limits are spec's
	// resources, what a tenant's pool charges its quota).
	req           placement.Capacity
	size, minSize int
	idleShrink    time.Duration
	p             *pool.Pool
	n             atomic.Int64
}

// held is how many of the pool's sandboxes are the pool's (not handed out):
// they count against the node's capacity.
func (wp *warmPool) held() int64 {
	st := wp.p.Stats()
	return int64(st.Ready + st.Resetting + st.Creating)
}

func (wp *warmPool) toProto(node string) *dsecv1.Pool {
	st := wp.p.Stats()
	return &dsecv1.Pool{
		Id: wp.id, Spec: wp.spec, Size: int32(st.Size), Ready: int32(st.Ready), InUse: int32(st.InUse),
		Resetting: int32(st.Resetting), Node: node, Tenant: wp.tenant, MinSize: int32(wp.minSize),
		IdleShrink: durationpb.New(wp.idleShrink), Hits: st.Hits, Misses: st.Misses,
	}
}

// serves reports whether the pool may hand sandboxes to caller: its own
// tenant's, or any tenant's when the admin made it.
func (wp *warmPool) serves(caller *dsecv1.Caller) bool {
	return wp.tenant == "" || wp.tenant == caller.GetTenant()
}

// pooledLocked is what pools hold of kind's capacity; the caller holds mu.
func (e *Edge) pooledLocked(kind runtime.Kind) placement.Capacity {
	var c placement.Capacity
	for _, wp := range e.pools {
		if wp.kind != kind {
			continue
		}
		n := wp.held()
		c.MilliCPU += n * wp.req.MilliCPU
		c.MemoryBytes += n * wp.req.MemoryBytes
		c.Sandboxes += n
	}
	return c
}

// dropRuntime destroys a sandbox's runtime sandbox and, if it came from a
// pool, counts it out of the pool.
func dropRuntime(ctx context.Context, wp *warmPool, rs runtime.Sandbox) error {
	err := rs.Destroy(ctx)
	if wp != nil {
		wp.p.Discard(rs)
	}
	return err
}

func (e *Edge) createPool(ctx context.Context, caller *dsecv1.Caller, id string, req *dsecv1.CreatePoolRequest, limits *dsecv1.Resources, sent *dsecv1.ResolvedImages) (*dsecv1.Pool, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	if req == nil {
		return nil, invalid("request is required")
	}
	size, minSize := int(req.Size), int(req.MinSize)
	switch {
	case size < 1 || size > maxPoolSize:
		return nil, invalid("size %d is outside [1, %d]", req.Size, maxPoolSize)
	case minSize < 0 || minSize > size:
		return nil, invalid("min_size %d is outside [0, size %d]", req.MinSize, req.Size)
	}
	if err := checkDuration("idle_shrink", req.IdleShrink); err != nil {
		return nil, err
	}
	shrink := req.IdleShrink.AsDuration()
	if req.IdleShrink == nil || shrink == 0 {
		shrink = defaultIdleShrink
	}
	spec, nodeReq, err := e.validateSpec(id, req.Spec, limits)
	if err != nil {
		return nil, err
	}
	kind := runtime.Kind(spec.Backend)
	rspec, digests, err := e.resolveSpec(ctx, id, spec, sent)
	if err != nil {
		return nil, err
	}
	wp := &warmPool{
		id: id, tenant: caller.Tenant, kind: kind, spec: spec, layers: digests,
		key:  PoolKey(spec.Backend, digests, spec.Resources, spec.Env),
		req:  nodeReq,
		size: size, minSize: minSize, idleShrink: shrink,
	}
	if caller.Admin {
		wp.tenant = ""
	}
	backend := e.cfg.Backends[kind]
	wp.p = pool.New(pool.Options{
		New: func(ctx context.Context) (runtime.Sandbox, error) {
			s := rspec
			s.ID = fmt.Sprintf("%s-%d", id, wp.n.Add(1))
			if err := e.poolRoom(wp); err != nil {
				return nil, err
			}
			return backend.Create(ctx, s)
		},
		Size: size, MinSize: minSize, IdleShrink: shrink,
		Fill: poolFillConcurrent, Logger: e.log.With("pool", id),
	})
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		wp.p.Close(context.WithoutCancel(ctx))
		return nil, fail.New(fail.Unavailable, fmt.Errorf("node %q is shutting down", e.cfg.NodeID))
	}
	if _, dup := e.pools[id]; dup {
		e.mu.Unlock()
		wp.p.Close(context.WithoutCancel(ctx))
		return nil, fail.New(fail.AlreadyExists, fmt.Errorf("pool %q already exists", id))
	}
	e.pools[id] = wp
	e.mu.Unlock()
	e.log.Info("pool created", "pool", id, "size", size, "tenant", wp.tenant)
	return wp.toProto(e.cfg.NodeID), nil
}

// poolRoom says whether the node has room for the pooled sandbox wp is
// making: pools fill only capacity that sandboxes do not use. That sandbox
// is charged already (held counts the pool's Creating): counting it again
// kept a pool from filling the node's last slot.
func (e *Edge) poolRoom(wp *warmPool) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if short := e.shortLocked(wp.kind, wp.req, true); short != "" {
		return fail.New(fail.ResourceExhausted, fmt.Errorf("node %q has no room to fill pool %q: out of %s", e.cfg.NodeID, wp.id, short))
	}
	return nil
}

func (e *Edge) listPools(caller *dsecv1.Caller) ([]*dsecv1.Pool, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	e.mu.Lock()
	pools := slices.Collect(maps.Values(e.pools))
	e.mu.Unlock()
	var out []*dsecv1.Pool
	for _, wp := range pools {
		if caller.Admin || wp.tenant == caller.Tenant {
			out = append(out, wp.toProto(e.cfg.NodeID))
		}
	}
	slices.SortFunc(out, func(a, b *dsecv1.Pool) int { return cmpString(a.Id, b.Id) })
	return out, nil
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// deletePool removes a pool: its ready sandboxes are destroyed; sandboxes
// taken from it live on and are destroyed when they end.
func (e *Edge) deletePool(ctx context.Context, caller *dsecv1.Caller, id string) error {
	if caller == nil {
		return invalid("caller is required")
	}
	e.mu.Lock()
	wp := e.pools[id]
	if wp == nil || !(caller.Admin || wp.tenant == caller.Tenant) {
		e.mu.Unlock()
		return fail.New(fail.NotFound, fmt.Errorf("pool %q not found", id))
	}
	delete(e.pools, id)
	e.mu.Unlock()
	if err := wp.p.Close(context.WithoutCancel(ctx)); err != nil {
		e.log.Warn("close pool", "pool", id, "err", err)
	}
	e.log.Info("pool deleted", "pool", id)
	return nil
}

// closePools closes every pool (node shutdown).
func (e *Edge) closePools(ctx context.Context) {
	e.mu.Lock()
	pools := slices.Collect(maps.Values(e.pools))
	pools = slices.AppendSeq(pools, maps.Values(e.autoPools))
	rebase := slices.Collect(maps.Values(e.rebasePools))
	clear(e.pools)
	clear(e.autoPools)
	clear(e.rebasePools)
	e.mu.Unlock()
	// Side by side: each pool's Close waits for its own destroys.
	var wg sync.WaitGroup
	for _, wp := range pools {
		wg.Go(func() { wp.p.Close(ctx) })
	}
	for _, rp := range rebase {
		wg.Go(func() { rp.p.Close(ctx) })
	}
	wg.Wait()
}

// poolSummaries describes the pools for heartbeats, and adds their layers
// to held (a pool's layers must survive GC like a sandbox's).
func (e *Edge) poolSummaries(held map[string]int) []*dsecv1.PoolSummary {
	e.mu.Lock()
	pools := slices.Collect(maps.Values(e.pools))
	explicit := len(pools)
	pools = slices.AppendSeq(pools, maps.Values(e.autoPools))
	e.mu.Unlock()
	out := make([]*dsecv1.PoolSummary, 0, len(pools))
	for i, wp := range pools {
		st := wp.p.Stats()
		ps := &dsecv1.PoolSummary{Id: wp.id, Tenant: wp.tenant, Key: wp.key, Ready: int32(st.Ready), Size: int32(st.Size)}
		if i < explicit && wp.tenant != "" {
			// A tenant's pool holds up to its size ready besides the
			// sandboxes taken from it: its quota is charged for them
			// (the node's own recycling is not anyone's).
			lim := wp.spec.GetResources()
			ps.Charged, ps.MilliCpu, ps.MemoryBytes = int32(wp.size), lim.GetMilliCpu(), lim.GetMemoryBytes()
		}
		out = append(out, ps)
		for _, l := range wp.layers {
			held[l]++
		}
	}
	return append(out, e.rebaseSummaries()...)
}

func (s *service) CreatePoolOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeCreatePoolRequest]) (*connect.Response[dsecv1.CreatePoolResponse], error) {
	p, err := s.e.createPool(ctx, req.Msg.Caller, req.Msg.PoolId, req.Msg.Request, req.Msg.Limits, req.Msg.Resolved)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.CreatePoolResponse{Pool: p}), nil
}

func (s *service) ListPoolsOnEdge(_ context.Context, req *connect.Request[dsecv1.EdgeListRequest]) (*connect.Response[dsecv1.ListPoolsResponse], error) {
	pools, err := s.e.listPools(req.Msg.Caller)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ListPoolsResponse{Pools: pools}), nil
}

func (s *service) DeletePoolOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeDeletePoolRequest]) (*connect.Response[dsecv1.DeletePoolResponse], error) {
	if err := s.e.deletePool(ctx, req.Msg.Caller, req.Msg.PoolId); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.DeletePoolResponse{}), nil
}
