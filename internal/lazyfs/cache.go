package lazyfs

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/fail"
)

// chunkKey is a chunk's sha256: the cache is content addressed, so chunks
// shared by layers (runs of zeros, files two layers both hold) are stored
// once, and a cached chunk is right for any layer whose index names it.
type chunkKey [sha256.Size]byte

// chunkCache is the node's bounded chunk cache: one file per chunk under
// dir, evicted least recently used first once their sizes pass max.
type chunkCache struct {
	dir string
	tmp string
	max int64
	m   *metrics

	mu       sync.Mutex
	lru      *list.List // of *cached, most recent at the front
	byKey    map[chunkKey]*list.Element
	used     int64
	inflight map[chunkKey]*call
}

type cached struct {
	key  chunkKey
	size int64
	// verified is false for pieces a previous process left: the first
	// read hashes the file before trusting it (a crash or a disk can have
	// damaged it since), and a piece that does not match is fetched again.
	verified bool
}

// call is one fetch of a chunk that every reader of it waits for.
type call struct {
	done chan struct{}
	data []byte
	err  error
}

func newChunkCache(dir string, max int64, m *metrics) (*chunkCache, error) {
	c := &chunkCache{
		dir: filepath.Join(dir, "chunks"), tmp: filepath.Join(dir, "tmp"), max: max, m: m,
		lru: list.New(), byKey: map[chunkKey]*list.Element{}, inflight: map[chunkKey]*call{},
	}
	for _, d := range []string{c.dir, c.tmp} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fail.New(fail.Internal, fmt.Errorf("chunk cache: %w", err))
		}
	}
	// Leftovers of writes a dead process did not finish.
	if ents, err := os.ReadDir(c.tmp); err == nil {
		for _, e := range ents {
			os.Remove(filepath.Join(c.tmp, e.Name()))
		}
	}
	// Chunks a previous run cached stay usable, checked again on their
	// first read (see cached.verified). Oldest first into the LRU, by
	// modification time (touched on every hit would cost a syscall per
	// read; placement order is a fair guess).
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return nil, fail.New(fail.Internal, fmt.Errorf("chunk cache: %w", err))
	}
	type old struct {
		key  chunkKey
		size int64
		t    time.Time
	}
	var olds []old
	for _, e := range ents {
		b, err := hex.DecodeString(e.Name())
		info, ierr := e.Info()
		if err != nil || len(b) != sha256.Size || ierr != nil {
			os.Remove(filepath.Join(c.dir, e.Name()))
			continue
		}
		var k chunkKey
		copy(k[:], b)
		olds = append(olds, old{k, info.Size(), info.ModTime()})
	}
	sort.Slice(olds, func(i, j int) bool { return olds[i].t.Before(olds[j].t) })
	for _, o := range olds {
		c.byKey[o.key] = c.lru.PushFront(&cached{key: o.key, size: o.size})
		c.used += o.size
	}
	c.evictLocked()
	return c, nil
}

func (c *chunkCache) path(k chunkKey) string { return filepath.Join(c.dir, hex.EncodeToString(k[:])) }

// readCached copies the cached chunk k, from offset off in it, into dst;
// false when it is not cached (or was evicted meanwhile).
func (c *chunkCache) readCached(k chunkKey, dst []byte, off int64) (int, bool) {
	c.mu.Lock()
	e, ok := c.byKey[k]
	verified := false
	if ok {
		c.lru.MoveToFront(e)
		verified = e.Value.(*cached).verified
	}
	c.mu.Unlock()
	if !ok {
		return 0, false
	}
	f, err := os.Open(c.path(k))
	if err != nil {
		return 0, false // evicted between the lookup and the open
	}
	defer f.Close()
	if !verified && !c.verify(k, f) {
		return 0, false
	}
	n, err := f.ReadAt(dst, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, false
	}
	return n, true
}

// verify hashes a piece a previous process cached; one that does not match
// its name is dropped, so that the caller fetches it again.
func (c *chunkCache) verify(k chunkKey, f *os.File) bool {
	h := sha256.New()
	if _, err := io.Copy(h, f); err == nil && chunkKey(h.Sum(nil)) == k {
		c.mu.Lock()
		if e, ok := c.byKey[k]; ok {
			e.Value.(*cached).verified = true
		}
		c.mu.Unlock()
		return true
	}
	c.mu.Lock()
	if e, ok := c.byKey[k]; ok {
		c.lru.Remove(e)
		delete(c.byKey, k)
		c.used -= e.Value.(*cached).size
		os.Remove(c.path(k))
	}
	c.mu.Unlock()
	return false
}

// has reports whether chunk k is cached.
func (c *chunkCache) has(k chunkKey) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.byKey[k]
	return ok
}

// get returns the piece k (a chunk or a metadata extent), fetching it
// with fetch once however many callers ask at the same time. The fetch
// runs on its own goroutine (bounded by the fetcher's deadlines and
// retries), so one reader that gives up does not fail the others; ctx
// bounds only this caller's wait.
func (c *chunkCache) get(ctx context.Context, k chunkKey, fetch func() ([]byte, error)) ([]byte, error) {
	c.mu.Lock()
	cl, ok := c.inflight[k]
	if !ok {
		cl = &call{done: make(chan struct{})}
		c.inflight[k] = cl
		go func() {
			cl.data, cl.err = fetch()
			if cl.err == nil {
				cl.err = c.place(k, cl.data)
			}
			c.mu.Lock()
			delete(c.inflight, k)
			c.mu.Unlock()
			close(cl.done)
		}()
	}
	c.mu.Unlock()
	select {
	case <-cl.done:
		return cl.data, cl.err
	case <-ctx.Done():
		return nil, fail.New(fail.Canceled, ctx.Err())
	}
}

// place writes a verified chunk into the cache and evicts past the bound.
// A chunk that cannot be written is still returned to its readers (err
// nil): the cache is an optimisation, the bytes are right.
func (c *chunkCache) place(k chunkKey, data []byte) error {
	f, err := os.CreateTemp(c.tmp, "chunk-*")
	if err != nil {
		return nil
	}
	_, werr := f.Write(data)
	cerr := f.Close()
	if werr != nil || cerr != nil || os.Rename(f.Name(), c.path(k)) != nil {
		os.Remove(f.Name())
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.byKey[k]; !ok {
		c.byKey[k] = c.lru.PushFront(&cached{key: k, size: int64(len(data)), verified: true})
		c.used += int64(len(data))
	}
	c.evictLocked()
	return nil
}

// evictLocked removes least recently used chunks until the cache fits its
// bound. A reader that opened an evicted chunk's file keeps reading it
// (the inode lives until closed); one that had not yet fetches it again.
func (c *chunkCache) evictLocked() {
	for c.used > c.max && c.lru.Len() > 0 {
		e := c.lru.Back()
		ch := e.Value.(*cached)
		c.lru.Remove(e)
		delete(c.byKey, ch.key)
		c.used -= ch.size
		os.Remove(c.path(ch.key))
		c.m.evictions.Inc()
	}
	c.m.cacheBytes.Set(float64(c.used))
}

// Used returns the bytes the cache holds.
func (c *chunkCache) Used() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used
}

// rangeRead is the store side of a fetch, for fetchChunk.
func rangeRead(ctx context.Context, rr blobstore.RangeReader, digest string, off, n int64) ([]byte, error) {
	rc, err := rr.OpenRange(ctx, digest, off, n)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	buf := make([]byte, n)
	if _, err := io.ReadFull(blobstore.ContextReader(ctx, rc), buf); err != nil {
		return nil, err
	}
	return buf, nil
}
