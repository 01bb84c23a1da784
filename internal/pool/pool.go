// Package pool keeps warm pools of pre-created sandboxes, so that a create
// whose spec matches a pool, or a stateless fncall, gets a clean sandbox at
// once instead of paying for a create on its own path.
//
// A pool has a clean queue (sandboxes ready to take) and a dirty queue
// (sandboxes handed back, waiting to be reset in place with rt.Resetter).
// Take hands out a clean one; when there is none it creates one on the
// caller's path while the pool is below its bound, and otherwise waits in a
// bounded FIFO queue for a released sandbox (admission under load: never a
// silent hang, ErrQueueFull at once when the queue is full). Put sends a used
// sandbox to the dirty queue; once reset it goes to the first waiter, else to
// the clean queue if the pool wants more, else it is destroyed. Background
// workers refill the clean queue to its target, back off when creates fail,
// and shrink it when the pool goes unused.
//
// Recycling beats creating. A reset costs a few milliseconds, a create tens
// (and on a 2-core node CPU is what bounds throughput), so the pool avoids
// creates that a returning sandbox would make useless: a take that finds
// nothing ready waits for a reset already in flight rather than creating
// (when one is in flight that no earlier waiter will get); the clean queue
// is refilled only after it has stayed below target for RefillDelay (a
// sandbox handed back in the meantime fills the gap), and not for sandboxes
// in use that are expected back soon (judged by how long takers have held
// sandboxes); and a sandbox handed
// back to a pool that has enough is destroyed at once, not reset first.
//
// The pool knows nothing of specs, IDs or capacity accounting: Options.New
// creates one sandbox and the owner (the edge, fncall) decides what it is.
//
// Goroutines: Options.Fill + Options.Resets workers (resets, destroys and
// creates, resets first; at most Fill creates and Resets resets at once) and
// one manager (idle shrink, backoff wake-ups, and watching the
// Done channels of ready sandboxes with one reflect.Select), whatever the
// number of sandboxes.
//
// Locking: one mutex, Pool.mu, guards all state. It is never held while
// calling into a sandbox or Options.New, so a slow backend never blocks Take,
// TryTake, Put or Stats.
package pool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

var (
	// ErrQueueFull is returned by Take when nothing can be had now and
	// Options.MaxWaiters callers already wait. Callers turn it into
	// Unavailable with RetryAfter as the hint.
	ErrQueueFull = errors.New("pool: wait queue is full")
	// ErrClosed is returned by Take once Close has begun.
	ErrClosed = errors.New("pool: closed")
)

// Defaults for zero Options fields.
const (
	DefaultFill       = 2
	DefaultResets     = 4
	DefaultMaxWaiters = 1024
	// DefaultRefillDelay is how long the clean queue stays below target
	// before the workers create replacements: long enough for a sandbox
	// used for one call or one short rollout step to come back and be
	// reset, short against the life of a sandbox a caller keeps.
	DefaultRefillDelay = 100 * time.Millisecond
)

// closeDestroyers is how many workers destroy a closing pool's sandboxes
// at once (the pool's own workers, if more, all do).
const closeDestroyers = 16

// Bounds on background work. A failing New is retried after backoffBase,
// doubling per consecutive failure up to backoffMax. The timeouts stop one
// wedged sandbox from holding a worker for ever.
const (
	backoffBase    = 50 * time.Millisecond
	backoffMax     = 10 * time.Second
	createTimeout  = 2 * time.Minute
	resetTimeout   = time.Minute
	destroyTimeout = time.Minute
	// rebuildEvery bounds how often the manager rebuilds its watch list.
	rebuildEvery = 10 * time.Millisecond
)

// RetryAfter clamps its estimate to this range.
const (
	minRetryAfter = 50 * time.Millisecond
	maxRetryAfter = time.Minute
)

// Options configure a pool. Only New is required, unless Recycle is set.
type Options struct {
	// New creates one sandbox for the pool (the caller gives it its ID,
	// spec and capacity accounting). It must return a sandbox with an ID
	// no other live sandbox of the pool has.
	New func(ctx context.Context) (rt.Sandbox, error)
	// Recycle makes a pool that never creates: only sandboxes handed to
	// Put fill it (up to Size ready), and takers that find nothing ready
	// or coming get nothing (TakeWarm's nil, also from Take when New is
	// nil). The edge keeps one per hot spec to reuse destroyed sandboxes.
	Recycle bool
	// Reset puts a handed-back sandbox in the state takers expect; nil
	// means the sandbox's own rt.Resetter.Reset. The edge's pool of
	// sandboxes waiting to be rebased onto another spec (rt.Rebaser) uses
	// Quiesce: their root file system is replaced when they are taken.
	Reset func(ctx context.Context, sb rt.Sandbox) error
	// Size is the number of clean sandboxes kept ready (refilled in the
	// background).
	Size int
	// Max bounds the sandboxes alive at once (ready, in use, being reset,
	// created or destroyed); 0 means no bound. When it is reached, Take
	// waits for a sandbox to come back. A Size above Max is allowed: the
	// clean queue then stops at what Max leaves.
	Max int
	// After IdleShrink without a Take (or TryTake) the ready target drops
	// to MinSize; the next Take brings it back to Size. IdleShrink 0 never
	// shrinks.
	MinSize    int
	IdleShrink time.Duration
	// MaxWaiters bounds the callers waiting in Take; beyond it Take fails
	// at once with ErrQueueFull. 0 means DefaultMaxWaiters; negative means
	// no waiting at all.
	MaxWaiters int
	// Fill bounds concurrent background creates (default DefaultFill, for
	// the 2-core nodes DSec runs on).
	Fill int
	// Resets bounds concurrent resets (default DefaultResets). A reset
	// spends part of its time waiting for killed processes to exit and for
	// mounts to go, so a few at once keep the cores busy.
	Resets int
	// RefillDelay is how long the clean queue must stay below its target
	// before background creates start; 0 means DefaultRefillDelay, negative
	// means at once. Takers that wait are never delayed by it.
	RefillDelay time.Duration
	// Logger, default slog.Default().
	Logger *slog.Logger
}

// Validate reports the first invalid field, named. New panics on options
// that fail it, so owners validate user input (a CreatePool request) first.
func (o Options) Validate() error {
	switch {
	case o.New == nil && !o.Recycle:
		return errors.New("pool: Options.New is required")
	case o.Size < 0:
		return fmt.Errorf("pool: size %d must not be negative", o.Size)
	case o.Max < 0:
		return fmt.Errorf("pool: max %d must not be negative", o.Max)
	case o.MinSize < 0:
		return fmt.Errorf("pool: min_size %d must not be negative", o.MinSize)
	case o.MinSize > o.Size:
		return fmt.Errorf("pool: min_size %d exceeds size %d", o.MinSize, o.Size)
	case o.IdleShrink < 0:
		return fmt.Errorf("pool: idle_shrink %v must not be negative", o.IdleShrink)
	case o.Fill < 0:
		return fmt.Errorf("pool: fill %d must not be negative", o.Fill)
	case o.Resets < 0:
		return fmt.Errorf("pool: resets %d must not be negative", o.Resets)
	}
	return nil
}

// Stats is a consistent picture of a pool.
type Stats struct {
	// Size is the configured ready target; Target the current one (MinSize
	// while shrunk).
	Size, Target int
	// Ready sandboxes are clean and can be taken; InUse ones are handed
	// out; Resetting ones are in the dirty queue or being reset; Creating
	// and Destroying count creates and destroys in flight.
	Ready, InUse, Resetting, Creating, Destroying int
	// Waiting callers in Take.
	Waiting int
	// Hits are takes served by a ready sandbox, Misses takes that found
	// none.
	Hits, Misses int64
	// Resets succeeded and failed (a failed one is destroyed).
	Resets, ResetFailures int64
	// CreateFailures counts failed creates (on callers' paths too);
	// Destroyed counts sandboxes destroyed by the pool, Detached those
	// taken out of it for good (Detach).
	CreateFailures, Destroyed, Detached int64
}

// Alive is every sandbox the pool accounts for, as Options.Max bounds it.
func (s Stats) Alive() int {
	return s.Ready + s.InUse + s.Resetting + s.Creating + s.Destroying
}

type state uint8

const (
	stReady state = iota + 1
	stInUse
	stDirty
	stResetting
	stDoomed // waiting for a worker to destroy it
	stDestroying
)

func (s state) String() string {
	return [...]string{"?", "ready", "in use", "dirty", "resetting", "doomed", "destroying"}[s]
}

// entry is one sandbox the pool accounts for.
type entry struct {
	sb    rt.Sandbox
	state state
	// takenAt is when it was last handed out (zero for a sandbox the pool
	// adopted in use): how long takers hold sandboxes tells the refill
	// whether a sandbox in use is about to come back.
	takenAt time.Time
}

// waiter is one Take waiting in the FIFO queue.
type waiter struct {
	// ch receives exactly one result, sent under Pool.mu (buffered, so the
	// send never blocks).
	ch   chan result
	done bool // a result was sent, or the waiter left (under Pool.mu)
	// createErr is the error of the waiter's own create, if it tried one.
	createErr error
}

type result struct {
	e   *entry
	err error
}

// Pool is a warm pool. All methods are safe for concurrent use.
type Pool struct {
	o          Options
	log        *slog.Logger
	maxWaiters int
	ctx        context.Context // cancelled by Close: aborts background creates and resets
	cancel     context.CancelFunc
	stop       chan struct{} // closed by Close: stops the manager
	wake       chan struct{} // cap 1: the manager re-reads the state
	done       chan struct{} // closed when nothing is left in flight after Close

	mu         sync.Mutex
	cond       *sync.Cond // workers wait here for work
	closed     bool
	doneClosed bool
	// flight counts the goroutines and calls Close waits for: workers, the
	// manager, creates on callers' paths and synchronous destroys.
	flight int

	size     int
	shrunk   bool
	lastTake time.Time

	entries map[string]*entry // every sandbox accounted for, by ID
	ready   []*entry          // clean queue: taken from the back (warmest)
	dirty   []*entry          // handed back, waiting for a reset
	doomed  []*entry          // waiting for a destroy
	waiters []*waiter         // FIFO

	inUse, resetting, destroying int
	creating, bgCreating         int

	hits, misses, resets, resetFailures, createFailures, destroyed, detached int64

	failStreak   int
	lastErr      error
	backoffUntil time.Time

	// deficitSince is when the clean queue (with what is on its way) fell
	// below target; zero when it is not below. See RefillDelay.
	deficitSince time.Time

	// Moving averages for RetryAfter.
	resetAvg, createAvg, putGap time.Duration
	lastPut                     time.Time
	// holdAvg is the moving average of how long taken sandboxes were held
	// before Put (see expectedBackLocked).
	holdAvg time.Duration
}

// New starts a pool; its workers begin filling it at once. It panics if
// o.Validate fails.
func New(o Options) *Pool {
	if err := o.Validate(); err != nil {
		panic(err)
	}
	if o.Fill == 0 {
		o.Fill = DefaultFill
	}
	if o.Resets == 0 {
		o.Resets = DefaultResets
	}
	if o.RefillDelay == 0 {
		o.RefillDelay = DefaultRefillDelay
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	p := &Pool{
		o:        o,
		log:      o.Logger,
		stop:     make(chan struct{}),
		wake:     make(chan struct{}, 1),
		done:     make(chan struct{}),
		size:     o.Size,
		lastTake: time.Now(),
		entries:  map[string]*entry{},
	}
	switch {
	case o.MaxWaiters == 0:
		p.maxWaiters = DefaultMaxWaiters
	case o.MaxWaiters > 0:
		p.maxWaiters = o.MaxWaiters
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.cond = sync.NewCond(&p.mu)
	p.flight = o.Fill + o.Resets + 1
	for range o.Fill + o.Resets {
		go p.worker()
	}
	go p.manage()
	return p
}

// TryTake returns a clean sandbox, or nil when none is ready. It never
// blocks and never creates.
func (p *Pool) TryTake() rt.Sandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.tookLocked()
	if e := p.popReadyLocked(); e != nil {
		p.hits++
		return e.sb
	}
	p.misses++
	return nil
}

// Take returns a clean sandbox. When none is ready it waits for one being
// reset or created in the background, if one is on its way that no earlier
// waiter will get; else it creates one on the caller's path if the pool is
// below Max (and New is not backing off after failures); otherwise, or if
// that create fails, it waits in a FIFO queue for a sandbox to come back (or
// a background create) until ctx ends. The error then wraps ctx's, and the
// last create error if creates are failing. A full queue fails at once with
// ErrQueueFull.
func (p *Pool) Take(ctx context.Context) (rt.Sandbox, error) {
	return p.take(ctx, true)
}

// TakeWarm is Take without the create: it returns a ready sandbox, or waits
// for one on its way (being reset or created) that no earlier waiter will
// get, or returns nil, nil at once when there is none, for an owner that
// creates sandboxes its own way when the pool cannot serve (the edge).
func (p *Pool) TakeWarm(ctx context.Context) (rt.Sandbox, error) {
	return p.take(ctx, false)
}

func (p *Pool) take(ctx context.Context, create bool) (rt.Sandbox, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("pool: take: %w", err)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		if !create {
			return nil, nil
		}
		return nil, ErrClosed
	}
	p.tookLocked()
	if e := p.popReadyLocked(); e != nil {
		p.hits++
		p.mu.Unlock()
		return e.sb, nil
	}
	p.misses++
	create = create && p.o.New != nil
	coming := p.comingLocked() > len(p.waiters)
	if !create && (!coming || len(p.waiters) >= p.maxWaiters) {
		p.mu.Unlock()
		return nil, nil
	}
	var createErr error
	if !coming && p.canCreateLocked(time.Now()) {
		sb, err := p.createForCaller(ctx) // unlocks and relocks
		if sb != nil || errors.Is(err, ErrClosed) {
			p.mu.Unlock()
			return sb, err
		}
		if ctx.Err() != nil {
			p.mu.Unlock()
			return nil, fmt.Errorf("pool: take: %w (create: %w)", ctx.Err(), err)
		}
		createErr = err
		// A sandbox may have come back while we were creating.
		if e := p.popReadyLocked(); e != nil {
			p.mu.Unlock()
			return e.sb, nil
		}
	}
	if len(p.waiters) >= p.maxWaiters {
		p.mu.Unlock()
		if createErr != nil {
			return nil, fmt.Errorf("%w (create: %w)", ErrQueueFull, createErr)
		}
		return nil, ErrQueueFull
	}
	w := &waiter{ch: make(chan result, 1), createErr: createErr}
	p.waiters = append(p.waiters, w)
	p.cond.Broadcast() // a worker may create for it
	p.mu.Unlock()

	select {
	case r := <-w.ch:
		if r.err != nil || r.e == nil {
			return nil, r.err // nil, nil: let go by a recycling pool
		}
		return r.e.sb, nil
	case <-ctx.Done():
	}
	p.mu.Lock()
	if !w.done {
		w.done = true
		p.waiters = slices.DeleteFunc(p.waiters, func(x *waiter) bool { return x == w })
		lastErr := w.createErr
		if lastErr == nil && p.failStreak > 0 {
			lastErr = p.lastErr
		}
		p.mu.Unlock()
		if lastErr != nil {
			return nil, fmt.Errorf("pool: take: waited for a sandbox: %w (last create error: %w)", ctx.Err(), lastErr)
		}
		return nil, fmt.Errorf("pool: take: waited for a sandbox: %w", ctx.Err())
	}
	p.mu.Unlock()
	// Served at the moment ctx ended: the caller is gone, so the clean
	// sandbox goes on to the next waiter or back to the clean queue.
	r := <-w.ch
	if r.err != nil || r.e == nil {
		return nil, r.err
	}
	p.mu.Lock()
	p.inUse-- // never used: it skips the reset
	if !p.placeCleanLocked(r.e) {
		p.flight++
		p.mu.Unlock()
		p.destroyEntry(r.e)
		p.mu.Lock()
		p.leaveLocked()
	}
	p.mu.Unlock()
	return nil, fmt.Errorf("pool: take: %w", ctx.Err())
}

// createForCaller creates a sandbox on Take's path. Called and returns with
// p.mu held. It returns the sandbox, or the create's error, or ErrClosed.
func (p *Pool) createForCaller(ctx context.Context) (rt.Sandbox, error) {
	p.creating++
	p.flight++
	p.mu.Unlock()
	// Close aborts the create too, so that it does not wait for it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(p.ctx, cancel)()
	start := time.Now()
	sb, err := p.o.New(ctx)
	if err == nil && sb == nil {
		err = errors.New("pool: New returned no sandbox")
	}
	p.mu.Lock()
	p.creating--
	defer p.leaveLocked()
	if err != nil && p.closed {
		return nil, ErrClosed // the queue it would wait in is gone
	}
	if err != nil {
		p.createFailedLocked(ctx.Err() != nil, err)
		return nil, err
	}
	if p.closed {
		p.mu.Unlock()
		p.destroySandbox(sb)
		p.mu.Lock()
		return nil, ErrClosed
	}
	e, err := p.registerLocked(sb, time.Since(start))
	if err != nil {
		p.mu.Unlock()
		p.destroySandbox(sb)
		p.mu.Lock()
		p.createFailedLocked(false, err)
		return nil, err
	}
	p.handOutLocked(e, time.Now())
	return sb, nil
}

// Put hands back a sandbox taken from the pool. It is reset in the
// background and then goes to the first waiter, else to the clean queue if
// the pool wants more, else it is destroyed; a sandbox that is not an
// rt.Resetter (with no Options.Reset), or whose reset fails, is destroyed
// (and replaced if wanted).
// A sandbox the pool did not hand out is adopted the same way (destroyed if
// that would exceed Max). After Close, Put destroys the sandbox before it
// returns. The caller must not use sb after Put.
func (p *Pool) Put(sb rt.Sandbox) {
	if sb == nil {
		return
	}
	id := sb.ID()
	p.mu.Lock()
	e := p.entries[id]
	switch {
	case e == nil:
		if p.closed {
			p.mu.Unlock()
			p.destroySandbox(sb)
			return
		}
		e = &entry{sb: sb}
		p.entries[id] = e
	case e.state != stInUse:
		p.mu.Unlock()
		p.log.Error("pool: Put of a sandbox that is not in use (put twice?); ignored", "sandbox", id, "state", e.state.String())
		return
	default:
		p.inUse--
	}
	now := time.Now()
	if !e.takenAt.IsZero() {
		p.holdAvg = ewma(p.holdAvg, now.Sub(e.takenAt))
		e.takenAt = time.Time{}
	}
	if !p.lastPut.IsZero() {
		p.putGap = ewma(p.putGap, now.Sub(p.lastPut))
	}
	p.lastPut = now
	if p.closed {
		p.destroyNowLocked(e)
		p.mu.Unlock()
		return
	}
	if !p.belowTargetLocked(now) {
		// Enough is ready or on its way: a reset would only be followed
		// by a destroy.
		p.doomLocked(e)
		p.mu.Unlock()
		return
	}
	e.state = stDirty
	p.dirty = append(p.dirty, e)
	// What is coming may cover the shortfall now: then the refill clock
	// stops, or a refill timed from an earlier take would create a
	// sandbox that this one makes useless.
	p.belowTargetLocked(now)
	p.cond.Broadcast()
	p.mu.Unlock()
}

// Discard destroys a taken sandbox that must not come back (its sandbox is
// lost or broken) and frees its place; it returns once it is destroyed.
// A sandbox the pool does not know is destroyed too.
func (p *Pool) Discard(sb rt.Sandbox) {
	if sb == nil {
		return
	}
	id := sb.ID()
	p.mu.Lock()
	e := p.entries[id]
	if e == nil {
		p.mu.Unlock()
		p.destroySandbox(sb)
		return
	}
	if e.state != stInUse {
		p.mu.Unlock()
		p.log.Error("pool: Discard of a sandbox that is not in use; ignored", "sandbox", id, "state", e.state.String())
		return
	}
	p.inUse--
	p.destroyNowLocked(e)
	p.mu.Unlock()
}

// Detach takes a taken sandbox out of the pool for good without destroying
// it: its place is freed and the caller owns it from then on (the edge
// rebases a sandbox taken from a rebase pool onto another spec, after
// which it is no pool's). A sandbox the pool does not hold in use is left
// alone (logged).
func (p *Pool) Detach(sb rt.Sandbox) {
	if sb == nil {
		return
	}
	id := sb.ID()
	p.mu.Lock()
	defer p.mu.Unlock()
	e := p.entries[id]
	if e == nil || e.state != stInUse {
		p.log.Error("pool: Detach of a sandbox the pool does not hold in use; ignored", "sandbox", id)
		return
	}
	p.inUse--
	p.detached++
	delete(p.entries, id)
	p.cond.Broadcast() // room under Max: a waiter may get a create
}

// destroyNowLocked destroys e on the caller's goroutine (p.mu is released
// meanwhile), counted in flight so that Close waits for it.
func (p *Pool) destroyNowLocked(e *entry) {
	e.state = stDestroying
	p.destroying++
	p.flight++
	p.mu.Unlock()
	p.destroyEntry(e)
	p.mu.Lock()
	p.leaveLocked()
}

// Resize sets the ready target (negative counts as 0). Extra ready
// sandboxes are destroyed; missing ones are created in the background.
// MinSize still applies while the pool is shrunk.
func (p *Pool) Resize(size int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.size = max(size, 0)
	p.trimLocked()
	p.cond.Broadcast()
}

// Stats returns the pool's counters.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Stats{
		Size:           p.size,
		Target:         p.targetLocked(),
		Ready:          len(p.ready),
		InUse:          p.inUse,
		Resetting:      len(p.dirty) + p.resetting,
		Creating:       p.creating,
		Destroying:     len(p.doomed) + p.destroying,
		Waiting:        len(p.waiters),
		Hits:           p.hits,
		Misses:         p.misses,
		Resets:         p.resets,
		ResetFailures:  p.resetFailures,
		CreateFailures: p.createFailures,
		Destroyed:      p.destroyed,
		Detached:       p.detached,
	}
}

// RetryAfter estimates how long a caller refused with ErrQueueFull should
// wait before trying again, for the retry-after hint of the Unavailable
// status it becomes. A queued caller is served when a sandbox comes back,
// so the estimate is the queue length plus one times the recent interval
// between Puts (or, before any Put, the recent create time), plus one
// reset; at least the rest of a create backoff. Clamped to [50ms, 1m].
func (p *Pool) RetryAfter() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	gap := p.putGap
	if !p.lastPut.IsZero() && now.Sub(p.lastPut) > gap {
		// Puts have slowed down: the average is stale.
		gap = now.Sub(p.lastPut)
	}
	if gap == 0 {
		gap = p.createAvg
	}
	d := time.Duration(len(p.waiters)+1)*gap + p.resetAvg
	if now.Before(p.backoffUntil) {
		d = max(d, p.backoffUntil.Sub(now))
	}
	return min(max(d, minRetryAfter), maxRetryAfter)
}

// Close fails waiting Takes with ErrClosed, destroys the ready and dirty
// sandboxes, aborts background creates and stops the workers. Sandboxes in
// use are not waited for: Put or Discard destroys them later. Close returns
// when nothing else is in flight, or with ctx's error if ctx ends first (the
// workers still finish the destroys).
func (p *Pool) Close(ctx context.Context) error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		p.cancel()
		close(p.stop)
		for _, w := range p.waiters {
			w.done = true
			w.ch <- result{err: ErrClosed}
		}
		p.waiters = nil
		for _, e := range p.ready {
			e.state = stDoomed
		}
		p.doomed = append(p.doomed, p.ready...)
		p.ready = nil
		// A recycling pool may hold thousands of idle sandboxes at a
		// node's shutdown; its few workers would tear them down one at
		// a time each (minutes), so more join for the destroys. They
		// leave once the queues are empty.
		if extra := min(closeDestroyers-p.o.Fill-p.o.Resets, len(p.doomed)+len(p.dirty)); extra > 0 {
			p.flight += extra
			for range extra {
				go p.worker()
			}
		}
		p.cond.Broadcast()
		p.checkDoneLocked()
	}
	p.mu.Unlock()
	select {
	case <-p.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pool: close: %w", ctx.Err())
	}
}
