package controlplane

import (
	"strconv"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
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

// Per node, from its last heartbeat (what dsec node ls shows): the
// measured figures and the capacity of dead nodes are not exported, their
// sandboxes are (as lost).
var (
	nodeAliveDesc = prometheus.NewDesc("dsec_server_node_alive",
		"1 while the node heartbeats, 0 once it is past the node timeout (until it is forgotten).", []string{"node"}, nil)
	nodeFullDesc = prometheus.NewDesc("dsec_server_node_full",
		"1 while the node's measured state refuses creates (dsec node ls says why).", []string{"node"}, nil)
	nodeSandboxesDesc = prometheus.NewDesc("dsec_server_node_sandboxes",
		"The node's sandboxes by backend and state (lost: of a dead node or an earlier run of its edge).", []string{"node", "backend", "state"}, nil)
	nodeMemoryDesc = prometheus.NewDesc("dsec_server_node_memory_bytes",
		"Memory of the node: backend=\"\" kind=total|used (not reclaimable)|available|swap_total|swap_used, as it measures it; per backend kind=capacity|charged (what placement counts)|requested|sandboxes (its sandboxes' measured use)|sandboxes_swap.",
		[]string{"node", "backend", "kind"}, nil)
	nodeCPUDesc = prometheus.NewDesc("dsec_server_node_cpu_millis",
		"CPU of the node in thousandths of a core: backend=\"\" kind=busy (measured, all of it); per backend kind=capacity|charged|requested|sandboxes (its sandboxes' measured use).",
		[]string{"node", "backend", "kind"}, nil)
	nodeSlotsDesc = prometheus.NewDesc("dsec_server_node_sandbox_slots",
		"Sandbox slots of the node per backend: kind=capacity|charged (live and pooled sandboxes).", []string{"node", "backend", "kind"}, nil)
	nodePressureDesc = prometheus.NewDesc("dsec_server_node_pressure_percent",
		"PSI avg10 of the node: resource=memory|cpu, kind=some|full.", []string{"node", "resource", "kind"}, nil)
	nodeLimitDesc = prometheus.NewDesc("dsec_server_node_limit",
		"What bounds the node: resource=open_files (its edge's)|threads (the system's), kind=used|max.", []string{"node", "resource", "kind"}, nil)
	tenantCPUDesc = prometheus.NewDesc("dsec_server_tenant_cpu_millis",
		"CPU the tenant's sandboxes on live nodes use together, as their nodes last measured it (thousandths of a core).", []string{"tenant"}, nil)
	tenantMemoryDesc = prometheus.NewDesc("dsec_server_tenant_memory_bytes",
		"Memory the tenant's sandboxes on live nodes use together, as their nodes last measured it: kind=used (less inactive file pages)|swap.", []string{"tenant", "kind"}, nil)
)

func (c *registryCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{sandboxesDesc, nodesDesc, nodeAliveDesc, nodeFullDesc, nodeSandboxesDesc, nodeMemoryDesc,
		nodeCPUDesc, nodeSlotsDesc, nodePressureDesc, nodeLimitDesc, tenantCPUDesc, tenantMemoryDesc} {
		ch <- d
	}
}

func (c *registryCollector) Collect(ch chan<- prometheus.Metric) {
	for k, n := range c.reg.stateCounts() {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
	alive, dead := c.reg.nodeCounts()
	ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(alive), strconv.FormatBool(true))
	ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(dead), strconv.FormatBool(false))
	for _, n := range c.reg.nodeList() {
		collectNode(ch, n)
	}
	for tenant, u := range c.reg.tenantMeasured() {
		ch <- prometheus.MustNewConstMetric(tenantCPUDesc, prometheus.GaugeValue, float64(u.milliCPU), tenant)
		ch <- prometheus.MustNewConstMetric(tenantMemoryDesc, prometheus.GaugeValue, float64(u.memory), tenant, "used")
		ch <- prometheus.MustNewConstMetric(tenantMemoryDesc, prometheus.GaugeValue, float64(u.swap), tenant, "swap")
	}
}

// collectNode sends n's gauges.
func collectNode(ch chan<- prometheus.Metric, n *dsecv1.Node) {
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append([]string{n.GetId()}, labels...)...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	g(nodeAliveDesc, b2f(n.GetAlive()))
	for _, sc := range n.GetSandboxes() {
		g(nodeSandboxesDesc, float64(sc.GetCount()), sc.GetBackend(), sc.GetState())
	}
	if !n.GetAlive() {
		return
	}
	g(nodeFullDesc, b2f(n.GetFull() != ""))
	for _, b := range n.GetBackends() {
		k := b.GetBackend()
		g(nodeMemoryDesc, float64(b.GetMemoryBytes()), k, "capacity")
		g(nodeMemoryDesc, float64(b.GetChargedMemoryBytes()), k, "charged")
		g(nodeMemoryDesc, float64(b.GetRequestedMemoryBytes()), k, "requested")
		g(nodeMemoryDesc, float64(b.GetUsedMemoryBytes()), k, "sandboxes")
		g(nodeMemoryDesc, float64(b.GetUsedSwapBytes()), k, "sandboxes_swap")
		g(nodeCPUDesc, float64(b.GetMilliCpu()), k, "capacity")
		g(nodeCPUDesc, float64(b.GetChargedMilliCpu()), k, "charged")
		g(nodeCPUDesc, float64(b.GetRequestedMilliCpu()), k, "requested")
		g(nodeCPUDesc, float64(b.GetUsedMilliCpu()), k, "sandboxes")
		g(nodeSlotsDesc, float64(b.GetSandboxes()), k, "capacity")
		g(nodeSlotsDesc, float64(b.GetChargedSandboxes()), k, "charged")
	}
	m := n.GetMeasured()
	if m == nil {
		return
	}
	g(nodeMemoryDesc, float64(m.GetMemoryTotalBytes()), "", "total")
	g(nodeMemoryDesc, float64(m.GetMemoryUsedBytes()), "", "used")
	g(nodeMemoryDesc, float64(m.GetMemoryAvailableBytes()), "", "available")
	g(nodeMemoryDesc, float64(m.GetSwapTotalBytes()), "", "swap_total")
	g(nodeMemoryDesc, float64(m.GetSwapUsedBytes()), "", "swap_used")
	g(nodeCPUDesc, float64(m.GetMilliCpu()), "", "busy")
	if m.GetPsiMemorySome() >= 0 {
		g(nodePressureDesc, m.GetPsiMemorySome(), "memory", "some")
		g(nodePressureDesc, m.GetPsiMemoryFull(), "memory", "full")
	}
	if m.GetPsiCpuSome() >= 0 {
		g(nodePressureDesc, m.GetPsiCpuSome(), "cpu", "some")
	}
	g(nodeLimitDesc, float64(m.GetOpenFiles()), "open_files", "used")
	g(nodeLimitDesc, float64(m.GetMaxOpenFiles()), "open_files", "max")
	g(nodeLimitDesc, float64(m.GetThreads()), "threads", "used")
	g(nodeLimitDesc, float64(m.GetMaxThreads()), "threads", "max")
}
