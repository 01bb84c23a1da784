package edge_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	edgespec "github.com/dsec-dev/dsec/internal/spec"
)

// pidsLimits lists pids.max of every sandbox cgroup of the backend.
func pidsLimits(w *world) []string {
	var out []string
	for _, root := range w.backend.CgroupDirs() {
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.Name() == "pids.max" && filepath.Dir(p) != root {
				if b, err := os.ReadFile(p); err == nil {
					out = append(out, strings.TrimSpace(string(b)))
				}
			}
			return nil
		})
	}
	return out
}

// TestRequestsVsLimits: the node charges its capacity with what a spec
// states (its requests), and gives the sandbox its limits (the server's
// resolution of the defaults, else the node's own). On 2 cores at a CPU
// request share of 1/4, 20 sandboxes without resources fit (each charged 1 core of
// its default limit, 8 did); cpu=1 ones stop at 8. Heartbeats report the
// requests as used and the limits per sandbox (the tenant's charge); a
// pool's node charge is its spec's requests too, its quota charge its
// limits.
func TestRequestsVsLimits(t *testing.T) {
	w := newWorld(t)
	rec, url := startRecorder(t)
	n := w.startNode(t, "rq", func(c *edge.Config) {
		c.Servers = []string{url}
		c.Capacity = map[runtime.Kind]placement.Capacity{runtime.KindContainer: {MilliCPU: 2000, MemoryBytes: 24 << 30, Sandboxes: 64}}
		c.RequestShare = map[runtime.Kind]placement.Share{runtime.KindContainer: {CPU: 0.25, Memory: 1}}
		c.Defaults = edgespec.Resources{Pids: 77}
	})
	bare := &dsecv1.SandboxSpec{Image: baseImage}
	nodeLimits := edgespec.Resources{MilliCPU: edgespec.Builtin.MilliCPU, MemoryBytes: edgespec.Builtin.MemoryBytes, Pids: 77, DiskBytes: edgespec.Builtin.DiskBytes}

	// Without limits from a server: the node's defaults.
	const defaulted = 20
	for i := range defaulted {
		sb, err := n.create(t, tenant("a"), bare)
		if err != nil {
			t.Fatalf("sandbox %d of %d created without resources: %v", i+1, defaulted, err)
		}
		if got := edgespec.FromProto(sb.GetSpec().GetResources()); got != nodeLimits {
			t.Fatalf("sandbox without resources has %+v, want the node's defaults %+v", got, nodeLimits)
		}
	}
	if lim := pidsLimits(w); count(lim, "77") != defaulted {
		t.Errorf("pids.max of the sandbox cgroups %v, want the default 77 in %d", lim, defaulted)
	}

	// With a server's limits: those, explicit values over them, the
	// node's defaults for what both leave 0.
	limited, err := n.client.CreateOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreateRequest{
		Caller: tenant("b"), SandboxId: ids.NewSandbox(n.id),
		Spec:   &dsecv1.SandboxSpec{Image: baseImage, Resources: &dsecv1.Resources{Pids: 50}},
		Limits: &dsecv1.Resources{MilliCpu: 300, MemoryBytes: 256 << 20, Pids: 99},
	}))
	if err != nil {
		t.Fatal(err)
	}
	want := edgespec.Resources{MilliCPU: 300, MemoryBytes: 256 << 20, Pids: 50, DiskBytes: edgespec.Builtin.DiskBytes}
	if got := edgespec.FromProto(limited.Msg.GetSandbox().GetSpec().GetResources()); got != want {
		t.Fatalf("sandbox with a server's limits has %+v, want %+v", got, want)
	}
	got, err := n.client.GetOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: tenant("b"), SandboxId: limited.Msg.GetSandbox().GetId()}))
	if err != nil {
		t.Fatal(err)
	}
	if g := edgespec.FromProto(got.Msg.GetSandbox().GetSpec().GetResources()); g != want {
		t.Fatalf("Get shows %+v, want the limits %+v", g, want)
	}
	_, err = n.client.CreateOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreateRequest{
		Caller: tenant("b"), SandboxId: ids.NewSandbox(n.id), Spec: bare, Limits: &dsecv1.Resources{MemoryBytes: -1},
	}))
	wantCode(t, err, connect.CodeInvalidArgument, "limits.memory_bytes")

	// Explicit CPU is a request.
	explicit := &dsecv1.SandboxSpec{Image: baseImage, Resources: &dsecv1.Resources{MilliCpu: 1000}}
	for i := range 8 {
		if _, err := n.create(t, tenant("c"), explicit); err != nil {
			t.Fatalf("cpu=1 sandbox %d of 8: %v", i+1, err)
		}
	}
	_, err = n.create(t, tenant("c"), explicit)
	wantCode(t, err, connect.CodeResourceExhausted, "milli_cpu")

	// A tenant's pool of a bare spec still fills the full node: its
	// sandboxes request nothing of it.
	poolID := ids.NewSandbox(n.id)
	if _, err := n.client.CreatePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreatePoolRequest{
		Caller: tenant("d"), PoolId: poolID, Request: &dsecv1.CreatePoolRequest{Spec: bare, Size: 2},
		Limits: &dsecv1.Resources{MilliCpu: 250},
	})); err != nil {
		t.Fatal(err)
	}
	n.waitPool(t, poolID, func(p *dsecv1.Pool) bool { return p.Ready == 2 })

	const live = defaulted + 1 + 8
	beat := rec.waitFor(t, func(b *dsecv1.HeartbeatRequest) bool {
		return len(b.Sandboxes) == live && len(b.Pools) > 0 && b.Pools[0].GetReady() == 2 &&
			len(b.Capacity) == 1 && b.Capacity[0].UsedMemoryBytes > 0
	})
	// Charged: a quarter of the 8000 milli-CPU requested, the measured
	// memory (an idle agent's few MiB each: the requests state none).
	c := beat.Capacity[0]
	if c.RequestedMilliCpu != 8000 || c.RequestedMemoryBytes != 0 || c.UsedMilliCpu != 2000 || c.UsedMemoryBytes <= 0 ||
		c.UsedMemoryBytes > (live+2)*(16<<20) || c.UsedSandboxes != live+2 {
		t.Errorf("heartbeat capacity %v, want 8000 milli-CPU and no memory requested, 2000 milli-CPU and a few MiB a sandbox charged, and %d sandboxes (the pool's 2 included)", c, live+2)
	}
	for _, s := range beat.Sandboxes {
		wantCPU, wantMem := int64(1000), edgespec.Builtin.MemoryBytes
		if s.Tenant == "b" {
			wantCPU, wantMem = 300, 256<<20
		}
		if s.MilliCpu != wantCPU || s.MemoryBytes != wantMem {
			t.Errorf("summary of %s (tenant %s): %d milli-CPU, %d bytes; want its limits %d, %d", s.Id, s.Tenant, s.MilliCpu, s.MemoryBytes, wantCPU, wantMem)
		}
	}
	for _, p := range beat.Pools {
		if p.Id == poolID && (p.Charged != 2 || p.MilliCpu != 250 || p.MemoryBytes != edgespec.Builtin.MemoryBytes) {
			t.Errorf("pool summary %v, want 2 charged at its limits (250 milli-CPU, %d bytes)", p, edgespec.Builtin.MemoryBytes)
		}
	}
}

func count(ss []string, s string) int {
	n := 0
	for _, x := range ss {
		if x == s {
			n++
		}
	}
	return n
}
