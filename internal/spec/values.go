package spec

import "github.com/dsec-dev/dsec/internal/runtime"

// The contract's enumerations as typed values: code compares and switches
// on these, and converts to the API's strings (which JSON, the CLI and the
// SDKs keep) only where a message is filled or read.

// State is where a sandbox is in its life, as Get, List and heartbeats
// report it.
type State string

// Sandbox states.
const (
	StateCreating  State = "creating"
	StateRunning   State = "running"
	StateFrozen    State = "frozen" // running, its processes frozen
	StateLost      State = "lost"   // its node restarted or stopped answering
	StateDestroyed State = "destroyed"
	StateFailed    State = "failed"
)

// Live reports whether a sandbox in s still holds its node and counts
// against its tenant's quota.
func (s State) Live() bool { return s != StateDestroyed && s != StateFailed && s != StateLost }

// Outcome is how an exec ended (ExecResult.outcome). InfraError means the
// platform failed and nothing else: trainers mask those samples.
type Outcome string

// Exec outcomes.
const (
	OutcomeOK         Outcome = "ok"
	OutcomeFailed     Outcome = "failed"
	OutcomeTimeout    Outcome = "timeout"
	OutcomeInfraError Outcome = "infra_error"
)

// Backends a spec may name ("" is Container): runtime's kinds.
const (
	Container = runtime.KindContainer
	FnCall    = runtime.KindFnCall
	MicroVM   = runtime.KindMicroVM
	FullVM    = runtime.KindFullVM
)
