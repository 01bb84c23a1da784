package lazyfs

import (
	"context"
	"errors"
	"fmt"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/fail"
)

// DefaultMinLazyBytes is the size under which a layer is fetched whole:
// a few range reads cost more than one small download, and the chunk
// index would save little.
const DefaultMinLazyBytes = 8 << 20

// Store is a blobstore.Cache whose layer files (Fetch, Path: what the edge
// mounts) are lazy files on FS for layers this node does not hold whole.
// Everything else (refs, Put, Ingest, batches) is the Cache's.
type Store struct {
	*blobstore.Cache
	fs       *FS
	minBytes int64
}

var (
	_ blobstore.Repository = (*Store)(nil)
	_ blobstore.Local      = (*Store)(nil)
	_ blobstore.Fetcher    = (*Store)(nil)
	_ blobstore.Ingester   = (*Store)(nil)
)

// NewStore serves cache's layers through fs; layers under minBytes (0:
// DefaultMinLazyBytes) are fetched whole.
func NewStore(cache *blobstore.Cache, fs *FS, minBytes int64) *Store {
	if minBytes <= 0 {
		minBytes = DefaultMinLazyBytes
	}
	return &Store{Cache: cache, fs: fs, minBytes: minBytes}
}

// FS returns the lazy file system.
func (s *Store) FS() *FS { return s.fs }

// Path is Fetch with no deadline.
func (s *Store) Path(digest string) (string, error) { return s.Fetch(context.Background(), digest) }

// Fetch returns a file holding the blob: the node's whole copy when it has
// one (a layer built here), the lazy file when the layer is big enough and
// has a chunk index, else the whole blob fetched into the cache. The answer
// for a layer already open lazily asks the store nothing.
func (s *Store) Fetch(ctx context.Context, digest string) (string, error) {
	if p, err := s.Cache.Cached(digest); err == nil {
		return p, nil
	}
	if p, ok := s.fs.opened(digest); ok {
		return p, nil
	}
	desc, err := s.Cache.Stat(ctx, digest)
	if err != nil {
		return "", err
	}
	if desc.Size < s.minBytes {
		return s.Cache.Fetch(ctx, digest)
	}
	p, err := s.fs.Open(ctx, digest, desc.Size)
	if errors.Is(err, blobstore.ErrNotFound) {
		// Stored before chunk indexes existed: whole, as before.
		return s.Cache.Fetch(ctx, digest)
	}
	if err != nil {
		if fail.KindOf(err) == fail.Unknown {
			err = fail.New(fail.Unavailable, err)
		}
		return "", fmt.Errorf("lazy layer %s: %w", digest, err)
	}
	return p, nil
}

// CachedLayers returns the layers open lazily on this node: their metadata
// and the chunks read so far are in the node's cache (edge heartbeats
// report them, for placement).
func (s *Store) CachedLayers() []string { return s.fs.OpenLayers() }
