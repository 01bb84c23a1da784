package trajectory_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/testutil"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// endSandboxes creates n sandboxes named prefix-0 … prefix-(n-1), runs one
// exec in each and ends them, as a create, exec, destroy loop does; the
// appends of different sandboxes run concurrently (group commit).
func endSandboxes(tb testing.TB, l *trajectory.Log, prefix string, n int) []string {
	tb.Helper()
	ctx := context.Background()
	ids := make([]string, n)
	errs := make(chan error, n)
	sem := make(chan struct{}, 64)
	var wg sync.WaitGroup
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			id := ids[i]
			if err := l.Create(ctx, id, testEnv(), t0, t0.Add(time.Second)); err != nil {
				errs <- err
				return
			}
			req := execReq("echo", id)
			op, _, err := l.Begin(ctx, id, 1, req)
			if err != nil {
				errs <- err
				return
			}
			fillExec(req, []byte(id+"\n"), 0)
			if err := op.Commit(ctx, req); err != nil {
				errs <- err
				return
			}
			errs <- l.End(ctx, id, trajectory.KindDestroy, "destroyed on request")
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			tb.Fatal(err)
		}
	}
	return ids
}

// shippedLines reads sandbox id's shipped trajectory from store: its
// lines of the blob its ref names, which may be a pack.
func shippedLines(t *testing.T, store blobstore.Repository, id string) [][]byte {
	t.Helper()
	lines, _, err := trajectory.ReadShipped(context.Background(), store, id)
	if err != nil {
		t.Fatal(err)
	}
	return lines
}

// A batch ship writes every trajectory as Ship does, readable by another
// opening of the store (the server's), at a few flushes in all; unknown
// and repeated IDs are skipped; shipping again with nothing new writes
// nothing.
func TestShipBatch(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	store, err := blobstore.NewDir(root)
	if err != nil {
		t.Fatal(err)
	}
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store})
	const n = 40
	ids := endSandboxes(t, l, "sb", n)
	// One of them was shipped before it ended: the batch moves its ref.
	if err := l.Ship(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}

	before := store.Syncs()
	if err := l.ShipBatch(ctx, append([]string{"unknown", ids[3]}, ids...)); err != nil {
		t.Fatal(err)
	}
	syncs := store.Syncs() - before
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		t.Fatal(err)
	}
	// One syncfs and two directories on ext4; never the four per
	// trajectory a blob Put and a ref Set cost.
	if st.Type == unix.EXT4_SUPER_MAGIC && syncs != 3 || syncs >= 4*n {
		t.Errorf("a batch of %d trajectories cost %d fsync/syncfs calls", n, syncs)
	}

	reopened, err := blobstore.NewDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		got := shippedLines(t, reopened, id)
		if want := pageAll(t, l, id, false); !bytes.Equal(joinLines(got), joinLines(want)) {
			t.Fatalf("shipped trajectory of %s:\n%s\nwant:\n%s", id, joinLines(got), joinLines(want))
		}
		verifyLines(t, got)
		if recs := parseLines(t, got); recs[len(recs)-1].Kind != trajectory.KindDestroy {
			t.Fatalf("shipped trajectory of %s ends with %s", id, recs[len(recs)-1].Kind)
		}
	}
	if _, err := reopened.Refs().Get(ctx, trajectory.ShipRef("unknown")); !errors.Is(err, blobstore.ErrNotFound) {
		t.Fatalf("an unknown sandbox was shipped: %v", err)
	}
	if entries, _ := os.ReadDir(store.TempDir()); len(entries) != 0 {
		t.Fatalf("%d temp files left", len(entries))
	}

	before = store.Syncs()
	if err := l.ShipBatch(ctx, ids); err != nil {
		t.Fatal(err)
	}
	if err := l.ShipAll(ctx); err != nil {
		t.Fatal(err)
	}
	if d := store.Syncs() - before; d != 0 {
		t.Fatalf("shipping again with nothing new cost %d syncs", d)
	}
	// Forgetting keeps the shipped copy, and has nothing to ship.
	for _, id := range ids {
		if err := l.Forget(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if d := store.Syncs() - before; d != 0 {
		t.Fatalf("forgetting shipped sandboxes cost %d syncs", d)
	}
	verifyLines(t, shippedLines(t, reopened, ids[n-1]))
}

// A sandbox whose trajectory cannot be written does not hold back the
// others of its batch: the error names it, the others are shipped, and
// Forget refuses to forget it until it is shipped.
func TestShipBatchOneFails(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store})
	ids := endSandboxes(t, l, "sb", 5)
	// A ref below trajectories/sb-2 makes that name a directory.
	blocker := blobstore.Digest(nil)
	if _, err := store.Put(ctx, bytes.NewReader(nil)); err != nil {
		t.Fatal(err)
	}
	if err := store.Refs().Set(ctx, trajectory.ShipRef(ids[2])+"/x", blocker); err != nil {
		t.Fatal(err)
	}

	err := l.ShipBatch(ctx, ids)
	if err == nil || !strings.Contains(err.Error(), "ship trajectory of sb-2") {
		t.Fatalf("ShipBatch with an unshippable sandbox: %v", err)
	}
	for i, id := range ids {
		if i != 2 {
			verifyLines(t, shippedLines(t, store, id))
		}
	}
	if err := l.Forget(ctx, ids[2]); err == nil {
		t.Fatal("Forget forgot a sandbox whose trajectory was never shipped")
	}
	info(t, l, ids[2])

	if err := store.Refs().Delete(ctx, trajectory.ShipRef(ids[2])+"/x"); err != nil {
		t.Fatal(err)
	}
	if err := l.Forget(ctx, ids[2]); err != nil {
		t.Fatal(err)
	}
	verifyLines(t, shippedLines(t, store, ids[2]))
}

// A batch that fails part way (its blobs cannot be put in place) leaves
// every ref as it was: no ref points at a blob that is not stored, the
// trajectories shipped before stay readable, and the next ship, once the
// store works again, ships everything.
func TestShipBatchFailureLeavesNoDanglingRef(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store})
	early := endSandboxes(t, l, "early", 3)
	if err := l.ShipBatch(ctx, early); err != nil {
		t.Fatal(err)
	}
	shippedBefore := shippedLines(t, store, early[0])
	// A reward after the end: early-0 has a new record to ship.
	op, _, err := l.Begin(ctx, early[0], 0, &trajectory.Record{Kind: trajectory.KindReward, Reward: &trajectory.Reward{Value: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if err := op.Commit(ctx, &trajectory.Record{Kind: trajectory.KindReward, Reward: &trajectory.Reward{Value: 1}}); err != nil {
		t.Fatal(err)
	}
	late := endSandboxes(t, l, "late", 4)

	blobs := filepath.Join(store.Root(), "blobs", "sha256")
	if err := testutil.SetImmutable(blobs, true); err != nil {
		t.Skipf("cannot make %s immutable (needs root and a file system with the attribute): %v", blobs, err)
	}
	t.Cleanup(func() { testutil.SetImmutable(blobs, false) })
	err = l.ShipBatch(ctx, append(late, early[0]))
	if !errors.Is(err, syscall.EPERM) {
		t.Fatalf("ShipBatch into an immutable blob directory: %v", err)
	}
	for _, id := range late {
		if _, err := store.Refs().Get(ctx, trajectory.ShipRef(id)); !errors.Is(err, blobstore.ErrNotFound) {
			t.Fatalf("%s has a ref although its blob could not be stored: %v", id, err)
		}
	}
	if got := shippedLines(t, store, early[0]); !bytes.Equal(joinLines(got), joinLines(shippedBefore)) {
		t.Fatal("the failed batch changed a ref shipped before")
	}
	// Forget still ships first: it refuses while the store fails.
	if err := l.Forget(ctx, late[0]); err == nil {
		t.Fatal("Forget forgot a sandbox it could not ship")
	}
	info(t, l, late[0])

	if err := testutil.SetImmutable(blobs, false); err != nil {
		t.Fatal(err)
	}
	if err := l.Forget(ctx, late[0]); err != nil {
		t.Fatal(err)
	}
	if err := l.ShipAll(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range append(late, early...) {
		verifyLines(t, shippedLines(t, store, id))
	}
	if got := shippedLines(t, store, early[0]); len(got) != len(shippedBefore)+1 {
		t.Fatalf("early-0 shipped with %d records, want %d (the reward)", len(got), len(shippedBefore)+1)
	}
}

// BenchmarkShipEnded ships sandboxes that ended (create, one exec,
// destroy), as the edge does under a create/destroy loop: "each" one ship
// per sandbox, "batch-N" the edge's ship loop gathering N ends per batch
// (20: 200 destroys/s at its 100 ms pace). Reported per sandbox: wall time,
// CPU time of the process (user and system, which is where the file
// system's work for the ship lands), and fsync/syncfs calls.
func BenchmarkShipEnded(b *testing.B) {
	for _, batch := range []int{0, 1, 20, 200} {
		name := "each"
		if batch > 0 {
			name = fmt.Sprintf("batch-%d", batch)
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			store, err := blobstore.NewDir(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			l, err := trajectory.Open(trajectory.Options{Dir: b.TempDir(), Store: store})
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			ids := endSandboxes(b, l, "sb", b.N)
			syncs, cpu := store.Syncs(), cpuTime()
			b.ResetTimer()
			if batch == 0 {
				for _, id := range ids {
					if err := l.Ship(ctx, id); err != nil {
						b.Fatal(err)
					}
				}
			} else {
				for i := 0; i < len(ids); i += batch {
					if err := l.ShipBatch(ctx, ids[i:min(i+batch, len(ids))]); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.StopTimer()
			b.ReportMetric(float64((cpuTime()-cpu).Microseconds())/float64(b.N), "cpu-us/op")
			b.ReportMetric(float64(store.Syncs()-syncs)/float64(b.N), "syncs/op")
			// Inodes the store holds per sandbox shipped: what each ship
			// costs in inode allocations (2 each alone, 2 per batch in
			// packs).
			b.ReportMetric(float64(storeInodes(b, store.Root()))/float64(b.N), "files/op")
		})
	}
}

// cpuTime is the CPU time (user and system) the process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
