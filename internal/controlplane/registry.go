package controlplane

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/url"
	"slices"
	"sort"
	"sync"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
)

// registry is the control plane's soft state: what each node last said in
// its heartbeat, plus the creates this replica has placed but not yet seen
// in a heartbeat. All of it is rebuilt from heartbeats after a restart.
//
// One mutex guards everything; placement runs under it so that two
// concurrent creates never both take the last slot of a node or the last
// unit of a tenant's quota (within this replica).
type registry struct {
	now       func() time.Time
	timeout   time.Duration
	retention time.Duration
	// pendingGrace is how long a finished create stays charged after it
	// completed while no heartbeat has listed it yet.
	pendingGrace time.Duration

	mu    sync.Mutex
	nodes map[string]*node
	// byURL finds a node by the scheme://host of its URL.
	byURL   map[string]*node
	pending map[string]*pendingCreate
	// pendingUse is the usage of pending creates per tenant.
	pendingUse map[string]iam.Usage
	// room is closed (and replaced) whenever room may have appeared on a
	// node: creates waiting in the admission queue then try again.
	room chan struct{}
}

type node struct {
	id, url, bootID string
	capacity        map[runtime.Kind]placement.Capacity
	// usage is what the node is charged per backend (measured use plus
	// its share of requests) and share the fraction of a request it
	// charges, as last reported.
	usage map[runtime.Kind]placement.Capacity
	share map[runtime.Kind]placement.Share
	// backends are the capacity entries as last reported, for what node
	// ls shows beyond placement's view (requests, measured use).
	backends []*dsecv1.BackendCapacity
	// status is what the node measures about itself, as last reported.
	status    *dsecv1.NodeStatus
	layers    map[string]struct{}
	load      float64
	sandboxes map[string]*dsecv1.SandboxSummary
	// tenantUse sums the live (not destroyed or failed) sandboxes per tenant.
	tenantUse map[string]iam.Usage
	// lost holds sandboxes an earlier boot of this node owned.
	lost     map[string]lostSandbox
	lastSeen time.Time
	// pendingUse charges this replica's pending creates to the node.
	pendingUse map[runtime.Kind]placement.Capacity
	// deadLogged records that the node's death has been reported.
	deadLogged bool
	// pools are the node's warm pools as last reported.
	pools []*dsecv1.PoolSummary
	// queued is how many creates and calls wait on the node.
	queued int32
	// defaults are the resources the node gives what a spec leaves 0, as
	// last reported (zero before the first heartbeat that says).
	defaults spec.Resources
}

type lostSandbox struct {
	summary *dsecv1.SandboxSummary
	reason  string
	since   time.Time
}

type pendingCreate struct {
	id, node, tenant string
	kind             runtime.Kind
	// use is what it charges its tenant (limits), nodeUse what it
	// charges its node (requests).
	use     iam.Usage
	nodeUse placement.Capacity
	labels  map[string]string
	doneAt  time.Time // zero while the edge call is in flight
	// pool is set for a pool being created (id is the pool's): use is
	// its whole size, and a heartbeat listing the pool ends it.
	pool bool
}

func newRegistry(timeout, retention time.Duration) *registry {
	return &registry{
		now:          time.Now,
		timeout:      timeout,
		retention:    retention,
		pendingGrace: max(2*timeout, 5*time.Second),
		nodes:        map[string]*node{},
		byURL:        map[string]*node{},
		pending:      map[string]*pendingCreate{},
		pendingUse:   map[string]iam.Usage{},
		room:         make(chan struct{}),
	}
}

// roomSignal returns a channel closed the next time room may appear.
func (r *registry) roomSignal() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.room
}

// signalRoomLocked wakes every create waiting for room; the caller holds mu.
func (r *registry) signalRoomLocked() {
	close(r.room)
	r.room = make(chan struct{})
}

func (r *registry) alive(n *node, now time.Time) bool { return now.Sub(n.lastSeen) <= r.timeout }

// urlKey is the scheme://host of a node's advertised URL, as an edge
// client's requests name it.
func urlKey(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	return u.Scheme + "://" + u.Host
}

// answered records that the edge at url (scheme://host) answered a call:
// proof of life as good as a heartbeat. A node whose CPU is saturated
// (a wave of rollouts on two cores) can be seconds late with its beats
// while it still serves every exec; declaring it dead then turned its
// sandboxes' steps into infra errors, a platform failure the workload
// caused. Only liveness is refreshed: what the node reported stays as
// last reported until its next beat.
//
// The proof dates from when the call was sent (sent, from sentAt), not
// from when its answer was read: the answer shows the node alive at some
// moment after the send, and a reply read late (after the node died, the
// client slow to read it) must not make a dead node look alive from then on.
func (r *registry) answered(url string, sent time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n := r.byURL[url]; n != nil && sent.After(n.lastSeen) {
		n.lastSeen = sent
	}
}

// sentAt is the registry's clock, for answered.
func (r *registry) sentAt() time.Time { return r.now() }

func countsAgainstQuota(state string) bool { return spec.State(state).Live() }

// heartbeat records what a node says about itself.
func (r *registry) heartbeat(hb *dsecv1.HeartbeatRequest) error {
	if err := ids.ValidNode(hb.GetNodeId()); err != nil {
		return fmt.Errorf("node_id: %w", err)
	}
	if hb.GetUrl() == "" {
		return fmt.Errorf("url: empty for node %q", hb.GetNodeId())
	}
	capacity := make(map[runtime.Kind]placement.Capacity, len(hb.GetCapacity()))
	usage := make(map[runtime.Kind]placement.Capacity, len(hb.GetCapacity()))
	share := make(map[runtime.Kind]placement.Share, len(hb.GetCapacity()))
	for i, c := range hb.GetCapacity() {
		if c.GetBackend() == "" {
			return fmt.Errorf("capacity[%d].backend: empty", i)
		}
		k := runtime.Kind(c.GetBackend())
		capacity[k] = placement.Capacity{MilliCPU: c.GetMilliCpu(), MemoryBytes: c.GetMemoryBytes(), Sandboxes: c.GetSandboxes()}
		usage[k] = placement.Capacity{MilliCPU: c.GetUsedMilliCpu(), MemoryBytes: c.GetUsedMemoryBytes(), Sandboxes: c.GetUsedSandboxes()}
		if err := checkNonNegative(capacity[k], usage[k]); err != nil {
			return fmt.Errorf("capacity[%d] (%s): %w", i, k, err)
		}
		sh := placement.Share{CPU: c.GetRequestShareCpu(), Memory: c.GetRequestShareMemory()}
		if !(sh.CPU >= 0 && sh.CPU <= 1) || !(sh.Memory >= 0 && sh.Memory <= 1) {
			return fmt.Errorf("capacity[%d] (%s): request share %+v not in [0, 1]", i, k, sh)
		}
		share[k] = sh
	}
	layers := make(map[string]struct{}, len(hb.GetLayers()))
	for _, l := range hb.GetLayers() {
		layers[l] = struct{}{}
	}
	sandboxes := make(map[string]*dsecv1.SandboxSummary, len(hb.GetSandboxes()))
	tenantUse := map[string]iam.Usage{}
	for _, s := range hb.GetSandboxes() {
		sandboxes[s.GetId()] = s
		if countsAgainstQuota(s.GetState()) {
			tenantUse[s.GetTenant()] = tenantUse[s.GetTenant()].Add(iam.Usage{Sandboxes: 1, MilliCPU: s.GetMilliCpu(), MemoryBytes: s.GetMemoryBytes()})
		}
	}
	for i, p := range hb.GetPools() {
		if p.GetCharged() < 0 || p.GetMilliCpu() < 0 || p.GetMemoryBytes() < 0 {
			return fmt.Errorf("pools[%d] (%s): negative amount", i, p.GetId())
		}
		if p.GetCharged() > 0 && p.GetTenant() != "" {
			tenantUse[p.GetTenant()] = tenantUse[p.GetTenant()].Add(poolUse(p))
		}
	}
	defaults := spec.FromProto(hb.GetDefaults())
	if defaults.Validate("defaults") != nil {
		return fmt.Errorf("defaults: %+v out of bounds", defaults)
	}
	load := hb.GetLoad()
	if !(load >= 0) || load > 1e6 {
		load = 0
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	n := r.nodes[hb.GetNodeId()]
	if n == nil {
		n = &node{id: hb.GetNodeId(), lost: map[string]lostSandbox{}, pendingUse: map[runtime.Kind]placement.Capacity{}}
		r.nodes[n.id] = n
	}
	if n.bootID != "" && n.bootID != hb.GetBootId() {
		// The edge restarted: sandboxes of its previous life are gone even
		// if an ID were to reappear.
		reason := fmt.Sprintf("node %s restarted", n.id)
		for id, s := range n.sandboxes {
			if _, again := sandboxes[id]; !again {
				n.lost[id] = lostSandbox{summary: s, reason: reason, since: now}
			}
		}
		for id, p := range r.pending {
			if p.node == n.id && !p.doneAt.IsZero() {
				if _, again := sandboxes[id]; !again && !p.pool {
					n.lost[id] = lostSandbox{summary: p.summary(), reason: reason, since: now}
				}
				r.dropPendingLocked(p)
			}
		}
	}
	if n.url != hb.GetUrl() {
		if r.byURL[urlKey(n.url)] == n {
			delete(r.byURL, urlKey(n.url))
		}
		r.byURL[urlKey(hb.GetUrl())] = n
	}
	n.url, n.bootID = hb.GetUrl(), hb.GetBootId()
	n.capacity, n.usage, n.share, n.layers, n.load = capacity, usage, share, layers, load
	n.status, n.backends = hb.GetStatus(), hb.GetCapacity()
	n.sandboxes, n.tenantUse = sandboxes, tenantUse
	n.lastSeen = now
	n.deadLogged = false
	n.pools, n.queued = hb.GetPools(), hb.GetQueued()
	n.defaults = defaults
	defer r.signalRoomLocked()
	// A pool being created that the node now reports is charged by it.
	for _, pl := range n.pools {
		if p := r.pending[pl.GetId()]; p != nil && p.pool && p.node == n.id {
			r.dropPendingLocked(p)
		}
	}
	// A pending create the node now reports is counted by the heartbeat.
	// Walk the smaller side: usually a few pending creates against
	// thousands of reported sandboxes, but a burst can invert that.
	if len(r.pending) < len(sandboxes) {
		for id, p := range r.pending {
			if _, ok := sandboxes[id]; ok && p.node == n.id {
				r.dropPendingLocked(p)
			}
		}
	} else {
		for id := range sandboxes {
			if p := r.pending[id]; p != nil && p.node == n.id {
				r.dropPendingLocked(p)
			}
		}
	}
	return nil
}

// poolUse is what a pool in a heartbeat charges its tenant's quota.
func poolUse(p *dsecv1.PoolSummary) iam.Usage {
	return iam.Usage{Sandboxes: 1, MilliCPU: p.GetMilliCpu(), MemoryBytes: p.GetMemoryBytes()}.Scale(int64(p.GetCharged()))
}

// defaults returns the resources to fill into a spec for what it and its
// tenant leave 0: the live nodes' reported defaults, the largest of them
// field by field where nodes disagree (a sandbox must not get more than
// its quota was charged, wherever it is placed), else fallback when no
// live node has reported any.
func (r *registry) defaults(fallback spec.Resources) spec.Resources {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var d spec.Resources
	for _, n := range r.nodes {
		if r.alive(n, now) {
			d = d.Max(n.defaults)
		}
	}
	return d.Or(fallback)
}

// tenantUse is what tenant holds as this replica sees it (live sandboxes
// and pools on live nodes, plus its creates in flight).
func (r *registry) tenantUse(tenant string) iam.Usage {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.tenantUseLocked(tenant, r.now())
}

func checkNonNegative(cs ...placement.Capacity) error {
	for _, c := range cs {
		if c.MilliCPU < 0 || c.MemoryBytes < 0 || c.Sandboxes < 0 {
			return fmt.Errorf("negative amount in %+v", c)
		}
	}
	return nil
}

func (p *pendingCreate) summary() *dsecv1.SandboxSummary {
	return &dsecv1.SandboxSummary{
		Id: p.id, Tenant: p.tenant, State: string(spec.StateCreating), Labels: p.labels,
		MilliCpu: p.use.MilliCPU, MemoryBytes: p.use.MemoryBytes, Backend: string(p.kind),
	}
}

func (r *registry) dropPendingLocked(p *pendingCreate) {
	delete(r.pending, p.id)
	r.pendingUse[p.tenant] = r.pendingUse[p.tenant].Sub(p.use)
	if u := r.pendingUse[p.tenant]; u == (iam.Usage{}) {
		delete(r.pendingUse, p.tenant)
	}
	if n := r.nodes[p.node]; n != nil {
		c := n.pendingUse[p.kind]
		c.MilliCPU -= p.nodeUse.MilliCPU
		c.MemoryBytes -= p.nodeUse.MemoryBytes
		c.Sandboxes -= p.nodeUse.Sandboxes
		n.pendingUse[p.kind] = c
	}
}

// placeReq is one sandbox to place, with the tenant it is charged to.
type placeReq struct {
	tenant string
	quota  *iam.Quota // nil: not limited (admin)
	// req is what the sandbox asks of a node: its requests (the resources
	// its spec states).
	req placement.Request
	// charge is what one sandbox charges its tenant's quota: its limits
	// (defaults included; prepared.charge).
	charge iam.Usage
	labels map[string]string
	// pool, when above 0, places a pool of that many sandboxes of req: its
	// tenant's quota and the node are charged for all of them (the node
	// is chosen as for one).
	pool int64
}

// need is what pr charges its tenant's quota.
func (pr placeReq) need() iam.Usage {
	if pr.pool > 0 {
		return pr.charge.Scale(pr.pool)
	}
	return pr.charge
}

// nodeNeed is what pr charges node n until a heartbeat counts it: n's
// share of its requests.
func (pr placeReq) nodeNeed(n *node) placement.Capacity {
	c, sh := max(pr.pool, 1), n.shareOf(pr.req.Kind)
	return placement.Capacity{MilliCPU: c * placement.ChargeOf(pr.req.MilliCPU, sh.CPU), MemoryBytes: c * placement.ChargeOf(pr.req.MemoryBytes, sh.Memory), Sandboxes: c}
}

// shareOf is the request share n reported for kind.
func (n *node) shareOf(kind runtime.Kind) placement.Share {
	if sh, ok := n.share[kind]; ok {
		return sh
	}
	return placement.DefaultShare
}

// reservation is where one placeReq goes, or why it cannot.
type reservation struct {
	id, node, url string
	err           error
}

// reserve checks quotas and places a batch in one placement.Place call,
// charging each placed request to its tenant and node until the create
// completes and a heartbeat reports it (or it is released).
func (r *registry) reserve(reqs []placeReq) ([]reservation, error) {
	out := make([]reservation, len(reqs))
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()

	// Quota admission first, in order, so a batch that overruns a quota
	// gets its tail refused rather than random items.
	// used starts at each tenant's current usage (computed once per call:
	// it walks every node) and grows as items are admitted.
	used := map[string]iam.Usage{}
	var admitted []int
	for i, pr := range reqs {
		need := pr.need()
		u, ok := used[pr.tenant]
		if !ok {
			u = r.tenantUseLocked(pr.tenant, now)
		}
		if pr.quota != nil {
			if err := pr.quota.Admit(pr.tenant, u, need); err != nil {
				used[pr.tenant] = u
				out[i].err = err
				continue
			}
		}
		used[pr.tenant] = u.Add(need)
		admitted = append(admitted, i)
	}
	if len(admitted) == 0 {
		return out, nil
	}

	views := r.viewsLocked(now)
	preqs := make([]placement.Request, len(admitted))
	for j, i := range admitted {
		preqs[j] = reqs[i].req
	}
	decisions, err := placement.Place(views, preqs, placement.WithSeed(rand.Uint64()))
	if err != nil {
		return nil, err
	}
	for j, d := range decisions {
		i := admitted[j]
		if d.Err != nil {
			out[i].err = d.Err
			continue
		}
		n := r.nodes[d.NodeID]
		pr := reqs[i]
		p := &pendingCreate{
			id: ids.NewSandbox(n.id), node: n.id, tenant: pr.tenant, kind: pr.req.Kind, labels: pr.labels,
			use: pr.need(), nodeUse: pr.nodeNeed(n), pool: pr.pool > 0,
		}
		r.pending[p.id] = p
		r.pendingUse[p.tenant] = r.pendingUse[p.tenant].Add(p.use)
		c := n.pendingUse[p.kind]
		c.MilliCPU += p.nodeUse.MilliCPU
		c.MemoryBytes += p.nodeUse.MemoryBytes
		c.Sandboxes += p.nodeUse.Sandboxes
		n.pendingUse[p.kind] = c
		out[i] = reservation{id: p.id, node: n.id, url: n.url}
	}
	return out, nil
}

// tenantUseLocked is what tenant's sandboxes hold on live nodes plus its
// pending creates.
func (r *registry) tenantUseLocked(tenant string, now time.Time) iam.Usage {
	u := r.pendingUse[tenant]
	for _, n := range r.nodes {
		if r.alive(n, now) {
			u = u.Add(n.tenantUse[tenant])
		}
	}
	return u
}

func (r *registry) viewsLocked(now time.Time) []placement.NodeView {
	views := make([]placement.NodeView, 0, len(r.nodes))
	for _, n := range r.nodes {
		if !r.alive(n, now) {
			continue
		}
		views = append(views, placement.NodeView{
			ID: n.id, Healthy: true, Capacity: n.capacity, Usage: n.charged(), Share: n.share, Layers: n.layers, Load: min(n.load, 1),
			Full: n.status.GetFull(),
		})
	}
	return views
}

// charged is what n is charged per backend as this replica sees it: what
// it last reported plus the creates placed on it that no heartbeat counts
// yet. It is n.usage itself when there are none (callers do not change
// it); the caller holds mu.
func (n *node) charged() map[runtime.Kind]placement.Capacity {
	if len(n.pendingUse) == 0 {
		return n.usage
	}
	usage := make(map[runtime.Kind]placement.Capacity, len(n.usage))
	maps.Copy(usage, n.usage)
	for k, p := range n.pendingUse {
		u := usage[k]
		u.MilliCPU += max(p.MilliCPU, 0)
		u.MemoryBytes += max(p.MemoryBytes, 0)
		u.Sandboxes += max(p.Sandboxes, 0)
		usage[k] = u
	}
	return usage
}

// completed marks a reserved create as done on its edge: it stays charged
// until a heartbeat lists it or the grace period passes.
func (r *registry) completed(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.pending[id]; p != nil {
		p.doneAt = r.now()
	}
}

// release drops a reservation whose create failed.
func (r *registry) release(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.pending[id]; p != nil {
		r.dropPendingLocked(p)
		r.signalRoomLocked()
	}
}

// forget drops everything known about a destroyed sandbox, so its quota
// frees at once rather than at the next heartbeat.
func (r *registry) forget(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.dropLocked(id)
	if n == nil {
		return
	}
	delete(n.lost, id)
	if s, ok := n.sandboxes[id]; ok {
		delete(n.sandboxes, id)
		if countsAgainstQuota(s.GetState()) {
			n.tenantUse[s.GetTenant()] = n.tenantUse[s.GetTenant()].Sub(iam.Usage{Sandboxes: 1, MilliCPU: s.GetMilliCpu(), MemoryBytes: s.GetMemoryBytes()})
			// Free the node's room now too, rather than at its next
			// heartbeat, for creates waiting in the admission queue.
			k := runtime.Kind(s.GetBackend())
			if u, ok := n.usage[k]; ok {
				u.Sandboxes = max(u.Sandboxes-1, 0)
				u.MilliCPU = max(u.MilliCPU-s.GetMilliCpu(), 0)
				u.MemoryBytes = max(u.MemoryBytes-s.GetMemoryBytes(), 0)
				n.usage[k] = u
			}
			r.signalRoomLocked()
		}
	}
}

// dropLocked drops the pending charge of id (a sandbox or a pool) and
// returns the node its ID names, nil when none is known.
func (r *registry) dropLocked(id string) *node {
	if p := r.pending[id]; p != nil {
		r.dropPendingLocked(p)
	}
	nodeID, err := ids.NodeOf(id)
	if err != nil {
		return nil
	}
	return r.nodes[nodeID]
}

// forgetPool drops a deleted pool's charge at once rather than at the
// node's next heartbeat.
func (r *registry) forgetPool(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.dropLocked(id)
	if n == nil {
		return
	}
	for i, pl := range n.pools {
		if pl.GetId() != id {
			continue
		}
		if pl.GetCharged() > 0 && pl.GetTenant() != "" {
			n.tenantUse[pl.GetTenant()] = n.tenantUse[pl.GetTenant()].Sub(poolUse(pl))
		}
		n.pools = slices.Delete(slices.Clone(n.pools), i, i+1)
		r.signalRoomLocked()
		return
	}
}

// warmNodes lists the live nodes holding a ready sandbox of a warm pool
// with key that serves tenant, most ready first.
func (r *registry) warmNodes(key, tenant string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	type cand struct {
		id    string
		ready int32
	}
	var cs []cand
	for _, n := range r.nodes {
		if !r.alive(n, now) {
			continue
		}
		var ready int32
		for _, p := range n.pools {
			if p.GetKey() == key && (p.GetTenant() == tenant || p.GetTenant() == "") {
				ready += p.GetReady()
			}
		}
		if ready > 0 {
			cs = append(cs, cand{n.id, ready})
		}
	}
	sort.Slice(cs, func(i, j int) bool { return cs[i].ready > cs[j].ready })
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.id
	}
	return out
}

// nodesExcept lists every known node but keep.
func (r *registry) nodesExcept(keep []string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for id := range r.nodes {
		if !slices.Contains(keep, id) {
			out = append(out, id)
		}
	}
	return out
}

// tookWarm counts one ready sandbox of a pool on node as taken until the
// node's next heartbeat says otherwise, so a burst spreads over pools.
func (r *registry) tookWarm(nodeID, key string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n := r.nodes[nodeID]; n != nil {
		for _, p := range n.pools {
			if p.GetKey() == key && p.GetReady() > 0 {
				p.Ready--
				return
			}
		}
	}
}

// route is what the registry knows about the node owning a sandbox.
type route struct {
	node, url string
	known     bool // the node has heartbeated to this replica
	alive     bool
	// summary is the sandbox as last reported (or as pending), nil if unknown.
	summary *dsecv1.SandboxSummary
	// lostReason is set when the sandbox is lost: its node is dead or
	// restarted since.
	lostReason string
}

func (r *registry) route(id string) (route, error) {
	nodeID, err := ids.NodeOf(id)
	if err != nil {
		return route{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.nodes[nodeID]
	if n == nil {
		return route{node: nodeID}, nil
	}
	rt := route{node: n.id, url: n.url, known: true, alive: r.alive(n, r.now())}
	if l, ok := n.lost[id]; ok {
		rt.summary, rt.lostReason = l.summary, l.reason
		return rt, nil
	}
	if s, ok := n.sandboxes[id]; ok {
		rt.summary = s
	} else if p := r.pending[id]; p != nil && !p.pool {
		rt.summary = p.summary()
	}
	if !rt.alive && rt.summary != nil {
		rt.lostReason = notResponding(n.id)
	}
	return rt, nil
}

func notResponding(node string) string { return fmt.Sprintf("node %s is not responding", node) }

// edgeRef names a live node to fan out to.
type edgeRef struct{ id, url string }

// snapshot returns the live nodes and every lost sandbox (of dead nodes and
// of earlier boots), the latter with their node and reason.
func (r *registry) snapshot() (live []edgeRef, lost []lostEntry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for _, n := range r.nodes {
		for _, l := range n.lost {
			lost = append(lost, lostEntry{node: n.id, summary: l.summary, reason: l.reason})
		}
		if r.alive(n, now) {
			live = append(live, edgeRef{id: n.id, url: n.url})
			continue
		}
		for _, s := range n.sandboxes {
			if s.GetState() != string(spec.StateDestroyed) {
				lost = append(lost, lostEntry{node: n.id, summary: s, reason: notResponding(n.id)})
			}
		}
		for _, p := range r.pending {
			if p.node == n.id && !p.doneAt.IsZero() && !p.pool {
				lost = append(lost, lostEntry{node: n.id, summary: p.summary(), reason: notResponding(n.id)})
			}
		}
	}
	return live, lost
}

type lostEntry struct {
	node    string
	summary *dsecv1.SandboxSummary
	reason  string
}

// liveSummaries returns the last reported sandboxes of one node, for when
// the node is alive but did not answer a fan-out.
func (r *registry) liveSummaries(nodeID string) []*dsecv1.SandboxSummary {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.nodes[nodeID]
	if n == nil {
		return nil
	}
	out := make([]*dsecv1.SandboxSummary, 0, len(n.sandboxes))
	for _, s := range n.sandboxes {
		out = append(out, s)
	}
	return out
}

// sweep expires what heartbeats no longer vouch for: finished creates never
// reported, lost sandboxes and dead nodes past the retention. It returns the
// nodes that died since the last sweep, for logging.
func (r *registry) sweep() (died []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for _, p := range r.pending {
		if !p.doneAt.IsZero() && now.Sub(p.doneAt) > r.pendingGrace {
			if n := r.nodes[p.node]; n != nil && r.alive(n, now) {
				r.dropPendingLocked(p)
			}
		}
	}
	for id, n := range r.nodes {
		for sid, l := range n.lost {
			if now.Sub(l.since) > r.retention {
				delete(n.lost, sid)
			}
		}
		if r.alive(n, now) {
			continue
		}
		if !n.deadLogged {
			n.deadLogged = true
			died = append(died, id)
		}
		if now.Sub(n.lastSeen) > r.retention {
			for _, p := range r.pending {
				if p.node == id {
					r.dropPendingLocked(p)
				}
			}
			delete(r.nodes, id)
			if r.byURL[urlKey(n.url)] == n {
				delete(r.byURL, urlKey(n.url))
			}
		}
	}
	return died
}

// stateCounts counts sandboxes by backend and state, lost ones included.
func (r *registry) stateCounts() map[[2]string]int {
	out := map[[2]string]int{}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for _, n := range r.nodes {
		alive := r.alive(n, now)
		for _, s := range n.sandboxes {
			st := s.GetState()
			if !alive && st != string(spec.StateDestroyed) {
				st = string(spec.StateLost)
			}
			out[[2]string{s.GetBackend(), st}]++
		}
		for _, l := range n.lost {
			out[[2]string{l.summary.GetBackend(), string(spec.StateLost)}]++
		}
	}
	return out
}

// nodeCounts returns how many known nodes are alive and dead.
func (r *registry) nodeCounts() (alive, dead int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	for _, n := range r.nodes {
		if r.alive(n, now) {
			alive++
		} else {
			dead++
		}
	}
	return alive, dead
}
