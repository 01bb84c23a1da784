package layer

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// smallLayer builds a one-file layer and returns its descriptor and file.
func smallLayer(t testing.TB, repo *blobstore.Dir, content string) (blobstore.Descriptor, string) {
	t.Helper()
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), []byte(content), 0o644))
	d, err := Build(context.Background(), repo, src)
	require.NoError(t, err)
	p, err := repo.Path(d.Digest)
	require.NoError(t, err)
	return d, p
}

func countMounts(t testing.TB, dir string) int {
	t.Helper()
	points, err := mountPointsUnder(filepath.Dir(dir))
	require.NoError(t, err)
	n := 0
	for _, p := range points {
		if p == dir {
			n++
		}
	}
	return n
}

func TestMountsRefcount(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	d, file := smallLayer(t, e.repo, "hello")

	dir1, err := e.mounts.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	dir2, err := e.mounts.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	assert.Equal(t, dir1, dir2)
	assert.Equal(t, filepath.Join(e.mounts.Root(), strings.TrimPrefix(d.Digest, "sha256:")), dir1)
	assert.Equal(t, 1, countMounts(t, dir1), "mounted once")
	assert.Equal(t, 2, e.mounts.Refs(d.Digest))
	b, err := os.ReadFile(filepath.Join(dir1, "f"))
	require.NoError(t, err)
	assert.Equal(t, "hello", string(b))
	assert.Error(t, os.WriteFile(filepath.Join(dir1, "g"), nil, 0o644), "read-only")

	require.NoError(t, e.mounts.Release(d.Digest))
	assert.Equal(t, 1, countMounts(t, dir1), "still held once")
	require.NoError(t, e.mounts.Release(d.Digest))
	assert.Equal(t, 0, countMounts(t, dir1))
	assert.NoDirExists(t, dir1)
	assert.ErrorContains(t, e.mounts.Release(d.Digest), "not acquired")

	// Mountable again after the last release.
	dir3, err := e.mounts.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	assert.Equal(t, 1, countMounts(t, dir3))
	require.NoError(t, e.mounts.Release(d.Digest))
	assert.Equal(t, 0, countMounts(t, dir3))
}

func TestMountsConcurrent(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	type lay struct{ d, file string }
	var layers []lay
	for _, c := range []string{"a", "b", "c"} {
		d, f := smallLayer(t, e.repo, c)
		layers = append(layers, lay{d.Digest, f})
	}
	const perLayer = 8
	var wg sync.WaitGroup
	errs := make(chan error, 2*perLayer*len(layers))
	for round := 0; round < 2; round++ {
		for _, l := range layers {
			for range perLayer {
				wg.Go(func() {
					if _, err := e.mounts.Acquire(ctx, l.d, l.file); err != nil {
						errs <- err
						return
					}
					if round == 1 {
						errs <- e.mounts.Release(l.d)
					}
				})
			}
		}
		wg.Wait()
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, l := range layers {
		dir := filepath.Join(e.mounts.Root(), strings.TrimPrefix(l.d, "sha256:"))
		assert.Equal(t, 1, countMounts(t, dir), "one mount however many holders")
		assert.Equal(t, perLayer, e.mounts.Refs(l.d))
		for range perLayer {
			require.NoError(t, e.mounts.Release(l.d))
		}
		assert.Equal(t, 0, countMounts(t, dir))
		assert.NoDirExists(t, dir)
	}
}

func TestMountsErrors(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	_, err := e.mounts.Acquire(ctx, "sha256:nothex", "/dev/null")
	assert.ErrorIs(t, err, blobstore.ErrInvalidDigest)

	notErofs := filepath.Join(t.TempDir(), "junk")
	require.NoError(t, os.WriteFile(notErofs, make([]byte, 8192), 0o644))
	digest := blobstore.Digest([]byte("junk"))
	_, err = e.mounts.Acquire(ctx, digest, notErofs)
	assert.ErrorContains(t, err, notErofs)
	assert.NoDirExists(t, filepath.Join(e.mounts.Root(), strings.TrimPrefix(digest, "sha256:")), "no directory left by a failed mount")

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	d, file := smallLayer(t, e.repo, "x")
	// Hold the entry's lock so Acquire has to wait, then cancel.
	_, err = e.mounts.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	e.mounts.mu.Lock()
	entry := e.mounts.entries[d.Digest]
	e.mounts.mu.Unlock()
	entry.lock <- struct{}{}
	_, err = e.mounts.Acquire(cancelled, d.Digest, file)
	<-entry.lock
	assert.ErrorIs(t, err, context.Canceled)
	require.NoError(t, e.mounts.Release(d.Digest))
}

func TestNewMountsCleansUpAfterCrash(t *testing.T) {
	testutil.RequireRoot(t)
	repo, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	root := filepath.Join(t.TempDir(), "layers")
	crashed, err := NewMounts(root)
	require.NoError(t, err)
	d, file := smallLayer(t, repo, "stale")
	dir, err := crashed.Acquire(context.Background(), d.Digest, file)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unmountDir(dir) })
	// Simulate a crash: the process forgets, the mount stays.
	require.Equal(t, 1, countMounts(t, dir))

	fresh, err := NewMounts(root)
	require.NoError(t, err)
	t.Cleanup(func() { fresh.Close() })
	assert.Equal(t, 0, countMounts(t, dir))
	assert.NoDirExists(t, dir)
	dir2, err := fresh.Acquire(context.Background(), d.Digest, file)
	require.NoError(t, err)
	assert.Equal(t, dir, dir2)
	require.NoError(t, fresh.Release(d.Digest))
}

func TestUnescapeMountinfo(t *testing.T) {
	assert.Equal(t, "/a b\tc\\d", unescapeMountinfo(`/a\040b\011c\134d`))
	assert.Equal(t, `/plain\x`, unescapeMountinfo(`/plain\x`))
}

// BenchmarkAcquireRelease measures mounting and unmounting one layer from
// cold (no holder), the cost a sandbox create pays for a layer not yet used
// on the node.
func BenchmarkAcquireRelease(b *testing.B) {
	testutil.RequireRoot(b)
	repo, err := blobstore.NewDir(b.TempDir())
	require.NoError(b, err)
	m, err := NewMounts(filepath.Join(b.TempDir(), "layers"))
	require.NoError(b, err)
	b.Cleanup(func() { m.Close() })
	d, file := smallLayer(b, repo, "bench")
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		if _, err := m.Acquire(ctx, d.Digest, file); err != nil {
			b.Fatal(err)
		}
		if err := m.Release(d.Digest); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAcquireHeld measures Acquire+Release of a layer that stays
// mounted (another sandbox holds it): the common, shared case.
func BenchmarkAcquireHeld(b *testing.B) {
	testutil.RequireRoot(b)
	repo, err := blobstore.NewDir(b.TempDir())
	require.NoError(b, err)
	m, err := NewMounts(filepath.Join(b.TempDir(), "layers"))
	require.NoError(b, err)
	b.Cleanup(func() { m.Close() })
	d, file := smallLayer(b, repo, "bench")
	ctx := context.Background()
	_, err = m.Acquire(ctx, d.Digest, file)
	require.NoError(b, err)
	b.Cleanup(func() { m.Release(d.Digest) })
	b.ResetTimer()
	for b.Loop() {
		if _, err := m.Acquire(ctx, d.Digest, file); err != nil {
			b.Fatal(err)
		}
		if err := m.Release(d.Digest); err != nil {
			b.Fatal(err)
		}
	}
}

func TestMountsLinger(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	d, file := smallLayer(t, e.repo, "hello")

	// Long linger: the last release keeps the mount, a new acquire reuses
	// it, Close unmounts what nobody holds.
	m, err := NewMounts(t.TempDir(), WithLinger(time.Hour))
	require.NoError(t, err)
	dir, err := m.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	require.NoError(t, m.Release(d.Digest))
	assert.Equal(t, 1, countMounts(t, dir), "lingers after the last release")
	assert.Equal(t, 0, m.Refs(d.Digest))
	_, err = m.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	assert.Equal(t, 1, countMounts(t, dir), "reacquired without a second mount")
	require.NoError(t, m.Close())
	assert.Equal(t, 1, countMounts(t, dir), "Close keeps held layers")
	require.NoError(t, m.Release(d.Digest))
	require.NoError(t, m.Close())
	assert.Equal(t, 0, countMounts(t, dir))
	assert.NoDirExists(t, dir)

	// Short linger: the mount goes by itself.
	m, err = NewMounts(t.TempDir(), WithLinger(time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { m.Close() })
	dir, err = m.Acquire(ctx, d.Digest, file)
	require.NoError(t, err)
	require.NoError(t, m.Release(d.Digest))
	require.Eventually(t, func() bool { return countMounts(t, dir) == 0 }, 10*time.Second, 5*time.Millisecond)
}
