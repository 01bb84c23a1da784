package controlplane

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
)

// ClusterService: the operators' view of the nodes (admin token), answered
// from the registry, that is from the nodes' last heartbeats: no edge is
// called.

type clusterService struct{ s *Server }

func (cs *clusterService) ListNodes(ctx context.Context, _ *connect.Request[dsecv1.ListNodesRequest]) (*connect.Response[dsecv1.ListNodesResponse], error) {
	if err := needAdmin(ctx, "listing nodes"); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ListNodesResponse{Nodes: cs.s.reg.nodeList()}), nil
}

// nodeList describes every known node, sorted by id.
func (r *registry) nodeList() []*dsecv1.Node {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	out := make([]*dsecv1.Node, 0, len(r.nodes))
	for _, n := range r.nodes {
		out = append(out, r.describeLocked(n, now))
	}
	slices.SortFunc(out, func(a, b *dsecv1.Node) int { return cmp.Compare(a.GetId(), b.GetId()) })
	return out
}

// describeLocked is n as ListNodes reports it; the caller holds mu.
func (r *registry) describeLocked(n *node, now time.Time) *dsecv1.Node {
	alive := r.alive(n, now)
	out := &dsecv1.Node{
		Id: n.id, Alive: alive, LastHeartbeatAt: timestamppb.New(n.lastSeen), Url: n.url,
		Load: n.load, Queued: n.queued, Pools: int32(len(n.pools)),
	}
	charged := n.charged()
	reported := map[runtime.Kind]*dsecv1.BackendCapacity{}
	for _, b := range n.backends {
		reported[runtime.Kind(b.GetBackend())] = b
	}
	for _, k := range slices.Sorted(maps.Keys(n.capacity)) {
		c, u, sh, b := n.capacity[k], charged[k], n.shareOf(k), reported[k]
		out.Backends = append(out.Backends, &dsecv1.NodeBackend{
			Backend:              string(k),
			MilliCpu:             c.MilliCPU,
			MemoryBytes:          c.MemoryBytes,
			Sandboxes:            c.Sandboxes,
			ChargedMilliCpu:      u.MilliCPU,
			ChargedMemoryBytes:   u.MemoryBytes,
			ChargedSandboxes:     u.Sandboxes,
			RequestedMilliCpu:    b.GetRequestedMilliCpu(),
			RequestedMemoryBytes: b.GetRequestedMemoryBytes(),
			RequestShareCpu:      sh.CPU,
			RequestShareMemory:   sh.Memory,
			UsedMilliCpu:         b.GetMeasuredMilliCpu(),
			UsedMemoryBytes:      b.GetMeasuredMemoryBytes(),
			UsedSwapBytes:        b.GetMeasuredSwapBytes(),
		})
	}
	if st := n.status; st != nil {
		out.Measured = &dsecv1.NodeMeasurement{
			MilliCpu:             st.GetMilliCpu(),
			MemoryTotalBytes:     st.GetMemoryTotalBytes(),
			MemoryUsedBytes:      st.GetMemoryUsedBytes(),
			MemoryAvailableBytes: st.GetMemoryAvailableBytes(),
			SwapTotalBytes:       st.GetSwapTotalBytes(),
			SwapUsedBytes:        max(st.GetSwapTotalBytes()-st.GetSwapFreeBytes(), 0),
			PsiMemorySome:        st.GetPsiMemorySome(),
			PsiMemoryFull:        st.GetPsiMemoryFull(),
			PsiCpuSome:           st.GetPsiCpuSome(),
			OpenFiles:            st.GetOpenFiles(),
			MaxOpenFiles:         st.GetMaxOpenFiles(),
			Threads:              st.GetThreads(),
			MaxThreads:           st.GetMaxThreads(),
		}
		out.Full = st.GetFull()
	}
	counts := map[[2]string]int64{}
	for _, s := range n.sandboxes {
		st := s.GetState()
		if st == string(spec.StateDestroyed) {
			continue
		}
		if !alive {
			st = string(spec.StateLost)
		}
		counts[[2]string{s.GetBackend(), st}]++
	}
	for _, l := range n.lost {
		counts[[2]string{l.summary.GetBackend(), string(spec.StateLost)}]++
	}
	for _, k := range slices.SortedFunc(maps.Keys(counts), func(a, b [2]string) int {
		return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1]))
	}) {
		out.Sandboxes = append(out.Sandboxes, &dsecv1.SandboxCount{Backend: k[0], State: k[1], Count: counts[k]})
	}
	return out
}

// measuredUse is what sandboxes use together, as their nodes measured it.
type measuredUse struct{ milliCPU, memory, swap int64 }

// tenantMeasured is what each tenant's sandboxes on live nodes use, as
// their nodes last measured them (those not measured yet count nothing).
func (r *registry) tenantMeasured() map[string]measuredUse {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	out := map[string]measuredUse{}
	for _, n := range r.nodes {
		if !r.alive(n, now) {
			continue
		}
		for _, s := range n.sandboxes {
			u := s.GetUsage()
			if u == nil || !countsAgainstQuota(s.GetState()) {
				continue
			}
			m := out[s.GetTenant()]
			m.milliCPU += u.GetMilliCpu()
			m.memory += u.GetMemoryBytes()
			m.swap += u.GetSwapBytes()
			out[s.GetTenant()] = m
		}
	}
	return out
}
