package blobstore_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/blobstoretest"
	"github.com/dsec-dev/dsec/internal/testutil"
)

func newDir(t *testing.T) *blobstore.Dir {
	t.Helper()
	d, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	return d
}

func TestDirConformance(t *testing.T) {
	blobstoretest.Run(t, func(t *testing.T) blobstore.Store { return newDir(t) })
}

func TestNewURL(t *testing.T) {
	root := t.TempDir()
	for _, u := range []string{root, "dir://" + root, "file://" + root} {
		r, err := blobstore.New(u)
		require.NoError(t, err, u)
		assert.Equal(t, root, r.(*blobstore.Dir).Root())
	}
	for _, tc := range []struct{ url, want string }{
		{"", "empty"},
		{"dir://host/x", "host"},
		{"s3://bucket/prefix", "s3store.Open"},
		{"ftp://x/y", "unknown scheme"},
	} {
		_, err := blobstore.New(tc.url)
		assert.ErrorContains(t, err, tc.want, tc.url)
	}
}

func TestDirLeavesNoTempFiles(t *testing.T) {
	d := newDir(t)
	ctx := context.Background()
	_, err := d.Put(ctx, bytes.NewReader([]byte("a")))
	require.NoError(t, err)
	_, err = d.Put(ctx, bytes.NewReader([]byte("a")))
	require.NoError(t, err)
	require.NoError(t, d.Refs().Set(ctx, "r", blobstore.Digest([]byte("a"))))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = d.Put(cancelled, bytes.NewReader([]byte("b")))
	require.Error(t, err)
	entries, err := os.ReadDir(d.TempDir())
	require.NoError(t, err)
	assert.Empty(t, entries)
}

func TestDirIngest(t *testing.T) {
	d := newDir(t)
	ctx := context.Background()
	src := filepath.Join(d.TempDir(), "layer")
	require.NoError(t, os.WriteFile(src, []byte("erofs bytes"), 0o600))
	desc, err := d.Ingest(ctx, src)
	require.NoError(t, err)
	assert.Equal(t, blobstore.Digest([]byte("erofs bytes")), desc.Digest)
	assert.NoFileExists(t, src)
	p, err := d.Path(desc.Digest)
	require.NoError(t, err)
	info, err := os.Stat(p)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o444), info.Mode().Perm(), "blobs are read-only files")
	require.NoError(t, d.Verify(ctx, desc.Digest))

	// Ingesting content already present just drops the file.
	require.NoError(t, os.WriteFile(src, []byte("erofs bytes"), 0o600))
	again, err := d.Ingest(ctx, src)
	require.NoError(t, err)
	assert.Equal(t, desc, again)
	assert.NoFileExists(t, src)

	// From another file system (or directory) it still works.
	other := filepath.Join(t.TempDir(), "f")
	require.NoError(t, os.WriteFile(other, []byte("elsewhere"), 0o600))
	desc, err = d.Ingest(ctx, other)
	require.NoError(t, err)
	assert.Equal(t, blobstore.Digest([]byte("elsewhere")), desc.Digest)
}

func TestDirRefLayout(t *testing.T) {
	dir := newDir(t)
	d := dir.Refs()
	ctx := context.Background()
	dg := blobstore.Digest([]byte("m"))
	require.NoError(t, d.Set(ctx, "images/library/ubuntu:22.04", dg))
	b, err := os.ReadFile(filepath.Join(dir.Root(), "refs", "images", "library", "ubuntu:22.04"))
	require.NoError(t, err)
	assert.Equal(t, dg+"\n", string(b))

	// A name cannot also be the directory of other names.
	err = d.Set(ctx, "images/library", dg)
	assert.ErrorContains(t, err, "conflicts")
	_, err = d.Get(ctx, "images/library")
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorIs(t, d.Delete(ctx, "images/library"), blobstore.ErrNotFound)

	// Deleting the last ref under a directory prunes the empty directories.
	require.NoError(t, d.Delete(ctx, "images/library/ubuntu:22.04"))
	assert.NoDirExists(t, filepath.Join(dir.Root(), "refs", "images"))
	assert.DirExists(t, filepath.Join(dir.Root(), "refs"))

	// A corrupt ref file is reported as such, not as a digest.
	require.NoError(t, os.WriteFile(filepath.Join(dir.Root(), "refs", "bad"), []byte("garbage"), 0o644))
	_, err = d.Get(ctx, "bad")
	assert.ErrorContains(t, err, `ref "bad" is corrupt`)
}

// plainRepo hides Dir's WriteBatch, so that blobstore.WriteBatch takes its
// generic path (a Put per blob, a Set per ref).
type plainRepo struct {
	blobstore.Repository
	blobstore.Local
}

func TestGenericBatchConformance(t *testing.T) {
	blobstoretest.Run(t, func(t *testing.T) blobstore.Store {
		d := newDir(t)
		return plainRepo{d, d}
	})
}

// trajectoryBatch is n small blobs and a ref to each, as a ship of n ended
// sandboxes writes them.
func trajectoryBatch(n int, tag string) blobstore.Batch {
	var b blobstore.Batch
	for i := range n {
		blob := fmt.Appendf(nil, `{"sandbox":"sb-%s-%d","seq":0,"kind":"create"}`+"\n", tag, i)
		b.Blobs = append(b.Blobs, blob)
		b.Refs = append(b.Refs, blobstore.Ref{Name: fmt.Sprintf("trajectories/sb-%s-%d", tag, i), Digest: blobstore.Digest(blob)})
	}
	return b
}

func checkBatch(t *testing.T, d *blobstore.Dir, b blobstore.Batch) {
	t.Helper()
	ctx := context.Background()
	for i, ref := range b.Refs {
		got, err := d.Refs().Get(ctx, ref.Name)
		require.NoError(t, err, ref.Name)
		require.Equal(t, ref.Digest, got, ref.Name)
		blob, err := blobstore.ReadAll(ctx, d, got)
		require.NoError(t, err, ref.Name)
		require.Equal(t, b.Blobs[i], blob, ref.Name)
	}
}

func assertNoTemps(t *testing.T, d *blobstore.Dir) {
	t.Helper()
	entries, err := os.ReadDir(d.TempDir())
	require.NoError(t, err)
	assert.Empty(t, entries, "temp files left behind")
}

// A batch is durable on its own: another opening of the store (a new
// process, or the server reading what an edge shipped) finds every ref and
// blob, and no temp file is left.
func TestDirBatchSurvivesReopen(t *testing.T) {
	root := t.TempDir()
	d, err := blobstore.NewDir(root)
	require.NoError(t, err)
	b := trajectoryBatch(50, "r")
	require.NoError(t, d.WriteBatch(context.Background(), b))
	assertNoTemps(t, d)

	again, err := blobstore.NewDir(root)
	require.NoError(t, err)
	checkBatch(t, again, b)
	p, err := again.Path(b.Refs[0].Digest)
	require.NoError(t, err)
	info, err := os.Stat(p)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o444), info.Mode().Perm(), "blobs are read-only files")
	raw, err := os.ReadFile(filepath.Join(root, "refs", "trajectories", "sb-r-0"))
	require.NoError(t, err)
	assert.Equal(t, b.Refs[0].Digest+"\n", string(raw), "a batch writes refs in the same layout as Set")
}

// The point of a batch: its flushes do not grow with its size, where Put
// and Set cost two each (file and directory).
func TestDirBatchFlushes(t *testing.T) {
	ctx := context.Background()
	const n = 20
	d := newDir(t)
	one := trajectoryBatch(n, "one")
	before := d.Syncs()
	for i := range n {
		_, err := d.Put(ctx, bytes.NewReader(one.Blobs[i]))
		require.NoError(t, err)
		require.NoError(t, d.Refs().Set(ctx, one.Refs[i].Name, one.Refs[i].Digest))
	}
	each := d.Syncs() - before
	assert.Equal(t, int64(4*n), each, "a Put and a Set each")

	b := trajectoryBatch(n, "batch")
	before = d.Syncs()
	require.NoError(t, d.WriteBatch(ctx, b))
	batch := d.Syncs() - before
	checkBatch(t, d, b)
	// One syncfs, blobs/sha256 and refs/trajectories where syncfs covers
	// the file system (ext4 here); a sync per file and the two
	// directories elsewhere.
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(d.Root(), &st))
	if st.Type == unix.EXT4_SUPER_MAGIC {
		assert.Equal(t, int64(3), batch)
	} else {
		assert.LessOrEqual(t, batch, int64(2*n+2))
	}

	// Written again, nothing is new: no file written, nothing synced.
	before = d.Syncs()
	require.NoError(t, d.WriteBatch(ctx, b))
	assert.Equal(t, int64(0), d.Syncs()-before)
}

// inode returns the inode number of the file at p.
func inode(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Stat(p, &st))
	return st.Ino
}

// Blobs already stored and refs already pointing where the batch says are
// left as they are (no new file, no file deleted), but a stored blob's
// times move to now, as Put's do: it is about to be referenced again.
func TestDirBatchRewritesNothingStored(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	b := trajectoryBatch(3, "s")
	require.NoError(t, d.WriteBatch(ctx, b))
	blobPath, err := d.Path(b.Refs[0].Digest)
	require.NoError(t, err)
	refPath := filepath.Join(d.Root(), "refs", "trajectories", "sb-s-0")
	blobIno, refIno := inode(t, blobPath), inode(t, refPath)
	old := time.Now().Add(-time.Hour)
	require.NoError(t, os.Chtimes(blobPath, old, old))

	require.NoError(t, d.WriteBatch(ctx, b))
	assert.Equal(t, blobIno, inode(t, blobPath), "stored blob rewritten")
	assert.Equal(t, refIno, inode(t, refPath), "unchanged ref rewritten")
	info, err := os.Stat(blobPath)
	require.NoError(t, err)
	assert.True(t, info.ModTime().After(old.Add(time.Minute)), "stored blob's time not refreshed")
	assertNoTemps(t, d)
}

// When the blobs cannot be put in place, no ref of the batch is set: a ref
// never points at a blob that is not stored. Nothing is left in tmp/.
func TestDirBatchBlobFailureSetsNoRef(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	first := trajectoryBatch(2, "f")
	require.NoError(t, d.WriteBatch(ctx, first))
	blobsDir := filepath.Dir(mustPath(t, d, first.Refs[0].Digest))
	if err := testutil.SetImmutable(blobsDir, true); err != nil {
		t.Skipf("cannot make %s immutable (needs root and a file system with the attribute): %v", blobsDir, err)
	}
	t.Cleanup(func() { testutil.SetImmutable(blobsDir, false) })

	// New trajectories, and a new version of one already shipped.
	b := trajectoryBatch(5, "g")
	moved := []byte(`{"sandbox":"sb-f-0","seq":1,"kind":"destroy"}` + "\n")
	b.Blobs = append(b.Blobs, moved)
	b.Refs = append(b.Refs, blobstore.Ref{Name: first.Refs[0].Name, Digest: blobstore.Digest(moved)})
	err := d.WriteBatch(ctx, b)
	require.Error(t, err)
	assert.ErrorContains(t, err, "put blob")

	for _, ref := range b.Refs[:5] {
		_, err := d.Refs().Get(ctx, ref.Name)
		assert.ErrorIs(t, err, blobstore.ErrNotFound, "ref %s set although its blob was not stored", ref.Name)
	}
	checkBatch(t, d, first) // the old version still stands
	assertNoTemps(t, d)

	require.NoError(t, testutil.SetImmutable(blobsDir, false))
	require.NoError(t, d.WriteBatch(ctx, b), "the same batch once the store works again")
	checkBatch(t, d, b)
}

func mustPath(t *testing.T, d *blobstore.Dir, digest string) string {
	t.Helper()
	p, err := d.Path(digest)
	require.NoError(t, err)
	return p
}

// A ref that cannot be set (its name is the directory of other refs) fails
// alone: the error names it, the batch's other refs are set and point at
// stored blobs, and nothing is left in tmp/.
func TestDirBatchRefConflict(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	digest := blobstore.Digest([]byte("x"))
	_, err := d.Put(ctx, bytes.NewReader([]byte("x")))
	require.NoError(t, err)
	require.NoError(t, d.Refs().Set(ctx, "trajectories/dir/child", digest))

	b := trajectoryBatch(4, "c")
	b.Refs = append(b.Refs[:2], append([]blobstore.Ref{{Name: "trajectories/dir", Digest: b.Refs[2].Digest}}, b.Refs[2:]...)...)
	err = d.WriteBatch(ctx, b)
	require.Error(t, err)
	assert.ErrorContains(t, err, `"trajectories/dir": conflicts with another ref`)
	b.Refs = append(b.Refs[:2], b.Refs[3:]...)
	checkBatch(t, d, b)
	got, err := d.Refs().Get(ctx, "trajectories/dir/child")
	require.NoError(t, err)
	assert.Equal(t, digest, got)
	assertNoTemps(t, d)
}
