package placement

import "math"

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
	// CPU, memory and sandbox slots, as charged) that would be in use
	// once the request is placed, in [0, 1].
	Utilization float64
	// Added is the part of Utilization this batch put there (earlier
	// requests of the same Place call, plus this one): work the node's
	// measured Load cannot show yet.
	Added float64
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

// loadBand coarsens a measured load (busy fraction of the node's cores)
// to quarter steps, capped at a saturated node: heartbeats sample load at
// different moments, and a burst must not pile onto whichever node happened
// to report 0.71 instead of 0.74, nor rank two saturated nodes by how far
// past saturation they are. Within a band, utilization and what the batch
// added decide.
func loadBand(load float64) float64 {
	if load >= 1 {
		return 1
	}
	if load <= 0 {
		return 0
	}
	return math.Floor(load*4) / 4
}

// LeastLoaded is the v1 policy: spread load, prefer nodes holding the
// request's layers. A node counts as busy as the larger of its allocated
// utilization and its measured Load plus what this batch has added to it
// since (a node running hotter than its allocations say is avoided, and a
// burst onto equally hot nodes still spreads: the measured load alone
// would not move until the next heartbeat).
type LeastLoaded struct {
	// LocalityWeight is how much utilization a full layer hit is worth.
	LocalityWeight float64
}

// Score implements Scorer.
func (s LeastLoaded) Score(_ *Request, c Candidate) float64 {
	busy := c.Utilization
	if l := loadBand(c.Node.Load) + c.Added; l > busy {
		busy = l
	}
	return s.LocalityWeight*c.Locality - busy
}
