package container

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestWatermarksAndTick(t *testing.T) {
	for _, c := range []struct{ size, low, high int64 }{
		{192 << 20, 24 << 20, 48 << 20},
		{24 << 30, 1 << 30, 2 << 30},
	} {
		if low, high := watermarks(c.size); low != c.low || high != c.high {
			t.Errorf("watermarks(%d) = %d, %d; want %d, %d", c.size, low, high, c.low, c.high)
		}
	}
	for in, want := range map[time.Duration]time.Duration{
		DefaultIdleAfter: 500 * time.Millisecond, 100 * time.Millisecond: 25 * time.Millisecond, time.Millisecond: 10 * time.Millisecond,
	} {
		if got := qosTick(in); got != want {
			t.Errorf("qosTick(%v) = %v, want %v", in, got, want)
		}
	}
}

// BenchmarkBeginEnd is what the QoS adds to every request of a sandbox
// whose weight is not lowered: begin and end.
func BenchmarkBeginEnd(b *testing.B) {
	s := &sandbox{}
	for b.Loop() {
		s.begin()
		s.end()
	}
}

// BenchmarkSetWeight is the write the first request after an idle period
// pays (by path: open, write, close), on a cgroup of its own.
func BenchmarkSetWeight(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	group := fmt.Sprintf("/dsec-bench-weight-%d", os.Getpid())
	dir := filepath.Join(cgroupRoot, "cpu", group)
	if err := os.Mkdir(dir, 0o755); err != nil {
		b.Skipf("no cgroup v1 cpu hierarchy: %v", err)
	}
	defer os.Remove(dir)
	c := &cgroupV1{group: group}
	w := weightNormal
	for b.Loop() {
		if err := c.setWeight(w); err != nil {
			b.Fatal(err)
		}
		w = weightIdle - w
	}
}
