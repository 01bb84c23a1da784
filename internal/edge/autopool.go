package edge

import (
	"context"
	"maps"
	"slices"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/pool"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Recycling (automatic pools). An RL job creates thousands of sandboxes of
// one spec and destroys each after its rollout. A create costs a fresh
// agent, namespaces, cgroups and an overlay (~20 ms of CPU on a 2-core
// node); a reset in place (runtime.Resetter: every process killed, a fresh
// overlay, IPC and /dev/shm emptied) costs 2–3 ms. So a destroyed container
// sandbox is not torn down but handed to an automatic pool for its tenant
// and spec key, reset in the background, and the next create of that spec
// by that tenant takes it (waiting for a reset in flight rather than
// creating). A pool keeps at most Config.AutoPool ready sandboxes, never
// creates any, and empties after autoPoolIdle without a create; only hot
// specs are recycled (created at least twice by the tenant within
// autoPoolIdle): in an RL job whose every task has its own workspace layer
// no two sandboxes share a spec, and holding each for reuse would only
// cost a reset and memory.
//
// Recycled sandboxes never cross tenants (a reset is thorough, but tenant
// isolation should not rest on it alone). A recycled sandbox's runtime ID,
// and so its hostname, is the first sandbox's. Ready sandboxes of automatic
// pools are not charged to the node's capacity (idle, they hold ~1.5 MB
// each and no CPU), but their keys and ready counts are in heartbeats so
// servers send a matching create to the node that can recycle one.

// DefaultAutoPool is the CLI's default for Config.AutoPool.
const DefaultAutoPool = 64

// autoPoolIdle: an automatic pool unused for this long destroys its ready
// sandboxes (the spec has gone cold).
const autoPoolIdle = 30 * time.Second

func autoPoolKey(tenant, key string) string { return tenant + "/" + key }

// recentCreate is when a (tenant, spec key) was last created and whether
// it was created again within autoPoolIdle of the time before (hot).
type recentCreate struct {
	last time.Time
	hot  bool
}

// noteCreate records a create of key by tenant, for hotness.
func (e *Edge) noteCreate(tenant, key string) {
	if e.cfg.AutoPool <= 0 {
		return
	}
	now := time.Now()
	ak := autoPoolKey(tenant, key)
	e.mu.Lock()
	defer e.mu.Unlock()
	r, seen := e.recent[ak]
	r.hot = seen && now.Sub(r.last) < autoPoolIdle
	r.last = now
	e.recent[ak] = r
}

// sweepAutoPools forgets specs not created for autoPoolIdle and closes
// automatic pools that have emptied after going idle. Called by the reaper.
func (e *Edge) sweepAutoPools(ctx context.Context) {
	now := time.Now()
	var idle []*warmPool
	e.mu.Lock()
	for ak, r := range e.recent {
		if now.Sub(r.last) >= autoPoolIdle {
			delete(e.recent, ak)
		}
	}
	for ak, wp := range e.autoPools {
		// Shrunk (idle for autoPoolIdle) and empty: nothing to recycle
		// into it until the spec is hot again.
		if st := wp.p.Stats(); st.Alive() == 0 && st.Target < st.Size {
			delete(e.autoPools, ak)
			idle = append(idle, wp)
		}
	}
	e.mu.Unlock()
	for _, wp := range idle {
		wp.p.Close(ctx) // a Put racing this destroys its sandbox: safe
	}
}

// autoPoolFor returns the automatic pool for sb's tenant and spec,
// creating it, or nil when sb cannot be recycled: recycling is off, the node
// is closing, sb is not a container sandbox, its runtime cannot reset, or
// its layers are no longer its spec's (rolled back to a checkpoint).
func (e *Edge) autoPoolFor(sb *sandbox, rs runtime.Sandbox) *warmPool {
	if e.cfg.AutoPool <= 0 || sb.kind != runtime.KindContainer {
		return nil
	}
	if _, ok := rs.(runtime.Resetter); !ok {
		return nil
	}
	if len(sb.rspec.Layers) != len(sb.layers) {
		return nil
	}
	for i, l := range sb.rspec.Layers {
		if l.Digest != sb.layers[i] {
			return nil
		}
	}
	select {
	case <-rs.Done():
		return nil
	default:
	}
	key := PoolKey(sb.spec.Backend, sb.layers, sb.spec.Resources, sb.spec.Env)
	ak := autoPoolKey(sb.tenant, key)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	if wp := e.autoPools[ak]; wp != nil {
		return wp
	}
	if !e.recent[ak].hot {
		return nil
	}
	id := "auto-" + key[:16]
	wp := &warmPool{
		id: id, tenant: sb.tenant, key: key, kind: sb.kind, spec: sb.spec, layers: sb.layers,
		req:        placement.Capacity{MilliCPU: sb.req.MilliCPU, MemoryBytes: sb.req.MemoryBytes, Sandboxes: 1},
		idleShrink: autoPoolIdle,
	}
	wp.p = pool.New(pool.Options{
		Recycle: true, Size: e.cfg.AutoPool, IdleShrink: autoPoolIdle,
		Logger: e.log.With("pool", id, "tenant", sb.tenant),
	})
	e.autoPools[ak] = wp
	return wp
}

// takeRecycled takes a recycled sandbox of the tenant's automatic pool for
// key, or waits for one being reset, or returns nils.
func (e *Edge) takeRecycled(ctx context.Context, caller *dsecv1.Caller, key string) (*warmPool, runtime.Sandbox) {
	e.mu.Lock()
	wp := e.autoPools[autoPoolKey(caller.GetTenant(), key)]
	e.mu.Unlock()
	if wp == nil {
		return nil, nil
	}
	if rs, err := wp.p.TakeWarm(ctx); rs != nil && err == nil {
		return wp, rs
	}
	return nil, nil
}

// autoPoolList returns the automatic pools.
func (e *Edge) autoPoolList() []*warmPool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Collect(maps.Values(e.autoPools))
}
