package pool_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

func TestValidate(t *testing.T) {
	newFn := func(context.Context) (rt.Sandbox, error) { return nil, errors.New("unused") }
	for _, tc := range []struct {
		o    pool.Options
		want string // in the error; "" for valid
	}{
		{pool.Options{New: newFn, Size: 2, Max: 4, MinSize: 1, IdleShrink: time.Minute}, ""},
		{pool.Options{New: newFn, Size: 8, Max: 4}, ""}, // the clean queue stops at Max
		{pool.Options{Size: 1}, "New is required"},
		{pool.Options{New: newFn, Size: -1}, "size -1"},
		{pool.Options{New: newFn, Max: -2}, "max -2"},
		{pool.Options{New: newFn, Size: 1, MinSize: 2}, "min_size 2 exceeds size 1"},
		{pool.Options{New: newFn, MinSize: -1}, "min_size -1"},
		{pool.Options{New: newFn, IdleShrink: -time.Second}, "idle_shrink"},
		{pool.Options{New: newFn, Fill: -1}, "fill -1"},
	} {
		err := tc.o.Validate()
		if tc.want == "" {
			if err != nil {
				t.Errorf("%+v: %v", tc.o, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one naming %q", tc.o, err, tc.want)
		}
		func() {
			defer func() {
				if r := recover(); r == nil {
					t.Errorf("New(%+v) did not panic", tc.o)
				}
			}()
			pool.New(tc.o)
		}()
	}
}

// TestRefillAndTryTake: the pool fills to Size in the background; TryTake
// counts hits and misses and never creates; sandboxes put back make the
// pool whole again (reset in place, or destroyed and replaced).
func TestRefillAndTryTake(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		c := newCreator(t, m)
		p, _ := startPool(t, c, pool.Options{Size: 2, Max: 2})
		st := waitStats(t, p, "2 ready", func(s pool.Stats) bool { return s.Ready == 2 })
		if st.Creating != 0 || st.InUse != 0 || st.Hits != 0 || st.Misses != 0 {
			t.Fatalf("after fill: %+v", st)
		}
		a, b := p.TryTake(), p.TryTake()
		if a == nil || b == nil || a.ID() == b.ID() {
			t.Fatalf("two TryTakes of a full pool: %v %v", a, b)
		}
		echo(t, a, "a")
		echo(t, b, "b")
		// Max is reached: nothing is ready and nothing may be created.
		if x := p.TryTake(); x != nil {
			t.Fatalf("TryTake beyond Max returned %s", x.ID())
		}
		st = p.Stats()
		if st.Hits != 2 || st.Misses != 1 || st.InUse != 2 || st.Ready != 0 {
			t.Fatalf("after 3 TryTakes: %+v", st)
		}
		if n := c.created.Load(); n != 2 {
			t.Fatalf("%d sandboxes created, want 2 (TryTake must not create)", n)
		}
		p.Put(a)
		p.Put(b)
		st = waitStats(t, p, "2 ready again", func(s pool.Stats) bool {
			return s.Ready == 2 && s.Resetting == 0 && s.Creating == 0 && s.Destroying == 0
		})
		if m.reset && (st.Resets != 2 || c.created.Load() != 2) {
			t.Fatalf("reset mode: %+v, created %d: want 2 resets and no new create", st, c.created.Load())
		}
		if !m.reset && (st.Destroyed != 2 || c.created.Load() != 4) {
			t.Fatalf("destroy mode: %+v, created %d: want 2 destroyed and 2 replacements", st, c.created.Load())
		}
		x := p.TryTake()
		if x == nil {
			t.Fatal("TryTake of a refilled pool missed")
		}
		echo(t, x, "again")
		p.Put(x)
	})
}

// TestTakeCreatesOnCallerPath: an empty pool below Max creates on the
// caller's path; a sandbox put back to a pool that wants none is destroyed.
func TestTakeCreatesOnCallerPath(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		c := newCreator(t, m)
		p, _ := startPool(t, c, pool.Options{Size: 0})
		sb, err := p.Take(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		echo(t, sb, "created")
		st := p.Stats()
		if st.Misses != 1 || st.Hits != 0 || st.InUse != 1 || c.created.Load() != 1 {
			t.Fatalf("after Take of an empty pool: %+v, created %d", st, c.created.Load())
		}
		p.Put(sb)
		st = waitStats(t, p, "nothing alive", func(s pool.Stats) bool { return s.Alive() == 0 })
		if st.Destroyed != 1 {
			t.Fatalf("a sandbox put back to a pool of size 0 was not destroyed: %+v", st)
		}
		select {
		case <-sb.Done():
		default:
			t.Fatal("destroyed sandbox's Done is open")
		}
	})
}

type taken struct {
	i   int
	sb  rt.Sandbox
	err error
}

// TestMaxWaitersFIFO: at Max, takers wait in order and are served in that
// order by Puts; beyond MaxWaiters a Take fails at once with ErrQueueFull.
func TestMaxWaitersFIFO(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		c := newCreator(t, m)
		p, _ := startPool(t, c, pool.Options{Size: 0, Max: 2, MaxWaiters: 3})
		ctx := t.Context()
		a, err := p.Take(ctx)
		if err != nil {
			t.Fatal(err)
		}
		b, err := p.Take(ctx)
		if err != nil {
			t.Fatal(err)
		}
		results := make(chan taken, 3)
		for i := range 3 {
			go func() {
				sb, err := p.Take(ctx)
				results <- taken{i, sb, err}
			}()
			// The next one starts only once this one is queued.
			waitStats(t, p, fmt.Sprintf("%d waiting", i+1), func(s pool.Stats) bool { return s.Waiting == i+1 })
		}
		// A deadline the refusal must not wait for.
		fullCtx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		defer cancel()
		if sb, err := p.Take(fullCtx); !errors.Is(err, pool.ErrQueueFull) {
			t.Fatalf("Take with a full queue: %v, %v; want ErrQueueFull", sb, err)
		}
		if ra := p.RetryAfter(); ra <= 0 || ra > time.Minute {
			t.Fatalf("RetryAfter %v", ra)
		}
		if st := p.Stats(); st.Alive() != 2 {
			t.Fatalf("%d alive with Max 2: %+v", st.Alive(), st)
		}

		serve := func(put rt.Sandbox, want int) rt.Sandbox {
			t.Helper()
			p.Put(put)
			r := <-results
			if r.err != nil || r.i != want {
				t.Fatalf("after a Put: waiter %d got %v (err %v); want waiter %d first", r.i, r.sb, r.err, want)
			}
			if m.reset && r.sb.ID() != put.ID() {
				t.Fatalf("reset mode: waiter got %s, not the reset %s", r.sb.ID(), put.ID())
			}
			echo(t, r.sb, "served")
			return r.sb
		}
		w0 := serve(a, 0)
		w1 := serve(b, 1)
		w2 := serve(w0, 2)
		p.Put(w1)
		p.Put(w2)
		st := waitStats(t, p, "all back", func(s pool.Stats) bool {
			return s.InUse == 0 && s.Resetting == 0 && s.Destroying == 0 && s.Creating == 0
		})
		if st.Waiting != 0 || st.Alive() > 2 {
			t.Fatalf("after serving every waiter: %+v", st)
		}
	})
}

// TestWaiterDeadline: a waiter whose context ends gets its error, leaves
// the queue and takes no place with it.
func TestWaiterDeadline(t *testing.T) {
	c := newCreator(t, modes[1])
	p, _ := startPool(t, c, pool.Options{Size: 0, Max: 1})
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	sb, err := p.Take(ctx)
	if sb != nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Take at Max with a deadline: %v, %v", sb, err)
	}
	if st := p.Stats(); st.Waiting != 0 || st.InUse != 1 {
		t.Fatalf("after the waiter left: %+v", st)
	}
	p.Put(a)
	// The place is free again: the next Take is served.
	b, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	echo(t, b, "next")
	p.Put(b)
}

// TestResetCleans: a sandbox put back dirty comes back to the next taker
// without its files or processes.
func TestResetCleans(t *testing.T) {
	if !newEnv(t).resettable {
		t.Skip("the container backend does not implement runtime.Resetter yet: nothing to check the reset of")
	}
	c := newCreator(t, modes[0])
	p, _ := startPool(t, c, pool.Options{Size: 1, Max: 1})
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	sh(t, a, "echo secret > /root/secret && echo t > /tmp/t && mkdir /var/left && "+
		"(setsid sleep 1000 </dev/null >/dev/null 2>&1 &) && echo x > /dev/shm/x")
	// The background child may not have exec'd sleep yet when the shell
	// returns (ps shows it as "[exe]" then): wait for it, boundedly.
	for i := 0; ; i++ {
		out := sh(t, a, "ps")
		if strings.Contains(out, "sleep 1000") {
			break
		}
		if i == 200 {
			t.Fatalf("background process not running before Put:\n%s", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	id := a.ID()
	p.Put(a)
	b, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if b.ID() != id {
		t.Fatalf("got %s, not the reset %s (Max 1)", b.ID(), id)
	}
	if out := sh(t, b, "ls -a /root /tmp /dev/shm; ls -d /var/left 2>/dev/null; true"); strings.Contains(out, "secret") ||
		strings.Contains(out, "left") || strings.Contains(out, "\nt\n") || strings.Contains(out, "x\n") {
		t.Fatalf("the next taker sees the last one's files:\n%s", out)
	}
	if out := sh(t, b, "ps"); strings.Contains(out, "sleep 1000") {
		t.Fatalf("the next taker sees the last one's processes:\n%s", out)
	}
	p.Put(b)
}

// execReset stands in for the backend's Reset while it has none: its
// Reset runs a command in the sandbox, so it fails, for real, the way a
// backend's Reset does once the sandbox's agent is dead.
type execReset struct{ rt.Sandbox }

func (s *execReset) Reset(ctx context.Context) error {
	_, err := s.Exec(ctx, rt.ExecRequest{Argv: []string{"true"}}, nil)
	return err
}

// killAgent kills sandbox id's PID 1 and waits until its Done closes.
func killAgent(t *testing.T, e *env, sb rt.Sandbox) {
	t.Helper()
	pid, ok := e.backend.AgentPID(sb.ID())
	if !ok {
		t.Fatalf("no agent for %s", sb.ID())
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-sb.Done()
}

// TestResetFailureReplaces: a sandbox whose reset fails is destroyed and
// replaced.
func TestResetFailureReplaces(t *testing.T) {
	c := newCreator(t, modes[0])
	if !c.e.resettable {
		c.wrap = func(sb rt.Sandbox) rt.Sandbox { return &execReset{sb} }
	}
	p, _ := startPool(t, c, pool.Options{Size: 1, Max: 1})
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	killAgent(t, c.e, a)
	p.Put(a)
	st := waitStats(t, p, "a replacement", func(s pool.Stats) bool {
		return s.ResetFailures == 1 && s.Ready == 1 && s.Destroying == 0
	})
	if st.Resets != 0 || st.Destroyed != 1 {
		t.Fatalf("after a failed reset: %+v", st)
	}
	b := p.TryTake()
	if b == nil || b.ID() == a.ID() {
		t.Fatalf("TryTake after the replacement: %v", b)
	}
	echo(t, b, "replacement")
	p.Put(b)
}

// TestDeadReadyReplaced: a ready sandbox whose agent dies is dropped from
// the clean queue and replaced; no taker ever gets it.
func TestDeadReadyReplaced(t *testing.T) {
	c := newCreator(t, modes[1])
	p, rec := startPool(t, c, pool.Options{Size: 2})
	waitStats(t, p, "2 ready", func(s pool.Stats) bool { return s.Ready == 2 })
	ids := c.createdIDs()
	victimID := ids[0]
	pid, ok := c.e.backend.AgentPID(victimID)
	if !ok {
		t.Fatalf("no agent for %s", victimID)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitStats(t, p, "the dead one replaced", func(s pool.Stats) bool {
		return s.Destroyed == 1 && s.Ready == 2 && s.Creating == 0
	})
	if n := rec.count(slog.LevelWarn, "died"); n != 1 {
		t.Errorf("%d warnings about the dead sandbox, want 1", n)
	}
	for range 2 {
		sb := p.TryTake()
		if sb == nil || sb.ID() == victimID {
			t.Fatalf("TryTake: %v (victim %s)", sb, victimID)
		}
		echo(t, sb, "alive")
		defer p.Put(sb)
	}
}

// TestIdleShrinkAndGrow: after IdleShrink without a take the ready target
// drops to MinSize; the next take brings it back to Size.
func TestIdleShrinkAndGrow(t *testing.T) {
	c := newCreator(t, modes[1])
	p, _ := startPool(t, c, pool.Options{Size: 3, MinSize: 1, IdleShrink: time.Second})
	sawFull := false
	waitStats(t, p, "full or shrunk", func(s pool.Stats) bool {
		sawFull = sawFull || s.Ready == 3
		return s.Ready == 3 || s.Target == 1
	})
	st := waitStats(t, p, "shrunk", func(s pool.Stats) bool {
		return s.Target == 1 && s.Ready == 1 && s.Creating == 0 && s.Destroying == 0
	})
	if sawFull && st.Destroyed != 2 {
		t.Fatalf("shrunk from 3 to 1 ready with %d destroyed: %+v", st.Destroyed, st)
	}
	if st.Size != 3 {
		t.Fatalf("shrinking changed Size: %+v", st)
	}
	before := c.created.Load()
	sb := p.TryTake()
	if sb == nil {
		t.Fatal("TryTake of the shrunk pool missed its MinSize sandbox")
	}
	if st := p.Stats(); st.Target != 3 {
		t.Fatalf("a take did not bring the target back: %+v", st)
	}
	// Three creates bring the (now empty) clean queue back to Size.
	if !poll(t, time.Minute, func() bool { return c.created.Load() >= before+3 }) {
		t.Fatalf("grew back with %d creates: %+v", c.created.Load()-before, p.Stats())
	}
	p.Put(sb)
}

// TestCreateFailureBackoff: a failing New backs off exponentially and logs
// once per streak; waiters stay queued (reporting the last create error
// when their deadline ends) and are served once creates work again.
func TestCreateFailureBackoff(t *testing.T) {
	c := newCreator(t, modes[1])
	c.fail.Store(true)
	p, rec := startPool(t, c, pool.Options{Size: 1})
	waitStats(t, p, "4 create failures", func(s pool.Stats) bool { return s.CreateFailures >= 4 })
	if n := rec.count(slog.LevelWarn, "create failed"); n != 1 {
		t.Errorf("%d warnings for one streak of failures, want 1", n)
	}
	c.mu.Lock()
	calls := append([]time.Time(nil), c.calls...)
	c.mu.Unlock()
	// Lower bounds only: each retry waits at least its backoff (50 ms,
	// doubling), however slow the machine.
	for i := 1; i < 4; i++ {
		if gap, min := calls[i].Sub(calls[i-1]), 50*time.Millisecond<<(i-1); gap < min {
			t.Errorf("retry %d came %v after the previous one, before its %v backoff", i, gap, min)
		}
	}
	// A waiter whose deadline ends learns why.
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if _, err := p.Take(ctx); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, rt.ErrInvalidSpec) {
		t.Fatalf("Take while creates fail: %v; want the deadline and the last create error", err)
	}
	// A waiter is not lost: it is served once creates work again.
	got := make(chan taken, 1)
	go func() {
		sb, err := p.Take(t.Context())
		got <- taken{0, sb, err}
	}()
	waitStats(t, p, "1 waiting", func(s pool.Stats) bool { return s.Waiting == 1 })
	c.fail.Store(false)
	r := <-got
	if r.err != nil {
		t.Fatal(r.err)
	}
	echo(t, r.sb, "recovered")
	if n := rec.count(slog.LevelInfo, "work again"); n != 1 {
		t.Errorf("%d recovery messages, want 1", n)
	}
	p.Put(r.sb)
}

// TestOwnCreateFailure: a Take whose own create fails keeps waiting (a
// background create may still serve it) and reports that error at its
// deadline.
func TestOwnCreateFailure(t *testing.T) {
	c := newCreator(t, modes[1])
	c.fail.Store(true)
	p, _ := startPool(t, c, pool.Options{Size: 0})
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	_, err := p.Take(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, rt.ErrInvalidSpec) {
		t.Fatalf("Take whose create fails: %v; want the deadline and the create error", err)
	}
	if st := p.Stats(); st.Waiting != 0 || st.CreateFailures < 1 || st.InUse != 0 {
		t.Fatalf("after the failed Take: %+v", st)
	}
}

// TestDiscardAndAdopt: Discard destroys a taken sandbox and frees its
// place; Put of a sandbox the pool never handed out adopts it.
func TestDiscardAndAdopt(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		c := newCreator(t, m)
		p, _ := startPool(t, c, pool.Options{Size: 0, Max: 1})
		a, err := p.Take(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		p.Discard(a)
		select {
		case <-a.Done():
		default:
			t.Fatal("Discard returned before the sandbox was destroyed")
		}
		if st := p.Stats(); st.Alive() != 0 || st.Destroyed != 1 {
			t.Fatalf("after Discard: %+v", st)
		}
		// Adoption: a sandbox made elsewhere, put back while a taker
		// waits at Max: reset, it serves the waiter; not resettable, it is
		// destroyed and the waiter waits on.
		a, err = p.Take(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		foreign, err := c.New(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan taken, 1)
		go func() {
			sb, err := p.Take(t.Context())
			got <- taken{0, sb, err}
		}()
		waitStats(t, p, "1 waiting", func(s pool.Stats) bool { return s.Waiting == 1 })
		p.Put(foreign)
		if !m.reset {
			waitStats(t, p, "the foreign one destroyed", func(s pool.Stats) bool { return s.Destroyed == 2 })
			if st := p.Stats(); st.Waiting != 1 {
				t.Fatalf("a destroyed foreign sandbox served the waiter: %+v", st)
			}
			p.Put(a) // destroyed too, and replaced for the waiter
			a = nil
		}
		r := <-got
		if r.err != nil {
			t.Fatal(r.err)
		}
		if m.reset != (r.sb.ID() == foreign.ID()) {
			t.Fatalf("waiter got %s after the pool adopted %s (reset mode %v)", r.sb.ID(), foreign.ID(), m.reset)
		}
		echo(t, r.sb, "adopted")
		p.Put(r.sb)
		if a != nil {
			p.Put(a)
		}
	})
}

// TestClose: Close fails waiters, destroys what is ready, does not wait
// for sandboxes in use (Put destroys them), and leaves nothing behind (the
// leak check of startPool).
func TestClose(t *testing.T) {
	c := newCreator(t, modes[1])
	p, _ := startPool(t, c, pool.Options{Size: 1, Max: 2})
	a, err := p.Take(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	waitStats(t, p, "refilled", func(s pool.Stats) bool { return s.Ready == 1 })
	b := p.TryTake()
	if b == nil {
		t.Fatal("TryTake missed the refilled sandbox")
	}
	got := make(chan taken, 1)
	go func() {
		sb, err := p.Take(t.Context())
		got <- taken{0, sb, err}
	}()
	waitStats(t, p, "1 waiting", func(s pool.Stats) bool { return s.Waiting == 1 })
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close with sandboxes in use: %v", err)
	}
	if r := <-got; !errors.Is(r.err, pool.ErrClosed) {
		t.Fatalf("waiter at Close: %v, %v", r.sb, r.err)
	}
	if _, err := p.Take(t.Context()); !errors.Is(err, pool.ErrClosed) {
		t.Fatalf("Take after Close: %v", err)
	}
	if sb := p.TryTake(); sb != nil {
		t.Fatalf("TryTake after Close: %s", sb.ID())
	}
	echo(t, a, "still mine")
	p.Put(a)
	p.Discard(b)
	for _, sb := range []rt.Sandbox{a, b} {
		select {
		case <-sb.Done():
		default:
			t.Fatalf("%s not destroyed by Put/Discard after Close", sb.ID())
		}
	}
	if st := p.Stats(); st.Alive() != 0 {
		t.Fatalf("after Close and Put: %+v", st)
	}
}

// TestCloseAbortsCreate: Close cancels a create on a Take's path and
// waits for it; that Take gets ErrClosed, not a place in a dead queue.
func TestCloseAbortsCreate(t *testing.T) {
	c := newCreator(t, modes[1])
	c.gate = make(chan struct{}) // never opened
	p, _ := startPool(t, c, pool.Options{Size: 0})
	got := make(chan taken, 1)
	go func() {
		sb, err := p.Take(t.Context())
		got <- taken{0, sb, err}
	}()
	waitStats(t, p, "1 creating", func(s pool.Stats) bool { return s.Creating == 1 })
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close during a create: %v", err)
	}
	if r := <-got; !errors.Is(r.err, pool.ErrClosed) {
		t.Fatalf("Take whose create Close aborted: %v, %v", r.sb, r.err)
	}
	if st := p.Stats(); st.Alive() != 0 || st.CreateFailures != 0 {
		t.Fatalf("after Close: %+v (an aborted create is not a failure)", st)
	}
}

// TestConcurrentTakePut: 32 goroutines take, use and put back 10 times
// each; no sandbox is ever held by two of them at once, and none sees a
// previous holder's file.
func TestConcurrentTakePut(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		c := newCreator(t, m)
		p, _ := startPool(t, c, pool.Options{Size: 4, Max: 8, MaxWaiters: 64})
		const workers, rounds = 32, 10
		var (
			mu   sync.Mutex
			held = map[string]int{}
			wg   sync.WaitGroup
			errs = make(chan error, workers)
		)
		start := time.Now()
		for w := range workers {
			wg.Go(func() {
				for r := range rounds {
					if err := useOnce(t.Context(), p, &mu, held, w, r); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		st := waitStats(t, p, "quiet", func(s pool.Stats) bool {
			return s.InUse == 0 && s.Resetting == 0 && s.Creating == 0 && s.Destroying == 0
		})
		t.Logf("%d take/put cycles in %v: %+v, %d creates", workers*rounds, time.Since(start).Round(time.Millisecond), st, c.created.Load())
		if st.Hits+st.Misses != workers*rounds || st.Waiting != 0 {
			t.Fatalf("stats after the run: %+v", st)
		}
	})
}

func useOnce(ctx context.Context, p *pool.Pool, mu *sync.Mutex, held map[string]int, w, r int) error {
	sb, err := p.Take(ctx)
	if err != nil {
		return fmt.Errorf("worker %d round %d: take: %w", w, r, err)
	}
	mu.Lock()
	if other, dup := held[sb.ID()]; dup {
		mu.Unlock()
		return fmt.Errorf("worker %d got %s, held by worker %d", w, sb.ID(), other)
	}
	held[sb.ID()] = w
	mu.Unlock()
	res, err := sb.Exec(ctx, rt.ExecRequest{Shell: fmt.Sprintf("test ! -e /tmp/owner && echo %d > /tmp/owner && cat /tmp/owner", w)}, nil)
	mu.Lock()
	delete(held, sb.ID())
	mu.Unlock()
	if err != nil || res.ExitCode != 0 || string(res.Stdout) != fmt.Sprintf("%d\n", w) {
		p.Discard(sb)
		return fmt.Errorf("worker %d in %s: %v exit %d out %q (a previous holder's /tmp/owner?)", w, sb.ID(), err, res.ExitCode, res.Stdout)
	}
	p.Put(sb)
	return nil
}

// BenchmarkTakePut measures a take and a put back, one after the other, of
// a pool of 4 with Max 4 (reset in place when the backend can, else
// destroyed and re-created): in steady state the loop outruns the two
// background workers, so ns/op is the time the pool needs to turn one
// sandbox around on this machine.
func BenchmarkTakePut(b *testing.B) {
	e := newEnv(b)
	for _, m := range modes {
		b.Run(m.name, func(b *testing.B) {
			if m.reset && !e.resettable {
				b.Skip("the container backend does not implement runtime.Resetter yet")
			}
			c := &creator{e: e, prefix: "bench-" + m.name}
			if !m.reset {
				c.wrap = func(sb rt.Sandbox) rt.Sandbox { return &plain{sb} }
			}
			p := pool.New(pool.Options{New: c.New, Size: 4, Max: 4, Logger: slog.New(&logRecorder{})})
			defer p.Close(context.Background())
			for p.Stats().Ready < 4 {
				time.Sleep(time.Millisecond)
			}
			for b.Loop() {
				sb, err := p.Take(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				p.Put(sb)
			}
			st := p.Stats()
			b.ReportMetric(float64(st.Hits)/float64(st.Hits+st.Misses), "hit-ratio")
		})
	}
}

// slowDestroy is a real sandbox whose Destroy takes a while and counts
// how many run at once.
type slowDestroy struct {
	rt.Sandbox
	now, peak *atomic.Int64
}

func (s *slowDestroy) Destroy(ctx context.Context) error {
	n := s.now.Add(1)
	defer s.now.Add(-1)
	for {
		p := s.peak.Load()
		if n <= p || s.peak.CompareAndSwap(p, n) {
			break
		}
	}
	time.Sleep(50 * time.Millisecond)
	return s.Sandbox.Destroy(ctx)
}

// TestCloseDestroysSideBySide: a pool closed with many ready sandboxes
// (a node's recycling pool at shutdown) destroys them with more than its
// two workers at once.
func TestCloseDestroysSideBySide(t *testing.T) {
	c := newCreator(t, modes[1])
	var now, peak atomic.Int64
	c.wrap = func(sb rt.Sandbox) rt.Sandbox { return &slowDestroy{Sandbox: &plain{sb}, now: &now, peak: &peak} }
	p, _ := startPool(t, c, pool.Options{Size: 24, Max: 24, Fill: 1, Resets: 1})
	waitStats(t, p, "24 ready", func(s pool.Stats) bool { return s.Ready == 24 })
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := p.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); st.Alive() != 0 {
		t.Fatalf("after Close: %+v", st)
	}
	if got := peak.Load(); got <= 2 {
		t.Fatalf("Close destroyed at most %d at once; want more than the pool's 2 workers", got)
	}
}
