package dsec

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Backends a sandbox can run on.
const (
	BackendContainer = "container"
	BackendFnCall    = "fncall"
	BackendMicroVM   = "microvm"
	BackendFullVM    = "fullvm"
)

// Sandbox states reported by Get and List.
const (
	StateCreating  = "creating"
	StateRunning   = "running"
	StateLost      = "lost"
	StateDestroyed = "destroyed"
	StateFailed    = "failed"
	// StateFrozen is a running sandbox whose processes are frozen (Freeze,
	// FreezeJob or an idle timeout with IdleFreeze); Thaw resumes it.
	StateFrozen = "frozen"
)

// What an idle timeout does (Spec.IdleAction).
const (
	// IdleDestroy destroys an idle sandbox (the default).
	IdleDestroy = "destroy"
	// IdleFreeze freezes an idle sandbox, keeping its processes and
	// memory; Thaw resumes it.
	IdleFreeze = "freeze"
)

// Resources bounds a sandbox. Zero fields take the tenant's defaults, else
// the node's: every sandbox has all four limits, and its quota is charged
// for what it gets (a Sandbox's Spec shows it).
type Resources struct {
	// MilliCPU is thousandths of a core (1000 = one core).
	MilliCPU    int64
	MemoryBytes int64
	Pids        int64
	// DiskBytes bounds the writable layer (what the sandbox writes over
	// its image).
	DiskBytes int64
}

// Spec says what sandbox to create.
type Spec struct {
	// Backend is BackendContainer when empty.
	Backend string
	// Image is the base image, NAME:TAG.
	Image string
	// Workspace is an optional image layered over the base.
	Workspace string
	// Toolkits are images layered on top, last on top.
	Toolkits  []string
	Resources Resources
	Labels    map[string]string
	// TTL is the maximum lifetime; zero means none.
	TTL time.Duration
	// IdleTimeout destroys the sandbox after this long without an
	// operation (or freezes it, see IdleAction); zero means none.
	IdleTimeout time.Duration
	// IdleAction is what IdleTimeout does: IdleDestroy (the default when
	// empty) or IdleFreeze.
	IdleAction string
	// Env (K=V) applies to every exec, over the image's environment.
	Env []string
	// Network is the sandbox's egress policy (default: nothing goes out);
	// Sandbox.SetNetwork changes it while the sandbox runs.
	Network Network
}

func (s Spec) proto() *dsecv1.SandboxSpec {
	p := &dsecv1.SandboxSpec{
		Backend:    s.Backend,
		Image:      s.Image,
		Workspace:  s.Workspace,
		Toolkits:   s.Toolkits,
		Labels:     s.Labels,
		Env:        s.Env,
		IdleAction: s.IdleAction,
		Network:    s.Network.proto(),
	}
	if s.Resources != (Resources{}) {
		p.Resources = &dsecv1.Resources{
			MilliCpu:    s.Resources.MilliCPU,
			MemoryBytes: s.Resources.MemoryBytes,
			Pids:        s.Resources.Pids,
			DiskBytes:   s.Resources.DiskBytes,
		}
	}
	if s.TTL > 0 {
		p.Ttl = durationpb.New(s.TTL)
	}
	if s.IdleTimeout > 0 {
		p.IdleTimeout = durationpb.New(s.IdleTimeout)
	}
	return p
}

func specFromProto(p *dsecv1.SandboxSpec) Spec {
	if p == nil {
		return Spec{}
	}
	s := Spec{
		Backend:    p.GetBackend(),
		Image:      p.GetImage(),
		Workspace:  p.GetWorkspace(),
		Toolkits:   p.GetToolkits(),
		Labels:     p.GetLabels(),
		Env:        p.GetEnv(),
		IdleAction: p.GetIdleAction(),
		Network:    networkFromProto(p.GetNetwork()),
		Resources: Resources{
			MilliCPU:    p.GetResources().GetMilliCpu(),
			MemoryBytes: p.GetResources().GetMemoryBytes(),
			Pids:        p.GetResources().GetPids(),
			DiskBytes:   p.GetResources().GetDiskBytes(),
		},
	}
	if p.Ttl != nil {
		s.TTL = p.Ttl.AsDuration()
	}
	if p.IdleTimeout != nil {
		s.IdleTimeout = p.IdleTimeout.AsDuration()
	}
	return s
}

// Sandbox is a snapshot of one sandbox's description plus a handle to
// operate on it. The fields are as of the call that returned it; Refresh
// fetches them again.
type Sandbox struct {
	c *Client
	// seq numbers the handle's operations (see trajectory.go); shared by
	// copies of the handle.
	seq *numbering

	ID     string
	Node   string
	Tenant string
	Spec   Spec
	// State is one of the State constants.
	State string
	// Reason says why the sandbox is lost or failed.
	Reason       string
	CreatedAt    time.Time
	LastActiveAt time.Time
	// Layers are the layer digests the sandbox was built from, bottom first.
	Layers []string
	// NextSeq is the step number the sandbox's trajectory expected next when
	// this description was fetched (0 if its node keeps no trajectory).
	NextSeq uint64
	// Usage is what the sandbox uses as its node last measured it (every
	// few seconds); nil until the node has, and for backends that cannot
	// say.
	Usage *SandboxUsage
}

// SandboxUsage is what one sandbox uses, its agent included.
type SandboxUsage struct {
	// MilliCPU is its CPU averaged over Window, in thousandths of a core;
	// 0 while Window is 0 (measured once only so far).
	MilliCPU int64
	Window   time.Duration
	// MemoryBytes is the memory charged to it that the kernel cannot drop
	// at once (RAM in use less inactive file pages); SwapBytes what of it
	// is in swap.
	MemoryBytes int64
	SwapBytes   int64
	// MeasuredAt is when (zero when the server did not say: the figures of
	// a sandbox whose node stopped answering).
	MeasuredAt time.Time
}

func usageFromProto(p *dsecv1.SandboxUsage) *SandboxUsage {
	if p == nil {
		return nil
	}
	u := &SandboxUsage{MilliCPU: p.GetMilliCpu(), MemoryBytes: p.GetMemoryBytes(), SwapBytes: p.GetSwapBytes()}
	if p.Window != nil {
		u.Window = p.Window.AsDuration()
	}
	if p.MeasuredAt != nil {
		u.MeasuredAt = p.MeasuredAt.AsTime()
	}
	return u
}

func (c *Client) sandbox(p *dsecv1.Sandbox) *Sandbox {
	sb := &Sandbox{
		c:       c,
		seq:     &numbering{next: 1},
		NextSeq: p.GetNextSeq(),
		ID:      p.GetId(),
		Node:    p.GetNode(),
		Tenant:  p.GetTenant(),
		Spec:    specFromProto(p.GetSpec()),
		State:   p.GetState(),
		Reason:  p.GetReason(),
		Layers:  p.GetLayers(),
		Usage:   usageFromProto(p.GetUsage()),
	}
	if p.CreatedAt != nil {
		sb.CreatedAt = p.CreatedAt.AsTime()
	}
	if p.LastActiveAt != nil {
		sb.LastActiveAt = p.LastActiveAt.AsTime()
	}
	return sb
}

// Sandbox returns a handle for an existing sandbox without asking the
// server; only ID is set. The handle numbers its operations from 1 (or as
// opts say): a client that restarts and re-issues a sandbox's operations in
// the same order gets the recorded results back (fast-forward) up to where
// it left off, and the rest run.
func (c *Client) Sandbox(id string, opts ...HandleOption) *Sandbox {
	sb := &Sandbox{c: c, ID: id, seq: &numbering{next: 1}}
	for _, o := range opts {
		o(sb)
	}
	return sb
}

// Create creates one sandbox and returns when it is running.
func (c *Client) Create(ctx context.Context, spec Spec) (*Sandbox, error) {
	req := connect.NewRequest(&dsecv1.CreateSandboxRequest{Spec: spec.proto()})
	ctx, done := queued(ctx, req.Header())
	defer done()
	resp, err := c.sandboxes.Create(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("create sandbox from %q: %w", spec.Image, err)
	}
	return c.sandbox(resp.Msg.GetSandbox()), nil
}

// CreateMany creates n sandboxes from one spec in one call. It returns the
// sandboxes that were created and, if some were not, a *BatchError holding
// one error per failure (each with its Connect code).
func (c *Client) CreateMany(ctx context.Context, spec Spec, n int) ([]*Sandbox, error) {
	if n <= 0 {
		return nil, nil
	}
	req := connect.NewRequest(&dsecv1.BatchCreateSandboxesRequest{Spec: spec.proto(), Count: int32(n)})
	ctx, done := queued(ctx, req.Header())
	defer done()
	resp, err := c.sandboxes.BatchCreate(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("create %d sandboxes from %q: %w", n, spec.Image, err)
	}
	var (
		out  []*Sandbox
		errs []error
	)
	for i, r := range resp.Msg.GetResults() {
		if r.GetError() != nil {
			errs = append(errs, itemError(fmt.Sprintf("sandbox %d of %d", i+1, n), r.GetError()))
			continue
		}
		out = append(out, c.sandbox(r.GetSandbox()))
	}
	return out, batchErr(errs)
}

// Get describes one sandbox.
func (c *Client) Get(ctx context.Context, id string) (*Sandbox, error) {
	resp, err := c.sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetSandboxRequest{Id: id}))
	if err != nil {
		return nil, fmt.Errorf("get sandbox %s: %w", id, err)
	}
	return c.sandbox(resp.Msg.GetSandbox()), nil
}

// List returns the caller's sandboxes carrying every label in labels (all
// of them when labels is empty).
func (c *Client) List(ctx context.Context, labels map[string]string) ([]*Sandbox, error) {
	resp, err := c.sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListSandboxesRequest{Labels: labels}))
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	out := make([]*Sandbox, 0, len(resp.Msg.GetSandboxes()))
	for _, p := range resp.Msg.GetSandboxes() {
		out = append(out, c.sandbox(p))
	}
	return out, nil
}

// Destroy destroys one sandbox.
func (c *Client) Destroy(ctx context.Context, id string) error {
	if _, err := c.sandboxes.Destroy(ctx, connect.NewRequest(&dsecv1.DestroySandboxRequest{Id: id})); err != nil {
		return fmt.Errorf("destroy sandbox %s: %w", id, err)
	}
	return nil
}

// DestroyMany destroys sandboxes in one call. It returns a *BatchError
// holding one error per sandbox that could not be destroyed.
func (c *Client) DestroyMany(ctx context.Context, ids ...string) error {
	if len(ids) == 0 {
		return nil
	}
	resp, err := c.sandboxes.BatchDestroy(ctx, connect.NewRequest(&dsecv1.BatchDestroySandboxesRequest{Ids: ids}))
	if err != nil {
		return fmt.Errorf("destroy %d sandboxes: %w", len(ids), err)
	}
	var errs []error
	for _, r := range resp.Msg.GetResults() {
		if r.GetError() != nil {
			errs = append(errs, itemError("destroy sandbox "+r.GetId(), r.GetError()))
		}
	}
	return batchErr(errs)
}

// Refresh fetches the sandbox's description again.
func (s *Sandbox) Refresh(ctx context.Context) error {
	fresh, err := s.c.Get(ctx, s.ID)
	if err != nil {
		return err
	}
	c, seq := s.c, s.seq
	*s = *fresh
	s.c, s.seq = c, seq
	return nil
}

// Destroy destroys the sandbox.
func (s *Sandbox) Destroy(ctx context.Context) error { return s.c.Destroy(ctx, s.ID) }

// WriteFile writes data to path inside the sandbox with permission bits
// mode (0 means 0644), creating parent directories as needed.
func (s *Sandbox) WriteFile(ctx context.Context, path string, data []byte, mode uint32) error {
	req := &dsecv1.WriteFileRequest{SandboxId: s.ID, Path: path, Data: data, Mode: mode, Seq: s.take(0)}
	err := s.send(ctx, req.Seq, func() error {
		_, err := s.c.sandboxes.WriteFile(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return fmt.Errorf("write %s in sandbox %s: %w", path, s.ID, err)
	}
	return nil
}

// ReadFile reads path inside the sandbox. maxBytes bounds the size (0, or
// more than the server's ceiling of 16 MiB, means that ceiling); a larger
// file is InvalidArgument (read it through ExecStream instead).
func (s *Sandbox) ReadFile(ctx context.Context, path string, maxBytes int64) ([]byte, error) {
	req := &dsecv1.ReadFileRequest{SandboxId: s.ID, Path: path, MaxBytes: maxBytes, Seq: s.take(0)}
	var resp *connect.Response[dsecv1.ReadFileResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.ReadFile(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("read %s in sandbox %s: %w", path, s.ID, err)
	}
	return resp.Msg.GetData(), nil
}
