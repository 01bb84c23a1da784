package edge

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
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
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_edge_heartbeats_total",
			Help: "Heartbeats sent to servers, by result (ok, error).",
		}, []string{"result"}),
	}
	for _, c := range []prometheus.Collector{m.creates, m.destroys, m.failures, m.execSeconds, m.live, m.heartbeats, m.fncalls} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register edge metrics: %w", err)
		}
	}
	return m, nil
}
