package placement

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

const gib = int64(1) << 30

// noOvercommit charges requests whole (a reservation) so table rows read
// directly.
var noOvercommit = WithShare(Share{CPU: 1, Memory: 1})

func node(id string, c Capacity) NodeView {
	return NodeView{ID: id, Healthy: true, Capacity: map[runtime.Kind]Capacity{runtime.KindContainer: c}}
}

func (n NodeView) used(u Capacity) NodeView {
	n.Usage = map[runtime.Kind]Capacity{runtime.KindContainer: u}
	return n
}

func (n NodeView) holding(digests ...string) NodeView {
	n.Layers = make(map[string]struct{}, len(digests))
	for _, d := range digests {
		n.Layers[d] = struct{}{}
	}
	return n
}

func ctr(cpu, mem int64, layers ...LayerRef) Request {
	return Request{Kind: runtime.KindContainer, MilliCPU: cpu, MemoryBytes: mem, Layers: layers}
}

func mustPlace(t *testing.T, nodes []NodeView, reqs []Request, opts ...Option) []Decision {
	t.Helper()
	ds, err := Place(nodes, reqs, opts...)
	if err != nil {
		t.Fatalf("Place: %v", err)
	}
	if len(ds) != len(reqs) {
		t.Fatalf("Place returned %d decisions for %d requests", len(ds), len(reqs))
	}
	return ds
}

func capErr(t *testing.T, d Decision) *CapacityError {
	t.Helper()
	if d.Err == nil {
		t.Fatalf("placed on %s, want a capacity error", d.NodeID)
	}
	if !errors.Is(d.Err, ErrNoCapacity) {
		t.Fatalf("error %v does not match ErrNoCapacity", d.Err)
	}
	var ce *CapacityError
	if !errors.As(d.Err, &ce) {
		t.Fatalf("error %v is not a *CapacityError", d.Err)
	}
	if d.Node != -1 || d.NodeID != "" {
		t.Fatalf("failed decision names node %d %q", d.Node, d.NodeID)
	}
	return ce
}

func TestFitByResource(t *testing.T) {
	small := Capacity{MilliCPU: 1000, MemoryBytes: 2 * gib, Sandboxes: 2}
	tests := []struct {
		name      string
		nodes     []NodeView
		req       Request
		want      string // node ID, or "" for failure
		short     []Resource
		errSubstr string
	}{
		{name: "exact fit", nodes: []NodeView{node("n1", small)}, req: ctr(1000, 2*gib), want: "n1"},
		{name: "zero request fits", nodes: []NodeView{node("n1", small)}, req: ctr(0, 0), want: "n1"},
		{name: "cpu short", nodes: []NodeView{node("n1", small)}, req: ctr(1001, gib),
			short: []Resource{ResourceCPU}, errSubstr: "no node has 1001 milliCPU free for backend container"},
		{name: "memory short after usage", nodes: []NodeView{node("n1", small).used(Capacity{MemoryBytes: gib})}, req: ctr(10, gib+1),
			short: []Resource{ResourceMemory}, errSubstr: fmt.Sprintf("no node has %d bytes of memory free", gib+1)},
		{name: "sandbox slots full", nodes: []NodeView{node("n1", small).used(Capacity{Sandboxes: 2})}, req: ctr(1, 1),
			short: []Resource{ResourceSandboxes}, errSubstr: "no node has a sandbox slot free"},
		{name: "cpu and memory short", nodes: []NodeView{node("n1", small)}, req: ctr(2000, 3*gib),
			short: []Resource{ResourceCPU, ResourceMemory}, errSubstr: "2000 milliCPU or 3221225472 bytes of memory"},
		{name: "free everywhere but not together", nodes: []NodeView{
			node("cpu-rich", Capacity{MilliCPU: 8000, MemoryBytes: gib, Sandboxes: 10}),
			node("mem-rich", Capacity{MilliCPU: 500, MemoryBytes: 8 * gib, Sandboxes: 10}),
		}, req: ctr(4000, 4*gib), short: nil, errSubstr: "free at once"},
		{name: "second node fits", nodes: []NodeView{
			node("n1", small).used(Capacity{MilliCPU: 900}),
			node("n2", small),
		}, req: ctr(500, gib), want: "n2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := mustPlace(t, tt.nodes, []Request{tt.req}, noOvercommit)[0]
			if tt.want != "" {
				if d.Err != nil || d.NodeID != tt.want {
					t.Fatalf("got %q, %v; want %q", d.NodeID, d.Err, tt.want)
				}
				if tt.nodes[d.Node].ID != d.NodeID {
					t.Fatalf("Node index %d does not name %q", d.Node, d.NodeID)
				}
				return
			}
			ce := capErr(t, d)
			if !slices.Equal(ce.Short, tt.short) {
				t.Errorf("Short = %v, want %v", ce.Short, tt.short)
			}
			if !strings.Contains(d.Err.Error(), tt.errSubstr) {
				t.Errorf("error %q does not contain %q", d.Err, tt.errSubstr)
			}
		})
	}
}

// TestShare: a node is charged its measured use (Usage) plus its share of
// what sandboxes request; a memory limit above the node never fits.
func TestShare(t *testing.T) {
	c := Capacity{MilliCPU: 1000, MemoryBytes: gib, Sandboxes: 100}
	tests := []struct {
		name string
		node NodeView
		opts []Option
		req  Request
		fits bool
	}{
		{name: "default share: cpu beyond the node fits", node: node("n", c), req: ctr(64000, 0), fits: true},
		{name: "default share: memory up to the node fits", node: node("n", c).used(Capacity{MemoryBytes: gib / 2}), req: ctr(0, gib), fits: true},
		{name: "memory limit above the node never fits", node: node("n", c), req: ctr(0, gib+1)},
		{name: "measured use fills the node", node: node("n", c).used(Capacity{MemoryBytes: gib}), opts: []Option{WithShare(Share{Memory: 0.01})}, req: ctr(0, gib)},
		{name: "measured cpu counts", node: node("n", c).used(Capacity{MilliCPU: 1000}), opts: []Option{WithShare(Share{CPU: 0.5})}, req: ctr(1, 0)},
		{name: "half cpu share fits", node: node("n", c), opts: []Option{WithShare(Share{CPU: 0.5})}, req: ctr(2000, 0), fits: true},
		{name: "half cpu share exceeded", node: node("n", c), opts: []Option{WithShare(Share{CPU: 0.5})}, req: ctr(2001, 0)},
		{name: "usage counts against the share", node: node("n", c).used(Capacity{MilliCPU: 500}), opts: []Option{WithShare(Share{CPU: 0.25})}, req: ctr(2000, 0), fits: true},
		{name: "usage counts against the share, exceeded", node: node("n", c).used(Capacity{MilliCPU: 500}), opts: []Option{WithShare(Share{CPU: 0.25})}, req: ctr(2004, 0)},
		{name: "node share beats default", node: withShare(node("n", c), Share{CPU: 1}), opts: []Option{WithShare(Share{CPU: 0.1})}, req: ctr(1001, 0)},
		{name: "node memory share", node: withShare(node("n", c), Share{Memory: 0.5}).used(Capacity{MemoryBytes: gib / 2}), req: ctr(0, gib), fits: true},
		{name: "node memory share exceeded", node: withShare(node("n", c), Share{Memory: 0.5}).used(Capacity{MemoryBytes: gib/2 + 1}), req: ctr(0, gib)},
		{name: "tiny share still charges", node: node("n", c).used(Capacity{MilliCPU: 1000}), opts: []Option{WithShare(Share{CPU: 1e-9})}, req: ctr(1, 0)},
		{name: "sandboxes never overcommitted", node: node("n", c).used(Capacity{Sandboxes: 100}), req: ctr(0, 0)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := mustPlace(t, []NodeView{tt.node}, []Request{tt.req}, tt.opts...)[0]
			if got := d.Err == nil; got != tt.fits {
				t.Fatalf("fits = %v (err %v), want %v", got, d.Err, tt.fits)
			}
		})
	}
}

// TestShareSpreadsIdleBurst: with the default share (measured use only) a
// burst of large-limit requests fills nodes by sandbox slots and spreads.
func TestShareSpreadsIdleBurst(t *testing.T) {
	c := Capacity{MilliCPU: 2000, MemoryBytes: 24 * gib, Sandboxes: 4000}
	nodes := []NodeView{node("a", c), node("b", c)}
	reqs := make([]Request, 6000)
	for i := range reqs {
		reqs[i] = ctr(4000, 8*gib)
	}
	count := map[string]int{}
	for _, d := range mustPlace(t, nodes, reqs, WithSeed(3)) {
		if d.Err != nil {
			t.Fatal(d.Err)
		}
		count[d.NodeID]++
	}
	if count["a"] != 3000 || count["b"] != 3000 {
		t.Fatalf("placements %v, want 3000 on each node", count)
	}
}

// TestFullNodes: a node whose own measured state says it is full takes
// nothing, whatever its accounts say, and the error says so when every
// eligible node is.
func TestFullNodes(t *testing.T) {
	c := Capacity{MilliCPU: 2000, MemoryBytes: 24 * gib, Sandboxes: 100}
	full := node("a", c)
	full.Full = "memory (under pressure)"
	d := mustPlace(t, []NodeView{full, node("b", c)}, []Request{ctr(0, 0)})[0]
	if d.Err != nil || d.NodeID != "b" {
		t.Fatalf("placed on %q (%v), want b", d.NodeID, d.Err)
	}
	d = mustPlace(t, []NodeView{full}, []Request{ctr(0, 0)})[0]
	var ce *CapacityError
	if !errors.As(d.Err, &ce) || ce.Full != 1 || ce.Eligible != 1 || !strings.Contains(d.Err.Error(), "a: memory (under pressure)") {
		t.Fatalf("error %v, want every node full naming a's reason", d.Err)
	}
}

func withShare(n NodeView, sh Share) NodeView {
	if n.Share == nil {
		n.Share = map[runtime.Kind]Share{}
	}
	n.Share[runtime.KindContainer] = sh
	return n
}

func TestLeastLoaded(t *testing.T) {
	c := Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10000}
	tests := []struct {
		name  string
		nodes []NodeView
		req   Request
		want  string
	}{
		{name: "least cpu in use", nodes: []NodeView{
			node("half", c).used(Capacity{MilliCPU: 5000}),
			node("fifth", c).used(Capacity{MilliCPU: 2000}),
			node("most", c).used(Capacity{MilliCPU: 8000}),
		}, req: ctr(100, 0), want: "fifth"},
		{name: "binding resource is the fullest", nodes: []NodeView{
			node("mem-full", c).used(Capacity{MilliCPU: 1000, MemoryBytes: 9 * gib}),
			node("even", c).used(Capacity{MilliCPU: 5000, MemoryBytes: 5 * gib}),
		}, req: ctr(100, 0), want: "even"},
		{name: "sandbox slots bind", nodes: []NodeView{
			node("slots-full", Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10}).used(Capacity{Sandboxes: 9}),
			node("cpu-half", Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10}).used(Capacity{MilliCPU: 5000, Sandboxes: 1}),
		}, req: ctr(0, 0), want: "cpu-half"},
		{name: "bigger node is less loaded by the same usage", nodes: []NodeView{
			node("small", Capacity{MilliCPU: 4000, MemoryBytes: 4 * gib, Sandboxes: 10000}).used(Capacity{MilliCPU: 2000}),
			node("big", Capacity{MilliCPU: 16000, MemoryBytes: 16 * gib, Sandboxes: 10000}).used(Capacity{MilliCPU: 2000}),
		}, req: ctr(100, 0), want: "big"},
		{name: "measured load counts", nodes: []NodeView{
			withLoad(node("hot", c), 0.9),
			node("allocated", c).used(Capacity{MilliCPU: 3000}),
		}, req: ctr(100, 0), want: "allocated"},
		{name: "request size decides after placement", nodes: []NodeView{
			// Both 40% full; the request adds a larger fraction to the small node.
			node("small", Capacity{MilliCPU: 5000, MemoryBytes: 10 * gib, Sandboxes: 10000}).used(Capacity{MilliCPU: 2000}),
			node("big", Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10000}).used(Capacity{MilliCPU: 4000}),
		}, req: ctr(1000, 0), want: "big"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := mustPlace(t, tt.nodes, []Request{tt.req}, noOvercommit)[0]
			if d.Err != nil || d.NodeID != tt.want {
				t.Fatalf("got %q, %v; want %q", d.NodeID, d.Err, tt.want)
			}
		})
	}
}

func withLoad(n NodeView, load float64) NodeView {
	n.Load = load
	return n
}

func TestLocality(t *testing.T) {
	c := Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10000}
	base := LayerRef{Digest: "sha256:base", Bytes: 2 * gib}
	ws := LayerRef{Digest: "sha256:ws", Bytes: 1 << 20}
	tk := LayerRef{Digest: "sha256:tk", Bytes: 1 << 20}
	image := []LayerRef{base, ws, tk}
	load := func(n NodeView, milli int64) NodeView { return n.used(Capacity{MilliCPU: milli}) }
	tests := []struct {
		name  string
		nodes []NodeView
		req   Request
		opts  []Option
		want  string
	}{
		{name: "locality beats a small load difference", nodes: []NodeView{
			load(node("cold", c), 2500),
			load(node("warm", c), 3000).holding(base.Digest, ws.Digest, tk.Digest),
		}, req: ctr(0, 0, image...), want: "warm"},
		{name: "locality loses to a large load difference", nodes: []NodeView{
			load(node("cold", c), 2000),
			load(node("warm", c), 6000).holding(base.Digest, ws.Digest, tk.Digest),
		}, req: ctr(0, 0, image...), want: "cold"},
		{name: "a full node is never chosen for locality", nodes: []NodeView{
			load(node("cold", c), 9000),
			node("warm", Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 5}).used(Capacity{Sandboxes: 5}).holding(base.Digest, ws.Digest, tk.Digest),
		}, req: ctr(0, 0, image...), want: "cold"},
		{name: "bytes outweigh layer count", nodes: []NodeView{
			node("two-small", c).holding(ws.Digest, tk.Digest),
			node("one-big", c).holding(base.Digest),
		}, req: ctr(0, 0, image...), want: "one-big"},
		{name: "count when sizes are unknown", nodes: []NodeView{
			node("one", c).holding("a"),
			node("two", c).holding("b", "c"),
		}, req: ctr(0, 0, LayerRef{Digest: "a"}, LayerRef{Digest: "b"}, LayerRef{Digest: "c"}), want: "two"},
		{name: "weight zero ignores locality", nodes: []NodeView{
			load(node("cold", c), 2500),
			load(node("warm", c), 3000).holding(base.Digest, ws.Digest, tk.Digest),
		}, req: ctr(0, 0, image...), opts: []Option{WithLocalityWeight(0)}, want: "cold"},
		{name: "larger weight beats a larger load difference", nodes: []NodeView{
			load(node("cold", c), 2000),
			load(node("warm", c), 6000).holding(base.Digest, ws.Digest, tk.Digest),
		}, req: ctr(0, 0, image...), opts: []Option{WithLocalityWeight(0.5)}, want: "warm"},
		{name: "layers the request does not need do not count", nodes: []NodeView{
			load(node("cold", c), 2500),
			load(node("other", c), 3000).holding("sha256:unrelated1", "sha256:unrelated2"),
		}, req: ctr(0, 0, image...), want: "cold"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := append([]Option{noOvercommit}, tt.opts...)
			d := mustPlace(t, tt.nodes, []Request{tt.req}, opts...)[0]
			if d.Err != nil || d.NodeID != tt.want {
				t.Fatalf("got %q, %v; want %q", d.NodeID, d.Err, tt.want)
			}
		})
	}
}

// TestLocalityManyLayers crosses the 64-layer word boundary of the bitsets.
func TestLocalityManyLayers(t *testing.T) {
	c := Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10000}
	var layers []LayerRef
	var digests []string
	for i := range 130 {
		d := fmt.Sprintf("sha256:%03d", i)
		layers = append(layers, LayerRef{Digest: d, Bytes: 1})
		digests = append(digests, d)
	}
	// "high" holds layers 64..129 (66 of them), "low" holds 0..63 (64).
	nodes := []NodeView{node("low", c).holding(digests[:64]...), node("high", c).holding(digests[64:]...)}
	d := mustPlace(t, nodes, []Request{ctr(0, 0, layers...)})[0]
	if d.NodeID != "high" {
		t.Fatalf("got %q, %v; want high", d.NodeID, d.Err)
	}
	// Only the last layer differs between the nodes' holdings.
	d = mustPlace(t, nodes, []Request{ctr(0, 0, layers[129])})[0]
	if d.NodeID != "high" {
		t.Fatalf("got %q, %v; want high", d.NodeID, d.Err)
	}
}

func TestExclusions(t *testing.T) {
	c := Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 100}
	nodes := []NodeView{
		node("best", c),
		node("next", c).used(Capacity{MilliCPU: 5000}),
		node("worst", c).used(Capacity{MilliCPU: 8000}),
	}
	excl := func(r Request, ids ...string) Request { r.Exclude = ids; return r }
	ds := mustPlace(t, nodes, []Request{
		excl(ctr(100, 0), "best"),
		excl(ctr(100, 0), "best", "next", "no-such-node"),
		excl(ctr(100, 0), "best", "next", "worst"),
		ctr(100, 0), // exclusions belong to their request only
	}, noOvercommit)
	for i, want := range []string{"next", "worst", "", "best"} {
		if want == "" {
			ce := capErr(t, ds[i])
			if ce.Excluded != 3 || ce.Eligible != 0 {
				t.Errorf("request %d: Excluded=%d Eligible=%d, want 3, 0", i, ce.Excluded, ce.Eligible)
			}
			if !strings.Contains(ds[i].Err.Error(), "excludes all 3") {
				t.Errorf("request %d: error %q does not say all nodes were excluded", i, ds[i].Err)
			}
			continue
		}
		if ds[i].NodeID != want {
			t.Errorf("request %d: got %q, %v; want %q", i, ds[i].NodeID, ds[i].Err, want)
		}
	}
}

func TestSkipsUnhealthyAndDraining(t *testing.T) {
	c := Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 100}
	sick := node("sick", c)
	sick.Healthy = false
	draining := node("draining", c)
	draining.Draining = true
	busy := node("busy", c).used(Capacity{MilliCPU: 9000})

	d := mustPlace(t, []NodeView{sick, draining, busy}, []Request{ctr(100, 0)}, noOvercommit)[0]
	if d.NodeID != "busy" {
		t.Fatalf("got %q, %v; want busy", d.NodeID, d.Err)
	}
	d = mustPlace(t, []NodeView{sick, draining}, []Request{ctr(100, 0)}, noOvercommit)[0]
	ce := capErr(t, d)
	if ce.Offered != 2 || ce.Eligible != 0 || !strings.Contains(d.Err.Error(), "no healthy, non-draining node") {
		t.Fatalf("got %+v (%v)", ce, d.Err)
	}
}

func TestBackendsAccountedSeparately(t *testing.T) {
	n := NodeView{ID: "n", Healthy: true,
		Capacity: map[runtime.Kind]Capacity{
			runtime.KindContainer: {MilliCPU: 1000, MemoryBytes: gib, Sandboxes: 1},
			runtime.KindMicroVM:   {MilliCPU: 1000, MemoryBytes: gib, Sandboxes: 1},
		},
		Usage: map[runtime.Kind]Capacity{runtime.KindContainer: {Sandboxes: 1}},
	}
	ds := mustPlace(t, []NodeView{n}, []Request{
		ctr(0, 0),
		{Kind: runtime.KindMicroVM, MilliCPU: 1000, MemoryBytes: gib},
		{Kind: runtime.KindFullVM},
	})
	capErr(t, ds[0])
	if ds[1].NodeID != "n" {
		t.Errorf("microvm: got %q, %v; want n", ds[1].NodeID, ds[1].Err)
	}
	if ce := capErr(t, ds[2]); ce.Offered != 0 || !strings.Contains(ds[2].Err.Error(), "no node offers backend fullvm") {
		t.Errorf("fullvm: got %+v (%v)", ce, ds[2].Err)
	}
}

func TestCapacityRunsOutMidBatch(t *testing.T) {
	c := Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 2}
	nodes := []NodeView{node("a", c), node("b", c), node("c", c)}
	reqs := make([]Request, 8)
	for i := range reqs {
		reqs[i] = ctr(100, gib)
	}
	reqs[3] = ctr(20000, gib) // too big anywhere: fails without using a slot
	ds := mustPlace(t, nodes, reqs, noOvercommit)
	perNode := map[string]int{}
	for i, d := range ds {
		switch {
		case i == 3:
			if ce := capErr(t, d); !slices.Equal(ce.Short, []Resource{ResourceCPU}) {
				t.Errorf("request 3: Short = %v, want [milliCPU]", ce.Short)
			}
		case i < 7:
			if d.Err != nil {
				t.Fatalf("request %d: %v", i, d.Err)
			}
			perNode[d.NodeID]++
		default:
			if ce := capErr(t, d); !slices.Equal(ce.Short, []Resource{ResourceSandboxes}) {
				t.Errorf("request %d: Short = %v, want [sandboxes]", i, ce.Short)
			}
		}
	}
	want := map[string]int{"a": 2, "b": 2, "c": 2}
	if !reflect.DeepEqual(perNode, want) {
		t.Fatalf("per node %v, want %v", perNode, want)
	}
}

func equalNodes(n int, c Capacity) []NodeView {
	nodes := make([]NodeView, n)
	for i := range nodes {
		nodes[i] = node(fmt.Sprintf("node-%03d", i), c)
	}
	return nodes
}

func TestBurstSpreadsEvenly(t *testing.T) {
	const nNodes, nReqs = 160, 32768
	nodes := equalNodes(nNodes, Capacity{MilliCPU: 64000, MemoryBytes: 256 * gib, Sandboxes: 3200})
	reqs := make([]Request, nReqs)
	for i := range reqs {
		reqs[i] = ctr(1000, gib)
	}
	for _, seed := range []uint64{0, 1, 42} {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			ds := mustPlace(t, nodes, reqs, WithSeed(seed))
			counts := make([]int, nNodes)
			for i, d := range ds {
				if d.Err != nil {
					t.Fatalf("request %d: %v", i, d.Err)
				}
				counts[d.Node]++
			}
			lo, hi := slices.Min(counts), slices.Max(counts)
			if hi-lo > 1 {
				t.Fatalf("spread %d..%d per node, want at most 1 apart", lo, hi)
			}
			// Prefix balance: the burst is even at every point, not just at the end.
			prefix := make([]int, nNodes)
			for i, d := range ds[:nNodes*3+7] {
				prefix[d.Node]++
				if prefix[d.Node] > i/nNodes+1 {
					t.Fatalf("after %d placements node %d has %d", i+1, d.Node, prefix[d.Node])
				}
			}
		})
	}
}

func TestDeterministicWithSeed(t *testing.T) {
	nodes := equalNodes(160, Capacity{MilliCPU: 64000, MemoryBytes: 256 * gib, Sandboxes: 3200})
	reqs := make([]Request, 1000)
	for i := range reqs {
		reqs[i] = ctr(1000, gib)
	}
	order := func(seed uint64) []int {
		ds := mustPlace(t, nodes, reqs, WithSeed(seed))
		out := make([]int, len(ds))
		for i, d := range ds {
			out[i] = d.Node
		}
		return out
	}
	a, b, c := order(7), order(7), order(8)
	if !slices.Equal(a, b) {
		t.Fatal("same seed gave different decisions")
	}
	if slices.Equal(a, c) {
		t.Fatal("different seeds gave identical tie-breaks for 1000 placements over 160 equal nodes")
	}
}

func TestPerItemRequestErrors(t *testing.T) {
	nodes := []NodeView{node("n", Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 100})}
	reqs := []Request{
		ctr(100, gib),
		ctr(-1, 0),
		{MilliCPU: 1},
		ctr(0, -5),
		ctr(0, 0, LayerRef{Digest: ""}),
		ctr(0, 0, LayerRef{Digest: "sha256:x", Bytes: -1}),
		ctr(100, gib),
	}
	wantField := []string{"", "milliCPU", "kind", "memoryBytes", "layers[0].digest", "layers[0].bytes", ""}
	ds := mustPlace(t, nodes, reqs)
	for i, d := range ds {
		if wantField[i] == "" {
			if d.Err != nil || d.NodeID != "n" {
				t.Errorf("request %d: got %q, %v; want n", i, d.NodeID, d.Err)
			}
			continue
		}
		if !errors.Is(d.Err, ErrInvalidRequest) || !strings.Contains(d.Err.Error(), wantField[i]) {
			t.Errorf("request %d: error %v, want ErrInvalidRequest naming %s", i, d.Err, wantField[i])
		}
		if d.Node != -1 {
			t.Errorf("request %d: Node = %d, want -1", i, d.Node)
		}
	}
}

func TestInvalidNodes(t *testing.T) {
	c := Capacity{MilliCPU: 1000, MemoryBytes: gib, Sandboxes: 1}
	neg := node("neg", Capacity{MilliCPU: -1})
	negUse := node("neg-use", c).used(Capacity{MemoryBytes: -1})
	tests := []struct {
		name  string
		nodes []NodeView
		opts  []Option
	}{
		{name: "empty ID", nodes: []NodeView{node("", c)}},
		{name: "duplicate ID", nodes: []NodeView{node("a", c), node("a", c)}},
		{name: "negative capacity", nodes: []NodeView{neg}},
		{name: "negative usage", nodes: []NodeView{negUse}},
		{name: "NaN load", nodes: []NodeView{withLoad(node("a", c), math.NaN())}},
		{name: "negative node share", nodes: []NodeView{withShare(node("a", c), Share{CPU: -2})}},
		{name: "NaN node share", nodes: []NodeView{withShare(node("a", c), Share{Memory: math.NaN()})}},
		{name: "infinite default share", nodes: []NodeView{node("a", c)}, opts: []Option{WithShare(Share{Memory: math.Inf(1)})}},
		{name: "nil scorer", nodes: []NodeView{node("a", c)}, opts: []Option{WithScorer(nil)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ds, err := Place(tt.nodes, []Request{ctr(1, 1)}, tt.opts...)
			if err == nil {
				t.Fatalf("Place accepted it: %+v", ds)
			}
			if ds != nil {
				t.Fatalf("decisions returned with error: %+v", ds)
			}
		})
	}
}

// TestScorerSeam shows the policy is replaceable: a bin-packing scorer packs
// the batch onto one node where the default spreads it.
func TestScorerSeam(t *testing.T) {
	nodes := equalNodes(4, Capacity{MilliCPU: 10000, MemoryBytes: 10 * gib, Sandboxes: 10})
	reqs := make([]Request, 10)
	for i := range reqs {
		reqs[i] = ctr(100, 0)
	}
	binPack := ScorerFunc(func(_ *Request, c Candidate) float64 { return c.Utilization })
	ds := mustPlace(t, nodes, reqs, WithScorer(binPack))
	for i, d := range ds {
		if d.Node != ds[0].Node {
			t.Fatalf("request %d went to %s, not %s", i, d.NodeID, ds[0].NodeID)
		}
	}
	// The 11th does not fit on the packed node and goes elsewhere.
	ds = mustPlace(t, nodes, append(reqs, ctr(100, 0)), WithScorer(binPack))
	if ds[10].Err != nil || ds[10].Node == ds[0].Node {
		t.Fatalf("11th request: %q, %v", ds[10].NodeID, ds[10].Err)
	}
}

func TestDoesNotModifyInput(t *testing.T) {
	nodes := []NodeView{
		node("a", Capacity{MilliCPU: 1000, MemoryBytes: gib, Sandboxes: 5}).used(Capacity{MilliCPU: 100, Sandboxes: 1}).holding("x"),
		node("b", Capacity{MilliCPU: 1000, MemoryBytes: gib, Sandboxes: 5}),
	}
	before := fmt.Sprintf("%+v", nodes)
	reqs := []Request{ctr(100, 1000, LayerRef{Digest: "x"}), ctr(100, 1000), ctr(100, 1000)}
	reqsBefore := fmt.Sprintf("%+v", reqs)
	mustPlace(t, nodes, reqs)
	if after := fmt.Sprintf("%+v", nodes); after != before {
		t.Fatalf("nodes changed:\n%s\n%s", before, after)
	}
	if after := fmt.Sprintf("%+v", reqs); after != reqsBefore {
		t.Fatalf("requests changed:\n%s\n%s", reqsBefore, after)
	}
}

// TestRandomBatchesAgainstReplay checks the engine's invariants on random
// clusters and batches by replaying its decisions with a naive model: no
// placement overfills a node, and a request fails only when no eligible node
// could take it at that point in the batch.
func TestRandomBatchesAgainstReplay(t *testing.T) {
	kinds := []runtime.Kind{runtime.KindContainer, runtime.KindMicroVM}
	totalPlaced, totalFailed := 0, 0
	for seed := range uint64(30) {
		rng := rand.New(rand.NewPCG(seed, 99))
		nodes := make([]NodeView, 1+rng.IntN(20))
		for i := range nodes {
			n := NodeView{ID: fmt.Sprint("n", i), Healthy: rng.IntN(8) != 0, Draining: rng.IntN(8) == 0,
				Capacity: map[runtime.Kind]Capacity{}, Usage: map[runtime.Kind]Capacity{}, Load: rng.Float64() / 2,
				Layers: map[string]struct{}{}}
			if rng.IntN(3) == 0 {
				n.Share = map[runtime.Kind]Share{runtime.KindContainer: {CPU: float64(rng.IntN(5)) / 4, Memory: float64(rng.IntN(3)) / 2}}
			}
			for _, k := range kinds {
				if rng.IntN(4) == 0 {
					continue
				}
				c := Capacity{MilliCPU: int64(rng.IntN(16000)), MemoryBytes: int64(rng.IntN(32)) * gib, Sandboxes: int64(rng.IntN(40))}
				n.Capacity[k] = c
				n.Usage[k] = Capacity{MilliCPU: int64(rng.IntN(int(c.MilliCPU) + 1)), MemoryBytes: int64(rng.IntN(int(c.MemoryBytes/gib)+1)) * gib, Sandboxes: int64(rng.IntN(int(c.Sandboxes) + 1))}
			}
			for l := range 6 {
				if rng.IntN(2) == 0 {
					n.Layers[fmt.Sprint("l", l)] = struct{}{}
				}
			}
			nodes[i] = n
		}
		reqs := make([]Request, 300)
		for i := range reqs {
			r := Request{Kind: kinds[rng.IntN(2)], MilliCPU: int64(rng.IntN(3000)), MemoryBytes: int64(rng.IntN(4)) * gib}
			for range rng.IntN(4) {
				r.Layers = append(r.Layers, LayerRef{Digest: fmt.Sprint("l", rng.IntN(6)), Bytes: int64(rng.IntN(100))})
			}
			if rng.IntN(5) == 0 {
				r.Exclude = []string{nodes[rng.IntN(len(nodes))].ID}
			}
			reqs[i] = r
		}
		ds := mustPlace(t, nodes, reqs, WithSeed(seed))

		// Replay with plain maps.
		use := map[string]Capacity{}
		for _, n := range nodes {
			for k, u := range n.Usage {
				use[n.ID+"/"+string(k)] = u
			}
		}
		// charged is what a node is charged for r: the share of its
		// requests, rounded up.
		charged := func(n NodeView, r Request) Capacity {
			sh, ok := n.Share[r.Kind]
			if !ok {
				sh = DefaultShare
			}
			return Capacity{MilliCPU: int64(math.Ceil(float64(r.MilliCPU) * sh.CPU)), MemoryBytes: int64(math.Ceil(float64(r.MemoryBytes) * sh.Memory)), Sandboxes: 1}
		}
		fits := func(n NodeView, r Request) bool {
			if _, ok := n.Capacity[r.Kind]; !ok || !n.Healthy || n.Draining || slices.Contains(r.Exclude, n.ID) {
				return false
			}
			u, l, ch := use[n.ID+"/"+string(r.Kind)], n.Capacity[r.Kind], charged(n, r)
			return u.MilliCPU+ch.MilliCPU <= l.MilliCPU && u.MemoryBytes+ch.MemoryBytes <= l.MemoryBytes && u.Sandboxes+1 <= l.Sandboxes && r.MemoryBytes <= l.MemoryBytes
		}
		placed := 0
		for i, d := range ds {
			r := reqs[i]
			if d.Err != nil {
				if !errors.Is(d.Err, ErrNoCapacity) {
					t.Fatalf("seed %d request %d: unexpected error %v", seed, i, d.Err)
				}
				for _, n := range nodes {
					if fits(n, r) {
						t.Fatalf("seed %d request %d failed (%v) but fits on %s", seed, i, d.Err, n.ID)
					}
				}
				continue
			}
			n := nodes[d.Node]
			if !fits(n, r) {
				t.Fatalf("seed %d request %d placed on %s where it does not fit", seed, i, n.ID)
			}
			key := n.ID + "/" + string(r.Kind)
			u, ch := use[key], charged(n, r)
			use[key] = Capacity{MilliCPU: u.MilliCPU + ch.MilliCPU, MemoryBytes: u.MemoryBytes + ch.MemoryBytes, Sandboxes: u.Sandboxes + 1}
			placed++
		}
		totalPlaced += placed
		totalFailed += len(ds) - placed
	}
	// The generator must exercise both outcomes or the replay proves little.
	if totalPlaced == 0 || totalFailed == 0 {
		t.Fatalf("placed %d, failed %d: generator does not cover both outcomes", totalPlaced, totalFailed)
	}
	t.Logf("placed %d, failed %d", totalPlaced, totalFailed)
}

// TestBurstSpreadsOverHotNodes: the measured load of every node is stale
// for the length of a batch. A burst onto nodes that all report a high load
// (or loads in the same quarter band) must still spread by what the batch
// adds, not pile onto whichever node reported a hair less.
func TestBurstSpreadsOverHotNodes(t *testing.T) {
	c := Capacity{MilliCPU: 64000, MemoryBytes: 256 << 30, Sandboxes: 4096}
	for _, loads := range [][]float64{{3.1, 2.4, 5.0}, {0.71, 0.74, 0.70}} {
		nodes := []NodeView{
			withLoad(node("a", c), loads[0]), withLoad(node("b", c), loads[1]), withLoad(node("c", c), loads[2]),
		}
		reqs := make([]Request, 9)
		for i := range reqs {
			reqs[i] = ctr(0, 0)
		}
		count := map[string]int{}
		for _, d := range mustPlace(t, nodes, reqs, WithSeed(1)) {
			count[d.NodeID]++
		}
		for _, id := range []string{"a", "b", "c"} {
			if count[id] != 3 {
				t.Fatalf("loads %v: placements %v, want 3 on each node", loads, count)
			}
		}
	}
}
