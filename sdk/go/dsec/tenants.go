package dsec

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Quota bounds what a tenant's live sandboxes may hold; zero means
// unlimited.
type Quota struct {
	MaxSandboxes   int64
	MaxMilliCPU    int64
	MaxMemoryBytes int64
}

// Tenants is the tenant part of the API (admin token only).
type Tenants struct{ c *Client }

// Tenants returns the tenant API.
func (c *Client) Tenants() Tenants { return Tenants{c} }

// Create creates a tenant and returns its bearer token, which the server
// shows only this once.
func (t Tenants) Create(ctx context.Context, name string, q Quota) (string, error) {
	resp, err := t.c.tenants.Create(ctx, connect.NewRequest(&dsecv1.CreateTenantRequest{
		Name: name,
		Quota: &dsecv1.Quota{
			MaxSandboxes:   q.MaxSandboxes,
			MaxMilliCpu:    q.MaxMilliCPU,
			MaxMemoryBytes: q.MaxMemoryBytes,
		},
	}))
	if err != nil {
		return "", fmt.Errorf("create tenant %s: %w", name, err)
	}
	return resp.Msg.GetToken(), nil
}
