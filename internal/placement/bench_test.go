package placement

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// burst builds the paper's worst case: one job asks for 32K sandboxes at
// once over a 160-node unit. Requests use a handful of images (base +
// workspace + toolkit) and each node already holds a random subset of
// layers, so locality scoring does real work.
func burst(nNodes, nReqs int) ([]NodeView, []Request) {
	rng := rand.New(rand.NewPCG(1, 2))
	const images = 8
	layerOf := func(img, l int) string { return fmt.Sprintf("sha256:img%d-layer%d", img, l) }
	nodes := make([]NodeView, nNodes)
	for i := range nodes {
		n := NodeView{
			ID:      fmt.Sprintf("node-%03d", i),
			Healthy: true,
			Capacity: map[runtime.Kind]Capacity{
				runtime.KindContainer: {MilliCPU: 64000, MemoryBytes: 256 << 30, Sandboxes: 3200},
				runtime.KindMicroVM:   {MilliCPU: 64000, MemoryBytes: 256 << 30, Sandboxes: 800},
			},
			Usage: map[runtime.Kind]Capacity{
				runtime.KindContainer: {MilliCPU: int64(rng.IntN(20000)), MemoryBytes: int64(rng.IntN(64)) << 30, Sandboxes: int64(rng.IntN(500))},
			},
			Load:   rng.Float64() * 0.3,
			Layers: map[string]struct{}{},
		}
		for img := range images {
			for l := range 3 {
				if rng.IntN(3) == 0 {
					n.Layers[layerOf(img, l)] = struct{}{}
				}
			}
		}
		nodes[i] = n
	}
	reqs := make([]Request, nReqs)
	for i := range reqs {
		img := rng.IntN(images)
		reqs[i] = Request{
			Kind:        runtime.KindContainer,
			MilliCPU:    1000,
			MemoryBytes: 1 << 30,
			Layers: []LayerRef{
				{Digest: layerOf(img, 0), Bytes: 1 << 30},
				{Digest: layerOf(img, 1), Bytes: 50 << 20},
				{Digest: layerOf(img, 2), Bytes: 5 << 20},
			},
		}
	}
	return nodes, reqs
}

func BenchmarkPlace32KBurst160Nodes(b *testing.B) {
	nodes, reqs := burst(160, 32768)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		ds, err := Place(nodes, reqs, WithSeed(1))
		if err != nil {
			b.Fatal(err)
		}
		if ds[len(ds)-1].Err != nil {
			b.Fatal(ds[len(ds)-1].Err)
		}
	}
	b.ReportMetric(float64(len(reqs))*float64(b.N)/b.Elapsed().Seconds(), "placements/s")
}
