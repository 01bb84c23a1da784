package edge

import (
	"slices"
	"strings"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
)

// RebasePoolStats returns the counters of tenant's rebase pools (one per
// user-namespace mode), sorted by key.
func (e *Edge) RebasePoolStats(tenant string) []pool.Stats {
	e.mu.Lock()
	var keys []string
	for k := range e.rebasePools {
		if strings.HasPrefix(k, tenant+"/") {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	pools := make([]*pool.Pool, len(keys))
	for i, k := range keys {
		pools[i] = e.rebasePools[k].p
	}
	e.mu.Unlock()
	out := make([]pool.Stats, len(pools))
	for i, p := range pools {
		out[i] = p.Stats()
	}
	return out
}

// ForgetIdleSum makes the next roomToKeep sum the pools' idle sandboxes
// afresh instead of reusing a sum younger than idleSumEvery.
func (e *Edge) ForgetIdleSum() {
	e.idleMu.Lock()
	e.idleAt = time.Time{}
	e.idleMu.Unlock()
}
