package controlplane

import (
	"strconv"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	creates    *prometheus.CounterVec
	destroys   prometheus.Counter
	failures   *prometheus.CounterVec
	retries    prometheus.Counter
	execTime   *prometheus.HistogramVec
	heartbeats prometheus.Counter
	queueWait  prometheus.Histogram
	queueFull  prometheus.Counter
}

func newMetrics(r prometheus.Registerer, reg *registry) (*metrics, error) {
	m := &metrics{
		creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_server_sandbox_creates_total", Help: "Sandboxes created through this server, by backend.",
		}, []string{"backend"}),
		destroys: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_server_sandbox_destroys_total", Help: "Sandboxes destroyed through this server.",
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_server_failures_total", Help: "Failed operations by operation and reason (Connect code, or quota/placement).",
		}, []string{"op", "reason"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_server_placement_retries_total", Help: "Creates retried on another node after an edge refused or failed.",
		}),
		execTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "dsec_server_exec_seconds", Help: "Exec latency through the server, by outcome.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}, []string{"outcome"}),
		heartbeats: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_server_heartbeats_total", Help: "Edge heartbeats received.",
		}),
		queueWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "dsec_server_admission_wait_seconds", Help: "How long creates that found every node full waited for room.",
			Buckets: []float64{.01, .05, .1, .5, 1, 2.5, 5, 10, 30, 60},
		}),
		queueFull: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_server_admission_queue_full_total", Help: "Creates refused because the admission queue was full.",
		}),
	}
	for _, c := range []prometheus.Collector{m.creates, m.destroys, m.failures, m.retries, m.execTime, m.heartbeats, m.queueWait, m.queueFull, &registryCollector{reg: reg}} {
		if err := r.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *metrics) fail(op string, err error) {
	m.failures.WithLabelValues(op, reasonOf(err)).Inc()
}

func reasonOf(err error) string {
	if ce := new(connect.Error); asConnect(err, &ce) {
		return ce.Code().String()
	}
	return connect.CodeUnknown.String()
}

// registryCollector reports live state straight from the registry at scrape
// time, so gauges never drift from the heartbeats.
type registryCollector struct{ reg *registry }

var (
	sandboxesDesc = prometheus.NewDesc("dsec_server_sandboxes", "Sandboxes known from heartbeats, by backend and state.", []string{"backend", "state"}, nil)
	nodesDesc     = prometheus.NewDesc("dsec_server_nodes", "Known nodes, by whether they are alive.", []string{"alive"}, nil)
)

func (c *registryCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- sandboxesDesc
	ch <- nodesDesc
}

func (c *registryCollector) Collect(ch chan<- prometheus.Metric) {
	for k, n := range c.reg.stateCounts() {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
	alive, dead := c.reg.nodeCounts()
	ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(alive), strconv.FormatBool(true))
	ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(dead), strconv.FormatBool(false))
}
