package lifecycle

import (
	"testing"

	"github.com/dsec-dev/dsec/internal/spec"
)

var all = []State{None, Creating, Running, Frozen, RollingBack, Destroying, Destroyed, Lost, Failed}

// TestTransitions tries every move from every state: those listed here
// must succeed, every other must be refused and leave the state as it was.
func TestTransitions(t *testing.T) {
	want := map[[2]State]bool{
		{None, Creating}: true, {None, Lost}: true, {None, Destroyed}: true,
		{Creating, Running}: true, {Creating, Failed}: true, {Creating, Destroyed}: true,
		{Running, Frozen}: true, {Running, RollingBack}: true, {Running, Destroying}: true, {Running, Lost}: true,
		{Frozen, Running}: true, {Frozen, RollingBack}: true, {Frozen, Destroying}: true, {Frozen, Lost}: true,
		{RollingBack, Running}: true, {RollingBack, Lost}: true, {RollingBack, Destroying}: true,
		{Destroying, Destroyed}: true,
		{Lost, Destroyed}:       true,
		{Failed, Destroyed}:     true,
	}
	for _, from := range all {
		for _, to := range all {
			m := Machine{cur: from}
			err := m.To(to)
			switch {
			case want[[2]State{from, to}] && err != nil:
				t.Errorf("%s -> %s refused: %v", from, to, err)
			case want[[2]State{from, to}] && m.cur != to:
				t.Errorf("%s -> %s left it in %s", from, to, m.cur)
			case !want[[2]State{from, to}] && err == nil:
				t.Errorf("%s -> %s allowed, want refused", from, to)
			case !want[[2]State{from, to}] && m.cur != from:
				t.Errorf("refused %s -> %s moved it to %s", from, to, m.cur)
			}
			if Allowed(from, to) != want[[2]State{from, to}] {
				t.Errorf("Allowed(%s, %s) = %v", from, to, Allowed(from, to))
			}
		}
	}
}

// walk moves a new machine through states, failing on a refusal.
func walk(t *testing.T, states ...State) *Machine {
	t.Helper()
	m := &Machine{}
	for _, s := range states {
		if err := m.To(s); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

// TestMeanings checks what each state, and each path into the transient
// ones, means to the rest of the edge.
func TestMeanings(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		path                  []State
		visible               spec.State
		charged, frozen, live bool
		ended, destroyBegun   bool
	}{
		{"new", nil, "", false, false, false, false, false},
		{"creating", []State{Creating}, spec.StateCreating, true, false, false, false, false},
		{"running", []State{Creating, Running}, spec.StateRunning, true, false, true, false, false},
		{"frozen", []State{Creating, Running, Frozen}, spec.StateFrozen, true, true, true, false, false},
		{"thawed", []State{Creating, Running, Frozen, Running}, spec.StateRunning, true, false, true, false, false},
		{"rolling back", []State{Creating, Running, RollingBack}, spec.StateRunning, true, false, false, false, false},
		{"rolling back from frozen", []State{Creating, Running, Frozen, RollingBack}, spec.StateFrozen, true, true, false, false, false},
		{"rolled back from frozen runs", []State{Creating, Running, Frozen, RollingBack, Running}, spec.StateRunning, true, false, true, false, false},
		{"destroying", []State{Creating, Running, Destroying}, spec.StateRunning, true, false, false, false, true},
		{"destroying from frozen", []State{Creating, Running, Frozen, Destroying}, spec.StateFrozen, true, true, false, false, true},
		{"destroying while rolling back from frozen", []State{Creating, Running, Frozen, RollingBack, Destroying}, spec.StateFrozen, true, true, false, false, true},
		{"destroyed after running", []State{Creating, Running, Destroying, Destroyed}, spec.StateDestroyed, false, false, false, true, true},
		{"destroyed while creating", []State{Creating, Destroyed}, spec.StateDestroyed, false, false, false, true, false},
		{"lost", []State{Creating, Running, Lost}, spec.StateLost, false, false, false, true, false},
		{"lost then destroyed", []State{Creating, Running, Lost, Destroyed}, spec.StateDestroyed, false, false, false, true, false},
		{"failed", []State{Creating, Failed}, spec.StateFailed, false, false, false, true, false},
		{"recovered lost", []State{Lost}, spec.StateLost, false, false, false, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := walk(t, tc.path...)
			if m.Visible() != tc.visible || m.Charged() != tc.charged || m.Frozen() != tc.frozen ||
				m.Live() != tc.live || m.Ended() != tc.ended || m.DestroyBegun() != tc.destroyBegun {
				t.Fatalf("%s: visible %q charged %v frozen %v live %v ended %v destroyBegun %v; want %q %v %v %v %v %v",
					m.State(), m.Visible(), m.Charged(), m.Frozen(), m.Live(), m.Ended(), m.DestroyBegun(),
					tc.visible, tc.charged, tc.frozen, tc.live, tc.ended, tc.destroyBegun)
			}
		})
	}
}
