package edge

import (
	"context"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// A recycler reuses runtime sandboxes across the node's sandboxes: a create
// takes a runtime one of them holds ready instead of calling its backend's
// Create, and a destroy hands the runtime to one that keeps it instead of
// destroying it. The node's kinds of pool are recyclers, asked in order
// (Edge.recyclers):
//
//   - warmRecycler: the pools callers make (pools.go), whose ready
//     sandboxes are charged to the node, so a create takes from them before
//     admission turns that charge into the sandbox's own;
//   - autoRecycler: the automatic pools, per tenant and hot spec, of
//     destroyed sandboxes reset in place (autopool.go);
//   - rebaseRecycler: per tenant, destroyed sandboxes quiesced for the
//     next create of any spec (rebase.go).
//
// Backends take part through what their sandboxes implement, not through
// their kind: runtime.Resetter for warm and automatic pools,
// runtime.Rebaser for rebase pools. The fncall pools are not recyclers:
// they serve calls, not sandbox records (fncall.go).
type recycler interface {
	// source labels the creates it serves (the creates metric).
	source() string
	// beforeAdmission says take runs before the create is admitted.
	beforeAdmission() bool
	// take returns a runtime for c's sandbox, ready to run it, or nil when
	// it has none. Before admission c.sb.rspec is not set yet.
	take(ctx context.Context, c *claim) runtime.Sandbox
	// keep takes rs, the runtime of sb, which is being destroyed, was no
	// pool's, is not frozen and the node has room to keep; false leaves
	// rs to the caller to destroy.
	keep(sb *sandbox, rs runtime.Sandbox) bool
}

// claim is one create's request to the recyclers.
type claim struct {
	caller *dsecv1.Caller
	sb     *sandbox
	// key is the spec's PoolKey.
	key string
	// pool is set by take when the runtime stays its pool's (a warm or
	// automatic pool, which gets it back when the sandbox ends).
	pool *warmPool
}

// recyclersOf are the node's recyclers, in the order creates ask them.
func recyclersOf(e *Edge) []recycler {
	return []recycler{warmRecycler{e}, autoRecycler{e}, rebaseRecycler{e}}
}

// takeFromRecyclers asks the recyclers that take at this point of a create
// (before admission or after it) for a runtime; it returns nil and "" when
// none has one.
func (e *Edge) takeFromRecyclers(ctx context.Context, c *claim, beforeAdmission bool) (runtime.Sandbox, string) {
	for _, r := range e.recyclers {
		if r.beforeAdmission() != beforeAdmission {
			continue
		}
		if rs := r.take(ctx, c); rs != nil {
			return rs, r.source()
		}
	}
	return nil, ""
}

// keepInRecyclers offers the runtime of sb, being destroyed, to each
// recycler in turn; false: nobody kept it.
func (e *Edge) keepInRecyclers(sb *sandbox, rs runtime.Sandbox) bool {
	for _, r := range e.recyclers {
		if r.keep(sb, rs) {
			return true
		}
	}
	return false
}

// warmRecycler takes from the pools callers made; their sandboxes go back
// to them through sandbox.pool, so it keeps nothing else.
type warmRecycler struct{ e *Edge }

func (warmRecycler) source() string        { return "pool" }
func (warmRecycler) beforeAdmission() bool { return true }

func (r warmRecycler) take(ctx context.Context, c *claim) runtime.Sandbox {
	r.e.mu.Lock()
	var cands []*warmPool
	for _, wp := range r.e.pools {
		if wp.key == c.key && wp.serves(c.caller) {
			cands = append(cands, wp)
		}
	}
	r.e.mu.Unlock()
	for _, wp := range cands {
		if rs, err := wp.p.TakeWarm(ctx); rs != nil && err == nil {
			c.pool = wp
			return rs
		}
	}
	return nil
}

func (warmRecycler) keep(*sandbox, runtime.Sandbox) bool { return false }

// autoRecycler is the automatic pools. Its take runs for every create no
// warm pool served: it is where the spec's demand is counted.
type autoRecycler struct{ e *Edge }

func (autoRecycler) source() string        { return "recycled" }
func (autoRecycler) beforeAdmission() bool { return true }

func (r autoRecycler) take(ctx context.Context, c *claim) runtime.Sandbox {
	r.e.noteCreate(c.caller.GetTenant(), c.key)
	wp, rs := r.e.takeRecycled(ctx, c.caller, c.key)
	if rs != nil {
		c.pool = wp
	}
	return rs
}

func (r autoRecycler) keep(sb *sandbox, rs runtime.Sandbox) bool {
	wp := r.e.autoPoolFor(sb, rs)
	if wp == nil {
		return false
	}
	// Reset in place in the background, then ready for the next create
	// (or destroyed if the pool is full).
	wp.p.Put(rs)
	return true
}

// rebaseRecycler is the rebase pools: a runtime taken from one is rebased
// onto the new sandbox's spec and belongs to no pool.
type rebaseRecycler struct{ e *Edge }

func (rebaseRecycler) source() string        { return sourceRebased }
func (rebaseRecycler) beforeAdmission() bool { return false }

func (r rebaseRecycler) take(ctx context.Context, c *claim) runtime.Sandbox {
	rs := r.e.takeRebased(ctx, c.sb)
	if rs != nil {
		// It keeps its runtime ID, as a recycled one does; its hostname
		// is the sandbox's ID, kept for a rollback.
		c.sb.rspec.ID, c.sb.rspec.Hostname = rs.ID(), runtime.HostnameFor(c.sb.id)
	}
	return rs
}

func (r rebaseRecycler) keep(sb *sandbox, rs runtime.Sandbox) bool {
	p := r.e.rebasePoolFor(sb, rs)
	if p == nil {
		return false
	}
	// Quiesced in the background, then ready to be rebased (or destroyed
	// if the pool is full).
	p.Put(rs)
	return true
}
