package edge

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"

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
// hold the create for a sandbox a fresh create does not need). How many it
// keeps ready follows the tenant's demand as the automatic pools' caps do,
// more simply: at least Config.AutoPool, and grown to the most container
// sandboxes the tenant has had on the node at once, so that what an RL
// job's 200 rollouts in flight hand back is kept for the next 200 creates
// (a fixed cap of 64 tore down a third of it); never beyond what the
// node's capacity leaves beside other tenants' sandboxes, and grown only
// while half the node's available memory would hold that many idle
// sandboxes (growable). It empties after autoPoolIdle without a create by
// the tenant and is dropped once empty (the next one starts at the
// floor). Ready sandboxes are not charged to the node's capacity, as
// automatic pools' are not; they are in heartbeats under RebaseKey, so
// that servers send the tenant's creates of any container spec to a node
// that can rebase one. Sandboxes never cross tenants, nor user-namespace
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
	return tenant + "/" + RebaseKey(userNS)
}

// RebaseKey is the pool key under which heartbeats report a tenant's
// rebase pool: a ready sandbox there serves a create of any container spec
// of the tenant with that user-namespace mode. Spec keys (PoolKey) are
// hex digests, so they never take this form.
func RebaseKey(userNS bool) string {
	return "rebase/userns=" + strconv.FormatBool(userNS)
}

// rebasePool is a tenant's rebase pool.
type rebasePool struct {
	p      *pool.Pool
	tenant string
	userNS bool
}

// quiesce is the rebase pools' reset (pool.Options.Reset): a parked
// sandbox's processes and IPC go now, its root when it is rebased.
func quiesce(ctx context.Context, s runtime.Sandbox) error {
	return s.(runtime.Rebaser).Quiesce(ctx)
}

// rebasePoolFor returns sb's tenant's rebase pool, creating it, or nil when
// sb cannot be rebased later: recycling is off, the node is closing, sb is
// not recyclable (see recyclable) or its runtime cannot rebase. The caller
// has found no automatic or explicit pool for sb, which is still charged
// to the node. The pool's cap grows to the tenant's demand (see above).
func (e *Edge) rebasePoolFor(sb *sandbox, rs runtime.Sandbox) *pool.Pool {
	// Container sandboxes only: a rebase pool's demand is its tenant's
	// container sandboxes (tenantContainers), and only the container
	// backend's sandboxes rebase so far.
	if e.cfg.AutoPool <= 0 || sb.kind != runtime.KindContainer || !recyclable(sb, rs) {
		return nil
	}
	if _, ok := rs.(runtime.Rebaser); !ok {
		return nil
	}
	key := rebasePoolKey(sb.tenant, sb.rspec.UserNamespace)
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	rp := e.rebasePools[key]
	size := 0
	if rp != nil {
		size = rp.p.Stats().Size
	}
	// The tenant's container sandboxes here, sb included, and the room
	// the other tenants' leave.
	mine := e.tenantContainers[sb.tenant]
	others := max(e.used[runtime.KindContainer].Sandboxes-int64(mine), 0)
	room := e.cfg.Capacity[runtime.KindContainer].Sandboxes - others
	want := max(int(min(int64(mine), room)), e.cfg.AutoPool)
	if rp == nil {
		rp = &rebasePool{tenant: sb.tenant, userNS: sb.rspec.UserNamespace}
		rp.p = pool.New(pool.Options{
			Recycle: true, Size: growable(want, 0, e.cfg.AutoPool), IdleShrink: autoPoolIdle,
			Reset:  quiesce,
			Logger: e.log.With("pool", rebasePoolPrefix+key, "tenant", sb.tenant),
		})
		e.rebasePools[key] = rp
		e.mu.Unlock()
		return rp.p
	}
	e.mu.Unlock()
	// Outside e.mu (growable may read /proc/meminfo): a concurrent destroy
	// may resize to an older cap meanwhile; the next one sets it right.
	if want > size {
		if n := growable(want, size, e.cfg.AutoPool); n > size {
			rp.p.Resize(n)
		}
	}
	return rp.p
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
	p, rs := e.takeForRebase(sb)
	if rs == nil {
		return nil
	}
	// Out of the pool's books for good: once rebased the sandbox is no
	// pool's (its destroy may hand it to an automatic pool, or tear it
	// down), and one the pool still counted in use would stay in its books
	// for ever and keep it from being swept.
	p.Detach(rs)
	spec := sb.rspec
	spec.Hostname = runtime.HostnameFor(sb.id)
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

// roomToKeep reports whether a sandbox of kind being destroyed, still
// charged to the node, may be kept idle in an automatic or rebase pool:
// the node's live sandboxes of kind and the idle ones of those pools (not
// charged to capacity; each holds an agent, mounts and ~20 of the edge's
// descriptors) must stay within the kind's sandbox capacity, which the
// open-file limit bounds. Each pool's cap is bounded on its own; this
// bounds their sum, which many hot specs, or many tenants, could push past
// the node's descriptors. The idle count is summed over every pool at
// most every idleSumEvery (a node can hold a thousand pools, and this
// runs on every destroy), so it may lag by what that window's destroys
// and creates moved.
func (e *Edge) roomToKeep(kind runtime.Kind) bool {
	e.mu.Lock()
	live := e.used[kind].Sandboxes
	capa := e.cfg.Capacity[kind].Sandboxes
	e.mu.Unlock()
	return live+e.idleSum() <= capa
}

// idleSumEvery is how long roomToKeep reuses a sum of idle sandboxes.
const idleSumEvery = 20 * time.Millisecond

// idleSum is the sandboxes ready or being reset in automatic and rebase
// pools, summed at most every idleSumEvery.
func (e *Edge) idleSum() int64 {
	e.idleMu.Lock()
	defer e.idleMu.Unlock()
	if now := time.Now(); now.Sub(e.idleAt) >= idleSumEvery {
		e.mu.Lock()
		pools := make([]*pool.Pool, 0, len(e.autoPools)+len(e.rebasePools))
		for _, wp := range e.autoPools {
			pools = append(pools, wp.p)
		}
		for _, rp := range e.rebasePools {
			pools = append(pools, rp.p)
		}
		e.mu.Unlock()
		n := int64(0)
		for _, p := range pools {
			st := p.Stats()
			n += int64(st.Ready + st.Resetting)
		}
		e.idle, e.idleAt = n, now
	}
	return e.idle
}

// takeForRebase takes a sandbox of sb's tenant to rebase onto sb's spec,
// never waiting: a quiesced one of the tenant's rebase pool, else a ready
// one of one of the tenant's automatic pools, the pool whose spec was
// created longest ago first. A spec is hot after two creates, so in a job
// whose specs each come back once or twice its automatic pools fill with
// sandboxes nobody asks for again; until the pools empty (autoPoolIdle)
// they would sit idle while other specs' creates started new agents (one
// run of 1,000 cycles in which every spec was the previous run's: 823 of
// 1,000 creates fresh, 1,020 idle sandboxes held).
func (e *Edge) takeForRebase(sb *sandbox) (*pool.Pool, runtime.Sandbox) {
	type cand struct {
		p    *pool.Pool
		last time.Time
	}
	var autos []cand
	e.mu.Lock()
	rp := e.rebasePools[rebasePoolKey(sb.tenant, sb.rspec.UserNamespace)]
	for ak, wp := range e.autoPools {
		if wp.tenant == sb.tenant {
			autos = append(autos, cand{wp.p, e.recent[ak].last})
		}
	}
	e.mu.Unlock()
	if rp != nil {
		if rs := rp.p.TryTake(); rs != nil {
			return rp.p, rs
		}
	}
	// Most of a busy tenant's automatic pools have nothing ready: only
	// those that do are ordered.
	ready := autos[:0]
	for _, c := range autos {
		if c.p.Stats().Ready > 0 {
			ready = append(ready, c)
		}
	}
	slices.SortFunc(ready, func(a, b cand) int { return a.last.Compare(b.last) })
	for _, c := range ready {
		if rs := c.p.TryTake(); rs != nil {
			return c.p, rs
		}
	}
	return nil, nil
}

// sweepRebasePools closes rebase pools that have emptied after going idle.
// Called by the reaper with sweepAutoPools.
func (e *Edge) sweepRebasePools(ctx context.Context) {
	var idle []*pool.Pool
	e.mu.Lock()
	for key, rp := range e.rebasePools {
		if st := rp.p.Stats(); st.Alive() == 0 && st.Target < st.Size {
			delete(e.rebasePools, key)
			idle = append(idle, rp.p)
		}
	}
	e.mu.Unlock()
	for _, p := range idle {
		p.Close(ctx) // a Put racing this destroys its sandbox: safe
	}
}

// rebaseSummaries describes, for heartbeats, what each tenant has ready to
// rebase (RebaseKey): its rebase pool's ready sandboxes and its automatic
// pools' (which takeForRebase also takes). Only the rebase pool's own
// size is reported.
func (e *Edge) rebaseSummaries() []*dsecv1.PoolSummary {
	type tally struct{ ready, size int32 }
	e.mu.Lock()
	pools := slices.Collect(maps.Values(e.rebasePools))
	autos := slices.Collect(maps.Values(e.autoPools))
	e.mu.Unlock()
	// Automatic pools hold sandboxes of container specs, which have no
	// user namespace (the container backend refuses them).
	by := map[string]*tally{}
	at := func(tenant string, userNS bool) *tally {
		k := rebasePoolKey(tenant, userNS)
		if by[k] == nil {
			by[k] = &tally{}
		}
		return by[k]
	}
	for _, rp := range pools {
		st := rp.p.Stats()
		t := at(rp.tenant, rp.userNS)
		t.ready += int32(st.Ready)
		t.size += int32(st.Size)
	}
	for _, wp := range autos {
		if st := wp.p.Stats(); st.Ready > 0 {
			at(wp.tenant, false).ready += int32(st.Ready)
		}
	}
	out := make([]*dsecv1.PoolSummary, 0, len(by))
	for _, k := range slices.Sorted(maps.Keys(by)) {
		tenant, key, _ := strings.Cut(k, "/")
		t := by[k]
		out = append(out, &dsecv1.PoolSummary{Id: rebasePoolPrefix + k, Tenant: tenant, Key: key, Ready: t.ready, Size: t.size})
	}
	return out
}
