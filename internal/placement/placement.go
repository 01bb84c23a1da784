// Package placement chooses a node for each sandbox of a batch of create
// requests, from the control plane's soft view of the nodes.
//
// It is pure: no I/O, no goroutines, no clocks. That keeps it fast enough
// that a 32K-sandbox burst is never waiting on the scheduler, and lets every
// policy decision be tested exactly. Placement is optimistic (Omega/Sparrow
// style): the edge makes the final admission check, and a refused request
// comes back with that node in Request.Exclude.
//
// Within a batch each placement is charged to its node before the next
// request is considered, so a burst spreads over the nodes instead of piling
// onto whichever node looked emptiest when the batch began. Placement does
// not change the caller's NodeViews; the caller applies the Decisions to its
// own state.
package placement

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// Capacity is an amount of each resource a backend accounts for on a node.
// It is used both for what a node offers and for what is already allocated.
type Capacity struct {
	// MilliCPU is CPU in thousandths of a core.
	MilliCPU int64
	// MemoryBytes is RAM.
	MemoryBytes int64
	// Sandboxes is a count of sandboxes. Unlike CPU and memory it is never
	// overcommitted: it stands for per-sandbox costs (mounts, PIDs, agent
	// processes) the backend cannot stretch.
	Sandboxes int64
}

// Share is the fraction of a sandbox's requested CPU and memory that a node
// is charged for it on top of what its sandboxes are measured to use.
// Requests are limits, not reservations: an idle agent uses a sliver of its
// limits while it waits for the model, so a node is full when what its
// sandboxes use says so, not when the sum of their limits reaches its size.
// A share of 1 is a reservation (the Kubernetes way), 0 counts measured use
// only. Fields are literal: 0 is a valid share.
type Share struct {
	CPU    float64
	Memory float64
}

// DefaultShare is what a node charges per requested unit when it reports no
// share of its own: nothing. CPU is compressible (weights keep sandboxes with
// an exec in flight fast) and memory is measured (idle sandboxes give theirs
// back to swap and reclaim before anyone is OOM-killed), so a node admits
// what its measured state holds, and its edge refuses a create when that
// state says it is full.
var DefaultShare = Share{}

// NodeView is what the control plane knows about one node, rebuilt from its
// heartbeats.
type NodeView struct {
	ID string
	// Only healthy nodes that are not draining receive sandboxes.
	Healthy  bool
	Draining bool
	// Capacity says which backends the node runs and how much each may use;
	// a backend missing from the map is not offered. Every field is a hard
	// limit: zero Sandboxes means no sandbox of that backend fits.
	Capacity map[runtime.Kind]Capacity
	// Usage is what the node is already charged per backend: measured use
	// plus its Share of what live sandboxes request, and their count.
	Usage map[runtime.Kind]Capacity
	// Share is the fraction of a request the node charges per backend; a
	// backend missing from the map takes the batch default (WithShare).
	Share map[runtime.Kind]Share
	// Layers is the set of layer digests the node holds (cached or mounted).
	Layers map[string]struct{}
	// Full, when not empty, says what the node's own measured state is
	// short of (memory pressure, descriptors, ...): it takes no sandbox
	// until a later view says otherwise, whatever its accounts say.
	Full string
	// Load is the node's measured busy fraction in [0, 1]. Scorers may treat
	// a node hotter than its allocations suggest as that busy.
	Load float64
	// Labels are not used by the built-in policy; they keep room for
	// affinity rules.
	Labels map[string]string
}

// LayerRef is one layer a sandbox needs.
type LayerRef struct {
	Digest string
	// Bytes weighs the layer for locality: holding a 2 GB base layer matters
	// more than holding a 10 KB toolkit. Zero means unknown and weighs 1.
	Bytes int64
}

// Request asks for one sandbox.
type Request struct {
	Kind        runtime.Kind
	MilliCPU    int64
	MemoryBytes int64
	// Layers are bottom first, as in runtime.Spec.
	Layers []LayerRef
	// Exclude lists node IDs that already refused this request; unknown IDs
	// are ignored.
	Exclude []string
	// Tenant and Labels are not used by the built-in policy; they keep room
	// for quotas and affinity.
	Tenant string
	Labels map[string]string
}

// Decision is the outcome for the request at the same index.
type Decision struct {
	// NodeID and Node (an index into the nodes passed to Place) name the
	// chosen node; Node is -1 when Err is set.
	NodeID string
	Node   int
	Err    error
}

// ErrInvalidRequest wraps a per-item error for a request that can never be
// placed as written (the message names the field).
var ErrInvalidRequest = errors.New("invalid placement request")

// ErrInvalidNode wraps the error Place returns for a malformed node view.
var ErrInvalidNode = errors.New("invalid node view")

type options struct {
	scorer Scorer
	share  Share
	seed   uint64
}

// Option configures Place.
type Option func(*options)

// WithScorer replaces the scoring policy (default LeastLoaded with
// DefaultLocalityWeight).
func WithScorer(s Scorer) Option { return func(o *options) { o.scorer = s } }

// WithLocalityWeight is shorthand for WithScorer(LeastLoaded{LocalityWeight: w}).
func WithLocalityWeight(w float64) Option {
	return func(o *options) { o.scorer = LeastLoaded{LocalityWeight: w} }
}

// WithShare sets the share for nodes that do not report one for a backend
// (default DefaultShare).
func WithShare(sh Share) Option { return func(o *options) { o.share = sh } }

// WithSeed seeds the random choice between equally scored nodes; the same
// seed and input give the same decisions.
func WithSeed(seed uint64) Option { return func(o *options) { o.seed = seed } }

// Place chooses a node for each request, in order. Each Decision carries
// either a node or its own error (a *CapacityError when nothing fits, or
// ErrInvalidRequest); one request failing does not stop the rest. The
// returned error is non-nil only when the node views or options are
// malformed, in which case nothing is placed.
func Place(nodes []NodeView, reqs []Request, opts ...Option) ([]Decision, error) {
	o := options{scorer: LeastLoaded{LocalityWeight: DefaultLocalityWeight}, share: DefaultShare}
	for _, opt := range opts {
		opt(&o)
	}
	if o.scorer == nil {
		return nil, errors.New("placement: scorer is nil")
	}
	if err := checkShare("default share", o.share); err != nil {
		return nil, err
	}
	p, err := newPlanner(nodes, reqs, &o)
	if err != nil {
		return nil, err
	}
	out := make([]Decision, len(reqs))
	for i := range reqs {
		out[i] = p.place(i)
	}
	return out, nil
}

// slot is one node's accounts for one backend, laid out flat so that the
// inner loop touches no maps.
type slot struct {
	node                  int
	capCPU, capMem, capSB int64
	useCPU, useMem, useSB int64
	invCPU, invMem, invSB float64 // 1/cap, 0 when cap is 0
	shCPU, shMem          float64 // the node's Share for the backend
	start                 float64 // utilization before this batch
	full                  bool    // the node says it is full (NodeView.Full)
}

// charge is what the slot's node is charged for r: its share of r's
// requests, rounded up so that a share above 0 never charges nothing.
func (sl *slot) charge(r *Request) (cpu, mem int64) {
	return ChargeOf(r.MilliCPU, sl.shCPU), ChargeOf(r.MemoryBytes, sl.shMem)
}

// ChargeOf is what a node charges for v requested at share: rounded up, so
// that a share above 0 never charges nothing. Edges and servers charge by
// it too, so all three agree to the unit.
func ChargeOf(v int64, share float64) int64 {
	if v == 0 || share == 0 {
		return 0
	}
	if share == 1 {
		return v
	}
	c := math.Ceil(float64(v) * share)
	if c >= math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(c)
}

// fits reports whether r fits the slot: its charge within what is left,
// a sandbox slot free, and its memory limit no larger than the node (a
// sandbox that could never get all it may use anywhere is refused rather
// than placed where it would be OOM-killed short of its limit).
func (sl *slot) fits(r *Request, cpu, mem int64) bool {
	return !sl.full && cpu <= sl.capCPU-sl.useCPU && mem <= sl.capMem-sl.useMem && sl.useSB < sl.capSB && r.MemoryBytes <= sl.capMem
}

// utilization is the fullest of the slot's resources after adding
// (cpu, mem, 1 sandbox) to its use.
func (sl *slot) utilization(cpu, mem, sb int64) float64 {
	util := float64(sl.useCPU+cpu) * sl.invCPU
	if m := float64(sl.useMem+mem) * sl.invMem; m > util {
		util = m
	}
	if c := float64(sl.useSB+sb) * sl.invSB; c > util {
		util = c
	}
	return util
}

// pool holds the eligible nodes of one backend.
type pool struct {
	kind    runtime.Kind
	slots   []slot
	offered int // nodes offering the backend, eligible or not
}

// weighted is a request layer as a bit index into the node layer bitsets.
type weighted struct {
	bit    uint32
	weight float64
}

type reqInfo struct {
	pool   int // index into planner.pools, -1 if no node offers the kind
	layers []weighted
	total  float64
	err    error
}

type planner struct {
	nodes  []NodeView
	reqs   []Request
	scorer Scorer
	rng    *rand.Rand
	pools  []pool
	info   []reqInfo
	// held is a node-major bitset: bit d of node n's words is set when the
	// node holds interned layer d.
	held     []uint64
	words    int
	index    map[string]int // node ID → index, for exclusions
	excluded []uint32       // per node: stamp of the request excluding it
}

func checkShare(what string, sh Share) error {
	if !(sh.CPU >= 0) || !(sh.Memory >= 0) || math.IsInf(sh.CPU, 0) || math.IsInf(sh.Memory, 0) {
		return fmt.Errorf("%w: %s %+v must be finite and non-negative", ErrInvalidNode, what, sh)
	}
	return nil
}

func checkCapacity(node string, kind runtime.Kind, field string, c Capacity) error {
	if c.MilliCPU < 0 || c.MemoryBytes < 0 || c.Sandboxes < 0 {
		return fmt.Errorf("%w: node %q %s[%s] %+v has a negative field", ErrInvalidNode, node, field, kind, c)
	}
	return nil
}

func inverse(v int64) float64 {
	if v <= 0 {
		return 0
	}
	return 1 / float64(v)
}

func newPlanner(nodes []NodeView, reqs []Request, o *options) (*planner, error) {
	p := &planner{
		nodes:  nodes,
		reqs:   reqs,
		scorer: o.scorer,
		rng:    rand.New(rand.NewPCG(o.seed, o.seed^0x9e3779b97f4a7c15)),
		info:   make([]reqInfo, len(reqs)),
	}
	if err := p.buildPools(nodes, o.share); err != nil {
		return nil, err
	}
	p.internLayers()
	for i := range reqs {
		if len(reqs[i].Exclude) > 0 {
			p.excluded = make([]uint32, len(nodes))
			break
		}
	}
	return p, nil
}

func (p *planner) buildPools(nodes []NodeView, def Share) error {
	p.index = make(map[string]int, len(nodes))
	kinds := make(map[runtime.Kind]int)
	for n := range nodes {
		nv := &nodes[n]
		if nv.ID == "" {
			return fmt.Errorf("%w: node %d has an empty ID", ErrInvalidNode, n)
		}
		if _, dup := p.index[nv.ID]; dup {
			return fmt.Errorf("%w: node ID %q appears twice", ErrInvalidNode, nv.ID)
		}
		p.index[nv.ID] = n
		if math.IsNaN(nv.Load) || math.IsInf(nv.Load, 0) {
			return fmt.Errorf("%w: node %q load %v is not finite", ErrInvalidNode, nv.ID, nv.Load)
		}
		eligible := nv.Healthy && !nv.Draining
		for kind, c := range nv.Capacity {
			if err := checkCapacity(nv.ID, kind, "Capacity", c); err != nil {
				return err
			}
			u := nv.Usage[kind]
			if err := checkCapacity(nv.ID, kind, "Usage", u); err != nil {
				return err
			}
			sh, ok := nv.Share[kind]
			if !ok {
				sh = def
			}
			if err := checkShare(fmt.Sprintf("node %q share[%s]", nv.ID, kind), sh); err != nil {
				return err
			}
			pi, ok := kinds[kind]
			if !ok {
				pi = len(p.pools)
				kinds[kind] = pi
				p.pools = append(p.pools, pool{kind: kind})
			}
			pl := &p.pools[pi]
			pl.offered++
			if !eligible {
				continue
			}
			s := slot{
				node:   n,
				capCPU: c.MilliCPU,
				capMem: c.MemoryBytes,
				capSB:  c.Sandboxes,
				shCPU:  sh.CPU,
				shMem:  sh.Memory,
				full:   nv.Full != "",
				useCPU: u.MilliCPU,
				useMem: u.MemoryBytes,
				useSB:  u.Sandboxes,
			}
			s.invCPU, s.invMem, s.invSB = inverse(s.capCPU), inverse(s.capMem), inverse(s.capSB)
			s.start = s.utilization(0, 0, 0)
			pl.slots = append(pl.slots, s)
		}
	}
	// Map iteration order must not leak into decisions: slots are in node
	// order within each pool already; pool order only affects lookups.
	for i := range p.reqs {
		p.info[i].pool = -1
		if pi, ok := kinds[p.reqs[i].Kind]; ok {
			p.info[i].pool = pi
		}
	}
	return nil
}

// internLayers numbers every distinct digest the batch asks for and builds
// one bitset per node, so that locality costs a few bit tests per candidate
// instead of map lookups.
func (p *planner) internLayers() {
	intern := make(map[string]uint32)
	var digests []string
	total := 0
	for i := range p.reqs {
		total += len(p.reqs[i].Layers)
	}
	backing := make([]weighted, 0, total)
	for i := range p.reqs {
		r, info := &p.reqs[i], &p.info[i]
		if err := validate(r); err != nil {
			info.err = err
			continue
		}
		start := len(backing)
		for _, l := range r.Layers {
			bit, ok := intern[l.Digest]
			if !ok {
				bit = uint32(len(digests))
				intern[l.Digest] = bit
				digests = append(digests, l.Digest)
			}
			w := float64(l.Bytes)
			if w == 0 {
				w = 1
			}
			backing = append(backing, weighted{bit: bit, weight: w})
			info.total += w
		}
		info.layers = backing[start:len(backing):len(backing)]
	}
	if len(digests) == 0 {
		return
	}
	p.words = (len(digests) + 63) / 64
	p.held = make([]uint64, len(p.nodes)*p.words)
	for n := range p.nodes {
		held := p.nodes[n].Layers
		row := p.held[n*p.words : (n+1)*p.words]
		// Walk whichever side is smaller: a node may cache thousands of
		// layers while the batch needs three, or the other way round.
		if len(held) < len(digests) {
			for d := range held {
				if bit, ok := intern[d]; ok {
					row[bit>>6] |= 1 << (bit & 63)
				}
			}
		} else {
			for bit, d := range digests {
				if _, ok := held[d]; ok {
					row[bit>>6] |= 1 << (uint(bit) & 63)
				}
			}
		}
	}
}

func validate(r *Request) error {
	switch {
	case r.Kind == "":
		return fmt.Errorf("%w: kind is empty", ErrInvalidRequest)
	case r.MilliCPU < 0:
		return fmt.Errorf("%w: milliCPU %d is negative", ErrInvalidRequest, r.MilliCPU)
	case r.MemoryBytes < 0:
		return fmt.Errorf("%w: memoryBytes %d is negative", ErrInvalidRequest, r.MemoryBytes)
	}
	for i, l := range r.Layers {
		if l.Digest == "" {
			return fmt.Errorf("%w: layers[%d].digest is empty", ErrInvalidRequest, i)
		}
		if l.Bytes < 0 {
			return fmt.Errorf("%w: layers[%d].bytes %d is negative", ErrInvalidRequest, i, l.Bytes)
		}
	}
	return nil
}

func (p *planner) place(i int) Decision {
	r, info := &p.reqs[i], &p.info[i]
	if info.err != nil {
		return Decision{Node: -1, Err: info.err}
	}
	if info.pool < 0 {
		return Decision{Node: -1, Err: &CapacityError{Kind: r.Kind, Need: need(r)}}
	}
	pl := &p.pools[info.pool]
	stamp := uint32(i + 1)
	if len(r.Exclude) > 0 {
		for _, id := range r.Exclude {
			if n, ok := p.index[id]; ok {
				p.excluded[n] = stamp
			}
		}
	}
	best, ties := -1, 0
	bestScore := 0.0
	for s := range pl.slots {
		sl := &pl.slots[s]
		if p.excluded != nil && p.excluded[sl.node] == stamp {
			continue
		}
		cpu, mem := sl.charge(r)
		if !sl.fits(r, cpu, mem) {
			continue
		}
		util := sl.utilization(cpu, mem, 1)
		loc := 0.0
		if info.total > 0 {
			row := p.held[sl.node*p.words:]
			var h float64
			for _, l := range info.layers {
				if row[l.bit>>6]&(1<<(l.bit&63)) != 0 {
					h += l.weight
				}
			}
			loc = h / info.total
		}
		score := p.scorer.Score(r, Candidate{Node: &p.nodes[sl.node], Index: sl.node, Utilization: util, Added: util - sl.start, Locality: loc})
		switch {
		case best < 0 || score > bestScore:
			best, bestScore, ties = s, score, 1
		case score == bestScore:
			// Reservoir sampling: each of the k tied nodes ends up chosen
			// with probability 1/k, reproducibly for a given seed.
			ties++
			if p.rng.IntN(ties) == 0 {
				best = s
			}
		}
	}
	if best < 0 {
		return Decision{Node: -1, Err: p.diagnose(pl, r, stamp)}
	}
	sl := &pl.slots[best]
	cpu, mem := sl.charge(r)
	sl.useCPU += cpu
	sl.useMem += mem
	sl.useSB++
	return Decision{NodeID: p.nodes[sl.node].ID, Node: sl.node}
}

func need(r *Request) Capacity {
	return Capacity{MilliCPU: r.MilliCPU, MemoryBytes: r.MemoryBytes, Sandboxes: 1}
}

// diagnose says what ran out. It runs only on failure, so it may rescan.
func (p *planner) diagnose(pl *pool, r *Request, stamp uint32) error {
	e := &CapacityError{Kind: r.Kind, Need: need(r), Offered: pl.offered}
	var cpu, mem, sb bool
	for s := range pl.slots {
		sl := &pl.slots[s]
		if p.excluded != nil && p.excluded[sl.node] == stamp {
			e.Excluded++
			continue
		}
		e.Eligible++
		if sl.full {
			e.Full++
			if e.FullReason == "" {
				e.FullReason = p.nodes[sl.node].ID + ": " + p.nodes[sl.node].Full
			}
			continue
		}
		c, m := sl.charge(r)
		cpu = cpu || c <= sl.capCPU-sl.useCPU
		mem = mem || (m <= sl.capMem-sl.useMem && r.MemoryBytes <= sl.capMem)
		sb = sb || sl.useSB < sl.capSB
	}
	if e.Eligible == 0 || e.Full == e.Eligible {
		return e
	}
	if !cpu {
		e.Short = append(e.Short, ResourceCPU)
	}
	if !mem {
		e.Short = append(e.Short, ResourceMemory)
	}
	if !sb {
		e.Short = append(e.Short, ResourceSandboxes)
	}
	return e
}
