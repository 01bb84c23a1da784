package layer

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// A layer entering the store gets a chunk index beside it whose sums are
// those of its chunks, and whose metadata list names the chunks holding
// directories and inodes but not those holding only file data.
func TestBuildStoresChunkIndex(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	src := t.TempDir()
	for _, d := range []string{"a", "a/b", "c"} {
		require.NoError(t, os.MkdirAll(filepath.Join(src, d), 0o755))
	}
	for i, p := range []string{"a/big1", "a/b/big2", "c/big3"} {
		b := make([]byte, (3+i)<<20)
		rand.Read(b)
		require.NoError(t, os.WriteFile(filepath.Join(src, p), b, 0o644))
	}
	require.NoError(t, os.WriteFile(filepath.Join(src, "small"), []byte("hi"), 0o644))
	require.NoError(t, os.Symlink("a/big1", filepath.Join(src, "link")))

	desc, err := Build(ctx, e.repo, src)
	require.NoError(t, err)
	x, err := LoadChunkIndex(ctx, e.repo, desc.Digest, desc.Size)
	require.NoError(t, err)
	require.Equal(t, desc.Size, x.Size)

	p, err := e.repo.Path(desc.Digest)
	require.NoError(t, err)
	f, err := os.Open(p)
	require.NoError(t, err)
	defer f.Close()
	for i := range x.Chunks() {
		off, n := x.Extent(i)
		b := make([]byte, n)
		_, err := io.ReadFull(io.NewSectionReader(f, off, n), b)
		require.NoError(t, err)
		require.Equal(t, sha256.Sum256(b), x.Sums[i], "chunk %d", i)
	}
	// 12 MiB of file data, a few KiB of metadata: the superblock is in the
	// first extent, the extents are small, and their sums are right.
	require.NotEmpty(t, x.Meta)
	require.Zero(t, x.Meta[0].Off)
	require.Less(t, x.MetaBytes(), int64(256<<10), "metadata extents %v", x.Meta)
	for _, m := range x.Meta {
		b := make([]byte, m.Len)
		_, err := f.ReadAt(b, m.Off)
		require.NoError(t, err)
		require.Equal(t, sha256.Sum256(b), m.Sum)
	}

	// A layer of one chunk or less has none: it is fetched whole.
	small := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(small, "f"), []byte("x"), 0o644))
	sd, err := Build(ctx, e.repo, small)
	require.NoError(t, err)
	_, err = LoadChunkIndex(ctx, e.repo, sd.Digest, sd.Size)
	require.ErrorIs(t, err, blobstore.ErrNotFound)
}
