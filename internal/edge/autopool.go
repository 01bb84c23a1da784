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
// overlay, IPC and /dev/shm emptied) costs ~0.5 ms when the sandbox wrote
// nothing and 2–3 ms with a new overlay. So a destroyed container
// sandbox is not torn down but handed to an automatic pool for its tenant
// and spec key, reset in the background, and the next create of that spec
// by that tenant takes it (waiting for a reset in flight rather than
// creating). A pool never creates, and empties after autoPoolIdle without a
// create; only hot specs are recycled (created at least twice by the tenant
// within autoPoolIdle): in an RL job whose every task has its own workspace
// layer no two sandboxes share a spec, and holding each for reuse would only
// cost a reset and memory. Those go to their tenant's rebase pool instead,
// to serve creates of any spec (rebase.go).
//
// How many a pool keeps ready follows the spec's demand. A sandbox handed
// back to a pool that already has its cap ready or being reset is torn
// down, and the create it would have served starts a new agent instead:
// with 200 of a spec in flight and a fixed cap of 64, up to 40 % of the
// destroys were torn down and a third to half of the creates were fresh
// (and the teardowns queued behind the resets, hundreds deep). So the cap is the most sandboxes of
// the spec alive at once (its demand) over the last one to two
// autoPoolIdle windows: what comes back is kept because about as many
// creates follow. It is never below Config.AutoPool (the operator's floor),
// never above the container sandboxes the node's capacity leaves beside
// other specs' live ones, and grows only while the node's available memory
// could hold that many idle sandboxes twice over (readyFootprint each).
// When the demand falls the cap follows a window later and the extra ready
// sandboxes are destroyed; when the spec goes cold the pool empties.
//
// Recycled sandboxes never cross tenants (a reset is thorough, but tenant
// isolation should not rest on it alone). A recycled sandbox's runtime ID,
// and so its hostname, is the first sandbox's. Ready sandboxes of automatic
// pools are not charged to the node's capacity (idle, they hold ~1.5 MB
// each and no CPU), but their keys and ready counts are in heartbeats so
// servers send a matching create to the node that can recycle one.

// DefaultAutoPool is the CLI's default for Config.AutoPool: the least an
// automatic pool may keep ready, whatever its spec's demand.
const DefaultAutoPool = 64

// autoPoolPrefix starts the IDs of automatic pools.
const autoPoolPrefix = "auto-"

// autoPoolIdle: an automatic pool unused for this long destroys its ready
// sandboxes (the spec has gone cold); it is also the window over which a
// spec's demand is measured. A variable only so that tests can shorten it.
var autoPoolIdle = 30 * time.Second

// readyFootprint is what one idle recycled sandbox is taken to hold (its
// agent and overlay), for bounding a pool's cap by the node's available
// memory.
const readyFootprint = 2 << 20

func autoPoolKey(tenant, key string) string { return tenant + "/" + key }

// recentCreate is what the node remembers of a (tenant, spec key)'s recent
// creates: when it was last created and whether it was created again
// within autoPoolIdle of the time before (hot), and its demand.
type recentCreate struct {
	last time.Time
	hot  bool
	// The spec's sandboxes alive are its automatic pool's in use (taken
	// from it) and waiting to take one, plus unpooled (created fresh, not
	// yet destroyed). A create between noteCreate and takeRecycled's
	// count is missed for that moment: the peak is a max over many
	// observations, so it would rather miss than count a create twice.
	// unpooled mostly errs high (a create that fails after takeRecycled, a lost or
	// frozen sandbox is never destroyed through autoPoolFor), and the
	// sweep clamps it to what the node's layer counts allow; it errs low
	// only when the entry was forgotten (no create for autoPoolIdle) while
	// fresh sandboxes lived on, until they are gone. Either way only the
	// cap is off, never what a create gets.
	unpooled int
	// peak is the most alive at once since since, prevPeak the most in
	// the autoPoolIdle window before.
	peak, prevPeak int
	since          time.Time
}

// observe records that n of the spec's sandboxes are alive at now.
func (r *recentCreate) observe(now time.Time, n int) {
	if d := now.Sub(r.since); d >= autoPoolIdle {
		r.prevPeak = r.peak
		if d >= 2*autoPoolIdle {
			r.prevPeak = 0
		}
		r.peak, r.since = 0, now
	}
	r.peak = max(r.peak, n)
}

// demand is the most of the spec's sandboxes alive at once over the last
// one to two autoPoolIdle windows.
func (r recentCreate) demand() int { return max(r.peak, r.prevPeak) }

// noteCreate records a create of key by tenant, for hotness and demand,
// and resizes the spec's automatic pool when its cap has changed. Every
// call is followed by one takeRecycled for the same create.
func (e *Edge) noteCreate(tenant, key string) {
	if e.cfg.AutoPool <= 0 {
		return
	}
	now := time.Now()
	ak := autoPoolKey(tenant, key)
	e.mu.Lock()
	r, seen := e.recent[ak]
	r.hot = seen && now.Sub(r.last) < autoPoolIdle
	r.last = now
	wp := e.autoPools[ak]
	var st pool.Stats
	if wp != nil {
		st = wp.p.Stats()
	}
	r.observe(now, st.InUse+st.Waiting+r.unpooled+1) // +1: this create
	e.recent[ak] = r
	size := 0
	if wp != nil {
		size = e.autoPoolCapLocked(wp.kind, r, st.InUse)
	}
	e.mu.Unlock()
	if wp == nil || size == st.Size {
		return
	}
	// Outside e.mu: a concurrent create may resize to an older cap
	// meanwhile, and the next create sets it right.
	if size = growable(size, st.Size, e.cfg.AutoPool); size != st.Size {
		wp.p.Resize(size)
	}
}

// autoPoolCapLocked is the ready cap of the automatic pool of a spec with
// recent r and inUse sandboxes taken from the pool, before the memory bound
// (growable): its demand, at most the sandboxes of its kind the node's
// capacity leaves beside the other specs' live ones, at least
// Config.AutoPool. The caller holds e.mu.
func (e *Edge) autoPoolCapLocked(kind runtime.Kind, r recentCreate, inUse int) int {
	others := max(e.used[kind].Sandboxes-int64(inUse+r.unpooled), 0)
	room := e.cfg.Capacity[kind].Sandboxes - others
	return max(int(min(int64(r.demand()), room)), e.cfg.AutoPool)
}

// growable bounds a cap growing from size to want (floor at least) by the
// node's available memory: idle sandboxes may take half of it. Memory is
// read only when a cap would grow beyond its floor.
func growable(want, size, floor int) int {
	if want <= size || want <= floor {
		return want
	}
	avail, err := memAvailable()
	if err != nil {
		return max(size, floor)
	}
	return max(min(want, int(avail/2/readyFootprint)), size, floor)
}

// memAvailable is the kernel's estimate of the memory available for new
// work without swapping (MemAvailable).
func memAvailable() (int64, error) { return meminfo("MemAvailable") }

// layersAliveLocked is how many live sandboxes hold every one of layers: at
// least the sandboxes of a spec with those layers. The caller holds e.mu.
func (e *Edge) layersAliveLocked(layers []string) int {
	if len(layers) == 0 {
		return int(^uint(0) >> 1)
	}
	n := e.layers[layers[0]]
	for _, l := range layers[1:] {
		n = min(n, e.layers[l])
	}
	return n
}

// sweepAutoPools forgets specs not created for autoPoolIdle, corrects the
// unpooled counts of the others, and closes automatic pools that have
// emptied after going idle. Called by the reaper.
func (e *Edge) sweepAutoPools(ctx context.Context) {
	now := time.Now()
	var idle []*warmPool
	e.mu.Lock()
	for ak, r := range e.recent {
		if now.Sub(r.last) >= autoPoolIdle {
			delete(e.recent, ak)
			continue
		}
		if wp := e.autoPools[ak]; wp != nil && r.unpooled > 0 {
			// The spec's fresh sandboxes are among the live ones holding
			// its layers, less those taken from its pool.
			bound := e.layersAliveLocked(wp.layers) - wp.p.Stats().InUse
			if r.unpooled > bound {
				r.unpooled = max(bound, 0)
				e.recent[ak] = r
			}
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
// is closing, its runtime cannot reset, or
// its layers are no longer its spec's (rolled back to a checkpoint). It is
// called once for each destroy of a sandbox that did not come from a pool,
// and counts it out of its spec's unpooled sandboxes.
func (e *Edge) autoPoolFor(sb *sandbox, rs runtime.Sandbox) *warmPool {
	if e.cfg.AutoPool <= 0 {
		return nil
	}
	key := PoolKey(sb.spec.Backend, sb.layers, sb.spec.Resources, sb.spec.Env)
	ak := autoPoolKey(sb.tenant, key)
	ok := recyclable(sb, rs)
	e.mu.Lock()
	defer e.mu.Unlock()
	r, seen := e.recent[ak]
	if seen && r.unpooled > 0 {
		// Recycled or torn down, it is no longer in use: recycled, its
		// pool counts it when it is taken again.
		r.unpooled--
		e.recent[ak] = r
	}
	if !ok || e.closed {
		return nil
	}
	if wp := e.autoPools[ak]; wp != nil {
		return wp
	}
	if !r.hot {
		return nil
	}
	id := autoPoolPrefix + key[:16]
	wp := &warmPool{
		id: id, tenant: sb.tenant, key: key, kind: sb.kind, spec: sb.spec, layers: sb.layers,
		req:        placement.Capacity{MilliCPU: sb.req.MilliCPU, MemoryBytes: sb.req.MemoryBytes, Sandboxes: 1},
		idleShrink: autoPoolIdle,
	}
	// Memory is read under e.mu here, but only once per pool.
	size := growable(e.autoPoolCapLocked(sb.kind, r, 0), 0, e.cfg.AutoPool)
	wp.p = pool.New(pool.Options{
		Recycle: true, Size: size, IdleShrink: autoPoolIdle,
		Logger: e.log.With("pool", id, "tenant", sb.tenant),
	})
	e.autoPools[ak] = wp
	return wp
}

// recyclable reports whether sb can go to an automatic pool: a live
// sandbox whose runtime can reset (of any backend: what its sandboxes
// implement decides, not its kind) and whose layers are still its spec's.
func recyclable(sb *sandbox, rs runtime.Sandbox) bool {
	if _, ok := rs.(runtime.Resetter); !ok {
		return false
	}
	if len(sb.rspec.Layers) != len(sb.layers) {
		return false
	}
	for i, l := range sb.rspec.Layers {
		if l.Digest != sb.layers[i] {
			return false
		}
	}
	select {
	case <-rs.Done():
		return false
	default:
		return true
	}
}

// takeRecycled takes a recycled sandbox of the tenant's automatic pool for
// key, or waits for one being reset, or returns nils (the create then
// starts a fresh sandbox, which counts as unpooled).
func (e *Edge) takeRecycled(ctx context.Context, caller *dsecv1.Caller, key string) (*warmPool, runtime.Sandbox) {
	ak := autoPoolKey(caller.GetTenant(), key)
	e.mu.Lock()
	wp := e.autoPools[ak]
	e.mu.Unlock()
	var rs runtime.Sandbox
	if wp != nil {
		if s, err := wp.p.TakeWarm(ctx); s != nil && err == nil {
			rs = s // counted in the pool's InUse from now on
		}
	}
	if rs != nil {
		return wp, rs
	}
	e.mu.Lock()
	if r, ok := e.recent[ak]; ok {
		r.unpooled++
		e.recent[ak] = r
	}
	e.mu.Unlock()
	return nil, nil
}

// autoPoolList returns the automatic pools.
func (e *Edge) autoPoolList() []*warmPool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Collect(maps.Values(e.autoPools))
}
