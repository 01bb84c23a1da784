package dsec

import (
	"context"
	"fmt"
	"math"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Pool is a warm pool: sandboxes of one spec kept created and clean ahead
// of demand on one node. A Create or Acquire by the pool's tenant whose
// spec matches (same backend, images, resources and env; labels, ttl and
// idle settings are the new sandbox's own) takes a clean one; a released
// one is reset and goes back.
type Pool struct {
	ID   string
	Spec Spec
	// Size is the target; Ready sandboxes are clean and waiting, InUse are
	// handed out, Resetting are on their way back.
	Size      int
	Ready     int
	InUse     int
	Resetting int
	Node      string
	Tenant    string
	// MinSize is the target while the pool is unused, and IdleShrink how
	// long unused before it shrinks to it.
	MinSize    int
	IdleShrink time.Duration
	// Hits are takes served warm; Misses are matching creates that found
	// the pool empty.
	Hits   int64
	Misses int64
}

func poolFromProto(p *dsecv1.Pool) *Pool {
	pl := &Pool{
		ID:        p.GetId(),
		Spec:      specFromProto(p.GetSpec()),
		Size:      int(p.GetSize()),
		Ready:     int(p.GetReady()),
		InUse:     int(p.GetInUse()),
		Resetting: int(p.GetResetting()),
		Node:      p.GetNode(),
		Tenant:    p.GetTenant(),
		MinSize:   int(p.GetMinSize()),
		Hits:      p.GetHits(),
		Misses:    p.GetMisses(),
	}
	if p.GetIdleShrink() != nil {
		pl.IdleShrink = p.GetIdleShrink().AsDuration()
	}
	return pl
}

// PoolOptions tunes a pool; the zero value takes the server's defaults.
type PoolOptions struct {
	// MinSize is what the pool shrinks to when unused (default 0).
	MinSize int
	// IdleShrink is how long without takes before it shrinks (default
	// 10 minutes).
	IdleShrink time.Duration
}

// CreatePool creates a pool keeping size sandboxes of spec ready. It
// returns at once; the pool fills in the background (watch Ready with
// ListPools).
func (c *Client) CreatePool(ctx context.Context, spec Spec, size int, opts PoolOptions) (*Pool, error) {
	switch {
	case size < 1 || size > math.MaxInt32:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("create pool: size: %d must be at least 1", size))
	case opts.MinSize < 0 || opts.MinSize > size:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("create pool: min_size: %d is outside [0, size %d]", opts.MinSize, size))
	case opts.IdleShrink < 0:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("create pool: idle_shrink: %s is negative", opts.IdleShrink))
	}
	req := &dsecv1.CreatePoolRequest{Spec: spec.proto(), Size: int32(size), MinSize: int32(opts.MinSize)}
	if opts.IdleShrink > 0 {
		req.IdleShrink = durationpb.New(opts.IdleShrink)
	}
	resp, err := c.pools.Create(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("create pool of %d %q sandboxes: %w", size, spec.Image, err)
	}
	return poolFromProto(resp.Msg.GetPool()), nil
}

// ListPools returns the pools the caller can see.
func (c *Client) ListPools(ctx context.Context) ([]*Pool, error) {
	resp, err := c.pools.List(ctx, connect.NewRequest(&dsecv1.ListPoolsRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", err)
	}
	out := make([]*Pool, 0, len(resp.Msg.GetPools()))
	for _, p := range resp.Msg.GetPools() {
		out = append(out, poolFromProto(p))
	}
	return out, nil
}

// DeletePool deletes a pool: it stops keeping sandboxes ready.
func (c *Client) DeletePool(ctx context.Context, id string) error {
	if _, err := c.pools.Delete(ctx, connect.NewRequest(&dsecv1.DeletePoolRequest{Id: id})); err != nil {
		return fmt.Errorf("delete pool %s: %w", id, err)
	}
	return nil
}
