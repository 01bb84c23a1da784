package container

import (
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
