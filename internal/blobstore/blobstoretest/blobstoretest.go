// Package blobstoretest is the conformance suite every blobstore.Store
// implementation runs, so that layers, snapshots and refs behave the same on
// a local directory, a shared file system or an object store.
package blobstoretest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// Run runs the suite. newStore returns a fresh, empty store for each
// subtest. Range tests run when it implements blobstore.RangeReader. Ref
// tests run when the store also has a Refs() method (as a
// blobstore.Repository does);
// corruption tests run when it implements blobstore.Local (they need to
// damage a stored blob behind the store's back). Batch tests run through
// blobstore.WriteBatch, so they check a store's own BatchWriter when it has
// one and the generic fallback otherwise.
func Run(t *testing.T, newStore func(t *testing.T) blobstore.Store) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s blobstore.Store)
	}{
		{"PutOpenStat", testPutOpenStat},
		{"PutIdempotent", testPutIdempotent},
		{"EmptyBlob", testEmptyBlob},
		{"LargeStream", testLargeStream},
		{"NotFound", testNotFound},
		{"InvalidDigest", testInvalidDigest},
		{"Delete", testDelete},
		{"Walk", testWalk},
		{"CancelledPut", testCancelledPut},
		{"Corrupt", testCorrupt},
		{"ConcurrentSameContent", testConcurrentSame},
		{"ConcurrentDifferentContent", testConcurrentDifferent},
		{"Refs", testRefs},
		{"RefsInvalid", testRefsInvalid},
		{"RefsConcurrentSet", testRefsConcurrentSet},
		{"Batch", testBatch},
		{"BatchRefused", testBatchRefused},
		{"many refs to one digest in one batch", testBatchSharedDigest},
		{"Range", testRange},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, newStore(t))
		})
	}
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

func put(t *testing.T, s blobstore.Store, b []byte) blobstore.Descriptor {
	t.Helper()
	d, err := s.Put(context.Background(), bytes.NewReader(b))
	require.NoError(t, err)
	return d
}

// WalkAll returns every blob of s, as Walk lists them.
func WalkAll(t *testing.T, s blobstore.Store) []blobstore.Descriptor {
	t.Helper()
	var all []blobstore.Descriptor
	require.NoError(t, s.Walk(context.Background(), func(d blobstore.Descriptor) error {
		all = append(all, d)
		return nil
	}))
	return all
}

func testPutOpenStat(t *testing.T, s blobstore.Store) {
	ctx := context.Background()
	data := []byte("hello, sandbox")
	d := put(t, s, data)
	assert.Equal(t, blobstore.Digest(data), d.Digest)
	assert.Equal(t, int64(len(data)), d.Size)

	st, err := s.Stat(ctx, d.Digest)
	require.NoError(t, err)
	assert.Equal(t, d, st)

	got, err := blobstore.ReadAll(ctx, s, d.Digest)
	require.NoError(t, err)
	assert.Equal(t, data, got)
}

func testPutIdempotent(t *testing.T, s blobstore.Store) {
	data := randomBytes(t, 4096)
	d1 := put(t, s, data)
	d2 := put(t, s, data)
	assert.Equal(t, d1, d2)
	assert.Equal(t, []blobstore.Descriptor{d1}, WalkAll(t, s))
}

func testEmptyBlob(t *testing.T, s blobstore.Store) {
	d := put(t, s, nil)
	assert.Equal(t, "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", d.Digest)
	got, err := blobstore.ReadAll(context.Background(), s, d.Digest)
	require.NoError(t, err)
	assert.Empty(t, got)
}

func testLargeStream(t *testing.T, s blobstore.Store) {
	data := randomBytes(t, 8<<20+123)
	// A plain io.Reader (no WriterTo, no Len) so the store must stream.
	d, err := s.Put(context.Background(), struct{ io.Reader }{bytes.NewReader(data)})
	require.NoError(t, err)
	assert.Equal(t, int64(len(data)), d.Size)
	got, err := blobstore.ReadAll(context.Background(), s, d.Digest)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(data, got), "large blob read back differs")
}

func testNotFound(t *testing.T, s blobstore.Store) {
	ctx := context.Background()
	missing := blobstore.Digest([]byte("never stored"))
	_, err := s.Open(ctx, missing)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorContains(t, err, missing)
	_, err = s.Stat(ctx, missing)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorContains(t, err, missing)
	err = s.Delete(ctx, missing)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
}

func testInvalidDigest(t *testing.T, s blobstore.Store) {
	ctx := context.Background()
	for _, bad := range []string{
		"",
		"sha256:",
		"sha256:abc",
		"md5:d41d8cd98f00b204e9800998ecf8427e",
		"sha256:" + strings.Repeat("A", 64),
		"sha256:" + strings.Repeat("0", 63) + "/",
		"sha256:../../../../etc/passwd" + strings.Repeat("0", 40),
		strings.Repeat("0", 64),
	} {
		_, err := s.Open(ctx, bad)
		assert.ErrorIs(t, err, blobstore.ErrInvalidDigest, "Open(%q)", bad)
		_, err = s.Stat(ctx, bad)
		assert.ErrorIs(t, err, blobstore.ErrInvalidDigest, "Stat(%q)", bad)
		assert.ErrorIs(t, s.Delete(ctx, bad), blobstore.ErrInvalidDigest, "Delete(%q)", bad)
	}
}

func testDelete(t *testing.T, s blobstore.Store) {
	ctx := context.Background()
	keep := put(t, s, []byte("keep"))
	gone := put(t, s, []byte("gone"))
	require.NoError(t, s.Delete(ctx, gone.Digest))
	_, err := s.Stat(ctx, gone.Digest)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.Equal(t, []blobstore.Descriptor{keep}, WalkAll(t, s))
	// Content can be stored again after deletion.
	again := put(t, s, []byte("gone"))
	assert.Equal(t, gone, again)
}

func testWalk(t *testing.T, s blobstore.Store) {
	var want []blobstore.Descriptor
	for i := range 5 {
		want = append(want, put(t, s, []byte(fmt.Sprintf("blob %d", i))))
	}
	got := WalkAll(t, s)
	sortDesc := func(a, b blobstore.Descriptor) int { return strings.Compare(a.Digest, b.Digest) }
	slices.SortFunc(want, sortDesc)
	slices.SortFunc(got, sortDesc)
	assert.Equal(t, want, got)

	stop := errors.New("stop")
	calls := 0
	err := s.Walk(context.Background(), func(blobstore.Descriptor) error {
		calls++
		return stop
	})
	assert.ErrorIs(t, err, stop)
	assert.Equal(t, 1, calls)
}

func testCancelledPut(t *testing.T, s blobstore.Store) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := s.Put(ctx, bytes.NewReader(randomBytes(t, 1<<20)))
	assert.ErrorIs(t, err, context.Canceled)
	assert.Empty(t, WalkAll(t, s), "a cancelled Put must not leave a blob")
}

func testCorrupt(t *testing.T, s blobstore.Store) {
	local, ok := s.(blobstore.Local)
	if !ok {
		t.Skip("store has no local files to corrupt")
	}
	ctx := context.Background()
	data := randomBytes(t, 64<<10)
	d := put(t, s, data)
	p, err := local.Path(d.Digest)
	require.NoError(t, err)

	damage := func(mutate func([]byte) []byte) {
		t.Helper()
		require.NoError(t, os.Chmod(p, 0o644))
		require.NoError(t, os.WriteFile(p, mutate(slices.Clone(data)), 0o644))
	}
	for _, tc := range []struct {
		name   string
		mutate func([]byte) []byte
	}{
		{"flipped byte", func(b []byte) []byte { b[len(b)/2] ^= 0xff; return b }},
		{"truncated", func(b []byte) []byte { return b[:len(b)-1] }},
		{"extended", func(b []byte) []byte { return append(b, 0) }},
	} {
		damage(tc.mutate)
		_, err := blobstore.ReadAll(ctx, s, d.Digest)
		assert.ErrorIs(t, err, blobstore.ErrDigestMismatch, tc.name)
		assert.ErrorContains(t, err, d.Digest, tc.name)
		if v, ok := s.(interface {
			Verify(context.Context, string) error
		}); ok {
			assert.ErrorIs(t, v.Verify(ctx, d.Digest), blobstore.ErrDigestMismatch, tc.name)
		}
	}
}

func testConcurrentSame(t *testing.T, s blobstore.Store) {
	data := randomBytes(t, 1<<20)
	const n = 16
	descs := make([]blobstore.Descriptor, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			descs[i], errs[i] = s.Put(context.Background(), bytes.NewReader(data))
		})
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		assert.Equal(t, descs[0], descs[i])
	}
	assert.Len(t, WalkAll(t, s), 1)
	got, err := blobstore.ReadAll(context.Background(), s, descs[0].Digest)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(data, got))
}

func testConcurrentDifferent(t *testing.T, s blobstore.Store) {
	const n = 16
	datas := make([][]byte, n)
	for i := range n {
		datas[i] = randomBytes(t, 64<<10+i)
	}
	descs := make([]blobstore.Descriptor, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			descs[i], errs[i] = s.Put(context.Background(), bytes.NewReader(datas[i]))
		})
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		got, err := blobstore.ReadAll(context.Background(), s, descs[i].Digest)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(datas[i], got), "blob %d", i)
	}
	assert.Len(t, WalkAll(t, s), n)
}

func refsOf(t *testing.T, s blobstore.Store) blobstore.Refs {
	t.Helper()
	r, ok := s.(interface{ Refs() blobstore.Refs })
	if !ok {
		t.Skip("store does not keep refs")
	}
	return r.Refs()
}

func testRefs(t *testing.T, s blobstore.Store) {
	r := refsOf(t, s)
	ctx := context.Background()
	d1 := blobstore.Digest([]byte("one"))
	d2 := blobstore.Digest([]byte("two"))

	_, err := r.Get(ctx, "images/a:latest")
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorContains(t, err, "images/a:latest")

	require.NoError(t, r.Set(ctx, "images/a:latest", d1))
	require.NoError(t, r.Set(ctx, "images/a:v2", d2))
	require.NoError(t, r.Set(ctx, "images/lib/b:1.0", d2))
	require.NoError(t, r.Set(ctx, "other/x", d1))

	got, err := r.Get(ctx, "images/a:latest")
	require.NoError(t, err)
	assert.Equal(t, d1, got)

	require.NoError(t, r.Set(ctx, "images/a:latest", d2), "moving a ref")
	got, err = r.Get(ctx, "images/a:latest")
	require.NoError(t, err)
	assert.Equal(t, d2, got)

	list, err := r.List(ctx, "images/")
	require.NoError(t, err)
	assert.Equal(t, []blobstore.Ref{
		{Name: "images/a:latest", Digest: d2},
		{Name: "images/a:v2", Digest: d2},
		{Name: "images/lib/b:1.0", Digest: d2},
	}, list)
	list, err = r.List(ctx, "images/a:")
	require.NoError(t, err)
	assert.Len(t, list, 2)
	list, err = r.List(ctx, "")
	require.NoError(t, err)
	assert.Len(t, list, 4)
	list, err = r.List(ctx, "nothing/here/")
	require.NoError(t, err)
	assert.Empty(t, list)

	// Every character a name may hold survives the store's encoding
	// (an object store's URL escaping: '+' is not a space).
	odd := "odd/A-z_0.9+x@y:tag"
	require.NoError(t, r.Set(ctx, odd, d1))
	got, err = r.Get(ctx, odd)
	require.NoError(t, err)
	assert.Equal(t, d1, got)
	list, err = r.List(ctx, "odd/")
	require.NoError(t, err)
	assert.Equal(t, []blobstore.Ref{{Name: odd, Digest: d1}}, list)
	require.NoError(t, r.Delete(ctx, odd))

	require.NoError(t, r.Delete(ctx, "images/lib/b:1.0"))
	_, err = r.Get(ctx, "images/lib/b:1.0")
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorIs(t, r.Delete(ctx, "images/lib/b:1.0"), blobstore.ErrNotFound)
	list, err = r.List(ctx, "images/")
	require.NoError(t, err)
	assert.Len(t, list, 2)
}

func testRefsInvalid(t *testing.T, s blobstore.Store) {
	r := refsOf(t, s)
	ctx := context.Background()
	good := blobstore.Digest([]byte("x"))
	for _, name := range []string{"", "/abs", "a//b", "a/../b", "..", "a/.", "a b", "a\x00b", "trailing/"} {
		err := r.Set(ctx, name, good)
		assert.ErrorIs(t, err, blobstore.ErrInvalidRef, "Set(%q)", name)
		_, err = r.Get(ctx, name)
		assert.ErrorIs(t, err, blobstore.ErrInvalidRef, "Get(%q)", name)
	}
	assert.ErrorIs(t, r.Set(ctx, "ok", "sha256:nope"), blobstore.ErrInvalidDigest)
}

// testRefsConcurrentSet moves one ref from many goroutines while others read
// it: every read must return one of the written digests, never an error, an
// empty value or a torn one.
func testRefsConcurrentSet(t *testing.T, s blobstore.Store) {
	r := refsOf(t, s)
	ctx := context.Background()
	const name = "images/race:latest"
	const writers, rounds = 8, 20
	valid := map[string]bool{}
	var digests []string
	for i := range writers {
		d := blobstore.Digest([]byte(fmt.Sprint("value ", i)))
		digests = append(digests, d)
		valid[d] = true
	}
	require.NoError(t, r.Set(ctx, name, digests[0]))

	done := make(chan struct{})
	var readers sync.WaitGroup
	readErrs := make(chan error, 4)
	for range 4 {
		readers.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				got, err := r.Get(ctx, name)
				if err != nil || !valid[got] {
					readErrs <- fmt.Errorf("Get(%q) = %q, %v during concurrent Set", name, got, err)
					return
				}
			}
		})
	}
	var writersWG sync.WaitGroup
	setErrs := make([]error, writers)
	for i := range writers {
		writersWG.Go(func() {
			for range rounds {
				if err := r.Set(ctx, name, digests[i]); err != nil {
					setErrs[i] = err
					return
				}
			}
		})
	}
	writersWG.Wait()
	close(done)
	readers.Wait()
	close(readErrs)
	for err := range readErrs {
		t.Error(err)
	}
	for _, err := range setErrs {
		require.NoError(t, err)
	}
	got, err := r.Get(ctx, name)
	require.NoError(t, err)
	assert.True(t, valid[got])
}

func repoOf(t *testing.T, s blobstore.Store) blobstore.Repository {
	t.Helper()
	r, ok := s.(blobstore.Repository)
	if !ok {
		t.Skip("store does not keep refs")
	}
	return r
}

// testBatch writes blobs and refs together: new and already stored blobs,
// the same content twice, a ref moved, a ref named twice (the last wins),
// a ref to a blob stored before the batch.
func testBatch(t *testing.T, s blobstore.Store) {
	r := repoOf(t, s)
	refs := r.Refs()
	ctx := context.Background()
	old := put(t, s, []byte("stored before the batch"))
	require.NoError(t, refs.Set(ctx, "trajectories/moved", old.Digest))

	blobs := [][]byte{[]byte("one"), []byte("two"), randomBytes(t, 100_000), []byte("one"), []byte("stored before the batch")}
	d := func(i int) string { return blobstore.Digest(blobs[i]) }
	b := blobstore.Batch{Blobs: blobs, Refs: []blobstore.Ref{
		{Name: "trajectories/a", Digest: d(0)},
		{Name: "trajectories/b", Digest: d(1)},
		{Name: "trajectories/moved", Digest: d(2)},
		{Name: "trajectories/twice", Digest: d(0)},
		{Name: "other/old", Digest: old.Digest},
		{Name: "trajectories/twice", Digest: d(1)},
	}}
	require.NoError(t, blobstore.WriteBatch(ctx, r, b))

	for i, blob := range blobs {
		got, err := blobstore.ReadAll(ctx, s, d(i))
		require.NoError(t, err, "blob %d", i)
		assert.True(t, bytes.Equal(blob, got), "blob %d", i)
	}
	assert.Len(t, WalkAll(t, s), 4, "one, two, the big one and the old one")
	want := map[string]string{
		"trajectories/a": d(0), "trajectories/b": d(1), "trajectories/moved": d(2),
		"trajectories/twice": d(1), "other/old": old.Digest,
	}
	for name, digest := range want {
		got, err := refs.Get(ctx, name)
		require.NoError(t, err, name)
		assert.Equal(t, digest, got, name)
	}
	// Again: everything is there already; nothing changes.
	require.NoError(t, blobstore.WriteBatch(ctx, r, b))
	list, err := refs.List(ctx, "")
	require.NoError(t, err)
	assert.Len(t, list, len(want))
	assert.Len(t, WalkAll(t, s), 4)
	// An empty batch is nothing to do.
	require.NoError(t, blobstore.WriteBatch(ctx, r, blobstore.Batch{}))
}

// testBatchSharedDigest: many refs of one batch name one blob (the
// sandboxes of a trajectory pack). Each stays a ref of its own: setting,
// deleting or moving some of them in a later batch leaves the others.
func testBatchSharedDigest(t *testing.T, s blobstore.Store) {
	r := repoOf(t, s)
	refs := r.Refs()
	ctx := context.Background()
	const n = 40
	pack, other, next := []byte("a pack of trajectories\n"), []byte("a trajectory alone\n"), []byte("the next pack\n")
	pd, od, nd := blobstore.Digest(pack), blobstore.Digest(other), blobstore.Digest(next)
	name := func(i int) string { return fmt.Sprintf("trajectories/sb-%d", i) }
	// Before the batch: one of them names another blob, which it leaves.
	put(t, s, other)
	require.NoError(t, refs.Set(ctx, name(7), od))

	b := blobstore.Batch{Blobs: [][]byte{pack, other}}
	for i := range n {
		b.Refs = append(b.Refs, blobstore.Ref{Name: name(i), Digest: pd})
	}
	b.Refs = append(b.Refs, blobstore.Ref{Name: "trajectories/alone", Digest: od})
	require.NoError(t, blobstore.WriteBatch(ctx, r, b))
	want := map[string]string{"trajectories/alone": od}
	for i := range n {
		want[name(i)] = pd
	}
	check := func(what string) {
		t.Helper()
		list, err := refs.List(ctx, "trajectories/")
		require.NoError(t, err, what)
		got := map[string]string{}
		for _, ref := range list {
			got[ref.Name] = ref.Digest
		}
		require.Equal(t, want, got, what)
		for ref, digest := range want {
			d, err := refs.Get(ctx, ref)
			require.NoError(t, err, "%s: %s", what, ref)
			require.Equal(t, digest, d, "%s: %s", what, ref)
		}
	}
	check("after the batch")
	require.NoError(t, blobstore.WriteBatch(ctx, r, b))
	check("after the same batch again")

	require.NoError(t, refs.Set(ctx, name(3), od))
	want[name(3)] = od
	check("after setting one of them")
	require.NoError(t, refs.Delete(ctx, name(4)))
	delete(want, name(4))
	check("after deleting one of them")

	// A later batch moves some of them to the next pack, as a ship of
	// sandboxes still running does.
	b = blobstore.Batch{Blobs: [][]byte{next}}
	for i := 10; i < 20; i++ {
		b.Refs = append(b.Refs, blobstore.Ref{Name: name(i), Digest: nd})
		want[name(i)] = nd
	}
	require.NoError(t, blobstore.WriteBatch(ctx, r, b))
	check("after moving some of them")
	got, err := blobstore.ReadAll(ctx, s, pd)
	require.NoError(t, err)
	assert.Equal(t, pack, got)
}

// testBatchRefused: a batch with a bad ref, or a ref to a blob that is
// nowhere, is refused before anything is written.
func testBatchRefused(t *testing.T, s blobstore.Store) {
	r := repoOf(t, s)
	refs := r.Refs()
	ctx := context.Background()
	blob := []byte("would be stored")
	good := blobstore.Ref{Name: "trajectories/good", Digest: blobstore.Digest(blob)}
	missing := blobstore.Digest([]byte("stored nowhere"))
	for _, tc := range []struct {
		bad  blobstore.Ref
		want error
		says string
	}{
		{blobstore.Ref{Name: "trajectories/../x", Digest: good.Digest}, blobstore.ErrInvalidRef, "trajectories/../x"},
		{blobstore.Ref{Name: "trajectories/x", Digest: "sha256:nope"}, blobstore.ErrInvalidDigest, "trajectories/x"},
		{blobstore.Ref{Name: "trajectories/x", Digest: missing}, blobstore.ErrNotFound, "neither in the batch nor stored"},
	} {
		err := blobstore.WriteBatch(ctx, r, blobstore.Batch{Blobs: [][]byte{blob}, Refs: []blobstore.Ref{good, tc.bad}})
		require.ErrorIs(t, err, tc.want)
		assert.ErrorContains(t, err, tc.says)
		_, err = refs.Get(ctx, good.Name)
		assert.ErrorIs(t, err, blobstore.ErrNotFound, "a refused batch set a ref")
		_, err = s.Stat(ctx, good.Digest)
		assert.ErrorIs(t, err, blobstore.ErrNotFound, "a refused batch stored a blob")
	}
}

// testRange reads parts of a blob with blobstore.RangeReader: whole, a
// middle part, the last byte, nothing, a range running past the end (an
// error, not a short read), and the errors of a missing blob, a bad digest
// and a negative range.
func testRange(t *testing.T, s blobstore.Store) {
	rr, ok := s.(blobstore.RangeReader)
	if !ok {
		t.Skip("store reads no ranges")
	}
	ctx := context.Background()
	data := randomBytes(t, 1<<20+17)
	d := put(t, s, data)
	read := func(off, n int64) ([]byte, error) {
		rc, err := rr.OpenRange(ctx, d.Digest, off, n)
		if err != nil {
			return nil, err
		}
		defer rc.Close()
		return io.ReadAll(rc)
	}
	for _, tc := range []struct{ off, n int64 }{
		{0, d.Size}, {4096, 65536}, {d.Size - 1, 1}, {12345, 1}, {0, 0}, {d.Size, 0},
	} {
		got, err := read(tc.off, tc.n)
		require.NoError(t, err, "range %d+%d", tc.off, tc.n)
		assert.True(t, bytes.Equal(data[tc.off:tc.off+tc.n], got), "range %d+%d", tc.off, tc.n)
	}
	for _, tc := range []struct{ off, n int64 }{{d.Size - 10, 11}, {d.Size, 1}, {d.Size + 100, 5}} {
		_, err := read(tc.off, tc.n)
		assert.ErrorIs(t, err, io.ErrUnexpectedEOF, "range %d+%d past the end", tc.off, tc.n)
	}
	_, err := rr.OpenRange(ctx, d.Digest, -1, 5)
	assert.Error(t, err, "negative offset")
	_, err = rr.OpenRange(ctx, d.Digest, 0, -5)
	assert.Error(t, err, "negative length")
	missing := blobstore.Digest([]byte("never stored"))
	_, err = rr.OpenRange(ctx, missing, 0, 1)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorContains(t, err, missing)
	_, err = rr.OpenRange(ctx, "sha256:abc", 0, 1)
	assert.ErrorIs(t, err, blobstore.ErrInvalidDigest)
}
