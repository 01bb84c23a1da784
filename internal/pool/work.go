package pool

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// ---------------------------------------------------------------- workers

// worker runs background jobs: resets first (they serve waiters soonest),
// then destroys (they free room under Max), then creates.
func (p *Pool) worker() {
	p.mu.Lock()
	defer p.mu.Unlock()
	defer p.leaveLocked()
	for {
		if job := p.nextJobLocked(); job != nil {
			p.mu.Unlock()
			job()
			p.mu.Lock()
			continue
		}
		if p.closed {
			return // the queues are empty; later disposals are synchronous
		}
		p.cond.Wait()
	}
}

// nextJobLocked picks the next job and accounts for it, or returns nil.
func (p *Pool) nextJobLocked() func() {
	if len(p.dirty) > 0 && (p.closed || p.resetting < p.o.Resets) {
		e := p.dirty[0]
		p.dirty = p.dirty[1:]
		if p.closed {
			e.state = stDestroying
			p.destroying++
			return func() { p.destroyEntry(e) }
		}
		e.state = stResetting
		p.resetting++
		return func() { p.reset(e) }
	}
	if len(p.doomed) > 0 {
		e := p.doomed[0]
		p.doomed = p.doomed[1:]
		e.state = stDestroying
		p.destroying++
		return func() { p.destroyEntry(e) }
	}
	if p.bgCreating < p.o.Fill && p.needCreateLocked(time.Now()) {
		p.creating++
		p.bgCreating++
		return p.createInBackground
	}
	return nil
}

// needCreateLocked: a create is allowed, and either more callers wait than
// sandboxes are on their way, or the clean queue (with what is on its way)
// is below target by more than the sandboxes in use (which may come back),
// or has been below target for RefillDelay by more than the sandboxes in use
// that are expected back (see expectedBackLocked).
func (p *Pool) needCreateLocked(now time.Time) bool {
	if p.o.Recycle || !p.canCreateLocked(now) {
		return false
	}
	coming := p.comingLocked()
	if len(p.waiters) > coming {
		return true
	}
	if !p.belowTargetLocked(now) {
		return false
	}
	short := p.targetLocked() + len(p.waiters) - len(p.ready) - coming
	if short > p.inUse || p.o.RefillDelay < 0 {
		return true
	}
	if now.Sub(p.deficitSince) < p.o.RefillDelay {
		return false
	}
	back, _ := p.expectedBackLocked(now)
	return short > back
}

// maxExpectedHold bounds how long the refill waits for a sandbox in use.
// Takers that hold sandboxes longer than this on average (a rollout of
// minutes) are not waited for at all: the pool refills after RefillDelay.
const maxExpectedHold = 5 * time.Second

// expectedBackLocked counts the sandboxes in use that are expected back
// soon: taken less than twice the average hold (at least RefillDelay) ago,
// when the average hold is short. It also returns when the first of them
// stops being expected (zero if none), for the manager's timer.
//
// Why: a loop that takes a sandbox, uses it for a second and hands it back
// (an RL rollout step, one fncall) keeps the clean queue below target all
// the time. Creating for that shortfall after RefillDelay grew the pool by
// its whole size, and every sandbox handed back then found the pool full and
// was destroyed: a create and a destroy per cycle instead of a 1 ms reset.
func (p *Pool) expectedBackLocked(now time.Time) (int, time.Time) {
	window := p.o.RefillDelay
	if p.holdAvg > 0 && p.holdAvg <= maxExpectedHold {
		window = max(window, 2*p.holdAvg)
	}
	n := 0
	var next time.Time
	for _, e := range p.entries {
		if e.state != stInUse || e.takenAt.IsZero() {
			continue
		}
		if until := e.takenAt.Add(window); until.After(now) {
			n++
			if next.IsZero() || until.Before(next) {
				next = until
			}
		}
	}
	return n, next
}

// handOutLocked marks e in use from now.
func (p *Pool) handOutLocked(e *entry, now time.Time) {
	e.state = stInUse
	e.takenAt = now
	p.inUse++
}

// comingLocked counts the sandboxes on their way to the clean queue or a
// waiter: handed back and being reset, or being created in the background.
func (p *Pool) comingLocked() int {
	return len(p.dirty) + p.resetting + p.bgCreating
}

// belowTargetLocked reports whether what is ready and on its way falls short
// of the ready target (beyond the waiters it will serve), keeping
// deficitSince: set when the shortfall starts (the manager is woken to time
// the refill), cleared when it ends.
func (p *Pool) belowTargetLocked(now time.Time) bool {
	if len(p.ready)+p.comingLocked() >= p.targetLocked()+len(p.waiters) {
		p.deficitSince = time.Time{}
		return false
	}
	if p.deficitSince.IsZero() {
		p.deficitSince = now
		p.poke()
	}
	return true
}

// canCreateLocked: not closed, not backing off, below Max.
func (p *Pool) canCreateLocked(now time.Time) bool {
	if p.closed || now.Before(p.backoffUntil) {
		return false
	}
	return p.o.Max == 0 || p.aliveLocked() < p.o.Max
}

func (p *Pool) aliveLocked() int {
	return len(p.ready) + p.inUse + len(p.dirty) + p.resetting + len(p.doomed) + p.destroying + p.creating
}

func (p *Pool) createInBackground() {
	ctx, cancel := context.WithTimeout(p.ctx, createTimeout)
	start := time.Now()
	sb, err := p.o.New(ctx)
	cancel()
	if err == nil && sb == nil {
		err = errors.New("pool: New returned no sandbox")
	}
	p.mu.Lock()
	p.creating--
	p.bgCreating--
	if err != nil {
		// A create cut short by Close is not New's failure; one that ran
		// out of createTimeout is.
		p.createFailedLocked(p.ctx.Err() != nil, err)
		p.mu.Unlock()
		return
	}
	e, err := p.registerLocked(sb, time.Since(start))
	if err != nil {
		p.mu.Unlock()
		p.destroySandbox(sb)
		p.mu.Lock()
		p.createFailedLocked(false, err)
		p.mu.Unlock()
		return
	}
	p.placeCleanOrDestroyLocked(e)
}

// reset resets a handed-back sandbox and places it, or destroys it.
func (p *Pool) reset(e *entry) {
	reset := p.o.Reset
	ok := reset != nil
	if r, can := e.sb.(rt.Resetter); !ok && can {
		reset, ok = func(ctx context.Context, _ rt.Sandbox) error { return r.Reset(ctx) }, true
	}
	var err error
	start := time.Now()
	if ok {
		ctx, cancel := context.WithTimeout(p.ctx, resetTimeout)
		err = reset(ctx, e.sb)
		cancel()
	}
	p.mu.Lock()
	p.resetting--
	switch {
	case !ok:
		// Not resettable: replaced by a fresh one if the pool wants it.
		p.releaseUncoveredLocked()
	case err != nil:
		p.resetFailures++
		if p.ctx.Err() == nil {
			p.log.Warn("pool: reset failed; destroying the sandbox", "sandbox", e.sb.ID(), "err", err)
		}
		p.releaseUncoveredLocked()
	default:
		p.resets++
		p.resetAvg = ewma(p.resetAvg, time.Since(start))
		p.placeCleanOrDestroyLocked(e)
		return
	}
	e.state = stDestroying
	p.destroying++
	p.mu.Unlock()
	p.destroyEntry(e)
}

// releaseUncoveredLocked lets go the newest waiters of a recycling pool
// that no sandbox on its way will serve (a reset they counted on failed):
// such a pool creates nothing, so they would wait for ever. They get
// nothing and create on their own.
func (p *Pool) releaseUncoveredLocked() {
	if !p.o.Recycle {
		return
	}
	for n := len(p.waiters) - p.comingLocked(); n > 0 && len(p.waiters) > 0; n-- {
		w := p.waiters[len(p.waiters)-1]
		p.waiters = p.waiters[:len(p.waiters)-1]
		if !w.done {
			w.done = true
			w.ch <- result{}
		}
	}
}

// placeCleanOrDestroyLocked places a clean, unaccounted entry; if nobody
// wants it, it destroys it on this goroutine. It returns with p.mu released.
func (p *Pool) placeCleanOrDestroyLocked(e *entry) {
	if p.placeCleanLocked(e) {
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	p.destroyEntry(e)
}

// placeCleanLocked gives a clean entry that is in no queue and no count to
// the first waiter, else to the clean queue if it is below target (and Max
// allows: an adopted sandbox may not fit), and returns true. Otherwise it
// marks e destroying and returns false: the caller destroys it with
// destroyEntry on its own goroutine (after Close the workers may be gone).
func (p *Pool) placeCleanLocked(e *entry) bool {
	if !p.closed {
		for len(p.waiters) > 0 {
			w := p.waiters[0]
			p.waiters = p.waiters[1:]
			if w.done {
				continue
			}
			w.done = true
			p.handOutLocked(e, time.Now())
			w.ch <- result{e: e}
			return true
		}
		if len(p.ready) < p.targetLocked() && (p.o.Max == 0 || p.aliveLocked() < p.o.Max) {
			e.state = stReady
			p.ready = append(p.ready, e)
			p.poke()
			return true
		}
	}
	e.state = stDestroying
	p.destroying++
	return false
}

// destroyEntry destroys an entry in state stDestroying (counted in
// p.destroying) and forgets it. Called without p.mu.
func (p *Pool) destroyEntry(e *entry) {
	p.destroySandbox(e.sb)
	p.mu.Lock()
	p.destroying--
	p.destroyed++
	if p.entries[e.sb.ID()] == e {
		delete(p.entries, e.sb.ID())
	}
	p.cond.Broadcast() // room under Max: a waiter may get a create
	p.mu.Unlock()
}

func (p *Pool) destroySandbox(sb rt.Sandbox) {
	ctx, cancel := context.WithTimeout(context.Background(), destroyTimeout)
	defer cancel()
	if err := sb.Destroy(ctx); err != nil {
		p.log.Warn("pool: destroy failed", "sandbox", sb.ID(), "err", err)
	}
}

// registerLocked records a new sandbox; a duplicate ID is New's bug.
func (p *Pool) registerLocked(sb rt.Sandbox, took time.Duration) (*entry, error) {
	id := sb.ID()
	if _, dup := p.entries[id]; dup {
		return nil, fmt.Errorf("pool: New returned sandbox %q, whose ID the pool already holds", id)
	}
	e := &entry{sb: sb}
	p.entries[id] = e
	p.createAvg = ewma(p.createAvg, took)
	if p.failStreak > 0 {
		p.log.Info("pool: creates work again", "after_failures", p.failStreak)
	}
	p.failStreak = 0
	p.lastErr = nil
	p.backoffUntil = time.Time{}
	return e, nil
}

// createFailedLocked counts a failed create and backs off exponentially,
// logging once per streak of failures. A create cut short (cut: by its
// caller's context or by Close) is not New's failure.
func (p *Pool) createFailedLocked(cut bool, err error) {
	if cut || p.closed {
		return
	}
	p.createFailures++
	p.failStreak++
	p.lastErr = err
	d := backoffBase << min(p.failStreak-1, 20)
	p.backoffUntil = time.Now().Add(min(d, backoffMax))
	if p.failStreak == 1 {
		p.log.Warn("pool: create failed; backing off until creates work again", "err", err)
	}
	p.poke() // the manager wakes the workers when the backoff ends
}

// ---------------------------------------------------------------- state helpers

func (p *Pool) targetLocked() int {
	if p.shrunk {
		return min(p.o.MinSize, p.size)
	}
	return p.size
}

// tookLocked records a take: the idle clock restarts and a shrunk pool
// grows back.
func (p *Pool) tookLocked() {
	p.lastTake = time.Now()
	if p.shrunk {
		p.shrunk = false
		p.cond.Broadcast()
		p.poke()
	}
}

// popReadyLocked hands out the most recently readied sandbox that is still
// alive; dead ones found on the way go to the destroy queue.
func (p *Pool) popReadyLocked() *entry {
	for len(p.ready) > 0 {
		e := p.ready[len(p.ready)-1]
		p.ready = p.ready[:len(p.ready)-1]
		select {
		case <-e.sb.Done():
			p.doomLocked(e)
			continue
		default:
		}
		p.handOutLocked(e, time.Now())
		p.poke() // the manager times the refill
		return e
	}
	return nil
}

// doomLocked queues an entry that is in no queue for a worker to destroy.
func (p *Pool) doomLocked(e *entry) {
	e.state = stDoomed
	p.doomed = append(p.doomed, e)
	p.cond.Broadcast()
}

// trimLocked destroys the ready sandboxes beyond the target, longest idle
// first.
func (p *Pool) trimLocked() {
	n := len(p.ready) - p.targetLocked()
	if n <= 0 {
		return
	}
	for _, e := range p.ready[:n] {
		p.doomLocked(e)
	}
	p.ready = append(p.ready[:0], p.ready[n:]...)
}

// leaveLocked ends one unit of flight; the last one after Close closes done.
func (p *Pool) leaveLocked() {
	p.flight--
	p.checkDoneLocked()
}

func (p *Pool) checkDoneLocked() {
	if p.closed && p.flight == 0 && !p.doneClosed {
		p.doneClosed = true
		close(p.done)
	}
}

func (p *Pool) poke() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func ewma(avg, sample time.Duration) time.Duration {
	if avg == 0 {
		return sample
	}
	return avg + (sample-avg)/5
}

// ---------------------------------------------------------------- manager

// manage shrinks the pool when idle, wakes the workers when a create
// backoff ends, and replaces ready sandboxes whose init died: one
// reflect.Select over every ready sandbox's Done channel, rebuilt whenever
// the clean queue gains a sandbox (a goroutine per sandbox would not do for
// pools of hundreds).
func (p *Pool) manage() {
	defer func() {
		p.mu.Lock()
		p.leaveLocked()
		p.mu.Unlock()
	}()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer debounce.Stop()
	const fixed = 3 // stop, wake, timer
	cases := []reflect.SelectCase{
		{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(p.stop)},
		{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(p.wake)},
		{Dir: reflect.SelectRecv},
	}
	var watched []*entry
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return
		}
		now := time.Now()
		if p.o.IdleShrink > 0 && !p.shrunk && now.Sub(p.lastTake) >= p.o.IdleShrink {
			p.shrunk = true
			p.log.Debug("pool: idle; shrinking", "target", p.targetLocked())
			p.trimLocked()
		}
		var wakeAt time.Time
		if p.o.IdleShrink > 0 && !p.shrunk {
			wakeAt = p.lastTake.Add(p.o.IdleShrink)
		}
		if p.o.RefillDelay > 0 && p.belowTargetLocked(now) {
			due := p.deficitSince.Add(p.o.RefillDelay)
			if !now.Before(due) {
				// Due; the sandboxes in use that are expected back may
				// still cover the shortfall: look again when the first
				// of them is overdue.
				p.cond.Broadcast()
				due = time.Time{}
				if _, next := p.expectedBackLocked(now); !next.IsZero() {
					due = next
				}
			}
			if !due.IsZero() && (wakeAt.IsZero() || due.Before(wakeAt)) {
				wakeAt = due
			}
		}
		if !p.backoffUntil.IsZero() {
			if now.Before(p.backoffUntil) {
				if wakeAt.IsZero() || p.backoffUntil.Before(wakeAt) {
					wakeAt = p.backoffUntil
				}
			} else {
				p.backoffUntil = time.Time{}
				p.cond.Broadcast()
			}
		}
		cases = cases[:fixed]
		watched = watched[:0]
		for _, e := range p.ready {
			cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(e.sb.Done())})
			watched = append(watched, e)
		}
		p.mu.Unlock()

		timer.Stop()
		cases[2].Chan = reflect.Value{} // ignored by Select
		if !wakeAt.IsZero() {
			timer.Reset(time.Until(wakeAt))
			cases[2].Chan = reflect.ValueOf(timer.C)
		}
		i, _, _ := reflect.Select(cases)
		switch {
		case i == 0:
			return
		case i == 1:
			// Coalesce a burst of Puts into one rebuild: for a pool of
			// thousands, rebuilding (and Select sorting its cases) per Put
			// would cost a core. A dead sandbox waits at most this much
			// longer to be replaced, and takers never get one anyway.
			debounce.Reset(rebuildEvery)
			select {
			case <-p.stop:
				return
			case <-debounce.C:
			}
		case i >= fixed:
			p.dropDead(watched[i-fixed])
		}
	}
}

// dropDead moves a ready sandbox whose init exited to the destroy queue;
// the workers then create its replacement.
func (p *Pool) dropDead(e *entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e.state != stReady {
		return // taken meanwhile: its taker finds out
	}
	p.ready = slices.DeleteFunc(p.ready, func(x *entry) bool { return x == e })
	p.log.Warn("pool: ready sandbox died; replacing it", "sandbox", e.sb.ID())
	p.doomLocked(e)
}
