package controlplane

import (
	"context"
	"errors"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/spec"
)

// TenantService: the admin creates, updates and lists tenants; a tenant may
// read its own record (quota, defaults and what it holds now).

type tenantService struct{ s *Server }

func quotaFromProto(q *dsecv1.Quota) iam.Quota {
	return iam.Quota{
		MaxSandboxes: q.GetMaxSandboxes(), MaxMilliCPU: q.GetMaxMilliCpu(),
		MaxMemoryBytes: q.GetMaxMemoryBytes(), MaxImportBytes: q.GetMaxImportBytes(),
	}
}

// tenantProto describes t with its usage as this replica sees it.
func (s *Server) tenantProto(t iam.Tenant) *dsecv1.Tenant {
	u := s.reg.tenantUse(t.Name)
	return &dsecv1.Tenant{
		Name: t.Name,
		Quota: &dsecv1.Quota{
			MaxSandboxes: t.Quota.MaxSandboxes, MaxMilliCpu: t.Quota.MaxMilliCPU,
			MaxMemoryBytes: t.Quota.MaxMemoryBytes, MaxImportBytes: t.Quota.MaxImportBytes,
		},
		Defaults:  t.Defaults.Proto(),
		Usage:     &dsecv1.TenantUsage{Sandboxes: u.Sandboxes, MilliCpu: u.MilliCPU, MemoryBytes: u.MemoryBytes},
		CreatedAt: timestamppb.New(t.Created),
	}
}

func needAdmin(ctx context.Context, what string) error {
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	if !p.Admin {
		return errf(connect.CodePermissionDenied, "%s needs the admin token", what)
	}
	return nil
}

// tenantError maps an IAM error for a named tenant.
func tenantError(name string, err error) error {
	if errors.Is(err, blobstore.ErrNotFound) {
		return errf(connect.CodeNotFound, "tenant %q not found", name)
	}
	return toConnect(err)
}

func (ts *tenantService) Create(ctx context.Context, req *connect.Request[dsecv1.CreateTenantRequest]) (*connect.Response[dsecv1.CreateTenantResponse], error) {
	if err := needAdmin(ctx, "creating tenants"); err != nil {
		return nil, err
	}
	quota := quotaFromProto(req.Msg.GetQuota())
	defaults := spec.FromProto(req.Msg.GetDefaults())
	token, err := ts.s.iam.CreateTenant(ctx, req.Msg.GetName(), quota, defaults)
	if err != nil {
		return nil, toConnect(err)
	}
	ts.s.log.Info("tenant created", "tenant", req.Msg.GetName(), "quota", quota, "defaults", defaults)
	resp := &dsecv1.CreateTenantResponse{Name: req.Msg.GetName(), Token: token}
	if t, err := ts.s.iam.Tenant(ctx, req.Msg.GetName()); err == nil {
		resp.Tenant = ts.s.tenantProto(t)
	}
	return connect.NewResponse(resp), nil
}

func (ts *tenantService) Update(ctx context.Context, req *connect.Request[dsecv1.UpdateTenantRequest]) (*connect.Response[dsecv1.UpdateTenantResponse], error) {
	if err := needAdmin(ctx, "updating tenants"); err != nil {
		return nil, err
	}
	m := req.Msg
	set := func(dst *int64, v *int64) {
		if v != nil {
			*dst = *v
		}
	}
	t, err := ts.s.iam.UpdateTenant(ctx, m.GetName(), func(t *iam.Tenant) {
		set(&t.Quota.MaxSandboxes, m.MaxSandboxes)
		set(&t.Quota.MaxMilliCPU, m.MaxMilliCpu)
		set(&t.Quota.MaxMemoryBytes, m.MaxMemoryBytes)
		set(&t.Quota.MaxImportBytes, m.MaxImportBytes)
		set(&t.Defaults.MilliCPU, m.DefaultMilliCpu)
		set(&t.Defaults.MemoryBytes, m.DefaultMemoryBytes)
		set(&t.Defaults.Pids, m.DefaultPids)
		set(&t.Defaults.DiskBytes, m.DefaultDiskBytes)
	})
	if err != nil {
		return nil, tenantError(m.GetName(), err)
	}
	ts.s.log.Info("tenant updated", "tenant", t.Name, "quota", t.Quota, "defaults", t.Defaults)
	return connect.NewResponse(&dsecv1.UpdateTenantResponse{Tenant: ts.s.tenantProto(t)}), nil
}

func (ts *tenantService) Get(ctx context.Context, req *connect.Request[dsecv1.GetTenantRequest]) (*connect.Response[dsecv1.GetTenantResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	name := req.Msg.GetName()
	if name == "" {
		if p.Admin {
			return nil, errf(connect.CodeInvalidArgument, "name: required for the admin (it is no tenant)")
		}
		name = p.Tenant
	}
	if !p.Admin && name != p.Tenant {
		// As for other tenants' sandboxes: not found, not forbidden.
		return nil, errf(connect.CodeNotFound, "tenant %q not found", name)
	}
	if err := iam.ValidateName(name); err != nil {
		return nil, toConnect(err)
	}
	t, err := ts.s.iam.Tenant(ctx, name)
	if err != nil {
		return nil, tenantError(name, err)
	}
	return connect.NewResponse(&dsecv1.GetTenantResponse{Tenant: ts.s.tenantProto(t)}), nil
}

func (ts *tenantService) List(ctx context.Context, _ *connect.Request[dsecv1.ListTenantsRequest]) (*connect.Response[dsecv1.ListTenantsResponse], error) {
	if err := needAdmin(ctx, "listing tenants"); err != nil {
		return nil, err
	}
	all, err := ts.s.iam.ListTenants(ctx)
	if err != nil {
		return nil, toConnect(err)
	}
	out := make([]*dsecv1.Tenant, len(all))
	for i, t := range all {
		out[i] = ts.s.tenantProto(t)
	}
	return connect.NewResponse(&dsecv1.ListTenantsResponse{Tenants: out}), nil
}

type nodeService struct{ s *Server }

func (ns *nodeService) Heartbeat(ctx context.Context, req *connect.Request[dsecv1.HeartbeatRequest]) (*connect.Response[dsecv1.HeartbeatResponse], error) {
	if err := ns.s.reg.heartbeat(req.Msg); err != nil {
		return nil, errf(connect.CodeInvalidArgument, "heartbeat: %w", err)
	}
	ns.s.metrics.heartbeats.Inc()
	return connect.NewResponse(&dsecv1.HeartbeatResponse{IntervalSeconds: ns.s.heartbeatInterval()}), nil
}
