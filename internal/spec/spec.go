// Package spec is the sandbox spec contract: what a SandboxSpec may say and
// what a sandbox gets for what its spec leaves out. The server checks a
// create against it before placing it and the edge again before building
// it, so both judge a spec by the same rules, and a default is filled in by
// the same code wherever it is filled in.
//
// Every sandbox has requests and limits, the Kubernetes way. Its requests
// are the resources its spec states (0 for a field it leaves out); its
// limits are the requests with what the spec leaves 0 taken from the
// tenant's default, else the node's (Config of the edge, --default-*
// flags), else Builtin (Resolve). Limits go to the kernel and to tenant
// quotas, so a quota counts what the sandbox really gets, and to pool
// keys, so a defaulted spec shares pools with one that spells the same
// values out. Requests go to node capacity (placement and the edge's
// admission), so sandboxes that leave resources to the defaults reserve
// nothing of the node but a sandbox slot. The server resolves both and
// sends the edge the user's spec with the limits beside it; an edge
// called without limits fills them from its own defaults.
//
// Errors match ErrInvalid and name the field (spec.resources.milli_cpu,
// ...); callers map them to InvalidArgument at their API boundary.
package spec

import (
	"errors"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// ErrInvalid is matched by every error this package returns about a spec.
var ErrInvalid = errors.New("invalid sandbox spec")

// FieldError says which field of a spec is wrong and why.
type FieldError struct {
	// Field is the field's path as in the API, e.g. "spec.resources.pids".
	Field   string
	Problem string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Problem }

// Unwrap makes errors.Is(err, ErrInvalid) hold.
func (e *FieldError) Unwrap() error { return ErrInvalid }

func fieldErr(field, format string, args ...any) error {
	return &FieldError{Field: field, Problem: fmt.Sprintf(format, args...)}
}

// Idle actions (SandboxSpec.idle_action; "" is IdleDestroy).
const (
	IdleDestroy = "destroy"
	IdleFreeze  = "freeze"
)

// Upper bounds of a resource request. They are far above any machine
// DSec runs on, and low enough that a quota's sums over what a tenant can
// hold (a batch of 32768, a pool of 4096, of the largest) stay far from
// overflowing int64.
const (
	MaxMilliCPU    = 1 << 30 // ~1M cores
	MaxMemoryBytes = 1 << 44 // 16 TiB
	MaxPids        = 1 << 22 // the kernel's PID_MAX_LIMIT
	MaxDiskBytes   = 1 << 50 // 1 PiB
)

// Resources is what a sandbox may use. Zero fields mean "not set" in a
// spec or a set of defaults; a sandbox's effective resources have none.
type Resources struct {
	MilliCPU    int64 `json:"milliCpu,omitempty"`
	MemoryBytes int64 `json:"memoryBytes,omitempty"`
	Pids        int64 `json:"pids,omitempty"`
	DiskBytes   int64 `json:"diskBytes,omitempty"`
}

// Builtin is what a node gives a sandbox when neither the spec, its
// tenant nor the node's configuration say otherwise: one core, 1 GiB of
// memory, 1024 processes and a 10 GiB writable layer.
var Builtin = Resources{MilliCPU: 1000, MemoryBytes: 1 << 30, Pids: 1024, DiskBytes: 10 << 30}

// FromProto reads r (nil is all zero).
func FromProto(r *dsecv1.Resources) Resources {
	return Resources{MilliCPU: r.GetMilliCpu(), MemoryBytes: r.GetMemoryBytes(), Pids: r.GetPids(), DiskBytes: r.GetDiskBytes()}
}

// Proto returns r as the API's message.
func (r Resources) Proto() *dsecv1.Resources {
	return &dsecv1.Resources{MilliCpu: r.MilliCPU, MemoryBytes: r.MemoryBytes, Pids: r.Pids, DiskBytes: r.DiskBytes}
}

// Or returns r with each zero field taken from d.
func (r Resources) Or(d Resources) Resources {
	pick := func(a, b int64) int64 {
		if a != 0 {
			return a
		}
		return b
	}
	return Resources{pick(r.MilliCPU, d.MilliCPU), pick(r.MemoryBytes, d.MemoryBytes), pick(r.Pids, d.Pids), pick(r.DiskBytes, d.DiskBytes)}
}

// Max returns the larger of r and d field by field.
func (r Resources) Max(d Resources) Resources {
	return Resources{max(r.MilliCPU, d.MilliCPU), max(r.MemoryBytes, d.MemoryBytes), max(r.Pids, d.Pids), max(r.DiskBytes, d.DiskBytes)}
}

// Complete reports whether every field is set.
func (r Resources) Complete() bool {
	return r.MilliCPU > 0 && r.MemoryBytes > 0 && r.Pids > 0 && r.DiskBytes > 0
}

// Validate checks that no field is negative or above its bound. prefix
// names the message holding them in errors ("spec.resources",
// "defaults").
func (r Resources) Validate(prefix string) error {
	for _, f := range []struct {
		name     string
		v, limit int64
	}{
		{"milli_cpu", r.MilliCPU, MaxMilliCPU},
		{"memory_bytes", r.MemoryBytes, MaxMemoryBytes},
		{"pids", r.Pids, MaxPids},
		{"disk_bytes", r.DiskBytes, MaxDiskBytes},
	} {
		switch {
		case f.v < 0:
			return fieldErr(prefix+"."+f.name, "%d is negative", f.v)
		case f.v > f.limit:
			return fieldErr(prefix+"."+f.name, "%d is above the largest accepted, %d", f.v, f.limit)
		}
	}
	return nil
}

// NodeDefaults returns the defaults a node applies: configured, with
// Builtin for what the configuration leaves 0. It refuses a configuration
// that is negative or out of bounds.
func NodeDefaults(configured Resources) (Resources, error) {
	if err := configured.Validate("defaults"); err != nil {
		return Resources{}, err
	}
	return configured.Or(Builtin), nil
}

// Validate checks what a spec says, without I/O: a known backend, an image
// and well-formed image references, resources within bounds, non-negative
// durations, an idle action, env entries K=V and label keys that can be
// matched by a selector. It returns a copy of in with the backend
// defaulted; in is not modified. Which backends a node offers, whether
// the images exist and the caller's defaults are the callers' to apply.
func Validate(in *dsecv1.SandboxSpec) (*dsecv1.SandboxSpec, error) {
	if in == nil {
		return nil, fieldErr("spec", "required")
	}
	s := proto.CloneOf(in)
	if s.Backend == "" {
		s.Backend = string(Container)
	}
	switch runtime.Kind(s.Backend) {
	case Container, FnCall, MicroVM, FullVM:
	default:
		return nil, fieldErr("spec.backend", "unknown backend %q (want %s, %s, %s or %s)", s.Backend, Container, FnCall, MicroVM, FullVM)
	}
	if s.Image == "" {
		return nil, fieldErr("spec.image", "required")
	}
	if _, err := image.ParseRef(s.Image); err != nil {
		return nil, fieldErr("spec.image", "%v", err)
	}
	if s.Workspace != "" {
		if _, err := image.ParseRef(s.Workspace); err != nil {
			return nil, fieldErr("spec.workspace", "%v", err)
		}
	}
	for i, t := range s.Toolkits {
		if _, err := image.ParseRef(t); err != nil {
			return nil, fieldErr(fmt.Sprintf("spec.toolkits[%d]", i), "%v", err)
		}
	}
	if err := FromProto(s.Resources).Validate("spec.resources"); err != nil {
		return nil, err
	}
	if err := duration("spec.ttl", s.Ttl); err != nil {
		return nil, err
	}
	if err := duration("spec.idle_timeout", s.IdleTimeout); err != nil {
		return nil, err
	}
	switch s.IdleAction {
	case "", IdleDestroy, IdleFreeze:
	default:
		return nil, fieldErr("spec.idle_action", "%q is not %q or %q", s.IdleAction, IdleDestroy, IdleFreeze)
	}
	for i, e := range s.Env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
			return nil, fieldErr(fmt.Sprintf("spec.env[%d]", i), "%q is not K=V", e)
		}
		if strings.IndexByte(e, 0) >= 0 {
			return nil, fieldErr(fmt.Sprintf("spec.env[%d]", i), "contains a NUL byte")
		}
	}
	if n := s.Network; n != nil {
		// Kept in canonical form ("PyPI" is "pypi", a repeated target once),
		// which is what Get shows and the edge enforces.
		p, err := Network("spec.network", n.Allow, n.Deny)
		if err != nil {
			return nil, err
		}
		s.Network = NetworkProto(p)
	}
	for k, v := range s.Labels {
		if k == "" || strings.ContainsAny(k, "=,") {
			return nil, fieldErr("spec.labels", "key %q must be non-empty without '=' or ','", k)
		}
		if strings.IndexByte(k, 0) >= 0 || strings.IndexByte(v, 0) >= 0 {
			return nil, fieldErr("spec.labels", "label %q contains a NUL byte", k)
		}
	}
	return s, nil
}

// Resolve returns what a sandbox of s (a spec Validate returned) asks of
// its node and what it gets.
//
// requests are the resources s states: a field it leaves out is 0 and
// asks for nothing. Node capacity is charged requests (placement, the
// node's pending charge, the edge's admission, pools' node charge), so a
// sandbox created without resources does not reserve a core and a GiB of
// the node it runs on.
//
// limits are requests with each field left 0 taken from the first of
// defaults that sets it (the tenant's, then the node's, then Builtin):
// what the kernel enforces and what tenant quotas are charged. An explicit
// field is both its request and its limit.
//
// s is not modified.
func Resolve(s *dsecv1.SandboxSpec, defaults ...Resources) (requests, limits Resources) {
	requests = FromProto(s.GetResources())
	limits = requests
	for _, d := range defaults {
		limits = limits.Or(d)
	}
	return requests, limits
}

func duration(field string, d *durationpb.Duration) error {
	if d == nil {
		return nil
	}
	if err := d.CheckValid(); err != nil {
		return fieldErr(field, "%v", err)
	}
	if d.AsDuration() < 0 {
		return fieldErr(field, "%v is negative", d.AsDuration())
	}
	return nil
}
