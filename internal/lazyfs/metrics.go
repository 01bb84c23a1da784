package lazyfs

import (
	"crypto/sha256"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dsec-dev/dsec/internal/fail"
)

// metrics are the loader's counters (atomics, so tests and benchmarks read
// them without a registry) and the Prometheus series, dsec_lazy_*, that
// read them.
type metrics struct {
	readBytes, fetchedBytes, fetches, hits, misses, failures, evictedN, fetchNanos counter
	evictions                                                                      *counter
	cacheBytes                                                                     prometheus.Gauge
	fetchSeconds                                                                   prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		cacheBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "dsec_lazy_cache_bytes",
			Help: "Bytes of layer chunks in the node's chunk cache.",
		}),
		fetchSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "dsec_lazy_fetch_seconds",
			Help:    "Latency of one range read of a chunk from the blob store (each attempt).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
	}
	m.evictions = &m.evictedN
	if reg == nil {
		return m, nil
	}
	cf := func(name, help string, c *counter) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(c.Load()) })
	}
	for _, c := range []prometheus.Collector{
		m.cacheBytes, m.fetchSeconds,
		cf("dsec_lazy_read_bytes_total", "Bytes of lazy layer files the kernel read through FUSE (what sandboxes' reads of the layers needed).", &m.readBytes),
		cf("dsec_lazy_fetched_bytes_total", "Bytes of chunks fetched from the blob store.", &m.fetchedBytes),
		cf("dsec_lazy_fetches_total", "Range reads of chunks from the blob store (attempts).", &m.fetches),
		cf("dsec_lazy_cache_hits_total", "Chunk reads served from the node's chunk cache.", &m.hits),
		cf("dsec_lazy_cache_misses_total", "Chunk reads that waited for a fetch.", &m.misses),
		cf("dsec_lazy_fetch_failures_total", "Chunks that could not be fetched or did not match their digest (readers got EIO).", &m.failures),
		cf("dsec_lazy_evictions_total", "Chunks evicted from the node's chunk cache.", &m.evictedN),
	} {
		if err := reg.Register(c); err != nil {
			return nil, fail.New(fail.Internal, err)
		}
	}
	return m, nil
}

func sumOf(b []byte) [sha256.Size]byte { return sha256.Sum256(b) }
