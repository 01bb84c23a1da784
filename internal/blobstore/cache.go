package blobstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// Cache is a Repository whose blobs and refs live in a remote store (an
// s3store) and whose blobs this node uses are also kept, whole, in a local
// Dir: the edge mounts layers from files (Local), and the server and the
// layer builders write into a local temp dir (Ingester). The remote store
// is the truth: Stat, Walk, refs and batches go to it, so a blob a node
// still holds after the store deleted it is never reported as stored.
// Content is immutable, so reading a blob from the local copy when there is
// one (Open, OpenRange) gives the same bytes the store would.
//
// The local copy is not bounded yet: a layer fetched once stays until the
// node's data directory is cleared. The lazy loader (chunks on demand, an
// LRU-bounded cache) replaces whole-blob fetches for layers.
type Cache struct {
	remote Repository
	local  *Dir

	mu       sync.Mutex
	inflight map[string]*fetch
}

// fetch is one download of a blob that every Fetch of it waits for.
type fetch struct {
	done chan struct{}
	path string
	err  error
	// waiters is how many Fetch calls wait (under Cache.mu); when the
	// last gives up, cancel stops the download, so a hung store holds
	// nothing once nobody wants the blob.
	waiters int
	cancel  context.CancelFunc
}

var (
	_ Repository  = (*Cache)(nil)
	_ Local       = (*Cache)(nil)
	_ Fetcher     = (*Cache)(nil)
	_ Ingester    = (*Cache)(nil)
	_ BatchWriter = (*Cache)(nil)
	_ RangeReader = (*Cache)(nil)
	_ Ager        = (*Cache)(nil)
)

// NewCache keeps remote's blobs this node uses in local. local must belong
// to this node (not be shared), since its files are the node's copies.
func NewCache(remote Repository, local *Dir) *Cache {
	return &Cache{remote: remote, local: local, inflight: map[string]*fetch{}}
}

// Remote returns the store behind the cache.
func (c *Cache) Remote() Repository { return c.remote }

// Put stores r's bytes in the remote store only: blobs written through
// Put (manifests, trajectories) are rarely read back on the same node.
func (c *Cache) Put(ctx context.Context, r io.Reader) (Descriptor, error) {
	return c.remote.Put(ctx, r)
}

// Open reads the local copy when there is one, else the remote blob;
// either way verified at EOF.
func (c *Cache) Open(ctx context.Context, digest string) (io.ReadCloser, error) {
	if rc, err := c.local.Open(ctx, digest); err == nil {
		return rc, nil
	}
	return c.remote.Open(ctx, digest)
}

// Stat asks the remote store.
func (c *Cache) Stat(ctx context.Context, digest string) (Descriptor, error) {
	return c.remote.Stat(ctx, digest)
}

// Delete deletes the blob from the remote store and the local copy.
func (c *Cache) Delete(ctx context.Context, digest string) error {
	err := c.remote.Delete(ctx, digest)
	if lerr := c.local.Delete(ctx, digest); lerr != nil && !errors.Is(lerr, ErrNotFound) && err == nil {
		err = lerr
	}
	return err
}

// Walk lists the remote store's blobs.
func (c *Cache) Walk(ctx context.Context, fn func(Descriptor) error) error {
	return c.remote.Walk(ctx, fn)
}

// Refs are the remote store's.
func (c *Cache) Refs() Refs { return c.remote.Refs() }

// WriteBatch writes the batch to the remote store, with its own
// BatchWriter when it has one.
func (c *Cache) WriteBatch(ctx context.Context, b Batch) error {
	return WriteBatch(ctx, c.remote, b)
}

// BlobTime is the remote store's (see Ager); without one, the blob's
// existence is checked and its age is unknown.
func (c *Cache) BlobTime(ctx context.Context, digest string) (time.Time, error) {
	if a, ok := c.remote.(Ager); ok {
		return a.BlobTime(ctx, digest)
	}
	return time.Time{}, fmt.Errorf("blob store %T cannot tell how old blob %s is", c.remote, digest)
}

// OpenRange reads the local copy when there is one, else the remote store's
// range.
func (c *Cache) OpenRange(ctx context.Context, digest string, off, n int64) (io.ReadCloser, error) {
	if rc, err := c.local.OpenRange(ctx, digest, off, n); err == nil {
		return rc, nil
	}
	rr, ok := c.remote.(RangeReader)
	if !ok {
		return nil, fmt.Errorf("blob %s: store %T reads no ranges", digest, c.remote)
	}
	return rr.OpenRange(ctx, digest, off, n)
}

// TempDir is the local store's: files built there are ingested into both.
func (c *Cache) TempDir() string { return c.local.TempDir() }

// Ingest uploads the file to the remote store and then moves it into the
// local one: a layer built on this node (a snapshot's) is about to be
// mounted here.
func (c *Cache) Ingest(ctx context.Context, path string) (Descriptor, error) {
	var desc Descriptor
	var err error
	if up, ok := c.remote.(Uploader); ok {
		desc, err = up.Upload(ctx, path)
	} else {
		desc, err = PutFile(ctx, c.remote, path)
	}
	if err != nil {
		os.Remove(path)
		return Descriptor{}, err
	}
	local, err := c.local.Ingest(ctx, path)
	if err != nil {
		// Stored remotely all the same; the node fetches it when needed.
		return desc, nil
	}
	if local != desc {
		// The file changed between the upload and the move: keep neither
		// claim about it on this node.
		c.local.Delete(ctx, local.Digest)
		return Descriptor{}, fmt.Errorf("ingest %s: file changed while it was stored (%s, then %s)", path, desc.Digest, local.Digest)
	}
	return desc, nil
}

// Cached returns the node's whole copy of the blob, without fetching;
// ErrNotFound when there is none (the lazy loader serves such layers in
// chunks).
func (c *Cache) Cached(digest string) (string, error) { return c.local.Path(digest) }

// Path returns the blob's local file, fetching it first with no deadline
// (Fetch takes a context).
func (c *Cache) Path(digest string) (string, error) {
	return c.Fetch(context.Background(), digest)
}

// Fetch returns the blob's local file, copying it from the remote store
// first when this node has none. Concurrent fetches of one blob share one
// download. The copy is verified against the digest before it is placed,
// so a file the cache returns is always whole and correct.
func (c *Cache) Fetch(ctx context.Context, digest string) (string, error) {
	if p, err := c.local.Path(digest); err == nil {
		return p, nil
	} else if !errors.Is(err, ErrNotFound) {
		return "", err
	}
	c.mu.Lock()
	f, ok := c.inflight[digest]
	if !ok {
		// Again under the lock: a download that finished since the
		// check above placed the file before it left inflight.
		if p, err := c.local.Path(digest); err == nil {
			c.mu.Unlock()
			return p, nil
		}
		// The download belongs to no one caller: one that gives up must
		// not fail the others waiting for it, so it runs on its own
		// context, cancelled when the last waiter is gone.
		dctx, cancel := context.WithCancel(context.Background())
		f = &fetch{done: make(chan struct{}), cancel: cancel}
		c.inflight[digest] = f
		go c.download(dctx, digest, f)
	}
	f.waiters++
	c.mu.Unlock()
	select {
	case <-f.done:
		return f.path, f.err
	case <-ctx.Done():
		c.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			f.cancel()
			// A later Fetch starts a download of its own rather than
			// join this cancelled one.
			if c.inflight[digest] == f {
				delete(c.inflight, digest)
			}
		}
		c.mu.Unlock()
		return "", ctx.Err()
	}
}

// download copies a blob from the remote store into the local one.
func (c *Cache) download(ctx context.Context, digest string, f *fetch) {
	defer func() {
		c.mu.Lock()
		if c.inflight[digest] == f {
			delete(c.inflight, digest)
		}
		c.mu.Unlock()
		f.cancel()
		close(f.done)
	}()
	rc, err := c.remote.Open(ctx, digest)
	if err != nil {
		f.err = err
		return
	}
	defer rc.Close()
	// The verifying reader fails the copy at EOF if the bytes are wrong,
	// and Put then places nothing.
	desc, err := c.local.Put(ctx, rc)
	if err != nil {
		f.err = fmt.Errorf("fetch blob %s: %w", digest, err)
		return
	}
	if desc.Digest != digest {
		c.local.Delete(ctx, desc.Digest)
		f.err = fmt.Errorf("fetch blob %s: got %s: %w", digest, desc.Digest, ErrDigestMismatch)
		return
	}
	f.path, f.err = c.local.Path(digest)
}
