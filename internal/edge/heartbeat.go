package edge

import (
	"context"
	"maps"
	"slices"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

// CachedLayerer is implemented by layer stores that keep layers' chunks on
// the node without holding them mounted (lazyfs.Store): heartbeats report
// those layers so that placement prefers this node for their images.
type CachedLayerer interface {
	CachedLayers() []string
}

// heartbeat describes the node as servers need it to place and route: a
// full snapshot each time rather than a delta, so a server that starts (or
// misses beats) catches up with the next one and keeps no other state.
func (e *Edge) heartbeat() *dsecv1.HeartbeatRequest {
	req := &dsecv1.HeartbeatRequest{
		NodeId: e.cfg.NodeID,
		Url:    e.cfg.AdvertiseURL,
		Load:   loadPerCore(),
		BootId: e.bootID,
		// Servers fill these into the specs they place here.
		Defaults: e.cfg.Defaults.Proto(),
	}
	held := map[string]int{}
	req.Pools = e.poolSummaries(held)
	st, since := e.state.get()
	e.mu.Lock()
	for _, kind := range slices.Sorted(maps.Keys(e.cfg.Capacity)) {
		c, u, r, sh := e.cfg.Capacity[kind], e.chargedLocked(kind), e.requestedLocked(kind), e.cfg.RequestShare[kind]
		m := st.use[kind]
		req.Capacity = append(req.Capacity, &dsecv1.BackendCapacity{
			Backend:              string(kind),
			MilliCpu:             c.MilliCPU,
			MemoryBytes:          c.MemoryBytes,
			Sandboxes:            c.Sandboxes,
			UsedMilliCpu:         u.MilliCPU,
			UsedMemoryBytes:      u.MemoryBytes,
			UsedSandboxes:        u.Sandboxes,
			RequestShareCpu:      sh.CPU,
			RequestShareMemory:   sh.Memory,
			RequestedMilliCpu:    r.MilliCPU,
			RequestedMemoryBytes: r.MemoryBytes,
			MeasuredMilliCpu:     m.milliCPU,
			MeasuredMemoryBytes:  m.memoryBytes,
			MeasuredSwapBytes:    m.swapBytes,
		})
	}
	req.Status = st.proto(st.full(since, e.cfg.MemoryReserve))
	for d := range e.layers {
		held[d]++
	}
	// Layers whose chunks this node has cached (opened lazily) count as
	// held too: a create placed here reads them from its disk, not the
	// store.
	if c, ok := e.local.(CachedLayerer); ok {
		for _, d := range c.CachedLayers() {
			held[d] += 0
		}
	}
	req.Layers = slices.Sorted(maps.Keys(held))
	e.mu.Unlock()
	req.Sandboxes = e.summaries()
	req.Queued = e.fnQueued()
	return req
}

// heartbeatLoop beats to one server until ctx is done. Each server gets its
// own loop so that one slow or dead replica does not delay the others.
func (e *Edge) heartbeatLoop(ctx context.Context, url string) {
	client := dsecv1connect.NewNodeServiceClient(e.cfg.HTTPClient, url,
		connect.WithInterceptors(ClusterAuth(e.cfg.ClusterToken)))
	log := e.log.With("server", url)
	ticker := time.NewTicker(e.cfg.HeartbeatInterval)
	defer ticker.Stop()
	failing := false
	for {
		// One beat at a time, each bounded so that a server that stopped
		// answering is tried again; but not so tightly that a beat on a
		// saturated node (slow, not lost) is abandoned every time until
		// the server's node timeout (10 s by default) declares it dead.
		cctx, cancel := context.WithTimeout(ctx, max(2*e.cfg.HeartbeatInterval, 5*time.Second))
		_, err := client.Heartbeat(cctx, connect.NewRequest(e.heartbeat()))
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			e.metrics.heartbeats.WithLabelValues("error").Inc()
			if !failing {
				log.Warn("heartbeat failed", "err", err)
			}
			failing = true
		default:
			e.metrics.heartbeats.WithLabelValues("ok").Inc()
			if failing {
				log.Info("heartbeat recovered")
			}
			failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}
