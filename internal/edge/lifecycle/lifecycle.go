// Package lifecycle is the state machine of one sandbox on its edge: which
// state it is in, which moves are allowed, and what each state means to
// the rest of the node (what callers see, whether it is charged to the
// node's capacity, whether it takes operations).
//
// It replaces a state string plus frozen, rolling, destroying and charged
// flags, whose combinations (frozen and being destroyed, rolling back a
// frozen sandbox) were implicit in the order of if-statements. Here every
// combination the edge reaches is a state, and a move the table does not
// allow is refused, so a new backend or feature cannot quietly reach one
// nobody thought about.
//
// Two states are transient and remember the stable state they started
// from: RollingBack and Destroying (a frozen sandbox being destroyed still
// shows as frozen, and is not handed to a pool). Destroyed remembers the
// state it was entered from, so that operations on a sandbox destroyed
// while it ran are told it is being destroyed.
package lifecycle

import (
	"fmt"

	"github.com/dsec-dev/dsec/internal/spec"
)

// State is where a sandbox is in its life.
type State uint8

// The states. None is a record not admitted yet (or recovered from a
// trajectory, which enters Lost or Destroyed straight away).
const (
	None State = iota
	// Creating: admitted and charged; the backend is building it.
	Creating
	// Running: takes operations.
	Running
	// Frozen: its processes are stopped; its ttl still runs.
	Frozen
	// RollingBack: its runtime sandbox is being replaced by one on a
	// checkpoint; operations are refused and the old runtime's death is
	// not the sandbox's loss.
	RollingBack
	// Destroying: a destroy has begun; it is charged until the backend
	// has released it.
	Destroying
	// Destroyed, Lost and Failed are the ends: not charged, remembered
	// for a while so Get can say what became of it.
	Destroyed
	Lost
	Failed
)

var names = [...]string{
	None: "none", Creating: "creating", Running: "running", Frozen: "frozen",
	RollingBack: "rolling-back", Destroying: "destroying",
	Destroyed: "destroyed", Lost: "lost", Failed: "failed",
}

func (s State) String() string {
	if int(s) < len(names) {
		return names[s]
	}
	return fmt.Sprintf("state(%d)", s)
}

// allowed is the transition table: allowed[from] are the states a sandbox
// may move to from it.
var allowed = map[State][]State{
	// Admitted; or recovered from the trajectory log at start.
	None: {Creating, Lost, Destroyed},
	// Built; the backend failed; destroyed while being built (the create
	// tears the built sandbox down when the backend returns).
	Creating: {Running, Failed, Destroyed},
	Running:  {Frozen, RollingBack, Destroying, Lost},
	Frozen:   {Running, RollingBack, Destroying, Lost},
	// Rolled back (thawed: the new runtime runs); the new runtime could
	// not be made; destroyed meanwhile (the rollback drops what it made).
	RollingBack: {Running, Lost, Destroying},
	Destroying:  {Destroyed},
	// What is left of a lost or failed sandbox is destroyed on request.
	Lost:      {Destroyed},
	Failed:    {Destroyed},
	Destroyed: nil,
}

// Allowed reports whether the table allows moving from one state to another.
func Allowed(from, to State) bool {
	for _, s := range allowed[from] {
		if s == to {
			return true
		}
	}
	return false
}

// Machine is one sandbox's state. The zero Machine is in None. It is not
// safe for concurrent use: the edge guards it with its lock.
type Machine struct {
	cur  State
	from State
}

// State is the current state.
func (m *Machine) State() State { return m.cur }

// Is reports whether the current state is s.
func (m *Machine) Is(s State) bool { return m.cur == s }

// From is, in RollingBack and Destroying, the stable state (Running or
// Frozen) the sandbox was in when the first of them began; in Destroyed,
// the state it was destroyed from; None otherwise.
func (m *Machine) From() State { return m.from }

// To moves to next if the table allows it, and refuses (changing nothing)
// otherwise.
func (m *Machine) To(next State) error {
	if !Allowed(m.cur, next) {
		return fmt.Errorf("sandbox state %s cannot move to %s", m.cur, next)
	}
	switch {
	case next == RollingBack || next == Destroying:
		if !m.transient() {
			m.from = m.cur
		}
	case next == Destroyed:
		m.from = m.cur
	default:
		m.from = None
	}
	m.cur = next
	return nil
}

func (m *Machine) transient() bool { return m.cur == RollingBack || m.cur == Destroying }

// Frozen reports whether the sandbox's processes are stopped: frozen, or
// rolling back or being destroyed from frozen.
func (m *Machine) Frozen() bool {
	return m.cur == Frozen || m.transient() && m.from == Frozen
}

// Live reports whether the sandbox runs and takes state operations
// (freeze, thaw, snapshot, checkpoint, rollback): Running or Frozen.
func (m *Machine) Live() bool { return m.cur == Running || m.cur == Frozen }

// Charged reports whether the sandbox counts against the node's capacity
// and holds its layers: from admission until the backend released it.
func (m *Machine) Charged() bool {
	switch m.cur {
	case Creating, Running, Frozen, RollingBack, Destroying:
		return true
	}
	return false
}

// Ended reports whether the sandbox can no longer run anything.
func (m *Machine) Ended() bool { return m.cur == Destroyed || m.cur == Lost || m.cur == Failed }

// DestroyBegun reports whether a destroy of the sandbox while it ran has
// begun (and perhaps finished).
func (m *Machine) DestroyBegun() bool {
	return m.cur == Destroying || m.cur == Destroyed && m.from == Destroying
}

// Phase is the state of the API's contract the sandbox is in, frozen
// aside: every state between Running and the end is running (what the
// node's live gauge counts and messages name). None has no phase ("").
func (m *Machine) Phase() spec.State {
	switch m.cur {
	case Creating:
		return spec.StateCreating
	case Running, Frozen, RollingBack, Destroying:
		return spec.StateRunning
	case Destroyed:
		return spec.StateDestroyed
	case Lost:
		return spec.StateLost
	case Failed:
		return spec.StateFailed
	}
	return ""
}

// Visible is the state Get, List and heartbeats report: the phase, or
// frozen while the sandbox's processes are stopped.
func (m *Machine) Visible() spec.State {
	if m.Frozen() {
		return spec.StateFrozen
	}
	return m.Phase()
}
