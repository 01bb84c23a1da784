package edge

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge/lifecycle"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// Sandbox states as reported in Get, List and heartbeats (the contract's,
// spec.State).
const (
	StateCreating  = spec.StateCreating
	StateRunning   = spec.StateRunning
	StateLost      = spec.StateLost
	StateDestroyed = spec.StateDestroyed
	StateFailed    = spec.StateFailed
	StateFrozen    = spec.StateFrozen
)

// Idle actions (SandboxSpec.idle_action).
const (
	IdleDestroy = spec.IdleDestroy
	IdleFreeze  = spec.IdleFreeze
)

// Why a sandbox was destroyed (the reason label of the destroys metric).
const (
	reasonRequest = "request"
	reasonTTL     = "ttl"
	reasonIdle    = "idle"
	// reasonIdleFreeze is an idle timeout whose action is to freeze.
	reasonIdleFreeze = "idle-freeze"
	reasonShutdown   = "shutdown"
)

// sandbox is the edge's record of one sandbox. The fields above the line
// never change after create; the rest are guarded by Edge.mu.
type sandbox struct {
	id     string
	tenant string
	kind   runtime.Kind
	// spec is the sandbox's spec with its limits as resources (what Get
	// shows and the kernel enforces; spec.Resolve).
	spec *dsecv1.SandboxSpec
	// req is what it charges the node's capacity: its requests (the
	// resources its creator stated), not the defaults of its limits.
	req       placement.Capacity
	layers    []string
	createdAt time.Time
	ttl       time.Duration
	idle      time.Duration

	// st is where the sandbox is in its life (package lifecycle): it
	// says what it takes, what callers see and whether it is charged to
	// the node (from admission until its backend released it). Only
	// setState moves it.
	st         lifecycle.Machine
	reason     string
	lastActive time.Time
	// inflight counts operations in progress; a sandbox busy in a long exec
	// is not idle.
	inflight int
	// destroyed is closed when a destroy that began while the sandbox ran
	// has finished (other destroys wait for it).
	destroyed chan struct{}
	rt        runtime.Sandbox
	// rspec is what rt was created from; stack is its layer stack, bottom
	// first (the image's layers, then checkpoint layers after a rollback).
	rspec runtime.Spec
	// stateMu serialises freeze, thaw, snapshot, checkpoint and rollback.
	stateMu sync.Mutex
	// stateReleased is set once releaseState ran.
	stateReleased bool
	// pool is the warm pool rt was taken from, while rt is still that
	// pool's sandbox (a rollback replaces it); destroy hands rt back to it.
	pool *warmPool
	// use is what it was last measured to use (sandboxusage.go).
	use sandboxUse
	// egress relays rt's proxy connections while it runs (egress.go).
	egress *egressRun
	// verifyMu: one verify at a time (verify.go); image is the layer
	// stack it was created with (the image's, before any rollback), what
	// a verifier is built from.
	verifyMu sync.Mutex
	image    []runtime.Layer
}

// phase is the contract's state of sb, frozen aside (what messages name
// and the live gauge counts); the caller holds Edge.mu.
func (sb *sandbox) phase() spec.State { return sb.st.Phase() }

// tombstone schedules forgetting a sandbox that ended.
type tombstone struct {
	at time.Time
	sb *sandbox
}

// toProto describes sb; the caller holds Edge.mu.
func (e *Edge) toProto(sb *sandbox) *dsecv1.Sandbox {
	return &dsecv1.Sandbox{
		Id:           sb.id,
		Node:         e.cfg.NodeID,
		Tenant:       sb.tenant,
		Spec:         sb.spec,
		State:        string(sb.st.Visible()),
		CreatedAt:    timestamppb.New(sb.createdAt),
		LastActiveAt: timestamppb.New(sb.lastActive),
		Layers:       sb.layers,
		Reason:       sb.reason,
		NextSeq:      e.nextSeq(sb.id),
		Usage:        sb.use.proto(),
	}
}

func invalid(format string, args ...any) error { return fail.Invalid(format, args...) }

// validateSpec checks a spec by the contract (package spec) and what only
// this node knows (the backends it offers), and resolves its resources
// (spec.Resolve): it returns a copy whose resources are the sandbox's
// limits, and its requests (what in states), which is what the node's
// capacity is charged. limits are the server's resolution of what in
// leaves 0 (tenant defaults, else the nodes' reported ones; the quota it
// charged); what they leave 0 too, all of it when a caller other than a
// server sends none, takes this node's defaults.
func (e *Edge) validateSpec(id string, in *dsecv1.SandboxSpec, limits *dsecv1.Resources) (*dsecv1.SandboxSpec, placement.Capacity, error) {
	node, err := ids.NodeOf(id)
	if err != nil {
		return nil, placement.Capacity{}, invalid("sandbox_id: %w", err)
	}
	if node != e.cfg.NodeID {
		return nil, placement.Capacity{}, invalid("sandbox_id %q names node %q, not this node %q", id, node, e.cfg.NodeID)
	}
	s, err := spec.Validate(in)
	if err != nil {
		return nil, placement.Capacity{}, fail.New(fail.InvalidArgument, err)
	}
	if _, ok := e.cfg.Backends[runtime.Kind(s.Backend)]; !ok {
		return nil, placement.Capacity{}, invalid("spec.backend %q is not offered by node %q", s.Backend, e.cfg.NodeID)
	}
	if s.Network != nil && e.aether == nil {
		return nil, placement.Capacity{}, fail.New(fail.FailedPrecondition, fmt.Errorf("spec.network: node %q runs without egress", e.cfg.NodeID))
	}
	sent := spec.FromProto(limits)
	if err := sent.Validate("limits"); err != nil {
		return nil, placement.Capacity{}, fail.New(fail.InvalidArgument, err)
	}
	req, lim := spec.Resolve(s, sent, e.cfg.Defaults)
	s.Resources = lim.Proto()
	return s, placement.Capacity{MilliCPU: req.MilliCPU, MemoryBytes: req.MemoryBytes, Sandboxes: 1}, nil
}

func checkDuration(field string, d *durationpb.Duration) error {
	if d == nil {
		return nil
	}
	if err := d.CheckValid(); err != nil {
		return invalid("%s: %w", field, err)
	}
	if d.AsDuration() < 0 {
		return invalid("%s %s must not be negative", field, d.AsDuration())
	}
	return nil
}

// resolveSpec turns a validated spec into the runtime spec of sandbox id
// and its layer digests, bottom first: from the images a server resolved
// (sent), checking only that this node reaches each layer, else by
// resolving the spec's images here (callers other than a server).
func (e *Edge) resolveSpec(ctx context.Context, id string, spec *dsecv1.SandboxSpec, sent *dsecv1.ResolvedImages) (runtime.Spec, []string, error) {
	resolved, err := e.resolved(ctx, spec, sent)
	if err != nil {
		e.metrics.failures.WithLabelValues(spec.Backend, "image").Inc()
		switch {
		case errors.Is(err, image.ErrNotFound):
			return runtime.Spec{}, nil, fail.New(fail.NotFound, err)
		case errors.Is(err, image.ErrInvalidRef), errors.Is(err, image.ErrBackend):
			return runtime.Spec{}, nil, fail.New(fail.InvalidArgument, err)
		}
		return runtime.Spec{}, nil, fail.New(fail.Unavailable, fmt.Errorf("resolve images of sandbox %q: %w", id, err))
	}
	layers := make([]runtime.Layer, len(resolved.Layers))
	digests := make([]string, len(resolved.Layers))
	for i, l := range resolved.Layers {
		p, err := blobstore.LocalPath(ctx, e.local, l.Digest)
		if err != nil {
			e.metrics.failures.WithLabelValues(spec.Backend, "image").Inc()
			kind := fail.Unavailable
			if errors.Is(err, blobstore.ErrNotFound) {
				kind = fail.NotFound
			}
			return runtime.Spec{}, nil, fail.New(kind, fmt.Errorf("layer %s of sandbox %q: %w", l.Digest, id, err))
		}
		layers[i] = runtime.Layer{Digest: l.Digest, Path: p}
		digests[i] = l.Digest
	}
	r := spec.GetResources()
	res := runtime.Resources{MilliCPU: r.GetMilliCpu(), MemoryBytes: r.GetMemoryBytes(), Pids: r.GetPids(), DiskBytes: r.GetDiskBytes()}
	return runtime.Spec{
		ID:        id,
		Layers:    layers,
		Resources: res,
		Env:       append(append([]string(nil), resolved.Config.Env...), spec.Env...),
		Workdir:   resolved.Config.WorkingDir,
		User:      resolved.Config.User,
	}, digests, nil
}

// resolved returns the images of spec: those a server sent, else the
// spec's own resolved here.
func (e *Edge) resolved(ctx context.Context, spec *dsecv1.SandboxSpec, sent *dsecv1.ResolvedImages) (image.Resolved, error) {
	if sent == nil {
		// A fullvm boots its disk image (Layers[0].Path is the disk blob,
		// through e.local.Path as any layer); every other backend mounts
		// EROFS layers: ResolveFor refuses a mix-up naming the field.
		return e.images.ResolveFor(ctx, spec.Backend, spec.Image, spec.Workspace, spec.Toolkits...)
	}
	if len(sent.GetLayers()) == 0 {
		return image.Resolved{}, fmt.Errorf("resolved: no layers: %w", image.ErrInvalidRef)
	}
	r := image.Resolved{
		Config:    image.Config{Env: sent.GetEnv(), WorkingDir: sent.GetWorkdir(), User: sent.GetUser()},
		Manifests: sent.GetManifests(),
	}
	for i, l := range sent.GetLayers() {
		if err := blobstore.ValidateDigest(l.GetDigest()); err != nil {
			return image.Resolved{}, fmt.Errorf("resolved.layers[%d]: %w: %w", i, err, image.ErrInvalidRef)
		}
		r.Layers = append(r.Layers, blobstore.Descriptor{Digest: l.GetDigest(), Size: l.GetSize()})
	}
	return r, nil
}

// create validates, resolves images, admits and builds one sandbox; limits
// are the server's (see validateSpec), and so are the resolved images.
func (e *Edge) create(ctx context.Context, caller *dsecv1.Caller, id string, in *dsecv1.SandboxSpec, limits *dsecv1.Resources, sent *dsecv1.ResolvedImages) (*dsecv1.Sandbox, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	spec, req, err := e.validateSpec(id, in, limits)
	if err != nil {
		e.metrics.failures.WithLabelValues(backendLabel(in), "invalid").Inc()
		return nil, err
	}
	kind := runtime.Kind(spec.Backend)
	rspec, digests, err := e.resolveSpec(ctx, id, spec, sent)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	sb := &sandbox{
		id:         id,
		tenant:     caller.Tenant,
		kind:       kind,
		spec:       spec,
		req:        req,
		layers:     digests,
		createdAt:  now,
		ttl:        spec.GetTtl().AsDuration(),
		idle:       spec.GetIdleTimeout().AsDuration(),
		lastActive: now,
		// No state yet: admit moves it to creating, and only a move
		// counts it in the live gauge (a record born "creating" was
		// never counted there but was taken off it when it ran, and
		// dsec_edge_sandboxes{state="creating"} went negative).
	}
	// A ready sandbox of a matching pool is taken before admission: the
	// pool's charge for it turns into the sandbox's own (recycle.go).
	c := &claim{caller: caller, sb: sb, key: PoolKey(spec.Backend, digests, spec.Resources, spec.Env)}
	rs, source := e.takeFromRecyclers(ctx, c, true)
	if err := e.admit(sb); err != nil {
		if rs != nil {
			c.pool.p.Put(rs)
		}
		return nil, err
	}
	sb.rspec = rspec
	sb.image = rspec.Layers
	if rs != nil {
		// The sandbox keeps its pool's runtime ID: rollback re-creates
		// under it.
		sb.rspec.ID = rs.ID()
		sb.pool = c.pool
	} else if rs, source = e.takeFromRecyclers(ctx, c, false); rs == nil {
		source = "fresh"
		rs, err = e.cfg.Backends[kind].Create(ctx, sb.rspec)
	}

	if err == nil && e.traj != nil {
		// The creation record is durable before anyone learns the
		// sandbox exists: every later record chains to it.
		if lerr := e.traj.Create(ctx, id, environment(sb), now, time.Now()); lerr != nil {
			dropRuntime(context.WithoutCancel(ctx), sb.pool, rs)
			err = fmt.Errorf("trajectory: %w", lerr)
		}
	}

	e.mu.Lock()
	if err != nil {
		if sb.st.Is(lifecycle.Creating) { // else destroyed meanwhile, and so it stays
			e.setState(sb, lifecycle.Failed, err.Error())
		}
		e.mu.Unlock()
		reason := "backend"
		kind := fail.Internal
		switch {
		case errors.Is(err, runtime.ErrInvalidSpec):
			reason, kind = "invalid", fail.InvalidArgument
		case errors.Is(err, runtime.ErrBusy) && ctx.Err() == nil:
			// A refusal, as admission's: the server places it again.
			reason, kind = "busy", fail.ResourceExhausted
		case ctx.Err() != nil:
			reason, kind = "canceled", fail.Canceled
		}
		e.metrics.failures.WithLabelValues(spec.Backend, reason).Inc()
		e.log.Warn("create sandbox failed", "sandbox", id, "err", err)
		return nil, fail.New(kind, fmt.Errorf("create sandbox %q: %w", id, err))
	}
	if !sb.st.Is(lifecycle.Creating) || e.closed {
		// Destroyed (by request or shutdown) while the backend was building it.
		if sb.st.Is(lifecycle.Creating) {
			e.setState(sb, lifecycle.Destroyed, "")
		}
		e.mu.Unlock()
		dropRuntime(context.WithoutCancel(ctx), sb.pool, rs)
		e.endTrajectory(sb, trajectory.KindDestroy, "destroyed while being created")
		return nil, fail.New(fail.Aborted, fmt.Errorf("sandbox %q was destroyed while being created", id))
	}
	sb.rt = rs
	sb.lastActive = time.Now()
	e.setState(sb, lifecycle.Running, "")
	e.startEgressLocked(sb, rs)
	e.schedule(sb)
	out := e.toProto(sb)
	e.mu.Unlock()
	e.metrics.creates.WithLabelValues(spec.Backend, source).Inc()
	return out, nil
}

// sourceRebased is the creates metric's source label of a sandbox rebased
// from another spec (see rebase.go).
const sourceRebased = "rebased"

func backendLabel(spec *dsecv1.SandboxSpec) string {
	if spec.GetBackend() == "" {
		return string(runtime.KindContainer)
	}
	return spec.GetBackend()
}

// admit charges sb to the node if it fits and records it as creating.
func (e *Edge) admit(sb *sandbox) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fail.New(fail.Unavailable, fmt.Errorf("node %q is shutting down", e.cfg.NodeID))
	}
	if _, dup := e.sandboxes[sb.id]; dup {
		return fail.New(fail.AlreadyExists, fmt.Errorf("sandbox %q already exists", sb.id))
	}
	short := e.shortLocked(sb.kind, sb.req, false)
	if short != "" {
		e.metrics.failures.WithLabelValues(string(sb.kind), "admission").Inc()
		return fail.New(fail.ResourceExhausted,
			fmt.Errorf("node %q has no room for sandbox %q: %s backend out of %s", e.cfg.NodeID, sb.id, sb.kind, short))
	}
	e.sandboxes[sb.id] = sb
	e.state.admitted()
	e.setState(sb, lifecycle.Creating, "") // charges it
	return nil
}

// shortLocked says what the node is short of for one more sandbox of kind
// requesting req, or "" when it has room; the caller holds mu. The node is
// charged what it measures in use plus its share of what live and pooled
// sandboxes request (see nodestate.go), and its measured state must have
// room for one more sandbox. With counted, the sandbox is among those
// charged already (a pool's sandbox being made, in its Creating count):
// the node needs room for it, not for one more besides it.
func (e *Edge) shortLocked(kind runtime.Kind, req placement.Capacity, counted bool) string {
	capa, c := e.cfg.Capacity[kind], e.chargedLocked(kind)
	sh := e.cfg.RequestShare[kind]
	st, since := e.state.get()
	cpu, mem := placement.ChargeOf(req.MilliCPU, sh.CPU), placement.ChargeOf(req.MemoryBytes, sh.Memory)
	if counted {
		c.Sandboxes--
		c.MilliCPU -= cpu
		c.MemoryBytes -= mem
	}
	switch {
	case c.Sandboxes+1 > capa.Sandboxes:
		return fmt.Sprintf("sandboxes (%d of %d in use)", c.Sandboxes, capa.Sandboxes)
	case req.MemoryBytes > capa.MemoryBytes:
		return fmt.Sprintf("memory_bytes (%d requested, more than the node's %d)", req.MemoryBytes, capa.MemoryBytes)
	case cpu > capa.MilliCPU-c.MilliCPU:
		return fmt.Sprintf("milli_cpu (%d requested at a share of %g, %d of %d charged)", req.MilliCPU, sh.CPU, c.MilliCPU, capa.MilliCPU)
	case mem > capa.MemoryBytes-c.MemoryBytes:
		return fmt.Sprintf("memory_bytes (%d requested at a share of %g, %d of %d charged)", req.MemoryBytes, sh.Memory, c.MemoryBytes, capa.MemoryBytes)
	}
	return st.full(since, e.cfg.MemoryReserve)
}

// requestedLocked is what live and pooled sandboxes of kind request, and
// their count; the caller holds mu.
func (e *Edge) requestedLocked(kind runtime.Kind) placement.Capacity {
	u, p := e.used[kind], e.pooledLocked(kind)
	u.MilliCPU += p.MilliCPU
	u.MemoryBytes += p.MemoryBytes
	u.Sandboxes += p.Sandboxes
	return u
}

// chargedLocked is what the node is charged for kind: its share of what
// the backend's sandboxes request, plus, for memory, what they are
// measured to use; the caller holds mu. CPU is compressible: what
// sandboxes use of it is weighed (idle sandboxes get a low weight) and
// steers placement through the node's load, but does not refuse a create
// (a burst of creates spends CPU setting them up and would refuse itself).
func (e *Edge) chargedLocked(kind runtime.Kind) placement.Capacity {
	r, sh := e.requestedLocked(kind), e.cfg.RequestShare[kind]
	st, _ := e.state.get()
	u := st.use[kind]
	return placement.Capacity{
		MilliCPU:    placement.ChargeOf(r.MilliCPU, sh.CPU),
		MemoryBytes: u.memoryBytes + placement.ChargeOf(r.MemoryBytes, sh.Memory),
		Sandboxes:   r.Sandboxes,
	}
}

// charge and uncharge keep node usage and held layers as sb enters and
// leaves the charged states; setState calls them, holding mu.
func (e *Edge) charge(sb *sandbox) {
	u := e.used[sb.kind]
	u.MilliCPU += sb.req.MilliCPU
	u.MemoryBytes += sb.req.MemoryBytes
	u.Sandboxes++
	e.used[sb.kind] = u
	for _, d := range sb.layers {
		e.layers[d]++
	}
	if sb.kind == runtime.KindContainer {
		e.tenantContainers[sb.tenant]++
	}
}

func (e *Edge) uncharge(sb *sandbox) {
	u := e.used[sb.kind]
	u.MilliCPU -= sb.req.MilliCPU
	u.MemoryBytes -= sb.req.MemoryBytes
	u.Sandboxes--
	e.used[sb.kind] = u
	for _, d := range sb.layers {
		if e.layers[d]--; e.layers[d] <= 0 {
			delete(e.layers, d)
		}
	}
	if sb.kind == runtime.KindContainer {
		if e.tenantContainers[sb.tenant]--; e.tenantContainers[sb.tenant] <= 0 {
			delete(e.tenantContainers, sb.tenant)
		}
	}
}

// setState moves sb to next, keeping the node's charge, the live gauge
// and the tombstones; the caller holds mu. A record is counted in the
// gauge, by phase, from admission until it is destroyed or forgotten. A
// move the state machine refuses changes nothing and is logged: it is a
// bug of the caller's.
func (e *Edge) setState(sb *sandbox, next lifecycle.State, reason string) {
	old, wasCharged, wasEnded := sb.st.Phase(), sb.st.Charged(), sb.st.Ended()
	if err := sb.st.To(next); err != nil {
		e.log.Error("sandbox state", "sandbox", sb.id, "err", err)
		return
	}
	state := sb.st.Phase()
	switch {
	case !wasCharged && sb.st.Charged():
		e.charge(sb)
	case wasCharged && !sb.st.Charged():
		e.uncharge(sb)
	}
	if old != "" && old != StateDestroyed && old != state {
		e.metrics.live.WithLabelValues(string(sb.kind), string(old)).Dec()
	}
	if state != StateDestroyed && old != state {
		e.metrics.live.WithLabelValues(string(sb.kind), string(state)).Inc()
	}
	if reason != "" {
		// Reasons reach callers (Get, infra_error results): no host paths.
		sb.reason = e.redact.String(reason)
	}
	if !wasEnded && sb.st.Ended() {
		e.tombstones = append(e.tombstones, tombstone{at: time.Now().Add(e.cfg.Retention), sb: sb})
	}
}

// lookup finds id for caller; another tenant's sandbox is NotFound, so its
// existence does not leak.
func (e *Edge) lookup(caller *dsecv1.Caller, id string) (*sandbox, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	if id == "" {
		return nil, invalid("sandbox_id is required")
	}
	e.mu.Lock()
	sb := e.sandboxes[id]
	e.mu.Unlock()
	if sb == nil || (!caller.Admin && sb.tenant != caller.Tenant) {
		return nil, fail.New(fail.NotFound, fmt.Errorf("sandbox %q not found", id))
	}
	return sb, nil
}

// get describes one sandbox.
func (e *Edge) get(caller *dsecv1.Caller, id string) (*dsecv1.Sandbox, error) {
	sb, err := e.lookup(caller, id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.toProto(sb), nil
}

// list returns caller's sandboxes matching every label, destroyed ones
// excepted.
func (e *Edge) list(caller *dsecv1.Caller, labels map[string]string) ([]*dsecv1.Sandbox, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*dsecv1.Sandbox
	for _, sb := range e.sandboxes {
		if sb.st.Is(lifecycle.Destroyed) || (!caller.Admin && sb.tenant != caller.Tenant) {
			continue
		}
		if !matches(sb.spec.Labels, labels) {
			continue
		}
		out = append(out, e.toProto(sb))
	}
	return out, nil
}

func matches(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

// errLost carries why an operation found its sandbox lost.
type errLost struct{ reason string }

func (e errLost) Error() string { return e.reason }

// paused says why a running sandbox takes no operations right now (frozen,
// being rolled back, being destroyed), or nil. Numbered operations check it
// before they take a number: a client that retries after the thaw must not
// find its number used up by the refusal.
func (e *Edge) paused(sb *sandbox) error { return e.pausedUnless(sb, false) }

func (e *Edge) pausedUnless(sb *sandbox, frozenOK bool) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case sb.st.Is(lifecycle.Destroying):
		return fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is being destroyed", sb.id))
	case sb.st.Frozen() && !frozenOK:
		return fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is frozen: thaw it first", sb.id))
	case sb.st.Is(lifecycle.RollingBack):
		return fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is being rolled back", sb.id))
	case sb.st.Is(lifecycle.Creating):
		return fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is still being created", sb.id))
	}
	return nil
}

// begin marks an operation on sb as started and returns its runtime
// sandbox. A lost sandbox gives errLost; other non-running states give
// FailedPrecondition.
func (e *Edge) begin(sb *sandbox) (runtime.Sandbox, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case sb.st.DestroyBegun():
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is being destroyed", sb.id))
	case sb.st.Frozen():
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is frozen: thaw it first", sb.id))
	case sb.st.Is(lifecycle.RollingBack):
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is being rolled back", sb.id))
	case sb.st.Is(lifecycle.Running):
		sb.inflight++
		sb.lastActive = time.Now()
		return sb.rt, nil
	case sb.st.Is(lifecycle.Lost):
		return nil, errLost{fmt.Sprintf("sandbox %q is lost: %s", sb.id, sb.reason)}
	case sb.st.Is(lifecycle.Creating):
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is still being created", sb.id))
	}
	msg := fmt.Sprintf("sandbox %q is %s", sb.id, sb.phase())
	if sb.reason != "" {
		msg += ": " + sb.reason
	}
	return nil, fail.New(fail.FailedPrecondition, errors.New(msg))
}

// end closes an operation begun with begin. If it failed because the
// sandbox is gone, the sandbox is marked lost (unless something already
// ended it) and the error to report is returned as errLost.
func (e *Edge) end(sb *sandbox, rs runtime.Sandbox, opErr error) error {
	e.mu.Lock()
	sb.inflight--
	sb.lastActive = time.Now()
	if opErr == nil || !errors.Is(opErr, runtime.ErrSandboxGone) {
		e.mu.Unlock()
		return opErr
	}
	if (sb.st.Live() || sb.st.Is(lifecycle.RollingBack)) && (sb.st.Is(lifecycle.RollingBack) || sb.rt != rs) {
		e.mu.Unlock()
		return fail.New(fail.Aborted, fmt.Errorf("sandbox %q was rolled back during the operation", sb.id))
	}
	var gone runtime.Sandbox
	var lost errLost
	switch {
	case sb.st.DestroyBegun():
		lost = errLost{fmt.Sprintf("sandbox %q was destroyed during the operation", sb.id)}
	case sb.st.Live():
		gone = e.loseLocked(sb, opErr.Error())
		fallthrough
	default:
		lost = errLost{fmt.Sprintf("sandbox %q is %s: %s", sb.id, sb.phase(), sb.reason)}
	}
	e.mu.Unlock()
	if gone != nil {
		e.release(sb, gone)
	}
	return lost
}

// loseLocked marks a live (or rolling back) sandbox lost and returns its
// runtime sandbox, which the caller must release outside the lock.
func (e *Edge) loseLocked(sb *sandbox, reason string) runtime.Sandbox {
	e.setState(sb, lifecycle.Lost, reason)
	e.metrics.failures.WithLabelValues(string(sb.kind), "lost").Inc()
	e.log.Warn("sandbox lost", "sandbox", sb.id, "reason", reason)
	return sb.rt
}

// release records that sb is lost and frees what it still holds (mounts,
// cgroups, dirs).
func (e *Edge) release(sb *sandbox, rs runtime.Sandbox) {
	e.mu.Lock()
	reason := sb.reason
	wp := sb.pool
	e.mu.Unlock()
	e.endTrajectory(sb, trajectory.KindLost, reason)
	defer e.releaseState(sb)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := dropRuntime(ctx, wp, rs); err != nil {
		e.log.Warn("release lost sandbox", "sandbox", sb.id, "err", err)
	}
}

// destroy ends sb for reason. Destroying an ended sandbox succeeds and
// does nothing more. A running sandbox is reported destroyed (and stops
// counting against capacity) only once its backend has released it, so
// that Get and heartbeats never claim more than is true.
func (e *Edge) destroy(ctx context.Context, sb *sandbox, reason string) error {
	e.mu.Lock()
	switch {
	case sb.st.Is(lifecycle.Destroyed):
		e.mu.Unlock()
		return nil
	case sb.st.Is(lifecycle.Destroying):
		wait := sb.destroyed
		e.mu.Unlock()
		select {
		case <-wait:
			return nil
		case <-ctx.Done():
			return fail.New(fail.Canceled, fmt.Errorf("destroy sandbox %q: %w", sb.id, ctx.Err()))
		}
	case !sb.st.Live() && !sb.st.Is(lifecycle.RollingBack):
		// A lost sandbox was released already; a creating one is torn down
		// by its create when the backend returns.
		e.setState(sb, lifecycle.Destroyed, "")
		e.mu.Unlock()
		e.endTrajectory(sb, trajectory.KindDestroy, reason)
		return nil
	}
	done := make(chan struct{})
	sb.destroyed = done
	frozen := sb.st.Frozen()
	e.setState(sb, lifecycle.Destroying, "")
	rs, wp, closing := sb.rt, sb.pool, e.closed
	e.mu.Unlock()
	// Before the runtime goes back to a pool: its next user must not
	// inherit this sandbox's connections.
	e.stopEgress(sb)
	var err error
	switch {
	case wp != nil && !frozen && !closing:
		// Back to its pool: reset in place in the background, then
		// ready for the next create (or destroyed if the pool is full).
		wp.p.Put(rs)
	case wp == nil && !frozen && !closing && e.roomToKeep(sb.kind) && e.keepInRecyclers(sb, rs):
		// Kept by a recycler rather than torn down.
	default:
		err = dropRuntime(context.WithoutCancel(ctx), wp, rs)
	}
	// Counted before the state turns destroyed, so whoever sees the state
	// also sees the count.
	e.metrics.destroys.WithLabelValues(string(sb.kind), reason).Inc()

	e.mu.Lock()
	why := ""
	switch reason {
	case reasonTTL:
		why = fmt.Sprintf("ttl %s expired", sb.ttl)
	case reasonIdle:
		why = fmt.Sprintf("idle for %s", sb.idle)
	case reasonShutdown:
		why = "node shut down"
	}
	e.setState(sb, lifecycle.Destroyed, why)
	e.mu.Unlock()
	if why == "" {
		why = "destroyed on request"
	}
	// The destroy record is written before the destroy is acknowledged.
	e.endTrajectory(sb, trajectory.KindDestroy, why)
	e.releaseState(sb)
	e.mu.Lock()
	close(done)
	e.mu.Unlock()
	if err != nil {
		e.log.Warn("destroy sandbox", "sandbox", sb.id, "reason", reason, "err", err)
		return fail.New(fail.Internal, fmt.Errorf("destroy sandbox %q: %w", sb.id, err))
	}
	e.log.Debug("sandbox destroyed", "sandbox", sb.id, "reason", reason)
	return nil
}

// opError maps a runtime error of a file or exec operation to a Connect
// error naming the sandbox.
func opError(ctx context.Context, id, op string, err error) error {
	var lost errLost
	if errors.As(err, &lost) {
		return fail.New(fail.FailedPrecondition, lost)
	}
	if classified(err) {
		return err
	}
	wrapped := fmt.Errorf("%s in sandbox %q: %w", op, id, err)
	switch {
	case ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fail.New(fail.DeadlineExceeded, wrapped)
	case ctx.Err() != nil:
		return fail.New(fail.Canceled, wrapped)
	case errors.Is(err, fs.ErrNotExist):
		return fail.New(fail.NotFound, wrapped)
	case errors.Is(err, fs.ErrPermission):
		return fail.New(fail.PermissionDenied, wrapped)
	case errors.Is(err, fs.ErrExist):
		return fail.New(fail.AlreadyExists, wrapped)
	case errors.Is(err, fs.ErrInvalid), errors.Is(err, runtime.ErrInvalidSpec):
		return fail.New(fail.InvalidArgument, wrapped)
	case errors.Is(err, runtime.ErrFailedPrecondition):
		// The sandbox's own state (not a regular file, larger than asked
		// for, an I/O error of its files): not the platform's failure.
		return fail.New(fail.FailedPrecondition, wrapped)
	}
	return fail.New(fail.Unknown, wrapped)
}

// summaries lists every sandbox that is not destroyed, for heartbeats.
func (e *Edge) summaries() []*dsecv1.SandboxSummary {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]*dsecv1.SandboxSummary, 0, len(e.sandboxes))
	for _, sb := range e.sandboxes {
		if sb.st.Is(lifecycle.Destroyed) {
			continue
		}
		out = append(out, &dsecv1.SandboxSummary{
			Id:     sb.id,
			Tenant: sb.tenant,
			State:  string(sb.st.Visible()),
			Labels: maps.Clone(sb.spec.Labels),
			// The tenant's quota is charged the limits.
			MilliCpu:    sb.spec.GetResources().GetMilliCpu(),
			MemoryBytes: sb.spec.GetResources().GetMemoryBytes(),
			Backend:     string(sb.kind),
			Usage:       sb.use.summary(),
		})
	}
	return out
}
