package blobstore_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/blobstoretest"
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
		{"s3://bucket/prefix", "not implemented"},
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
