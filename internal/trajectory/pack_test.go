package trajectory_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// runSandbox creates sandbox id of tenant, runs one exec printing out
// bytes (kept inline: the log's InlineMax is larger) and ends it if end.
func runSandbox(t *testing.T, l *trajectory.Log, id, tenant string, out int, end bool) {
	t.Helper()
	ctx := context.Background()
	env := testEnv()
	env.Tenant = tenant
	if err := l.Create(ctx, id, env, t0, t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	exec(t, l, id, 1, bytes.Repeat([]byte{'x'}, out), "cat", "big")
	if end {
		if err := l.End(ctx, id, trajectory.KindDestroy, "destroyed on request"); err != nil {
			t.Fatal(err)
		}
	}
}

// blobs lists the digests of the blobs in store.
func blobs(t *testing.T, store blobstore.Store) []string {
	t.Helper()
	var out []string
	if err := store.Walk(context.Background(), func(d blobstore.Descriptor) error {
		out = append(out, d.Digest)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func refOf(t *testing.T, store blobstore.Repository, id string) string {
	t.Helper()
	d, err := store.Refs().Get(context.Background(), trajectory.ShipRef(id))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func readBlob(t *testing.T, store blobstore.Store, digest string) []byte {
	t.Helper()
	b, err := blobstore.ReadAll(context.Background(), store, digest)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// checkShipped checks that each sandbox reads back exactly its records
// from the store.
func checkShipped(t *testing.T, l *trajectory.Log, store blobstore.Repository, ids ...string) {
	t.Helper()
	for _, id := range ids {
		got := shippedLines(t, store, id)
		if want := pageAll(t, l, id, false); !bytes.Equal(joinLines(got), joinLines(want)) {
			t.Fatalf("shipped trajectory of %s:\n%s\nwant:\n%s", id, joinLines(got), joinLines(want))
		}
		verifyLines(t, got)
	}
}

// One batch of small trajectories is one pack per tenant, and a ref per
// sandbox naming its tenant's pack; a large trajectory is a blob of its
// own. A pack holds each of its trajectories' lines together and in
// order, and each sandbox reads back its own records only.
func TestShipPacks(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store, InlineMax: 256 << 10})
	var aIDs, bIDs, all []string
	for i := range 10 {
		id := fmt.Sprintf("a-%d", i)
		runSandbox(t, l, id, "tenant-a", 100, true)
		aIDs = append(aIDs, id)
		all = append(all, id)
		if i%2 == 0 {
			id := fmt.Sprintf("b-%d", i)
			runSandbox(t, l, id, "tenant-b", 100, true)
			bIDs = append(bIDs, id)
			all = append(all, id)
		}
	}
	// Over 64 KiB of JSONL: shipped alone.
	runSandbox(t, l, "big", "tenant-a", 100<<10, true)
	all = slices.Insert(all, 3, "big")

	if err := l.ShipBatch(ctx, all); err != nil {
		t.Fatal(err)
	}
	packA, packB, big := refOf(t, store, aIDs[0]), refOf(t, store, bIDs[0]), refOf(t, store, "big")
	if packA == packB || packA == big || packB == big {
		t.Fatal("tenants share a pack, or the large trajectory is in one")
	}
	for _, id := range aIDs {
		if d := refOf(t, store, id); d != packA {
			t.Fatalf("%s names %s, not tenant-a's pack %s", id, d, packA)
		}
	}
	for _, id := range bIDs {
		if d := refOf(t, store, id); d != packB {
			t.Fatalf("%s names %s, not tenant-b's pack %s", id, d, packB)
		}
	}
	if got := blobs(t, store); len(got) != 3 {
		t.Fatalf("%d blobs stored for two tenants' packs and one large trajectory, want 3", len(got))
	}
	// Three blobs and three ref files (the refs of a pack share one):
	// six inodes for sixteen sandboxes, where a blob and a ref each took
	// thirty-two.
	if n := storeInodes(t, store.Root()); n != 6 {
		t.Fatalf("the store holds %d files, want 6", n)
	}

	// The pack is the trajectories one after the other, in ship order.
	var want []byte
	for _, id := range aIDs {
		want = append(want, joinLines(pageAll(t, l, id, false))...)
		want = append(want, '\n')
	}
	if got := readBlob(t, store, packA); !bytes.Equal(got, want) {
		t.Fatalf("tenant-a's pack:\n%s\nwant:\n%s", got, want)
	}
	if got, want := readBlob(t, store, big), append(joinLines(pageAll(t, l, "big", false)), '\n'); !bytes.Equal(got, want) {
		t.Fatal("the large trajectory's blob holds more than its lines")
	}
	checkShipped(t, l, store, all...)
	// A whole pack verifies too: chains are per sandbox.
	if n, err := trajectory.Verify(bytes.NewReader(readBlob(t, store, packA))); err != nil || n != 3*len(aIDs) {
		t.Fatalf("Verify of a pack: %d %v", n, err)
	}
	// A sandbox has no lines in another tenant's pack.
	if _, err := trajectory.LinesOf(readBlob(t, store, packA), bIDs[0]); !errors.Is(err, trajectory.ErrNoRecords) {
		t.Fatalf("LinesOf a sandbox of tenant-b in tenant-a's pack: %v", err)
	}
}

// A pack stops growing at 1 MiB: a batch of trajectories just under the
// 64 KiB of a packed one fills several, none larger, and every sandbox
// still reads back its own records.
func TestShipPackLimit(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store, InlineMax: 256 << 10})
	var ids []string
	total := 0
	for i := range 40 {
		id := fmt.Sprintf("sb-%d", i)
		runSandbox(t, l, id, "tenant", 40<<10, true) // ~55 KiB of JSONL
		ids = append(ids, id)
		n := len(joinLines(pageAll(t, l, id, false))) + 1
		if n > 64<<10 || n < 48<<10 {
			t.Fatalf("trajectory of %d bytes; the test wants them just under 64 KiB", n)
		}
		total += n
	}
	if err := l.ShipBatch(ctx, ids); err != nil {
		t.Fatal(err)
	}
	packs := blobs(t, store)
	sum := 0
	for _, d := range packs {
		n := len(readBlob(t, store, d))
		if n > 1<<20 {
			t.Fatalf("pack of %d bytes, over 1 MiB", n)
		}
		sum += n
	}
	if want := (total + 1<<20 - 1) >> 20; len(packs) < want || len(packs) > want+1 || sum != total {
		t.Fatalf("%d packs of %d bytes in all for %d bytes of trajectories", len(packs), sum, total)
	}
	checkShipped(t, l, store, ids...)
}

// A running sandbox shipped again moves its ref to the new blob, which
// holds its whole trajectory; the pack it was in stays for the others
// (with its old lines, dead bytes now).
func TestShipReshipMovesRef(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store})
	var ids []string
	for i := range 5 {
		id := fmt.Sprintf("sb-%d", i)
		runSandbox(t, l, id, "tenant", 10, false)
		ids = append(ids, id)
	}
	if err := l.ShipAll(ctx); err != nil {
		t.Fatal(err)
	}
	first := refOf(t, store, ids[0])
	checkShipped(t, l, store, ids...)
	oldLines := shippedLines(t, store, ids[2])

	exec(t, l, ids[2], 2, []byte("more"), "echo", "more")
	if err := l.End(ctx, ids[3], trajectory.KindDestroy, "destroyed on request"); err != nil {
		t.Fatal(err)
	}
	if err := l.ShipAll(ctx); err != nil {
		t.Fatal(err)
	}
	second := refOf(t, store, ids[2])
	if second == first || refOf(t, store, ids[3]) != second {
		t.Fatal("the sandboxes shipped again do not share a new pack")
	}
	for _, i := range []int{0, 1, 4} {
		if d := refOf(t, store, ids[i]); d != first {
			t.Fatalf("%s moved from the pack with nothing new to ship", ids[i])
		}
	}
	checkShipped(t, l, store, ids...)
	if got := shippedLines(t, store, ids[2]); len(got) != len(oldLines)+1 {
		t.Fatalf("%s shipped again with %d records, want %d", ids[2], len(got), len(oldLines)+1)
	}
	stale, err := trajectory.LinesOf(readBlob(t, store, first), ids[2])
	if err != nil || !bytes.Equal(joinLines(stale), joinLines(oldLines)) {
		t.Fatalf("the first pack lost %s's old lines: %v", ids[2], err)
	}
}

// When a batch fails for one sandbox only, the others' refs stay on the
// pack the batch stored (they are not shipped again one by one) and the
// error names the one.
func TestShipBatchOneFailsKeepsPack(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	l := openLog(t, trajectory.Options{Dir: t.TempDir(), Store: store})
	ids := endSandboxes(t, l, "sb", 6)
	if _, err := store.Put(ctx, bytes.NewReader(nil)); err != nil {
		t.Fatal(err)
	}
	// A ref below trajectories/sb-4 makes that name a directory.
	if err := store.Refs().Set(ctx, trajectory.ShipRef(ids[4])+"/x", blobstore.Digest(nil)); err != nil {
		t.Fatal(err)
	}
	if err := l.ShipBatch(ctx, ids); err == nil || !bytes.Contains([]byte(err.Error()), []byte("ship trajectory of sb-4")) {
		t.Fatalf("ShipBatch with an unshippable sandbox: %v", err)
	}
	pack := refOf(t, store, ids[0])
	for i, id := range ids {
		if i != 4 && refOf(t, store, id) != pack {
			t.Fatalf("%s does not name the batch's pack", id)
		}
	}
	// The pack, the empty blob, and sb-4's blob of its own, stored by
	// its retry alone before its ref failed (garbage, named by no ref).
	if n := len(blobs(t, store)); n != 3 {
		t.Fatalf("%d blobs, want the pack, sb-4's and the empty one", n)
	}
	checkShipped(t, l, store, slices.Delete(slices.Clone(ids), 4, 5)...)
}

func TestLinesOf(t *testing.T) {
	line := func(id string, seq uint64) []byte {
		t.Helper()
		b, err := (&trajectory.Record{Sandbox: id, Seq: seq, Kind: trajectory.KindExec}).Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	odd := `we"ird\<&>`
	lines := [][]byte{
		line("sb-1", 0), line("sb-10", 0), line("sb-1", 1), line(odd, 0),
		[]byte(`{ "sandbox":"sb-1","seq":9}`), // not canonical: nobody's
		[]byte(`{"sandbox":"sb-1"}`),
		[]byte(`{"seq":0,"sandbox":"sb-1"}`),
		[]byte(`{"sandbox":"sb-1\`),
		{},
		line("sb-1", 2), // the last line, without its newline
	}
	blob := joinLines(lines)
	for _, tc := range []struct {
		id   string
		want [][]byte
	}{
		{"sb-1", [][]byte{lines[0], lines[2], lines[9]}},
		{"sb-10", [][]byte{lines[1]}},
		{odd, [][]byte{lines[3]}},
	} {
		got, err := trajectory.LinesOf(blob, tc.id)
		if err != nil || !bytes.Equal(joinLines(got), joinLines(tc.want)) {
			t.Fatalf("LinesOf %q: %v\n%s\nwant:\n%s", tc.id, err, joinLines(got), joinLines(tc.want))
		}
	}
	for _, id := range []string{"sb", "sb-2", ""} {
		if _, err := trajectory.LinesOf(blob, id); !errors.Is(err, trajectory.ErrNoRecords) {
			t.Fatalf("LinesOf %q: %v, want ErrNoRecords", id, err)
		}
	}
	if _, err := trajectory.LinesOf(nil, "sb-1"); !errors.Is(err, trajectory.ErrNoRecords) {
		t.Fatalf("LinesOf of an empty blob: %v", err)
	}

	want := []string{"sb-1", "sb-10", "sb-1", odd, "", "", "", "", "", "sb-1"}
	for i, l := range lines {
		id, ok := trajectory.LineSandbox(l)
		if id != want[i] || ok != (want[i] != "") {
			t.Fatalf("LineSandbox %s: %q %v, want %q", l, id, ok, want[i])
		}
	}
}
