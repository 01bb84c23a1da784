package edge

import (
	"slices"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
)

// AutoPoolStats returns the counters of tenant's automatic pools, sorted by
// pool ID.
func (e *Edge) AutoPoolStats(tenant string) []pool.Stats {
	pools := e.autoPoolList()
	slices.SortFunc(pools, func(a, b *warmPool) int { return cmpString(a.id, b.id) })
	var out []pool.Stats
	for _, wp := range pools {
		if wp.tenant == tenant {
			out = append(out, wp.p.Stats())
		}
	}
	return out
}

// SetAutoPoolIdle shortens autoPoolIdle for a test and returns what
// restores it. Call it before starting a node, and restore after the node
// is closed.
func SetAutoPoolIdle(d time.Duration) (restore func()) {
	old := autoPoolIdle
	autoPoolIdle = d
	return func() { autoPoolIdle = old }
}
