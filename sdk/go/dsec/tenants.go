package dsec

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Quota bounds what a tenant's live sandboxes and pools may hold; zero
// means unlimited. MaxImportBytes bounds one image import after
// decompression; zero takes the server's limit.
type Quota struct {
	MaxSandboxes   int64
	MaxMilliCPU    int64
	MaxMemoryBytes int64
	MaxImportBytes int64
}

// Usage is what a tenant's sandboxes and pools hold, as charged to its
// quota.
type Usage struct {
	Sandboxes   int64
	MilliCPU    int64
	MemoryBytes int64
}

// Tenant is a tenant's record: its quota, the defaults its sandboxes get
// for resources their spec leaves 0 (a zero field: the node's), and what
// it holds now.
type Tenant struct {
	Name      string
	Quota     Quota
	Defaults  Resources
	Usage     Usage
	CreatedAt time.Time
}

// TenantUpdate says what Tenants.Update changes: the fields that are set
// (non-nil). A zero value sets a quota back to unlimited (MaxImportBytes:
// to the server's limit) and a default back to the node's.
type TenantUpdate struct {
	MaxSandboxes, MaxMilliCPU, MaxMemoryBytes, MaxImportBytes          *int64
	DefaultMilliCPU, DefaultMemoryBytes, DefaultPids, DefaultDiskBytes *int64
}

// Tenants is the tenant part of the API (admin token, except Get of the
// caller's own tenant).
type Tenants struct{ c *Client }

// Tenants returns the tenant API.
func (c *Client) Tenants() Tenants { return Tenants{c} }

func quotaProto(q Quota) *dsecv1.Quota {
	return &dsecv1.Quota{
		MaxSandboxes: q.MaxSandboxes, MaxMilliCpu: q.MaxMilliCPU,
		MaxMemoryBytes: q.MaxMemoryBytes, MaxImportBytes: q.MaxImportBytes,
	}
}

func resourcesProto(r Resources) *dsecv1.Resources {
	return &dsecv1.Resources{MilliCpu: r.MilliCPU, MemoryBytes: r.MemoryBytes, Pids: r.Pids, DiskBytes: r.DiskBytes}
}

func tenantFromProto(p *dsecv1.Tenant) *Tenant {
	if p == nil {
		return nil
	}
	q, d, u := p.GetQuota(), p.GetDefaults(), p.GetUsage()
	t := &Tenant{
		Name: p.GetName(),
		Quota: Quota{
			MaxSandboxes: q.GetMaxSandboxes(), MaxMilliCPU: q.GetMaxMilliCpu(),
			MaxMemoryBytes: q.GetMaxMemoryBytes(), MaxImportBytes: q.GetMaxImportBytes(),
		},
		Defaults: Resources{MilliCPU: d.GetMilliCpu(), MemoryBytes: d.GetMemoryBytes(), Pids: d.GetPids(), DiskBytes: d.GetDiskBytes()},
		Usage:    Usage{Sandboxes: u.GetSandboxes(), MilliCPU: u.GetMilliCpu(), MemoryBytes: u.GetMemoryBytes()},
	}
	if p.GetCreatedAt() != nil {
		t.CreatedAt = p.GetCreatedAt().AsTime()
	}
	return t
}

// Create creates a tenant and returns its bearer token, which the server
// shows only this once.
func (t Tenants) Create(ctx context.Context, name string, q Quota) (string, error) {
	return t.CreateWithDefaults(ctx, name, q, Resources{})
}

// CreateWithDefaults creates a tenant whose sandboxes get defaults for the
// resources their spec leaves 0, and returns its bearer token.
func (t Tenants) CreateWithDefaults(ctx context.Context, name string, q Quota, defaults Resources) (string, error) {
	resp, err := t.c.tenants.Create(ctx, connect.NewRequest(&dsecv1.CreateTenantRequest{
		Name: name, Quota: quotaProto(q), Defaults: resourcesProto(defaults),
	}))
	if err != nil {
		return "", fmt.Errorf("create tenant %s: %w", name, err)
	}
	return resp.Msg.GetToken(), nil
}

// Update changes what u sets of a tenant's quota and defaults (admin), and
// returns the tenant as it is now. Live sandboxes keep what they got.
func (t Tenants) Update(ctx context.Context, name string, u TenantUpdate) (*Tenant, error) {
	resp, err := t.c.tenants.Update(ctx, connect.NewRequest(&dsecv1.UpdateTenantRequest{
		Name: name, MaxSandboxes: u.MaxSandboxes, MaxMilliCpu: u.MaxMilliCPU, MaxMemoryBytes: u.MaxMemoryBytes,
		MaxImportBytes: u.MaxImportBytes, DefaultMilliCpu: u.DefaultMilliCPU, DefaultMemoryBytes: u.DefaultMemoryBytes,
		DefaultPids: u.DefaultPids, DefaultDiskBytes: u.DefaultDiskBytes,
	}))
	if err != nil {
		return nil, fmt.Errorf("update tenant %s: %w", name, err)
	}
	return tenantFromProto(resp.Msg.GetTenant()), nil
}

// Get returns a tenant's record; name "" is the caller's own tenant. A
// tenant may get only itself.
func (t Tenants) Get(ctx context.Context, name string) (*Tenant, error) {
	resp, err := t.c.tenants.Get(ctx, connect.NewRequest(&dsecv1.GetTenantRequest{Name: name}))
	if err != nil {
		return nil, fmt.Errorf("get tenant %s: %w", name, err)
	}
	return tenantFromProto(resp.Msg.GetTenant()), nil
}

// List returns every tenant (admin).
func (t Tenants) List(ctx context.Context) ([]*Tenant, error) {
	resp, err := t.c.tenants.List(ctx, connect.NewRequest(&dsecv1.ListTenantsRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list tenants: %w", err)
	}
	out := make([]*Tenant, 0, len(resp.Msg.GetTenants()))
	for _, p := range resp.Msg.GetTenants() {
		out = append(out, tenantFromProto(p))
	}
	return out, nil
}
