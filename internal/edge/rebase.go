package edge

import (
	"context"
	"errors"
	"strconv"

	"github.com/dsec-dev/dsec/internal/pool"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Rebasing (recycling across specs). Automatic pools reuse a destroyed
// sandbox only for its own hot spec. In an RL job whose every task has its
// own workspace layer no two sandboxes share a spec, so every create would
// start a new agent, namespaces, cgroup and overlay (~33 ms of CPU per
// create/exec/destroy cycle on a 2-core node) although a sandbox of the
// same tenant was torn down a moment before. So a destroyed container
// sandbox that no automatic or explicit pool takes goes to its tenant's
// rebase pool instead: quiesced in the background (runtime.Rebaser: every
// user process killed and reaped, IPC cleared; the root file system is left
// for later), and taken by the tenant's next create that no warm or
// recycled sandbox serves, which rebases it onto its own spec (a fresh
// writable layer over the new layers, the new hostname, resources, env,
// workdir and user) for the cost of a reset.
//
// A rebase pool never creates and never waits: a create finds a quiesced
// sandbox ready or creates fresh (waiting for a quiesce in flight would
// hold the create for a sandbox a fresh create does not need). It keeps up
// to Config.AutoPool ready, fewer when half the node's available memory
// would not hold that many idle sandboxes, empties after autoPoolIdle
// without a create by the tenant, and is dropped once empty. Ready
// sandboxes are not charged to the node's capacity, as automatic pools'
// are not, and are not in heartbeats (they match no spec key; servers have
// no use for them yet). Sandboxes never cross tenants, nor user-namespace
// modes (a Rebase cannot change that mode). A rebased sandbox keeps the
// runtime ID of the sandbox it was created as (rollback re-creates under
// it, as for recycled ones), but its hostname is its own sandbox ID, kept
// in its runtime spec so that a rollback keeps it too. Destroyed, it goes
// through autoPoolFor like any sandbox built by the backend (its new spec
// may be hot), and else back to the rebase pool.

// rebasePoolPrefix names rebase pools in logs.
const rebasePoolPrefix = "rebase-"

// rebasePoolKey keys the rebase pools: one per tenant and user-namespace
// mode.
func rebasePoolKey(tenant string, userNS bool) string {
	return tenant + "/userns=" + strconv.FormatBool(userNS)
}

// quiesce is the rebase pools' reset (pool.Options.Reset): a parked
// sandbox's processes and IPC go now, its root when it is rebased.
func quiesce(ctx context.Context, s runtime.Sandbox) error {
	return s.(runtime.Rebaser).Quiesce(ctx)
}

// rebasePoolSize is how many quiesced sandboxes a rebase pool may keep
// ready: Config.AutoPool, fewer when half the node's available memory would
// not hold that many idle sandboxes (readyFootprint each).
func rebasePoolSize(autoPool int) int {
	avail, err := memAvailable()
	if err != nil {
		return autoPool
	}
	return max(min(autoPool, int(avail/2/readyFootprint)), 0)
}

// rebasePoolFor returns sb's tenant's rebase pool, creating it, or nil when
// sb cannot be rebased later: recycling is off, the node is closing, sb is
// not recyclable (see recyclable) or its runtime cannot rebase. The caller
// has found no automatic or explicit pool for sb.
func (e *Edge) rebasePoolFor(sb *sandbox, rs runtime.Sandbox) *pool.Pool {
	if e.cfg.AutoPool <= 0 || !recyclable(sb, rs) {
		return nil
	}
	if _, ok := rs.(runtime.Rebaser); !ok {
		return nil
	}
	key := rebasePoolKey(sb.tenant, sb.rspec.UserNamespace)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	if p := e.rebasePools[key]; p != nil {
		return p
	}
	// Memory is read under e.mu here, but only once per pool.
	p := pool.New(pool.Options{
		Recycle: true, Size: rebasePoolSize(e.cfg.AutoPool), IdleShrink: autoPoolIdle,
		Reset:  quiesce,
		Logger: e.log.With("pool", rebasePoolPrefix+key, "tenant", sb.tenant),
	})
	e.rebasePools[key] = p
	return p
}

// takeRebased takes a quiesced sandbox of sb's tenant's rebase pool, if
// one is ready, and rebases it onto sb.rspec (whose ID, sb's, becomes its
// hostname); it returns nil when none is ready or the rebase failed (the
// create then builds a fresh sandbox). sb is a container sandbox being
// created that no warm or recycled sandbox serves.
func (e *Edge) takeRebased(ctx context.Context, sb *sandbox) runtime.Sandbox {
	if e.cfg.AutoPool <= 0 || sb.kind != runtime.KindContainer {
		return nil
	}
	e.mu.Lock()
	p := e.rebasePools[rebasePoolKey(sb.tenant, sb.rspec.UserNamespace)]
	e.mu.Unlock()
	if p == nil {
		return nil
	}
	rs := p.TryTake()
	if rs == nil {
		return nil
	}
	// Out of the pool's books for good: once rebased the sandbox is no
	// pool's (its destroy may hand it to an automatic pool, or tear it
	// down), and one the pool still counted in use would stay in its books
	// for ever and keep it from being swept.
	p.Detach(rs)
	spec := sb.rspec
	spec.Hostname = hostnameOf(sb.id)
	err := rs.(runtime.Rebaser).Rebase(ctx, spec)
	switch {
	case err == nil:
		return rs
	case errors.Is(err, runtime.ErrInvalidSpec):
		// Refused before anything changed: still a quiesced sandbox of
		// the tenant. The fresh create will say what is wrong with spec.
		p.Put(rs)
	default:
		e.log.Warn("rebase failed; creating a fresh sandbox instead", "sandbox", sb.id, "runtime_id", rs.ID(), "err", err)
		if derr := rs.Destroy(context.WithoutCancel(ctx)); derr != nil {
			e.log.Warn("destroy a sandbox whose rebase failed", "runtime_id", rs.ID(), "err", derr)
		}
	}
	return nil
}

// hostnameOf is the hostname of sandbox id, as the backends derive it from
// an ID when a spec names none: the ID, cut to 63 bytes.
func hostnameOf(id string) string {
	if len(id) > 63 {
		return id[:63]
	}
	return id
}

// sweepRebasePools closes rebase pools that have emptied after going idle.
// Called by the reaper with sweepAutoPools.
func (e *Edge) sweepRebasePools(ctx context.Context) {
	var idle []*pool.Pool
	e.mu.Lock()
	for key, p := range e.rebasePools {
		if st := p.Stats(); st.Alive() == 0 && st.Target < st.Size {
			delete(e.rebasePools, key)
			idle = append(idle, p)
		}
	}
	e.mu.Unlock()
	for _, p := range idle {
		p.Close(ctx) // a Put racing this destroys its sandbox: safe
	}
}
