package pool_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// gatedReset holds the real backend's Reset until gate is closed, so a test
// can act while a reset is in flight.
type gatedReset struct {
	rt.Sandbox
	gate chan struct{}
}

func (s *gatedReset) Reset(ctx context.Context) error {
	select {
	case <-s.gate:
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.Sandbox.(rt.Resetter).Reset(ctx)
}

func newGatedCreator(t *testing.T) (*creator, chan struct{}) {
	if !newEnv(t).resettable {
		t.Skip("the container backend does not implement runtime.Resetter yet")
	}
	c := newCreator(t, modes[0])
	gate := make(chan struct{})
	c.wrap = func(sb rt.Sandbox) rt.Sandbox { return &gatedReset{Sandbox: sb, gate: gate} }
	return c, gate
}

// TestTakeWaitsForReset: a take that finds nothing ready while a handed-back
// sandbox is being reset waits for that sandbox instead of creating one.
func TestTakeWaitsForReset(t *testing.T) {
	c, gate := newGatedCreator(t)
	// Max: with the second sandbox in use, no create can serve the
	// waiting take before the reset does (the pool would otherwise refill
	// its ready target at once, and a fast create could win the race).
	p, _ := startPool(t, c, pool.Options{Size: 1, Max: 2, RefillDelay: time.Hour})
	waitStats(t, p, "one ready", func(s pool.Stats) bool { return s.Ready == 1 })
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Take(t.Context()) // nothing ready, nothing coming: created
	if err != nil {
		t.Fatal(err)
	}
	if n := c.created.Load(); n != 2 {
		t.Fatalf("created %d sandboxes for two takes of a pool of one, want 2", n)
	}
	p.Put(a) // its reset now waits at the gate
	got := make(chan taken, 1)
	go func() {
		sb, err := p.Take(context.Background())
		got <- taken{sb: sb, err: err}
	}()
	st := waitStats(t, p, "the take waiting", func(s pool.Stats) bool { return s.Waiting == 1 })
	if n := c.created.Load(); n != 2 || st.Creating != 0 {
		t.Fatalf("a take with a reset in flight created a sandbox (created %d, %+v)", n, st)
	}
	close(gate)
	r := <-got
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.sb.ID() != a.ID() {
		t.Fatalf("the waiting take got %s, want the reset %s", r.sb.ID(), a.ID())
	}
	echo(t, r.sb, "recycled")
	if n := c.created.Load(); n != 2 {
		t.Fatalf("created %d sandboxes, want 2", n)
	}
	p.Put(r.sb)
	p.Put(b)
}

// TestTakeWarm: TakeWarm never creates; it returns nil at once when nothing
// is ready or coming, and waits for a reset in flight.
func TestTakeWarm(t *testing.T) {
	c, gate := newGatedCreator(t)
	// Max: no create can serve the waiting take before the reset does
	// (see TestTakeWaitsForReset).
	p, _ := startPool(t, c, pool.Options{Size: 1, Max: 1, RefillDelay: time.Hour})
	waitStats(t, p, "one ready", func(s pool.Stats) bool { return s.Ready == 1 })
	a, err := p.TakeWarm(t.Context())
	if err != nil || a == nil {
		t.Fatalf("TakeWarm of a ready pool: %v, %v", a, err)
	}
	if sb, err := p.TakeWarm(t.Context()); sb != nil || err != nil {
		t.Fatalf("TakeWarm with nothing ready or coming: %v, %v; want nil, nil", sb, err)
	}
	p.Put(a)
	got := make(chan taken, 1)
	go func() {
		sb, err := p.TakeWarm(context.Background())
		got <- taken{sb: sb, err: err}
	}()
	waitStats(t, p, "the warm take waiting", func(s pool.Stats) bool { return s.Waiting == 1 })
	close(gate)
	r := <-got
	if r.err != nil || r.sb == nil || r.sb.ID() != a.ID() {
		t.Fatalf("TakeWarm with a reset in flight: %v, %v; want %s", r.sb, r.err, a.ID())
	}
	if n := c.created.Load(); n != 1 {
		t.Fatalf("TakeWarm created: %d sandboxes, want 1", n)
	}
	p.Put(r.sb)
}

// TestPutToFullPoolSkipsReset: a sandbox handed back to a pool that has
// enough ready is destroyed without being reset first.
func TestPutToFullPoolSkipsReset(t *testing.T) {
	c, gate := newGatedCreator(t)
	close(gate)
	p, _ := startPool(t, c, pool.Options{Size: 1, RefillDelay: time.Hour})
	waitStats(t, p, "one ready", func(s pool.Stats) bool { return s.Ready == 1 })
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	p.Put(a)
	waitStats(t, p, "a reset and ready", func(s pool.Stats) bool { return s.Ready == 1 && s.Resets == 1 })
	p.Put(b)
	st := waitStats(t, p, "b destroyed", func(s pool.Stats) bool { return s.Destroyed == 1 && s.Destroying == 0 })
	if st.Resets != 1 || st.Ready != 1 {
		t.Fatalf("after a Put to a full pool: %+v; want 1 reset (a's only), 1 ready", st)
	}
	<-b.Done()
}

// TestRefillDelay: a sandbox taken and handed back within RefillDelay is
// replaced by its own reset, not by a create.
func TestRefillDelay(t *testing.T) {
	c, gate := newGatedCreator(t)
	close(gate)
	p, _ := startPool(t, c, pool.Options{Size: 2, RefillDelay: time.Hour})
	waitStats(t, p, "two ready", func(s pool.Stats) bool { return s.Ready == 2 })
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	echo(t, a, "short")
	p.Put(a)
	st := waitStats(t, p, "settled", func(s pool.Stats) bool {
		return s.Ready == 2 && s.Resetting == 0 && s.Creating == 0 && s.Resets == 1
	})
	if n := c.created.Load(); n != 2 || st.Destroyed != 0 {
		t.Fatalf("a quick take and put: created %d, %+v; want 2 created, nothing destroyed", n, st)
	}
}

// TestRefillAfterDelay: a sandbox kept longer than RefillDelay is replaced
// by a create.
func TestRefillAfterDelay(t *testing.T) {
	c2, gate2 := newGatedCreator(t)
	close(gate2)
	q, _ := startPool(t, c2, pool.Options{Size: 2, RefillDelay: 50 * time.Millisecond})
	waitStats(t, q, "two ready", func(s pool.Stats) bool { return s.Ready == 2 })
	kept, err := q.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	waitStats(t, q, "refilled while one is kept", func(s pool.Stats) bool { return s.Ready == 2 && s.InUse == 1 })
	if n := c2.created.Load(); n != 3 {
		t.Fatalf("created %d, want 3", n)
	}
	q.Put(kept)
}

// TestRecyclePool: a recycling pool never creates; it keeps what is handed
// back (up to Size), TakeWarm gets it back reset, and Take on an empty one
// gets nothing rather than a create.
func TestRecyclePool(t *testing.T) {
	c, gate := newGatedCreator(t)
	close(gate)
	p, _ := startPool(t, c, pool.Options{Recycle: true, Size: 1})
	if sb, err := p.TakeWarm(t.Context()); sb != nil || err != nil {
		t.Fatalf("TakeWarm of an empty recycling pool: %v, %v; want nil, nil", sb, err)
	}
	a, err := c.New(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.New(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	sh(t, a, "echo left > /root/left")
	p.Put(a) // adopted, reset, kept
	waitStats(t, p, "a ready", func(s pool.Stats) bool { return s.Ready == 1 })
	p.Put(b) // the pool has enough: destroyed
	st := waitStats(t, p, "b destroyed", func(s pool.Stats) bool { return s.Destroyed == 1 && s.Destroying == 0 })
	if st.Creating != 0 || c.created.Load() != 2 {
		t.Fatalf("a recycling pool created: %+v, created %d", st, c.created.Load())
	}
	got, err := p.TakeWarm(t.Context())
	if err != nil || got == nil || got.ID() != a.ID() {
		t.Fatalf("TakeWarm: %v, %v; want %s", got, err, a.ID())
	}
	if out := sh(t, got, "ls /root"); out != "" {
		t.Fatalf("recycled sandbox keeps the last user's files: %q", out)
	}
	p.Put(got)
}

// TestRecyclePoolReleasesWaiters: a take waiting for a reset that fails is
// let go with nothing (the pool will not create for it), not left waiting.
func TestRecyclePoolReleasesWaiters(t *testing.T) {
	c := newCreator(t, modes[0])
	gate := make(chan struct{})
	c.wrap = func(sb rt.Sandbox) rt.Sandbox { return &failingReset{Sandbox: sb, gate: gate} }
	p, _ := startPool(t, c, pool.Options{Recycle: true, Size: 1})
	a, err := c.New(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	p.Put(a) // its reset waits at the gate, then fails
	got := make(chan taken, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		sb, err := p.TakeWarm(ctx)
		got <- taken{sb: sb, err: err}
	}()
	waitStats(t, p, "the warm take waiting", func(s pool.Stats) bool { return s.Waiting == 1 })
	close(gate)
	if r := <-got; r.sb != nil || r.err != nil {
		t.Fatalf("TakeWarm behind a failing reset: %v, %v; want nil, nil", r.sb, r.err)
	}
	waitStats(t, p, "a destroyed", func(s pool.Stats) bool { return s.Destroyed == 1 && s.Alive() == 0 })
}

// failingReset's Reset waits for gate and fails.
type failingReset struct {
	rt.Sandbox
	gate chan struct{}
}

func (s *failingReset) Reset(ctx context.Context) error {
	<-s.gate
	return errors.New("reset failed on purpose")
}

// TestNoRefillWhileHoldsAreShort: once takers are seen to hand sandboxes
// back quickly, sandboxes in use count as coming back, and a pool whose
// every sandbox is in use does not create replacements for them (which the
// returning sandboxes would only find destroyed). Without this, the second
// take below would start a refill after RefillDelay.
func TestNoRefillWhileHoldsAreShort(t *testing.T) {
	c, gate := newGatedCreator(t)
	close(gate)
	p, _ := startPool(t, c, pool.Options{Size: 2, RefillDelay: 20 * time.Millisecond})
	waitStats(t, p, "two ready", func(s pool.Stats) bool { return s.Ready == 2 })
	// Teach the pool that holds last about a second: the refill then
	// waits up to two seconds for a sandbox in use.
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	p.Put(a)
	// (The first take had no hold time to go by: its shortfall was
	// refilled after RefillDelay, and a was destroyed on its return.)
	waitStats(t, p, "a back", func(s pool.Stats) bool {
		return s.Ready == 2 && s.InUse == 0 && s.Resetting == 0 && s.Creating == 0 && s.Destroying == 0
	})
	before := c.created.Load()
	destroyedBefore := p.Stats().Destroyed
	x, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	y, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // ten RefillDelays, well inside the expected hold
	p.Put(x)
	p.Put(y)
	st := waitStats(t, p, "both back", func(s pool.Stats) bool {
		return s.Ready == 2 && s.InUse == 0 && s.Resetting == 0 && s.Creating == 0 && s.Destroying == 0
	})
	if n := c.created.Load(); n != before || st.Destroyed != destroyedBefore {
		t.Fatalf("created %d sandboxes while two came back within the expected hold (%+v); want none", n-before, st)
	}
}

// TestRecyclePoolCustomReset: Options.Reset replaces the sandbox's own
// Reset on Put (the edge quiesces sandboxes that wait to be rebased, and
// leaves their files to Rebase), and a failing one destroys the sandbox.
func TestRecyclePoolCustomReset(t *testing.T) {
	c, gate := newGatedCreator(t)
	close(gate)
	var calls atomic.Int32
	fail := atomic.Bool{}
	p, _ := startPool(t, c, pool.Options{Recycle: true, Size: 1, Reset: func(ctx context.Context, sb rt.Sandbox) error {
		calls.Add(1)
		if fail.Load() {
			return errors.New("custom reset failed on purpose")
		}
		return nil
	}})
	a, err := c.New(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	sh(t, a, "echo left > /root/left")
	p.Put(a)
	waitStats(t, p, "a ready", func(s pool.Stats) bool { return s.Ready == 1 })
	got, err := p.TakeWarm(t.Context())
	if err != nil || got == nil || got.ID() != a.ID() {
		t.Fatalf("TakeWarm: %v, %v; want %s", got, err, a.ID())
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("custom reset called %d times, want 1", n)
	}
	if out := sh(t, got, "ls /root"); out != "left\n" {
		t.Fatalf("the sandbox's own Reset ran instead of Options.Reset: /root holds %q", out)
	}
	fail.Store(true)
	p.Put(got)
	waitStats(t, p, "a destroyed", func(s pool.Stats) bool { return s.Destroyed == 1 && s.Alive() == 0 })
}

// TestDetach: a detached sandbox leaves the pool's books (its place is
// free, a Put of it is an adoption) and is not destroyed by the pool, not
// even by Close; a Detach of a sandbox not in use is ignored.
func TestDetach(t *testing.T) {
	c, gate := newGatedCreator(t)
	close(gate)
	p, _ := startPool(t, c, pool.Options{Recycle: true, Size: 1})
	a, err := c.New(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	p.Put(a)
	waitStats(t, p, "a ready", func(s pool.Stats) bool { return s.Ready == 1 })
	p.Detach(a) // ready, not in use: ignored
	if st := p.Stats(); st.Ready != 1 || st.Detached != 0 {
		t.Fatalf("Detach of a ready sandbox changed the pool: %+v", st)
	}
	got, err := p.TakeWarm(t.Context())
	if err != nil || got == nil {
		t.Fatalf("TakeWarm: %v, %v", got, err)
	}
	p.Detach(got)
	if st := p.Stats(); st.Alive() != 0 || st.Detached != 1 || st.Destroyed != 0 {
		t.Fatalf("after Detach: %+v; want nothing alive, one detached, none destroyed", st)
	}
	if err := p.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, got, "echo alive"); out != "alive\n" {
		t.Fatalf("detached sandbox after Close: %q", out)
	}
	got.Destroy(t.Context())
}
