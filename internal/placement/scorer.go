package placement

// DefaultLocalityWeight lets a node that holds all of a request's layers win
// over a node up to 10 percentage points less loaded. Layers load lazily, so
// a miss costs a slower first start, not a full image pull: locality should
// tip close calls, not pile a burst onto the few nodes that hold an image.
const DefaultLocalityWeight = 0.1

// Candidate is a node that fits a request, with the figures a Scorer weighs.
type Candidate struct {
	// Node is the node's view; Index is its position in the nodes passed to Place.
	Node  *NodeView
	Index int
	// Utilization is the fraction of the binding resource (the fullest of
	// CPU, memory and sandbox slots, after overcommit) that would be in use
	// once the request is placed, in [0, 1].
	Utilization float64
	// Locality is the fraction of the request's layer weight (bytes, or
	// count where sizes are unknown) the node already holds, in [0, 1];
	// 0 for a request without layers.
	Locality float64
}

// Scorer ranks the nodes that fit a request; the highest score wins and
// exact ties are broken by the seeded random. Place guarantees fit, so a
// Scorer only expresses preference. Score is called once per fitting node
// per request (millions of times for a burst): it must not allocate, must
// return a finite number, and must be a pure function of its arguments.
type Scorer interface {
	Score(req *Request, c Candidate) float64
}

// ScorerFunc adapts a function to Scorer.
type ScorerFunc func(req *Request, c Candidate) float64

// Score calls f.
func (f ScorerFunc) Score(req *Request, c Candidate) float64 { return f(req, c) }

// LeastLoaded is the v1 policy: spread load, prefer nodes holding the
// request's layers. A node counts as busy as the larger of its allocated
// utilization and its measured Load, so a node running hotter than its
// allocations say is avoided.
type LeastLoaded struct {
	// LocalityWeight is how much utilization a full layer hit is worth.
	LocalityWeight float64
}

// Score implements Scorer.
func (s LeastLoaded) Score(_ *Request, c Candidate) float64 {
	busy := c.Utilization
	if c.Node.Load > busy {
		busy = c.Node.Load
	}
	return s.LocalityWeight*c.Locality - busy
}
