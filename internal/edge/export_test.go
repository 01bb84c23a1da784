package edge

import dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"

// PoolSummaries is what the next heartbeat would say of the node's pools.
func (e *Edge) PoolSummaries() []*dsecv1.PoolSummary { return e.poolSummaries(map[string]int{}) }
