package edge

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dsec-dev/dsec/internal/pool"
)

// metrics are the edge's Prometheus series, all prefixed dsec_edge_.
type metrics struct {
	creates     *prometheus.CounterVec
	destroys    *prometheus.CounterVec
	failures    *prometheus.CounterVec
	execSeconds *prometheus.HistogramVec
	live        *prometheus.GaugeVec
	heartbeats  *prometheus.CounterVec
	fncalls     *prometheus.CounterVec
	egress      *prometheus.CounterVec
	egressBytes *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		fncalls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_fncalls_total",
			Help: "fncall calls run on this node, by language and status (Success, Failed, SandboxError).",
		}, []string{"language", "status"}),
		creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_sandbox_creates_total",
			Help: "Sandboxes created on this node, by backend and source: fresh (built by the backend), pool (taken from a warm pool), recycled (a destroyed sandbox of the same spec, reset, from an automatic pool), rebased (a destroyed sandbox of another spec of the tenant, rebased onto this one).",
		}, []string{"backend", "source"}),
		destroys: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_sandbox_destroys_total",
			Help: "Sandboxes destroyed, by reason (request, ttl, idle, shutdown).",
		}, []string{"backend", "reason"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_sandbox_failures_total",
			Help: "Refused or failed creates and lost sandboxes, by reason (invalid, image, admission, backend, canceled, lost).",
		}, []string{"backend", "reason"}),
		execSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_edge_exec_duration_seconds",
			Help:    "Time an exec took on the edge, from dispatch to result.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}, []string{"backend"}),
		live: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "dsec_edge_sandboxes",
			Help: "Sandboxes this node knows, by backend and state (destroyed ones excluded).",
		}, []string{"backend", "state"}),
		egress: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_egress_connections_total",
			Help: "Connections sandboxes asked their egress proxy for, by decision (allowed, denied).",
		}, []string{"decision"}),
		egressBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_egress_bytes_total",
			Help: "Bytes through sandboxes' egress proxy, by direction (out: from sandboxes upstream; in: back), counted when each connection ends.",
		}, []string{"direction"}),
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_heartbeats_total",
			Help: "Heartbeats sent to servers, by result (ok, error).",
		}, []string{"result"}),
	}
	for _, c := range []prometheus.Collector{m.creates, m.destroys, m.failures, m.execSeconds, m.live, m.heartbeats, m.fncalls, m.egress, m.egressBytes} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register edge metrics: %w", err)
		}
	}
	return m, nil
}

// poolSandboxesDesc describes dsec_edge_pool_sandboxes.
var poolSandboxesDesc = prometheus.NewDesc("dsec_edge_pool_sandboxes",
	"Sandboxes held by the node's pools, by kind (warm: PoolService pools; auto: automatic pools of hot specs; rebase: tenants' rebase pools; fncall) and state (ready, in_use, resetting). Ready sandboxes of auto and rebase pools are not charged to the node's capacity.",
	[]string{"kind", "state"}, nil)

// poolCollector reports dsec_edge_pool_sandboxes from the pools' counters
// at each scrape, so that an operator sees what the node holds idle.
type poolCollector struct{ e *Edge }

func (c poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- poolSandboxesDesc }

func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	e := c.e
	byKind := map[string][]*pool.Pool{}
	e.mu.Lock()
	for _, wp := range e.pools {
		byKind["warm"] = append(byKind["warm"], wp.p)
	}
	for _, wp := range e.autoPools {
		byKind["auto"] = append(byKind["auto"], wp.p)
	}
	for _, rp := range e.rebasePools {
		byKind["rebase"] = append(byKind["rebase"], rp.p)
	}
	for _, fp := range e.fnPools {
		byKind["fncall"] = append(byKind["fncall"], fp.p)
	}
	e.mu.Unlock()
	for _, kind := range []string{"warm", "auto", "rebase", "fncall"} {
		var ready, inUse, resetting int
		for _, p := range byKind[kind] {
			st := p.Stats()
			ready, inUse, resetting = ready+st.Ready, inUse+st.InUse, resetting+st.Resetting
		}
		for state, n := range map[string]int{"ready": ready, "in_use": inUse, "resetting": resetting} {
			ch <- prometheus.MustNewConstMetric(poolSandboxesDesc, prometheus.GaugeValue, float64(n), kind, state)
		}
	}
}
