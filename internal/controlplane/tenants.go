package controlplane

import (
	"context"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
)

type tenantService struct{ s *Server }

func (ts *tenantService) Create(ctx context.Context, req *connect.Request[dsecv1.CreateTenantRequest]) (*connect.Response[dsecv1.CreateTenantResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if !p.Admin {
		return nil, errf(connect.CodePermissionDenied, "creating tenants needs the admin token")
	}
	q := req.Msg.GetQuota()
	quota := iam.Quota{MaxSandboxes: q.GetMaxSandboxes(), MaxMilliCPU: q.GetMaxMilliCpu(), MaxMemoryBytes: q.GetMaxMemoryBytes()}
	token, err := ts.s.iam.CreateTenant(ctx, req.Msg.GetName(), quota)
	if err != nil {
		return nil, toConnect(err)
	}
	ts.s.log.Info("tenant created", "tenant", req.Msg.GetName(), "quota", quota)
	return connect.NewResponse(&dsecv1.CreateTenantResponse{Name: req.Msg.GetName(), Token: token}), nil
}

type nodeService struct{ s *Server }

func (ns *nodeService) Heartbeat(ctx context.Context, req *connect.Request[dsecv1.HeartbeatRequest]) (*connect.Response[dsecv1.HeartbeatResponse], error) {
	if err := ns.s.reg.heartbeat(req.Msg); err != nil {
		return nil, errf(connect.CodeInvalidArgument, "heartbeat: %w", err)
	}
	ns.s.metrics.heartbeats.Inc()
	return connect.NewResponse(&dsecv1.HeartbeatResponse{IntervalSeconds: ns.s.heartbeatInterval()}), nil
}
