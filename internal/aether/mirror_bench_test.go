package aether

import (
	"fmt"
	"io"
	"sync"
	"testing"
)

// BenchmarkMirrorWave: a wave of clients (sandboxes) downloading the same
// 20 MB wheel at once, through the node's mirror (a fresh, empty blob
// store each time: the wave's first request is a miss) and, in the same
// run, through the plain proxy straight to the HTTPS upstream. It reports
// the bytes the upstream served per wave and the wave's wall time. On
// loopback the upstream is as fast as the mirror's own disk, so the
// uplink cases share 1 Gbit/s (125 MB/s) among all upstream downloads,
// as a node's uplink would be shared.
//
//	go test -run '^$' -bench MirrorWave -benchtime 3x ./internal/aether/
func BenchmarkMirrorWave(b *testing.B) {
	const size = 20 << 20
	for _, c := range []struct {
		clients int
		rate    int64
	}{{16, 0}, {64, 0}, {16, 125e6}} {
		clients := c.clients
		uplink := "loopback"
		if c.rate > 0 {
			uplink = "1Gbit"
		}
		for _, via := range []string{"mirror", "proxy"} {
			b.Run(fmt.Sprintf("%s/uplink=%s/clients=%d", via, uplink, clients), func(b *testing.B) {
				up := newUpstream(b)
				up.rate = c.rate
				wheel := content(size, 9)
				up.files["/packages/cc/big-1.0-py3-none-any.whl"] = wheel
				url := up.url("files.pythonhosted.org") + "/packages/cc/big-1.0-py3-none-any.whl"
				if via == "mirror" {
					url = "http://" + MirrorHost + "/pypi/files/sha256/" + hexSHA256(wheel) + "/packages/cc/big-1.0-py3-none-any.whl"
				}
				pol, err := ParsePolicy([]string{"pypi", "files.pythonhosted.org"}, nil)
				if err != nil {
					b.Fatal(err)
				}
				b.SetBytes(int64(size * clients))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					h := newMirrorHarness(b, up, pol)
					c := h.client()
					b.StartTimer()
					var wg sync.WaitGroup
					for range clients {
						wg.Add(1)
						go func() {
							defer wg.Done()
							resp, err := c.Get(url)
							if err != nil {
								b.Error(err)
								return
							}
							defer resp.Body.Close()
							n, err := io.Copy(io.Discard, resp.Body)
							if err != nil || n != size || resp.StatusCode != 200 {
								b.Errorf("%d bytes, %s, %v", n, resp.Status, err)
							}
						}()
					}
					wg.Wait()
				}
				b.StopTimer()
				b.ReportMetric(float64(up.hitsOf("/packages/cc/big-1.0-py3-none-any.whl")*size)/float64(b.N)/(1<<20), "upstream-MiB/wave")
			})
		}
	}
}
