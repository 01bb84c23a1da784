// Package lazyfs serves layers this node does not hold as read-only files
// on a FUSE mount whose reads fetch the chunks (128 KiB) they need from the
// blob store with range reads, so an EROFS layer can be mounted (file-backed
// EROFS over the FUSE file) and a sandbox started before the layer is here:
// agents read a few per cent of an image.
//
// Every chunk is checked against the layer's chunk index (layer.ChunkIndex,
// stored beside the layer when it entered the store): a range read cannot
// use the whole blob's digest. Chunks go to a bounded node-local cache on
// disk (LRU), shared by all layers since it is keyed by the chunk's digest;
// concurrent readers of one chunk wait for one fetch. The EROFS metadata
// chunks are fetched before the file is handed out, so mounting and path
// lookups do not wait for the store one chunk at a time. A fetch that fails,
// times out (each attempt has a deadline, then a bounded number of retries)
// or brings bytes that do not match is EIO to the reader, never zeros.
//
// The first node to run a layer records which chunks were read, in order,
// and stores that list beside the layer (layer.PrefetchRef); later mounts
// read ahead along it.
//
// Store is what the edge uses instead of blobstore.Cache's whole-layer
// Fetch: layers without an index (stored before indexes existed) and small
// ones are still fetched whole.
package lazyfs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/layer"
)

// Options configure Mount.
type Options struct {
	// Remote is the store the layers and their indexes live in. It must
	// read ranges (blobstore.RangeReader).
	Remote blobstore.Repository
	// Dir holds the chunk cache (Dir/chunks), its temp files and the FUSE
	// mount point (Dir/mnt). It must be this node's own.
	Dir string
	// CacheBytes bounds the chunk cache on disk. Default 8 GiB.
	CacheBytes int64
	// FetchTimeout bounds one range read of a chunk. Default 20 s.
	FetchTimeout time.Duration
	// Attempts is how many times a chunk is tried before readers get EIO.
	// Default 3. A chunk whose bytes do not match is not tried again: the
	// store's content is immutable, so it would not change.
	Attempts int
	// Readahead is how many chunks of a prefetch list are fetched at once.
	// Default 8.
	Readahead int
	// MetaParallel is how many metadata extents are fetched at once when a
	// layer is opened. Default 32: they are small (a few KiB each, a few
	// hundred per image), so the time is the store's latency, not the
	// link's bandwidth.
	MetaParallel int
	// RecordFor is how long after its first read a layer without a
	// prefetch list records which chunks are read, before it stores the
	// list. Default 30 s: a sandbox's start and first commands.
	RecordFor time.Duration
	// Registry, if set, gets the dsec_lazy_* metrics.
	Registry prometheus.Registerer
	Logger   *slog.Logger
}

// FS is the node's lazy layer files: one FUSE mount, one file per layer.
type FS struct {
	opts   Options
	rr     blobstore.RangeReader
	mnt    string
	server *fuse.Server
	root   *fs.Inode
	cache  *chunkCache
	m      *metrics
	ctx    context.Context // cancelled by Close: readahead and recording stop
	stop   context.CancelFunc

	closeOnce sync.Once
	closeErr  error

	mu     sync.Mutex
	layers map[string]*layerFile
	// opening serialises opens of one layer (index, metadata fetch).
	opening map[string]*opening
	nextIno uint64
}

type opening struct {
	done chan struct{}
	l    *layerFile
	err  error
}

// Mount mounts the FUSE file system under opts.Dir/mnt, detaching one a
// dead process left there first. On error nothing stays mounted.
func Mount(opts Options) (*FS, error) {
	rr, ok := opts.Remote.(blobstore.RangeReader)
	if !ok {
		return nil, fail.Errorf(fail.Internal, "lazy layers: store %T reads no ranges", opts.Remote)
	}
	if opts.CacheBytes <= 0 {
		opts.CacheBytes = 8 << 30
	}
	if opts.FetchTimeout <= 0 {
		opts.FetchTimeout = 20 * time.Second
	}
	if opts.Attempts <= 0 {
		opts.Attempts = 3
	}
	if opts.Readahead <= 0 {
		opts.Readahead = 8
	}
	if opts.MetaParallel <= 0 {
		opts.MetaParallel = 32
	}
	if opts.RecordFor <= 0 {
		opts.RecordFor = 30 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	m, err := newMetrics(opts.Registry)
	if err != nil {
		return nil, err
	}
	cache, err := newChunkCache(opts.Dir, opts.CacheBytes, m)
	if err != nil {
		return nil, err
	}
	mnt := filepath.Join(opts.Dir, "mnt")
	// A FUSE mount whose server died answers ENOTCONN; it is only ours.
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err == nil {
		opts.Logger.Info("lazyfs: detached a stale mount", "dir", mnt)
	}
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return nil, fail.New(fail.Internal, fmt.Errorf("lazy layers: %w", err))
	}
	f := &FS{
		opts: opts, rr: rr, mnt: mnt, cache: cache, m: m,
		layers: map[string]*layerFile{}, opening: map[string]*opening{}, nextIno: 2,
	}
	f.ctx, f.stop = context.WithCancel(context.Background())
	root := &rootNode{}
	immutable := time.Hour
	zero := time.Duration(0)
	server, err := fs.Mount(mnt, root, &fs.Options{
		// Layer files never change: attributes and names are cached
		// long; a name looked up before its layer was added must not be
		// remembered as missing.
		EntryTimeout:    &immutable,
		AttrTimeout:     &immutable,
		NegativeTimeout: &zero,
		MountOptions: fuse.MountOptions{
			FsName:            "dsec-lazy",
			Name:              "dsec-lazy",
			DirectMount:       true,
			DirectMountStrict: true,
			// EROFS reads the file in the reader's context (a sandbox's
			// user namespace), not only the daemon's.
			AllowOther:    true,
			DisableXAttrs: true,
			MaxReadAhead:  1 << 20,
			MaxWrite:      1 << 20,
			// A file-backed EROFS mount of a file on a FUSE mount that
			// negotiated passthrough fails with ENOTBLK (DESIGN.md §4).
			DisabledCapabilities: fuse.CAP_PASSTHROUGH,
		},
	})
	if err != nil {
		f.stop()
		os.Remove(mnt)
		return nil, fail.New(fail.Internal, fmt.Errorf("lazy layers: mount FUSE on %s: %w", mnt, err))
	}
	f.server = server
	f.root = &root.Inode
	return f, nil
}

// Dir returns the FUSE mount point: the layer file of digest is
// Dir()/<hex>.
func (f *FS) Dir() string { return f.mnt }

// CachedBytes returns what the chunk cache holds on disk.
func (f *FS) CachedBytes() int64 { return f.cache.Used() }

// Stats are the counters behind the metrics, for tests and benchmarks.
type Stats struct {
	ReadBytes, FetchedBytes, Fetches, Hits, Misses, Failures, Evictions int64
	// FetchTime is the time all range reads took, summed.
	FetchTime time.Duration
}

// Stats returns the counters so far.
func (f *FS) Stats() Stats {
	return Stats{
		ReadBytes: f.m.readBytes.Load(), FetchedBytes: f.m.fetchedBytes.Load(), Fetches: f.m.fetches.Load(),
		Hits: f.m.hits.Load(), Misses: f.m.misses.Load(), Failures: f.m.failures.Load(), Evictions: f.m.evictedN.Load(),
		FetchTime: time.Duration(f.m.fetchNanos.Load()),
	}
}

// Close saves the prefetch lists still being recorded and unmounts. Layer
// files that EROFS mounts still hold keep the FUSE mount busy: it is then
// detached, and their readers get errors.
func (f *FS) Close() error {
	f.closeOnce.Do(func() { f.closeErr = f.close() })
	return f.closeErr
}

func (f *FS) close() error {
	f.mu.Lock()
	ls := make([]*layerFile, 0, len(f.layers))
	for _, l := range f.layers {
		ls = append(ls, l)
	}
	f.mu.Unlock()
	for _, l := range ls {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		l.savePrefetch(ctx)
		cancel()
	}
	f.stop()
	err := f.server.Unmount()
	if err != nil {
		// Busy: an EROFS mount still holds a layer file. Detached, the
		// mount goes once that one is unmounted; meanwhile the server
		// keeps answering (f.ctx is cancelled, so fetches fail: EIO).
		// No Wait: it would last until then.
		if derr := unix.Unmount(f.mnt, unix.MNT_DETACH); derr == nil || errors.Is(derr, unix.EINVAL) {
			err = nil
		}
	}
	os.Remove(f.mnt)
	return err
}

// Open makes the layer digest available as a file on the FUSE mount and
// returns its path: the chunk index is read, the metadata chunks fetched
// (within ctx), and readahead along the prefetch list started. A layer
// with no index gives an error wrapping blobstore.ErrNotFound.
func (f *FS) Open(ctx context.Context, digest string, size int64) (string, error) {
	if err := blobstore.ValidateDigest(digest); err != nil {
		return "", fail.New(fail.InvalidArgument, err)
	}
	name := strings.TrimPrefix(digest, "sha256:")
	path := filepath.Join(f.mnt, name)
	f.mu.Lock()
	if _, ok := f.layers[digest]; ok {
		f.mu.Unlock()
		return path, nil
	}
	op, ok := f.opening[digest]
	if !ok {
		op = &opening{done: make(chan struct{})}
		f.opening[digest] = op
		go func() {
			// On a context of its own: concurrent creates wait for one
			// open, and one that gives up does not fail the others.
			octx, cancel := context.WithTimeout(f.ctx, time.Duration(f.opts.Attempts)*f.opts.FetchTimeout*4)
			op.l, op.err = f.open(octx, digest, size)
			cancel()
			f.mu.Lock()
			delete(f.opening, digest)
			if op.err == nil {
				f.layers[digest] = op.l
			}
			f.mu.Unlock()
			close(op.done)
		}()
	}
	f.mu.Unlock()
	select {
	case <-op.done:
		if op.err != nil {
			return "", op.err
		}
		return path, nil
	case <-ctx.Done():
		return "", fail.New(fail.Canceled, fmt.Errorf("open lazy layer %s: %w", digest, ctx.Err()))
	}
}

func (f *FS) open(ctx context.Context, digest string, size int64) (*layerFile, error) {
	idx, err := layer.LoadChunkIndex(ctx, f.opts.Remote, digest, size)
	if err != nil {
		if errors.Is(err, blobstore.ErrNotFound) {
			return nil, fmt.Errorf("layer %s has no chunk index: %w", digest, err)
		}
		return nil, fail.New(fail.Unavailable, fmt.Errorf("lazy layer %s: %w", digest, err))
	}
	l := &layerFile{fs: f, digest: digest, index: idx, touched: make([]bool, idx.Chunks())}
	prefetch, err := loadPrefetch(ctx, f.opts.Remote, digest, idx.Chunks())
	if err != nil && !errors.Is(err, blobstore.ErrNotFound) {
		f.opts.Logger.Warn("lazyfs: prefetch list unreadable; recording a new one", "layer", digest, "err", err)
	}
	l.recording = prefetch == nil
	// Metadata first: the mount reads the superblock, and every lookup
	// reads inodes and directories; fetched together now (the extents
	// alone, not the chunks around them), not one at a time later.
	if err := f.fetchAll(ctx, f.opts.MetaParallel, len(idx.Meta), func(i int) error {
		_, err := l.meta(ctx, i)
		return err
	}); err != nil {
		return nil, err
	}
	f.mu.Lock()
	ino := f.nextIno
	f.nextIno++
	f.mu.Unlock()
	node := &layerNode{l: l}
	child := f.root.NewPersistentInode(context.Background(), node, fs.StableAttr{Mode: syscall.S_IFREG, Ino: ino})
	f.root.AddChild(strings.TrimPrefix(digest, "sha256:"), child, true)
	if len(prefetch) > 0 {
		go f.fetchAll(f.ctx, f.opts.Readahead, len(prefetch), func(i int) error {
			c := int(prefetch[i])
			if f.cache.has(chunkKey(idx.Sums[c])) {
				return nil
			}
			_, err := l.chunk(f.ctx, c)
			return err
		})
	}
	return l, nil
}

// fetchAll runs item(0..n-1), par at a time, in order, and stops at the
// first error, which it returns.
func (f *FS) fetchAll(ctx context.Context, par, n int, item func(i int) error) error {
	var (
		mu    sync.Mutex
		first error
	)
	failed := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return first != nil
	}
	work := make(chan int)
	var wg sync.WaitGroup
	for range min(par, max(n, 1)) {
		wg.Go(func() {
			for i := range work {
				if failed() {
					continue
				}
				if err := item(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		})
	}
feed:
	for i := range n {
		if failed() {
			break
		}
		select {
		case work <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(work)
	wg.Wait()
	if first != nil {
		return first
	}
	if err := ctx.Err(); err != nil {
		return fail.New(fail.Unavailable, err)
	}
	return nil
}

// fetchRange reads n bytes at off of l from the store and checks them
// against sum, retrying failed reads with a deadline on each attempt.
func (f *FS) fetchRange(l *layerFile, off, n int64, sum chunkKey, what string) ([]byte, error) {
	var last error
	for attempt := range f.opts.Attempts {
		if attempt > 0 {
			select {
			case <-time.After(time.Duration(100<<attempt) * time.Millisecond):
			case <-f.ctx.Done():
				return nil, fail.New(fail.Unavailable, fmt.Errorf("%s of layer %s: %w", what, l.digest, f.ctx.Err()))
			}
		}
		ctx, cancel := context.WithTimeout(f.ctx, f.opts.FetchTimeout)
		start := time.Now()
		data, err := rangeRead(ctx, f.rr, l.digest, off, n)
		cancel()
		f.m.fetchSeconds.Observe(time.Since(start).Seconds())
		f.m.fetchNanos.Add(int64(time.Since(start)))
		f.m.fetches.Add(1)
		if err != nil {
			last = err
			continue
		}
		f.m.fetchedBytes.Add(int64(len(data)))
		if chunkKey(sumOf(data)) != sum {
			f.m.failures.Add(1)
			return nil, fail.New(fail.DataLoss, fmt.Errorf("%s of layer %s: %w", what, l.digest, blobstore.ErrDigestMismatch))
		}
		return data, nil
	}
	f.m.failures.Add(1)
	return nil, fail.New(fail.Unavailable, fmt.Errorf("%s of layer %s: %d attempts: %w", what, l.digest, f.opts.Attempts, last))
}

// layerFile is one layer served lazily.
type layerFile struct {
	fs     *FS
	digest string
	index  *layer.ChunkIndex

	mu        sync.Mutex
	recording bool
	touched   []bool
	order     []uint32
	timer     *time.Timer
	saved     bool
}

// touch records chunk i's first read, while recording.
func (l *layerFile) touch(i int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.recording || l.saved || l.touched[i] {
		return
	}
	l.touched[i] = true
	l.order = append(l.order, uint32(i))
	if l.timer == nil {
		l.timer = time.AfterFunc(l.fs.opts.RecordFor, func() {
			ctx, cancel := context.WithTimeout(l.fs.ctx, time.Minute)
			defer cancel()
			l.savePrefetch(ctx)
		})
	}
}

// chunk returns chunk i of l, fetched once into the cache.
func (l *layerFile) chunk(ctx context.Context, i int) ([]byte, error) {
	off, n := l.index.Extent(i)
	k := chunkKey(l.index.Sums[i])
	return l.fs.cache.get(ctx, k, func() ([]byte, error) {
		return l.fs.fetchRange(l, off, n, k, fmt.Sprintf("chunk %d", i))
	})
}

// meta returns metadata extent i of l, fetched once into the cache.
func (l *layerFile) meta(ctx context.Context, i int) ([]byte, error) {
	e := l.index.Meta[i]
	k := chunkKey(e.Sum)
	b := make([]byte, e.Len)
	if n, ok := l.fs.cache.readCached(k, b, 0); ok && int64(n) == e.Len {
		return b, nil
	}
	return l.fs.cache.get(ctx, k, func() ([]byte, error) {
		return l.fs.fetchRange(l, e.Off, e.Len, k, fmt.Sprintf("metadata extent at %d", e.Off))
	})
}

// metaAt returns the metadata extent holding byte off, or -1.
func (l *layerFile) metaAt(off int64) int {
	m := l.index.Meta
	i := sort.Search(len(m), func(i int) bool { return m[i].Off+m[i].Len > off })
	if i < len(m) && m[i].Off <= off {
		return i
	}
	return -1
}

// read copies the layer's bytes at off into dst: from a metadata extent
// when off is in one, else from its chunk; cached pieces from disk, the
// others fetched. Any piece that cannot be had fails the whole read.
func (l *layerFile) read(ctx context.Context, dst []byte, off int64) (int, error) {
	if off >= l.index.Size {
		return 0, nil
	}
	end := min(off+int64(len(dst)), l.index.Size)
	done := 0
	for pos := off; pos < end; {
		var (
			k        chunkKey
			pieceOff int64
			pieceEnd int64
			fetch    func() ([]byte, error)
		)
		if m := l.metaAt(pos); m >= 0 {
			e := l.index.Meta[m]
			k, pieceOff, pieceEnd = chunkKey(e.Sum), e.Off, e.Off+e.Len
			fetch = func() ([]byte, error) { return l.meta(ctx, m) }
		} else {
			i := int(pos / l.index.ChunkSize)
			coff, clen := l.index.Extent(i)
			k, pieceOff, pieceEnd = chunkKey(l.index.Sums[i]), coff, coff+clen
			l.touch(i)
			fetch = func() ([]byte, error) { return l.chunk(ctx, i) }
		}
		in := pos - pieceOff
		want := min(end, pieceEnd) - pos
		part := dst[done : done+int(want)]
		if n, ok := l.fs.cache.readCached(k, part, in); ok && int64(n) == want {
			l.fs.m.hits.Add(1)
		} else {
			l.fs.m.misses.Add(1)
			data, err := fetch()
			if err != nil {
				return 0, err
			}
			copy(part, data[in:in+want])
		}
		pos += want
		done += int(want)
	}
	l.fs.m.readBytes.Add(int64(done))
	return done, nil
}

// SavePrefetch stores the prefetch list recorded so far for the layer
// digest (normally stored RecordFor after its first read).
func (f *FS) SavePrefetch(ctx context.Context, digest string) error {
	f.mu.Lock()
	l := f.layers[digest]
	f.mu.Unlock()
	if l == nil {
		return fail.Errorf(fail.NotFound, "lazy layer %s is not open", digest)
	}
	return l.savePrefetch(ctx)
}

func (l *layerFile) savePrefetch(ctx context.Context) error {
	l.mu.Lock()
	if !l.recording || l.saved || len(l.order) == 0 {
		l.mu.Unlock()
		return nil
	}
	l.saved = true
	if l.timer != nil {
		l.timer.Stop()
	}
	order := append([]uint32(nil), l.order...)
	l.mu.Unlock()
	if err := storePrefetch(ctx, l.fs.opts.Remote, l.digest, order); err != nil {
		l.fs.opts.Logger.Warn("lazyfs: store prefetch list", "layer", l.digest, "err", err)
		return err
	}
	return nil
}

// rootNode is the mount's directory; its children are added by Open.
type rootNode struct{ fs.Inode }

// layerNode is one layer's file.
type layerNode struct {
	fs.Inode
	l *layerFile
}

var (
	_ fs.NodeGetattrer = (*layerNode)(nil)
	_ fs.NodeOpener    = (*layerNode)(nil)
	_ fs.NodeReader    = (*layerNode)(nil)
)

func (n *layerNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	out.Size = uint64(n.l.index.Size)
	out.Blocks = (out.Size + 511) / 512
	out.Blksize = uint32(n.l.index.ChunkSize)
	return 0
}

func (n *layerNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&syscall.O_ACCMODE != syscall.O_RDONLY {
		return nil, 0, syscall.EROFS
	}
	// The bytes never change: the kernel may keep its page cache across
	// opens, so a second mount reads nothing from here.
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *layerNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	got, err := n.l.read(ctx, dest, off)
	if err != nil {
		// Fail closed: the kernel gets EIO, never a short or zeroed read.
		n.l.fs.opts.Logger.Warn("lazyfs: read failed", "layer", n.l.digest, "off", off, "len", len(dest), "err", err)
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:got]), 0
}

// counter is an atomic count that a Prometheus CounterFunc reads.
type counter struct{ atomic.Int64 }

func (c *counter) Inc() { c.Add(1) }

// opened returns the file of a layer already open.
func (f *FS) opened(digest string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.layers[digest]; !ok {
		return "", false
	}
	return filepath.Join(f.mnt, strings.TrimPrefix(digest, "sha256:")), true
}

// OpenLayers returns the digests of the layers open, sorted.
func (f *FS) OpenLayers() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.layers))
	for d := range f.layers {
		out = append(out, d)
	}
	sort.Strings(out)
	return out
}
