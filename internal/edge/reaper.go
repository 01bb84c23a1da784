package edge

import (
	"container/heap"
	"context"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/edge/lifecycle"
)

// The reaper enforces ttl and idle_timeout with one goroutine and a heap of
// deadlines instead of a timer per sandbox: thousands of idle sandboxes cost
// one heap entry each. Entries are checked lazily: an idle deadline moves
// every time the sandbox is used, so when an entry comes due the real
// deadline is recomputed and the entry pushed back if it moved.

type deadline struct {
	at time.Time
	sb *sandbox
}

type deadlineHeap []deadline

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h deadlineHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *deadlineHeap) Push(x any)        { *h = append(*h, x.(deadline)) }
func (h *deadlineHeap) Pop() any {
	old := *h
	d := old[len(old)-1]
	*h = old[:len(old)-1]
	return d
}

// due returns when sb's lifecycle ends and why; zero if it never does. A
// busy sandbox is not idle, so while operations run its idle deadline is
// only a time to look again. The caller holds mu.
func (sb *sandbox) due(now time.Time) (time.Time, string) {
	var at time.Time
	reason := ""
	if sb.ttl > 0 {
		at, reason = sb.createdAt.Add(sb.ttl), reasonTTL
	}
	// A frozen sandbox is paused, not idle: only its ttl runs.
	if sb.idle > 0 && !sb.st.Frozen() {
		d, r := sb.lastActive.Add(sb.idle), reasonIdle
		if sb.spec.GetIdleAction() == IdleFreeze {
			r = reasonIdleFreeze
		}
		if sb.inflight > 0 {
			d, r = now.Add(sb.idle), ""
		}
		if at.IsZero() || d.Before(at) {
			at, reason = d, r
		}
	}
	return at, reason
}

// schedule queues sb's next deadline; the caller holds mu.
func (e *Edge) schedule(sb *sandbox) {
	at, _ := sb.due(time.Now())
	if at.IsZero() {
		return
	}
	wasFirst := len(e.deadlines) == 0 || at.Before(e.deadlines[0].at)
	heap.Push(&e.deadlines, deadline{at: at, sb: sb})
	if wasFirst {
		select {
		case e.wake <- struct{}{}:
		default:
		}
	}
}

type expiry struct {
	sb     *sandbox
	reason string
}

// collect pops what is due at now: sandboxes to destroy, lost sandboxes to
// release, records to forget. It returns when it next has work.
func (e *Edge) collect(now time.Time, sweep bool) (expired []expiry, lost []*sandbox, forgotten []string, next time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for len(e.deadlines) > 0 && !e.deadlines[0].at.After(now) {
		d := heap.Pop(&e.deadlines).(deadline)
		if d.sb.phase() != StateRunning || d.sb.st.DestroyBegun() {
			continue
		}
		at, reason := d.sb.due(now)
		switch {
		case at.IsZero():
		case at.After(now) || reason == "":
			heap.Push(&e.deadlines, deadline{at: at, sb: d.sb})
		default:
			expired = append(expired, expiry{d.sb, reason})
		}
	}
	for len(e.tombstones) > 0 && !e.tombstones[0].at.After(now) {
		sb := e.tombstones[0].sb
		e.tombstones = e.tombstones[1:]
		if e.sandboxes[sb.id] == sb && sb.st.Ended() {
			delete(e.sandboxes, sb.id)
			forgotten = append(forgotten, sb.id)
			if !sb.st.Is(lifecycle.Destroyed) {
				e.metrics.live.WithLabelValues(string(sb.kind), string(sb.phase())).Dec()
			}
		}
	}
	if sweep {
		// A sandbox whose init died is lost even if nobody calls it.
		for _, sb := range e.sandboxes {
			if !sb.st.Live() {
				continue
			}
			select {
			case <-sb.rt.Done():
				e.loseLocked(sb, "sandbox init process exited")
				lost = append(lost, sb)
			default:
			}
		}
	}
	if len(e.deadlines) > 0 {
		next = e.deadlines[0].at
	}
	if len(e.tombstones) > 0 && (next.IsZero() || e.tombstones[0].at.Before(next)) {
		next = e.tombstones[0].at
	}
	return expired, lost, forgotten, next
}

// reapLoop runs until ctx is done.
func (e *Edge) reapLoop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	sweepEvery := e.cfg.HeartbeatInterval
	nextSweep := time.Now()
	for {
		now := time.Now()
		sweep := !now.Before(nextSweep)
		if sweep {
			nextSweep = now.Add(sweepEvery)
		}
		expired, lost, forgotten, next := e.collect(now, sweep)
		if sweep {
			e.sweepAutoPools(ctx)
			e.sweepRebasePools(ctx)
		}
		e.reap(ctx, expired, lost)
		for _, id := range forgotten {
			e.forgetTrajectory(id)
		}
		if next.IsZero() || nextSweep.Before(next) {
			next = nextSweep
		}
		timer.Reset(time.Until(next))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-e.wake:
		}
	}
}

// reap destroys expired sandboxes and releases lost ones, a few at a time
// so that a mass expiry does not stall the loop for long.
func (e *Edge) reap(ctx context.Context, expired []expiry, lost []*sandbox) {
	if len(expired) == 0 && len(lost) == 0 {
		return
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, x := range expired {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if x.reason == reasonIdleFreeze {
				e.log.Info("sandbox idle: freezing it", "sandbox", x.sb.id)
				if err := e.freeze(context.WithoutCancel(ctx), x.sb); err != nil {
					e.log.Warn("freeze idle sandbox", "sandbox", x.sb.id, "err", err)
				}
				return
			}
			e.log.Info("sandbox expired", "sandbox", x.sb.id, "reason", x.reason)
			e.destroy(context.WithoutCancel(ctx), x.sb, x.reason)
		})
	}
	for _, sb := range lost {
		// sb.rt is set once, before the sandbox runs, so it needs no lock.
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			e.release(sb, sb.rt)
		})
	}
	wg.Wait()
}
