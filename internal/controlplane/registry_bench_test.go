package controlplane

import (
	"fmt"
	"testing"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/spec"
)

// BenchmarkReserveBurst measures the control plane's share of the paper's
// worst case: one 32K-sandbox BatchCreate over a 160-node unit, quota
// checks and pending charges included (edge calls excluded).
func BenchmarkReserveBurst(b *testing.B) {
	const nodes, burst = 160, 32768
	q := &iam.Quota{MaxSandboxes: 1 << 20}
	reqs := make([]placeReq, burst)
	for i := range reqs {
		reqs[i] = explicitPR("trainer", q, 250)
		reqs[i].req.Layers = []placement.LayerRef{{Digest: "sha256:base", Bytes: 1 << 30}}
	}
	for b.Loop() {
		b.StopTimer()
		r, _ := testRegistry()
		for i := range nodes {
			hb := beat(fmt.Sprintf("node-%03d", i), "b", 3200)
			hb.Capacity[0].MilliCpu = 64000
			hb.Capacity[0].MemoryBytes = 256 << 30
			if i%3 == 0 {
				hb.Layers = []string{"sha256:base"}
			}
			hb.Sandboxes = []*dsecv1.SandboxSummary{{Id: fmt.Sprintf("node-%03d-00000000000000aa", i), Tenant: "trainer", State: string(spec.StateRunning)}}
			if err := r.heartbeat(hb); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		out, err := r.reserve(reqs)
		if err != nil {
			b.Fatal(err)
		}
		if out[burst-1].err != nil {
			b.Fatal(out[burst-1].err)
		}
	}
	b.ReportMetric(float64(burst*b.N)/b.Elapsed().Seconds(), "placements/s")
}
