package edge

import (
	"strings"
	"testing"
)

// TestNodeStateFull: what the node measures refuses a create, naming what
// is short, and creates admitted since the sample count at a sandbox's
// cost each.
func TestNodeStateFull(t *testing.T) {
	roomy := nodeState{memTotal: 24 << 30, memAvailable: 20 << 30, swapFree: 0, memSome: 0, memFull: 0,
		openFiles: 100, maxOpenFiles: 20000, threads: 200, maxThreads: 32768}
	tests := []struct {
		name  string
		edit  func(*nodeState)
		since int64
		want  string // "" fits
	}{
		{name: "roomy", edit: func(*nodeState) {}},
		{name: "memory below the reserve", edit: func(s *nodeState) { s.memAvailable = 100 << 20 }, want: "memory"},
		{name: "swap counts as room", edit: func(s *nodeState) { s.memAvailable, s.swapFree = 100<<20, 1<<30 }},
		{name: "thrashing", edit: func(s *nodeState) { s.memFull = 12.5 }, want: "pressure"},
		{name: "some stalls are fine", edit: func(s *nodeState) { s.memSome, s.memFull = 40, 2 }},
		{name: "no PSI", edit: func(s *nodeState) { s.memSome, s.memFull = -1, -1 }},
		{name: "descriptors", edit: func(s *nodeState) { s.openFiles = 20000 - 1024 - fdsPerSandbox + 1 }, want: "descriptors"},
		{name: "descriptors of creates since the sample", edit: func(s *nodeState) { s.openFiles = 1000 }, since: (20000 - 1024 - 1000) / fdsPerSandbox, want: "descriptors"},
		{name: "pids", edit: func(s *nodeState) { s.threads = 32768 - pidReserve - pidsPerSandbox + 1 }, want: "pids"},
		{name: "pids of creates since the sample", edit: func(s *nodeState) { s.threads, s.maxOpenFiles = 1000, 1<<30 }, since: (32768 - pidReserve - 1000) / pidsPerSandbox, want: "pids"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := roomy
			tt.edit(&st)
			got := st.full(tt.since, 512<<20)
			if (got == "") != (tt.want == "") || !strings.Contains(got, tt.want) {
				t.Fatalf("full = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestSample reads this machine's state: something in every field that
// Linux always has.
func TestSample(t *testing.T) {
	var s sampler
	s.sample()
	s.sample()
	st, since := s.get()
	if since != 0 || st.memTotal <= 0 || st.memAvailable <= 0 || st.openFiles <= 0 || st.maxOpenFiles <= 0 ||
		st.threads <= 0 || st.maxThreads <= 0 || st.milliCPU < 0 {
		t.Fatalf("sample %+v (since %d)", st, since)
	}
	s.admitted()
	if _, since := s.get(); since != 1 {
		t.Fatalf("since = %d after one admission, want 1", since)
	}
}
