package dsec

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Node is one node of the cluster as the server last heard from it (the
// operators' view: Nodes needs the admin token).
type Node struct {
	ID string
	// Alive is false once the node missed the server's node timeout; its
	// other figures are then those of its last heartbeat and its
	// sandboxes count as lost.
	Alive         bool
	LastHeartbeat time.Time
	// URL is where servers reach its edge.
	URL      string
	Backends []NodeBackend
	// Measured is what the node measures about itself (zero before its
	// first report of it).
	Measured NodeMeasurement
	// Full is empty while the node takes creates, else what it is short
	// of.
	Full string
	// Sandboxes counts its sandboxes by backend and state.
	Sandboxes []SandboxCount
	// Load is its 1-minute load average per core; Queued the creates and
	// calls waiting on it for room; Pools its warm pools.
	Load   float64
	Queued int
	Pools  int
}

// NodeBackend is what a node offers of one backend (capacity), what
// placement charges it (measured use plus its request share of what its
// sandboxes request, and their count), what they request, and what they
// are measured to use together.
type NodeBackend struct {
	Backend                                 string
	MilliCPU, MemoryBytes, Sandboxes        int64
	ChargedMilliCPU, ChargedMemoryBytes     int64
	ChargedSandboxes                        int64
	RequestedMilliCPU, RequestedMemoryBytes int64
	RequestShareCPU, RequestShareMemory     float64
	UsedMilliCPU, UsedMemoryBytes           int64
	UsedSwapBytes                           int64
}

// NodeMeasurement is what a node measures about itself. PSI figures are
// avg10 percentages, -1 where the kernel has none.
type NodeMeasurement struct {
	MilliCPU                                                int64
	MemoryTotalBytes, MemoryUsedBytes, MemoryAvailableBytes int64
	SwapTotalBytes, SwapUsedBytes                           int64
	PSIMemorySome, PSIMemoryFull, PSICPUSome                float64
	OpenFiles, MaxOpenFiles, Threads, MaxThreads            int64
}

// SandboxCount is how many sandboxes of a backend a node has in a state.
type SandboxCount struct {
	Backend, State string
	Count          int64
}

// ByState sums n's sandboxes per state.
func (n *Node) ByState() map[string]int64 {
	out := map[string]int64{}
	for _, c := range n.Sandboxes {
		out[c.State] += c.Count
	}
	return out
}

// ByBackend sums n's sandboxes per backend.
func (n *Node) ByBackend() map[string]int64 {
	out := map[string]int64{}
	for _, c := range n.Sandboxes {
		out[c.Backend] += c.Count
	}
	return out
}

// Nodes lists every node the server knows, alive or not, sorted by ID
// (admin token; a tenant's is PermissionDenied).
func (c *Client) Nodes(ctx context.Context) ([]*Node, error) {
	resp, err := c.cluster.ListNodes(ctx, connect.NewRequest(&dsecv1.ListNodesRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	out := make([]*Node, 0, len(resp.Msg.GetNodes()))
	for _, p := range resp.Msg.GetNodes() {
		out = append(out, nodeFromProto(p))
	}
	return out, nil
}

func nodeFromProto(p *dsecv1.Node) *Node {
	n := &Node{
		ID: p.GetId(), Alive: p.GetAlive(), URL: p.GetUrl(), Full: p.GetFull(),
		Load: p.GetLoad(), Queued: int(p.GetQueued()), Pools: int(p.GetPools()),
	}
	if p.LastHeartbeatAt != nil {
		n.LastHeartbeat = p.LastHeartbeatAt.AsTime()
	}
	for _, b := range p.GetBackends() {
		n.Backends = append(n.Backends, NodeBackend{
			Backend: b.GetBackend(), MilliCPU: b.GetMilliCpu(), MemoryBytes: b.GetMemoryBytes(), Sandboxes: b.GetSandboxes(),
			ChargedMilliCPU: b.GetChargedMilliCpu(), ChargedMemoryBytes: b.GetChargedMemoryBytes(), ChargedSandboxes: b.GetChargedSandboxes(),
			RequestedMilliCPU: b.GetRequestedMilliCpu(), RequestedMemoryBytes: b.GetRequestedMemoryBytes(),
			RequestShareCPU: b.GetRequestShareCpu(), RequestShareMemory: b.GetRequestShareMemory(),
			UsedMilliCPU: b.GetUsedMilliCpu(), UsedMemoryBytes: b.GetUsedMemoryBytes(), UsedSwapBytes: b.GetUsedSwapBytes(),
		})
	}
	if m := p.GetMeasured(); m != nil {
		n.Measured = NodeMeasurement{
			MilliCPU: m.GetMilliCpu(), MemoryTotalBytes: m.GetMemoryTotalBytes(), MemoryUsedBytes: m.GetMemoryUsedBytes(),
			MemoryAvailableBytes: m.GetMemoryAvailableBytes(), SwapTotalBytes: m.GetSwapTotalBytes(), SwapUsedBytes: m.GetSwapUsedBytes(),
			PSIMemorySome: m.GetPsiMemorySome(), PSIMemoryFull: m.GetPsiMemoryFull(), PSICPUSome: m.GetPsiCpuSome(),
			OpenFiles: m.GetOpenFiles(), MaxOpenFiles: m.GetMaxOpenFiles(), Threads: m.GetThreads(), MaxThreads: m.GetMaxThreads(),
		}
	} else {
		n.Measured = NodeMeasurement{PSIMemorySome: -1, PSIMemoryFull: -1, PSICPUSome: -1}
	}
	for _, sc := range p.GetSandboxes() {
		n.Sandboxes = append(n.Sandboxes, SandboxCount{Backend: sc.GetBackend(), State: sc.GetState(), Count: sc.GetCount()})
	}
	return n
}
