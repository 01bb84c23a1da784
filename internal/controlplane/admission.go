package controlplane

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"connectrpc.com/connect"

	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/placement"
)

// Admission under load (issue 6). When no node has room for a create, it
// waits in a bounded queue, within its deadline, for room to appear (a
// heartbeat, a destroy, a failed create) instead of failing at once; when
// the queue is full it is Unavailable with a retry-after hint. A create
// over its tenant's quota never waits: more time does not raise a quota.

// queueable reports whether err says "no room now" (as opposed to "no node
// could ever take it" or a quota refusal).
func queueable(err error) bool {
	var ce *placement.CapacityError
	return errors.As(err, &ce) && ce.Eligible > 0
}

// retryAfter estimates when a caller refused for a full queue should come
// back: a second, plus one per hundred creates already waiting.
func (s *Server) retryAfter() time.Duration {
	return time.Second + time.Duration(s.queued.Load()/100)*time.Second
}

// queueFull is the Unavailable refusal with its hint, in the message and in
// a Retry-After header (seconds, as HTTP has it).
func (s *Server) queueFull(what string) error {
	ra := s.retryAfter()
	err := connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s: every node is full and %d requests already wait for room; retry after %s",
		what, s.queued.Load(), ra))
	err.Meta().Set("Retry-After", strconv.Itoa(int(ra.Round(time.Second)/time.Second)))
	return err
}

// placeOrWait places one sandbox of prep after a first attempt failed with
// first, waiting for room when first says the nodes are full.
func (s *Server) placeOrWait(ctx context.Context, p iam.Principal, quota *iam.Quota, prep *prepared, first error) (reservation, error) {
	return s.waitForRoom(ctx, p, quota, prep, first, nil)
}

// refusedOrWait places one sandbox of prep after every node placement
// offered refused it (refused: the placement error with those nodes
// excluded): the nodes' measured state said they were full since their
// last heartbeats, so it waits for the next sign of room before placing
// again, as a create that found every node full does.
func (s *Server) refusedOrWait(ctx context.Context, p iam.Principal, quota *iam.Quota, prep *prepared, refused error) (reservation, error) {
	var ce *placement.CapacityError
	if !errors.As(refused, &ce) || ce.Offered == 0 {
		return reservation{}, toConnect(refused)
	}
	return s.waitForRoom(ctx, p, quota, prep, refused, s.reg.roomSignal())
}

// waitForRoom is placeOrWait's loop; room, when not nil, is waited for
// before the first try.
func (s *Server) waitForRoom(ctx context.Context, p iam.Principal, quota *iam.Quota, prep *prepared, first error, room <-chan struct{}) (reservation, error) {
	if room == nil && !queueable(first) {
		return reservation{}, toConnect(first)
	}
	if err := s.reg.everFits(prep.req); err != nil {
		// Waiting would hold a queue slot until the deadline for nothing.
		return reservation{}, err
	}
	if s.queued.Add(1) > int64(s.cfg.QueueSize) {
		s.queued.Add(-1)
		s.metrics.queueFull.Inc()
		return reservation{}, s.queueFull("create")
	}
	defer s.queued.Add(-1)
	start := time.Now()
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.QueueTimeout)
		defer cancel()
	}
	last := first
	if room != nil {
		select {
		case <-room:
		case <-ctx.Done():
			return reservation{}, s.waitedTooLong(ctx, start, last)
		}
	}
	for {
		// Take the signal before trying, so room that appears during the
		// attempt wakes the wait below.
		room := s.reg.roomSignal()
		res, err := s.place(p, quota, prep, nil)
		if err == nil {
			s.metrics.queueWait.Observe(time.Since(start).Seconds())
			return res, nil
		}
		if !queueable(err) {
			return reservation{}, toConnect(err)
		}
		last = err
		select {
		case <-room:
		case <-ctx.Done():
			return reservation{}, s.waitedTooLong(ctx, start, last)
		}
	}
}

// waitedTooLong is the answer to a create whose wait for room ended
// with ctx.
func (s *Server) waitedTooLong(ctx context.Context, start time.Time, last error) error {
	code := connect.CodeResourceExhausted
	if errors.Is(ctx.Err(), context.Canceled) {
		code = connect.CodeCanceled
	}
	return connect.NewError(code, fmt.Errorf("waited %s in the admission queue for room: %w", time.Since(start).Round(time.Millisecond), last))
}

// everFits refuses at once a request that no live node could hold even
// empty: a memory limit above every node's memory, or more than a node
// offers at the node's request share (say memory_bytes 2^40 on nodes of
// 24 GiB). It names the resource field and the most a node offers.
func (r *registry) everFits(req placement.Request) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var maxCPU, maxMem int64
	offered := false
	for _, n := range r.nodes {
		c, ok := n.capacity[req.Kind]
		if !r.alive(n, now) || !ok || c.Sandboxes < 1 {
			continue
		}
		offered = true
		sh := n.shareOf(req.Kind)
		if placement.ChargeOf(req.MilliCPU, sh.CPU) <= c.MilliCPU && req.MemoryBytes <= c.MemoryBytes &&
			placement.ChargeOf(req.MemoryBytes, sh.Memory) <= c.MemoryBytes {
			return nil
		}
		// The most this node could take: all of it, or its CPU over
		// its share.
		cpu := int64(math.MaxInt64)
		if sh.CPU > 0 {
			cpu = int64(min(float64(c.MilliCPU)/sh.CPU, math.MaxInt64/2))
		}
		maxCPU, maxMem = max(maxCPU, cpu), max(maxMem, c.MemoryBytes)
	}
	if !offered {
		return nil // placement said there are eligible nodes; let it decide
	}
	var field string
	switch {
	case req.MemoryBytes > maxMem:
		field = fmt.Sprintf("spec.resources.memory_bytes %d: the most any node offers the %s backend is %d", req.MemoryBytes, req.Kind, maxMem)
	case req.MilliCPU > maxCPU:
		field = fmt.Sprintf("spec.resources.milli_cpu %d: the most any node offers the %s backend is %d", req.MilliCPU, req.Kind, maxCPU)
	default:
		field = fmt.Sprintf("spec.resources milli_cpu %d with memory_bytes %d: no node offers both at once for the %s backend", req.MilliCPU, req.MemoryBytes, req.Kind)
	}
	return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("no node can ever hold this sandbox, even empty: %s", field))
}
