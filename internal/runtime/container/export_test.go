package container

import (
	"math"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// ResetCounts reports how many Resets of sb kept its root (nothing had
// changed) and how many built a new one.
func ResetCounts(sb rt.Sandbox) (kept, rebuilt int64) {
	s := sb.(*sandbox)
	return s.resetsKept.Load(), s.resetsRebuilt.Load()
}

// PristineNewest is the latest ctime second among the entries of sb's
// pristine state whose stat alone can tell a change (see pristine.recent),
// and false without a pristine state.
func PristineNewest(sb rt.Sandbox) (int64, bool) {
	s := sb.(*sandbox)
	s.resetMu.Lock()
	defer s.resetMu.Unlock()
	p := s.pristine
	if p == nil {
		return 0, false
	}
	var newest int64
	for _, e := range p.entries {
		if e.timesTell {
			newest = max(newest, e.st.ctime.Sec)
		}
	}
	return newest, true
}

// PristineRecent lists the entries of sb's pristine state that the next
// Reset reads in full (attributes, and names of directories) rather than
// by their stat alone.
func PristineRecent(sb rt.Sandbox) []string {
	s := sb.(*sandbox)
	s.resetMu.Lock()
	defer s.resetMu.Unlock()
	var out []string
	if p := s.pristine; p != nil {
		for i := range p.entries {
			if p.recent(&p.entries[i]) {
				out = append(out, p.entries[i].rel)
			}
		}
	}
	return out
}

// PristineReadAll makes the next Reset of sb read every entry of its
// pristine state in full, as one within a second of the entries' last
// change does.
func PristineReadAll(sb rt.Sandbox) {
	s := sb.(*sandbox)
	s.resetMu.Lock()
	defer s.resetMu.Unlock()
	if p := s.pristine; p != nil {
		p.verified = math.MinInt64
	}
}

// WaitBackground waits until the background work of sb's last Reset or
// Rebase (old root unmounted and removed, old layers released, next root
// prepared) is done.
func WaitBackground(sb rt.Sandbox) { sb.(*sandbox).bg.Wait() }
