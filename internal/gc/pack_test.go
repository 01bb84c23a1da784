package gc_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/gc"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// countingDir is the dir store, counting how often each blob is opened.
type countingDir struct {
	*blobstore.Dir
	mu    sync.Mutex
	opens map[string]int
}

func (c *countingDir) Open(ctx context.Context, digest string) (io.ReadCloser, error) {
	c.mu.Lock()
	c.opens[digest]++
	c.mu.Unlock()
	return c.Dir.Open(ctx, digest)
}

func (c *countingDir) reset() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	o := c.opens
	c.opens = map[string]int{}
	return o
}

// execOut appends an exec printing out to sandbox id's trajectory.
func execOut(t *testing.T, l *trajectory.Log, id string, out []byte) {
	t.Helper()
	ctx := t.Context()
	rec := &trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Argv: []string{"cat"}}}
	op, _, err := l.Begin(ctx, id, 0, rec)
	if err != nil {
		t.Fatal(err)
	}
	now := trajectory.Timestamp(time.Now())
	rec.Start, rec.End = now, now
	rec.Exec.Outcome, rec.Exec.Stdout, rec.Exec.Stderr = "exited", trajectory.NewData(out), trajectory.NewData(nil)
	if err := op.Commit(ctx, rec); err != nil {
		t.Fatal(err)
	}
}

// A trajectory pack stays while any ref names it and is read once per run
// however many do; the data its lines name stay only while the ref of the
// sandbox whose line it is names the pack. Once no ref names it, the pack
// goes after the grace period.
func TestTrajectoryPack(t *testing.T) {
	f := newFixture(t)
	ctx := f.ctx
	store := &countingDir{Dir: f.store, opens: map[string]int{}}
	l, err := trajectory.Open(trajectory.Options{Dir: t.TempDir(), Store: f.store, InlineMax: 64, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	// a, b and c print more than the log keeps inline (a data blob each);
	// 250 more sandboxes share their pack (one batch: at most 256). b keeps running.
	data := map[string][]byte{}
	var ids []string
	for i := range 253 {
		id := fmt.Sprintf("m-%d", i)
		out := []byte("short")
		if i < 3 {
			id = string(rune('a' + i))
			out = bytes.Repeat([]byte(id), 100)
			data[id] = out
		}
		env := &trajectory.Environment{Tenant: "t", Backend: "container", Image: "busybox", Layers: []string{blobstore.Digest(nil)}}
		if err := l.Create(ctx, id, env, time.Now(), time.Now()); err != nil {
			t.Fatal(err)
		}
		execOut(t, l, id, out)
		if id != "b" {
			if err := l.End(ctx, id, trajectory.KindDestroy, "destroyed"); err != nil {
				t.Fatal(err)
			}
		}
		ids = append(ids, id)
	}
	if err := l.ShipBatch(ctx, ids); err != nil {
		t.Fatal(err)
	}
	ref := func(id string) string {
		d, err := f.store.Refs().Get(ctx, trajectory.ShipRef(id))
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	pack := ref("a")
	for _, id := range ids {
		if ref(id) != pack {
			t.Fatalf("%s is not in the pack", id)
		}
	}
	da, db, dc := blobstore.Digest(data["a"]), blobstore.Digest(data["b"]), blobstore.Digest(data["c"])
	run := func(now time.Time) gc.Result {
		t.Helper()
		res, err := gc.Run(ctx, store, gc.Options{Grace: grace, Now: func() time.Time { return now }})
		if err != nil {
			t.Fatal(err)
		}
		f.checkCounts(res)
		return res
	}

	res := run(f.now)
	f.want([]string{pack, da, db, dc}, nil)
	if res.FreedBlobs != 0 {
		t.Fatalf("freed %v", res.Freed)
	}
	if n := store.reset()[pack]; n != 1 {
		t.Fatalf("the pack named by %d refs was read %d times in one run, want once", len(ids), n)
	}

	// a's trajectory is deleted, and b, still running, is shipped again
	// into a blob of its own: their lines in the pack are dead. a's data
	// goes; b's stays, named by its new blob too.
	if err := f.store.Refs().Delete(ctx, trajectory.ShipRef("a")); err != nil {
		t.Fatal(err)
	}
	more := bytes.Repeat([]byte("B"), 100)
	execOut(t, l, "b", more)
	if err := l.ShipBatch(ctx, []string{"b"}); err != nil {
		t.Fatal(err)
	}
	moved := ref("b")
	if moved == pack {
		t.Fatal("b was not shipped again")
	}
	res = run(f.now)
	f.want([]string{pack, moved, db, blobstore.Digest(more), dc}, []string{da})
	if !slices.Equal(res.Freed, []string{da}) {
		t.Fatalf("freed %v, want a's data only", res.Freed)
	}

	// Every ref naming the pack gone: it is kept while young, then freed
	// with the data of its last sandboxes.
	for _, id := range ids {
		if id != "a" && id != "b" {
			if err := f.store.Refs().Delete(ctx, trajectory.ShipRef(id)); err != nil {
				t.Fatal(err)
			}
		}
	}
	res = run(time.Now())
	if res.FreedBlobs != 0 {
		t.Fatalf("a young pack's run freed %v", res.Freed)
	}
	res = run(f.now)
	f.want([]string{moved, db, blobstore.Digest(more)}, []string{pack, dc})
	if want := sorted(pack, dc); !slices.Equal(res.Freed, want) {
		t.Fatalf("freed %v, want %v", res.Freed, want)
	}
}

// Refs set while a run goes on are checked after its sweep: a pack named
// by many of them is read once, and only the refs whose own sandbox's
// records name a freed blob are reported broken, not their pack mates.
func TestTrajectoryPackSetDuringRun(t *testing.T) {
	f := newFixture(t)
	ctx := f.ctx
	store := &countingDir{Dir: f.store, opens: map[string]int{}}
	old := f.put("old output, unreferenced")
	var buf bytes.Buffer
	const n = 50
	for i := range n {
		rec := &trajectory.Record{Sandbox: fmt.Sprintf("late-%d", i), Kind: trajectory.KindExec, Exec: &trajectory.Exec{
			Stdout: trajectory.NewData(nil), Stderr: trajectory.NewData(nil)}}
		if i == 7 {
			rec.Exec.Stdout = &trajectory.Data{Digest: old.Digest, Size: old.Size}
		}
		line, err := rec.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		buf.Write(line)
		buf.WriteByte('\n')
	}
	var pack string
	res, err := gc.Run(ctx, store, gc.Options{Grace: grace, Now: func() time.Time { return f.now }, Logger: slog.New(slog.DiscardHandler),
		Held: func(ctx context.Context) ([]string, error) {
			// Runs after the refs were read: a ship stores the pack
			// (not a candidate, being stored after the listing) and sets
			// its refs.
			b := blobstore.Batch{Blobs: [][]byte{buf.Bytes()}}
			pack = blobstore.Digest(buf.Bytes())
			for i := range n {
				b.Refs = append(b.Refs, blobstore.Ref{Name: trajectory.ShipRef(fmt.Sprintf("late-%d", i)), Digest: pack})
			}
			return nil, f.store.WriteBatch(ctx, b)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{trajectory.ShipRef("late-7")}; !slices.Equal(res.Broken, want) {
		t.Fatalf("broken %v, want %v", res.Broken, want)
	}
	if got := store.reset()[pack]; got != 1 {
		t.Fatalf("the pack named by %d new refs was read %d times, want once", n, got)
	}
}
