package controlplane

import (
	"context"
	"slices"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/gc"
)

// GarbageCollect frees the blobs nothing needs any more (see package gc):
// what no ref reaches, no node holds and was stored before the grace
// period. Admin only.
func (is *imageService) GarbageCollect(ctx context.Context, req *connect.Request[dsecv1.GarbageCollectRequest]) (*connect.Response[dsecv1.GarbageCollectResponse], error) {
	s := is.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if !p.Admin {
		return nil, errf(connect.CodePermissionDenied, "garbage collection: only the admin may run it")
	}
	grace := gc.DefaultGrace
	if g := req.Msg.GetGrace(); g != nil {
		if err := g.CheckValid(); err != nil {
			return nil, errf(connect.CodeInvalidArgument, "grace: %w", err)
		}
		if grace = g.AsDuration(); grace < 0 {
			return nil, errf(connect.CodeInvalidArgument, "grace: %v is negative", grace)
		}
	}
	// The layers nodes hold are soft state: right after a restart the
	// registry has not heard from every live edge yet, and a layer only a
	// sandbox keeps would look unused. Wait until every edge has had a
	// node timeout to heartbeat.
	if wait := s.cfg.NodeTimeout - time.Since(s.started); wait > 0 {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, toConnect(ctx.Err())
		}
	}
	start := time.Now()
	res, err := gc.Run(ctx, s.cfg.Store, gc.Options{
		Grace:  grace,
		DryRun: req.Msg.GetDryRun(),
		Held:   func(context.Context) ([]string, error) { return s.reg.heldLayers(), nil },
		Logger: s.log,
	})
	if err != nil {
		s.metrics.fail("gc", err)
		if res.FreedBlobs > 0 {
			return nil, errf(connect.CodeInternal, "garbage collection stopped after freeing %d blobs (%d bytes): %w", res.FreedBlobs, res.FreedBytes, err)
		}
		return nil, toConnect(err)
	}
	s.log.Info("garbage collected", "dry_run", res.DryRun, "grace", grace, "scanned", res.ScannedBlobs, "scanned_bytes", res.ScannedBytes,
		"freed", res.FreedBlobs, "freed_bytes", res.FreedBytes, "kept", res.KeptBlobs, "referenced", res.Referenced,
		"held", res.Held, "young", res.Young, "took", time.Since(start))
	return connect.NewResponse(&dsecv1.GarbageCollectResponse{
		ScannedBlobs:    res.ScannedBlobs,
		ScannedBytes:    res.ScannedBytes,
		FreedBlobs:      res.FreedBlobs,
		FreedBytes:      res.FreedBytes,
		KeptBlobs:       res.KeptBlobs,
		KeptBytes:       res.KeptBytes,
		Freed:           res.Freed,
		ReferencedBlobs: res.Referenced,
		HeldBlobs:       res.Held,
		YoungBlobs:      res.Young,
		DryRun:          res.DryRun,
		BrokenRefs:      res.Broken,
	}), nil
}

// heldLayers returns the layers every node the registry knows reports
// holding. Nodes that stopped heartbeating count until they are forgotten:
// their sandboxes may come back with them.
func (r *registry) heldLayers() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[string]struct{}{}
	for _, n := range r.nodes {
		for l := range n.layers {
			seen[l] = struct{}{}
		}
	}
	out := make([]string, 0, len(seen))
	for l := range seen {
		out = append(out, l)
	}
	slices.Sort(out)
	return out
}
