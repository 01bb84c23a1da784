package placement

import (
	"errors"
	"fmt"
	"strings"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// ErrNoCapacity is matched (errors.Is) by every *CapacityError; the API
// maps it to ResourceExhausted.
var ErrNoCapacity = errors.New("no capacity")

// Resource names one accounted resource in a CapacityError.
type Resource string

// The accounted resources.
const (
	ResourceCPU       Resource = "milliCPU"
	ResourceMemory    Resource = "memory"
	ResourceSandboxes Resource = "sandboxes"
)

// CapacityError says why a request found no node.
type CapacityError struct {
	Kind runtime.Kind
	// Need is what the request asked for (Sandboxes is always 1).
	Need Capacity
	// Offered counts nodes offering Kind at all; Eligible those healthy,
	// not draining and not excluded; Excluded those skipped because the
	// request excluded them.
	Offered, Eligible, Excluded int
	// Full counts eligible nodes that said they are full (NodeView.Full),
	// and FullReason is the first one's node and reason.
	Full       int
	FullReason string
	// Short lists the resources no eligible node has enough of. It is
	// empty when every resource is free somewhere but never all on one
	// node, or when no node is eligible.
	Short []Resource
}

func (e *CapacityError) Error() string {
	switch {
	case e.Offered == 0:
		return fmt.Sprintf("no node offers backend %s", e.Kind)
	case e.Eligible == 0 && e.Excluded > 0:
		return fmt.Sprintf("no node left for backend %s: the request excludes all %d healthy nodes offering it", e.Kind, e.Excluded)
	case e.Eligible == 0:
		return fmt.Sprintf("no healthy, non-draining node offers backend %s (%d offer it)", e.Kind, e.Offered)
	case e.Full == e.Eligible:
		return fmt.Sprintf("every node offering backend %s is full (%d; %s)", e.Kind, e.Full, e.FullReason)
	case len(e.Short) > 0:
		parts := make([]string, len(e.Short))
		for i, r := range e.Short {
			parts[i] = e.amount(r)
		}
		return fmt.Sprintf("no node has %s free for backend %s", strings.Join(parts, " or "), e.Kind)
	default:
		return fmt.Sprintf("no node has %s, %s and %s free at once for backend %s",
			e.amount(ResourceCPU), e.amount(ResourceMemory), e.amount(ResourceSandboxes), e.Kind)
	}
}

func (e *CapacityError) amount(r Resource) string {
	switch r {
	case ResourceCPU:
		return fmt.Sprintf("%d milliCPU", e.Need.MilliCPU)
	case ResourceMemory:
		return fmt.Sprintf("%d bytes of memory", e.Need.MemoryBytes)
	default:
		return "a sandbox slot"
	}
}

// Unwrap makes errors.Is(err, ErrNoCapacity) hold.
func (e *CapacityError) Unwrap() error { return ErrNoCapacity }
