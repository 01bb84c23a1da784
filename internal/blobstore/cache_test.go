package blobstore_test

import (
	"bytes"
	"context"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/blobstoretest"
)

// TestCacheConformance runs the suite on a Cache over a dir store standing
// for the remote one (s3store runs it over S3).
func TestCacheConformance(t *testing.T) {
	blobstoretest.Run(t, func(t *testing.T) blobstore.Store {
		return blobstore.NewCache(newDir(t), newDir(t))
	})
}

// gated is a remote store whose Opens count and, while gate is set, block
// until gate closes or their context ends (a store that hangs).
type gated struct {
	*blobstore.Dir
	opens     atomic.Int64
	gate      chan struct{}
	cancelled chan struct{}
}

func (g *gated) Open(ctx context.Context, digest string) (io.ReadCloser, error) {
	g.opens.Add(1)
	if g.gate != nil {
		select {
		case <-g.gate:
		case <-ctx.Done():
			close(g.cancelled)
			return nil, ctx.Err()
		}
	}
	return g.Dir.Open(ctx, digest)
}

// TestCacheFetchOnce: concurrent fetches of one blob share one download.
func TestCacheFetchOnce(t *testing.T) {
	remote := &gated{Dir: newDir(t), gate: make(chan struct{})}
	ctx := context.Background()
	d, err := remote.Put(ctx, bytes.NewReader([]byte("one download")))
	require.NoError(t, err)
	c := blobstore.NewCache(remote, newDir(t))
	const n = 8
	var wg sync.WaitGroup
	paths := make([]string, n)
	errs := make([]error, n)
	var started sync.WaitGroup
	started.Add(n)
	for i := range n {
		wg.Go(func() {
			started.Done()
			paths[i], errs[i] = c.Fetch(ctx, d.Digest)
		})
	}
	started.Wait()
	close(remote.gate)
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		assert.Equal(t, paths[0], paths[i])
	}
	assert.Equal(t, int64(1), remote.opens.Load(), "downloads of one blob")
	// Once cached, no more downloads.
	before := remote.opens.Load()
	_, err = c.Fetch(ctx, d.Digest)
	require.NoError(t, err)
	assert.Equal(t, before, remote.opens.Load())
}

// TestCacheFetchHung: a fetch from a store that hangs ends with its
// caller's context, and the download is cancelled once nobody waits for
// it; a later fetch starts afresh and succeeds when the store answers.
func TestCacheFetchHung(t *testing.T) {
	remote := &gated{Dir: newDir(t), gate: make(chan struct{}), cancelled: make(chan struct{})}
	d, err := remote.Put(context.Background(), bytes.NewReader([]byte("slow")))
	require.NoError(t, err)
	local := newDir(t)
	c := blobstore.NewCache(remote, local)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() {
		_, err := c.Fetch(ctx, d.Digest)
		done <- err
	}()
	// Wait until the download is under way, then give up.
	for remote.opens.Load() == 0 {
		select {
		case err := <-done:
			t.Fatalf("fetch ended before the store answered: %v", err)
		default:
		}
		runtime.Gosched()
	}
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	<-remote.cancelled // the download saw its context end: nothing is left hanging
	assert.Empty(t, blobstoretest.WalkAll(t, local))

	remote.gate = nil
	p, err := c.Fetch(context.Background(), d.Digest)
	require.NoError(t, err)
	assert.FileExists(t, p)
}
