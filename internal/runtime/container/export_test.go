package container

import rt "github.com/dsec-dev/dsec/internal/runtime"

// ResetCounts reports how many Resets of sb kept its root (nothing had
// changed) and how many built a new one.
func ResetCounts(sb rt.Sandbox) (kept, rebuilt int64) {
	s := sb.(*sandbox)
	return s.resetsKept.Load(), s.resetsRebuilt.Load()
}
