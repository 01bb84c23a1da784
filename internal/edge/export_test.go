package edge

import dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"

// PoolSummaries is what the next heartbeat would say of the node's pools.
func (e *Edge) PoolSummaries() []*dsecv1.PoolSummary { return e.poolSummaries(map[string]int{}) }

// FnPoolsInUse is, per fncall pool of the node, how many of its sandboxes
// calls hold.
func (e *Edge) FnPoolsInUse() []int {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []int
	for _, fp := range e.fnPools {
		out = append(out, fp.p.Stats().InUse)
	}
	return out
}
