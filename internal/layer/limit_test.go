package layer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// bombFile writes a gzip'd tar holding one file of size zero bytes.
func bombFile(t *testing.T, size int64) string {
	t.Helper()
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	require.NoError(t, err)
	tw := tar.NewWriter(zw)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "zero", Typeflag: tar.TypeReg, Mode: 0o644, Size: size}))
	chunk := make([]byte, 1<<20)
	for left := size; left > 0; left -= int64(len(chunk)) {
		_, err := tw.Write(chunk[:min(left, int64(len(chunk)))])
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	require.NoError(t, zw.Close())
	p := filepath.Join(t.TempDir(), "bomb.tar.gz")
	require.NoError(t, os.WriteFile(p, buf.Bytes(), 0o644))
	return p
}

func countRegular(t *testing.T, dir string) int {
	t.Helper()
	n := 0
	require.NoError(t, filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			n++
		}
		return err
	}))
	return n
}

// TestImportMaxBytes: WithMaxBytes bounds what an import expands to, not
// what it weighs compressed, and a refused import stores nothing and
// leaves no scratch files: a 64 MiB file of zeros (~65 KB gzip'd), a
// million-entry-style archive of empty files, and a directory.
func TestImportMaxBytes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	tmp := e.repo.TempDir()
	wantRefused := func(t *testing.T, err error, limit int64) {
		t.Helper()
		var sl *SizeLimitError
		require.ErrorIs(t, err, ErrTooLarge)
		require.True(t, errors.As(err, &sl), "error %v is no *SizeLimitError", err)
		require.Equal(t, limit, sl.Limit)
		require.Contains(t, err.Error(), fmt.Sprint(limit))
		require.Zero(t, countRegular(t, filepath.Join(e.repo.Root(), "blobs")), "blobs stored by a refused import")
		ents, _ := os.ReadDir(tmp)
		require.Empty(t, ents, "scratch left by a refused import")
		_, _, err = e.images.Get(ctx, "x:1")
		require.Error(t, err, "a refused import was tagged")
	}

	bomb := bombFile(t, 64<<20)
	fi, err := os.Stat(bomb)
	require.NoError(t, err)
	require.Less(t, fi.Size(), int64(256<<10))
	_, err = Import(ctx, e.repo, e.images, "x:1", bomb, nil, WithMaxBytes(8<<20))
	wantRefused(t, err, 8<<20)

	// Many empty files cost their headers.
	var many []tarEntry
	for i := range 5000 {
		many = append(many, tarEntry{name: fmt.Sprintf("f%05d", i), typ: tar.TypeReg})
	}
	manyPath := filepath.Join(t.TempDir(), "many.tar")
	require.NoError(t, os.WriteFile(manyPath, makeTar(t, many), 0o644))
	_, err = Import(ctx, e.repo, e.images, "x:1", manyPath, nil, WithMaxBytes(1<<20))
	wantRefused(t, err, 1<<20)

	// A directory is measured before it is built.
	dir := makeTree(t)
	_, err = Import(ctx, e.repo, e.images, "x:1", dir, nil, WithMaxBytes(4<<10))
	wantRefused(t, err, 4<<10)

	// Within the limit, each imports; without one, too.
	for _, p := range []string{bomb, manyPath, dir} {
		_, err := Import(ctx, e.repo, e.images, "x:1", p, nil, WithMaxBytes(128<<20))
		require.NoError(t, err, p)
	}
	_, err = Import(ctx, e.repo, e.images, "x:1", bomb, nil)
	require.NoError(t, err)
}
