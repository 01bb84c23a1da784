package lazyfs_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/s3store"
	"github.com/dsec-dev/dsec/internal/blobstore/s3test"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/lazyfs"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// One SeaweedFS server for the package; a prefix per test keeps tests
// apart.
var (
	srvOnce sync.Once
	srv     *s3test.Server
	srvErr  error
)

func server(t testing.TB) *s3test.Server {
	t.Helper()
	s3test.Need(t)
	srvOnce.Do(func() {
		dir, err := os.MkdirTemp("", "lazyfs-test-")
		if err != nil {
			srvErr = err
			return
		}
		srv, srvErr = s3test.StartIn(dir)
	})
	require.NoError(t, srvErr)
	return srv
}

func TestMain(m *testing.M) {
	code := m.Run()
	if srv != nil {
		srv.Stop()
		os.RemoveAll(srv.Dir)
	}
	os.Exit(code)
}

// proxy is a TCP relay in front of the server that a test can make hang
// (connections accepted, nothing answered) or refuse, to stand for a
// store that stops answering.
type proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	mode   string // "pass", "hang", "refuse"
	conns  []net.Conn
}

func newProxy(t testing.TB, target string) *proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, target: target, mode: "pass"}
	go p.serve()
	t.Cleanup(func() { ln.Close(); p.set("refuse") })
	return p
}

func (p *proxy) addr() string { return "http://" + p.ln.Addr().String() }

// set changes the mode; leaving "pass" cuts the connections open now, so
// that kept-alive ones do not bypass the change.
func (p *proxy) set(mode string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = mode
	if mode != "pass" {
		for _, c := range p.conns {
			c.Close()
		}
		p.conns = nil
	}
}

func (p *proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		mode := p.mode
		p.conns = append(p.conns, c)
		p.mu.Unlock()
		switch mode {
		case "refuse":
			c.Close()
		case "hang":
			go io.Copy(io.Discard, c) // read the request, answer nothing
		default:
			go func() {
				u, err := net.Dial("tcp", p.target)
				if err != nil {
					c.Close()
					return
				}
				p.mu.Lock()
				p.conns = append(p.conns, u)
				p.mu.Unlock()
				go func() { io.Copy(u, c); u.Close() }()
				io.Copy(c, u)
				c.Close()
			}()
		}
	}
}

// countingTransport counts the range reads sent to the store.
type countingTransport struct {
	ranges atomic.Int64
	all    atomic.Int64
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.all.Add(1)
	if r.Header.Get("Range") != "" {
		c.ranges.Add(1)
	}
	return http.DefaultTransport.RoundTrip(r)
}

type env struct {
	t      *testing.T
	srv    *s3test.Server
	prefix string
	proxy  *proxy
	remote *s3store.Store // through the proxy
	count  *countingTransport
	node   string // the node's data dir
	mounts *layer.Mounts
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testutil.RequireRoot(t)
	s := server(t)
	e := &env{t: t, srv: s, prefix: s3test.NewPrefix(), count: &countingTransport{}, node: t.TempDir()}
	e.proxy = newProxy(t, strings.TrimPrefix(s.Endpoint, "http://"))
	var err error
	e.remote, err = s3store.Open(context.Background(), s3store.Config{
		Bucket: s.Bucket, Prefix: e.prefix, Endpoint: e.proxy.addr(),
		AccessKey: s.AccessKey, SecretKey: s.SecretKey, TempDir: t.TempDir(),
		Transport: e.count, MaxRetries: 1,
	})
	require.NoError(t, err)
	e.mounts, err = layer.NewMounts(filepath.Join(e.node, "layers"))
	require.NoError(t, err)
	t.Cleanup(func() { e.mounts.Close() })
	return e
}

// node starts a node's lazy store on dir (a restarted node reuses its dir).
func (e *env) lazy(dir string, opts lazyfs.Options) *lazyfs.Store {
	e.t.Helper()
	opts.Remote = e.remote
	opts.Dir = filepath.Join(dir, "lazy")
	if opts.FetchTimeout == 0 {
		opts.FetchTimeout = 5 * time.Second
	}
	f, err := lazyfs.Mount(opts)
	require.NoError(e.t, err)
	e.t.Cleanup(func() {
		require.NoError(e.t, f.Close())
		requireNotMounted(e.t, f.Dir())
	})
	local, err := blobstore.NewDir(filepath.Join(dir, "blobcache"))
	require.NoError(e.t, err)
	return lazyfs.NewStore(blobstore.NewCache(e.remote, local), f, 2<<20)
}

func requireNotMounted(t testing.TB, dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	require.NotContains(t, string(b), " "+dir+" ", "still mounted")
}

// tree writes a source tree: files of random data big and small in a few
// directories, so that the layer has many data chunks and little metadata.
func tree(t *testing.T) string {
	dir := t.TempDir()
	for i := range 8 {
		sub := filepath.Join(dir, fmt.Sprintf("d%d", i%3), fmt.Sprintf("e%d", i))
		require.NoError(t, os.MkdirAll(sub, 0o755))
		b := make([]byte, (i+1)*700<<10)
		rand.Read(b)
		require.NoError(t, os.WriteFile(filepath.Join(sub, "big"), b, 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(sub, "small"), []byte(fmt.Sprint("small ", i)), 0o644))
	}
	require.NoError(t, os.Symlink("d0/e0/small", filepath.Join(dir, "link")))
	return dir
}

// build stores the tree as a layer in the remote store (as an import on
// another node would) and returns it.
func (e *env) build(src string) blobstore.Descriptor {
	desc, err := layer.Build(context.Background(), e.remote, src)
	require.NoError(e.t, err)
	return desc
}

// mount has the node mount the layer through st, released at the end.
func (e *env) mount(st *lazyfs.Store, d blobstore.Descriptor) string {
	e.t.Helper()
	p, err := st.Fetch(context.Background(), d.Digest)
	require.NoError(e.t, err)
	require.True(e.t, strings.HasPrefix(p, st.FS().Dir()), "layer %s not served lazily: %s", d.Digest, p)
	dir, err := e.mounts.Acquire(context.Background(), d.Digest, p)
	require.NoError(e.t, err)
	e.t.Cleanup(func() { e.mounts.Release(d.Digest) })
	return dir
}

// sameTree checks that every file under got reads as under want.
func sameTree(t *testing.T, want, got string) {
	n := 0
	require.NoError(t, filepath.WalkDir(want, func(p string, d fs.DirEntry, err error) error {
		require.NoError(t, err)
		rel, _ := filepath.Rel(want, p)
		g := filepath.Join(got, rel)
		if d.Type()&fs.ModeSymlink != 0 {
			a, _ := os.Readlink(p)
			b, err := os.Readlink(g)
			require.NoError(t, err)
			require.Equal(t, a, b)
			return nil
		}
		if d.IsDir() {
			return nil
		}
		a, err := os.ReadFile(p)
		require.NoError(t, err)
		b, err := os.ReadFile(g)
		require.NoError(t, err, rel)
		require.True(t, bytes.Equal(a, b), "%s differs", rel)
		n++
		return nil
	}))
	require.Equal(t, 16, n)
}

// A lazy layer mounts with only its metadata fetched, one small file costs
// a chunk or so more, and every file reads as in the source; each chunk is
// fetched once.
func TestLazyLayerReadsLikeWhole(t *testing.T) {
	e := newEnv(t)
	src := tree(t)
	d := e.build(src)
	st := e.lazy(e.node, lazyfs.Options{})
	dir := e.mount(st, d)

	afterMount := st.FS().Stats().FetchedBytes
	require.Less(t, afterMount, d.Size/4, "mounting fetched %d of %d bytes", afterMount, d.Size)
	b, err := os.ReadFile(filepath.Join(dir, "d1/e7/small"))
	require.NoError(t, err)
	require.Equal(t, "small 7", string(b))
	require.Less(t, st.FS().Stats().FetchedBytes, d.Size/2)

	sameTree(t, src, dir)
	s := st.FS().Stats()
	x, err := layer.LoadChunkIndex(context.Background(), e.remote, d.Digest, d.Size)
	require.NoError(t, err)
	require.LessOrEqual(t, s.FetchedBytes, d.Size+x.MetaBytes(), "a chunk fetched twice")
	require.Zero(t, s.Failures)
	require.Positive(t, s.ReadBytes)
}

// A second create on the node asks the store nothing: the same process
// serves the open layer; a restarted node's chunk cache serves every read
// (it reads the small index, no chunk).
func TestSecondMountFetchesNothing(t *testing.T) {
	e := newEnv(t)
	src := tree(t)
	d := e.build(src)
	st := e.lazy(e.node, lazyfs.Options{})
	dir := e.mount(st, d)
	sameTree(t, src, dir)
	require.NoError(t, e.mounts.Release(d.Digest))

	before := e.count.all.Load()
	dir = e.mount(st, d)
	sameTree(t, src, dir)
	require.Equal(t, before, e.count.all.Load(), "second mount in the same process asked the store")

	// A new loader on the same node directory: chunks come from disk.
	require.NoError(t, e.mounts.Release(d.Digest))
	rangesBefore := e.count.ranges.Load()
	require.NoError(t, st.FS().Close())
	st3 := e.lazy(e.node, lazyfs.Options{})
	dir = e.mount(st3, d)
	sameTree(t, src, dir)
	require.Equal(t, rangesBefore, e.count.ranges.Load(), "restarted node fetched chunks it had cached")
	require.Zero(t, st3.FS().Stats().FetchedBytes)
}

// Many readers of one chunk wait for one fetch.
func TestConcurrentReadersOneFetch(t *testing.T) {
	e := newEnv(t)
	d := e.build(tree(t))
	st := e.lazy(e.node, lazyfs.Options{})
	p, err := st.Fetch(context.Background(), d.Digest)
	require.NoError(t, err)
	x, err := layer.LoadChunkIndex(context.Background(), e.remote, d.Digest, d.Size)
	require.NoError(t, err)
	data := -1
	for i := range x.Chunks() {
		if !overlapsMeta(x, i) {
			data = i
			break
		}
	}
	require.GreaterOrEqual(t, data, 0, "no data chunk")
	before := e.count.ranges.Load()
	var wg sync.WaitGroup
	bufs := make([][]byte, 16)
	for r := range bufs {
		wg.Go(func() {
			// O_DIRECT: no page cache, no readahead into the next chunk;
			// each read reaches the loader as it is.
			fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECT, 0)
			if err != nil {
				return
			}
			defer unix.Close(fd)
			bufs[r] = make([]byte, 4096)
			if _, err := unix.Pread(fd, bufs[r], int64(data)*layer.ChunkSize+int64(r)*4096); err != nil {
				bufs[r] = nil
			}
		})
	}
	wg.Wait()
	require.Equal(t, before+1, e.count.ranges.Load(), "one chunk, one range read")
	for r := range bufs {
		require.NotNil(t, bufs[r], "reader %d failed", r)
	}
	s := st.FS().Stats()
	require.Equal(t, int64(16), s.Hits+s.Misses)
}

// overlapsMeta reports whether chunk i holds any metadata.
func overlapsMeta(x *layer.ChunkIndex, i int) bool {
	off, n := x.Extent(i)
	for _, m := range x.Meta {
		if m.Off < off+n && off < m.Off+m.Len {
			return true
		}
	}
	return false
}

// corrupt rewrites the layer's object in the store with the chunks chosen
// by which flipped in one byte: what a range read then returns does not
// match the index.
func (e *env) corrupt(d blobstore.Descriptor, which func(i int, meta bool) bool) {
	ctx := context.Background()
	x, err := layer.LoadChunkIndex(ctx, e.remote, d.Digest, d.Size)
	require.NoError(e.t, err)
	b, err := blobstore.ReadAll(ctx, e.remote, d.Digest)
	require.NoError(e.t, err)
	for i := range x.Chunks() {
		if which(i, overlapsMeta(x, i)) {
			off, _ := x.Extent(i)
			b[off+7] ^= 0xff
		}
	}
	cl, err := e.srv.Client()
	require.NoError(e.t, err)
	key := e.prefix + "/blobs/sha256/" + strings.TrimPrefix(d.Digest, "sha256:")
	_, err = cl.PutObject(ctx, e.srv.Bucket, key, bytes.NewReader(b), int64(len(b)), minio.PutObjectOptions{})
	require.NoError(e.t, err)
}

// A chunk whose bytes do not match its digest is EIO to the reader, never
// other bytes; files in good chunks still read.
func TestCorruptChunkIsEIO(t *testing.T) {
	e := newEnv(t)
	src := tree(t)
	d := e.build(src)
	e.corrupt(d, func(i int, meta bool) bool { return !meta })
	st := e.lazy(e.node, lazyfs.Options{})
	dir := e.mount(st, d)
	b, err := os.ReadFile(filepath.Join(dir, "d1/e7/big"))
	require.ErrorIs(t, err, syscall.EIO, "read %d bytes", len(b))
	require.Positive(t, st.FS().Stats().Failures)
	// Metadata chunks were good: listing and symlinks still work.
	l, err := os.Readlink(filepath.Join(dir, "link"))
	require.NoError(t, err)
	require.Equal(t, "d0/e0/small", l)
}

// A layer whose metadata cannot be fetched is not mounted, and nothing is
// left behind: no layer file, no EROFS mount, no directory.
func TestBadMetadataLeavesNothing(t *testing.T) {
	e := newEnv(t)
	d := e.build(tree(t))
	e.corrupt(d, func(i int, meta bool) bool { return i == 0 })
	st := e.lazy(e.node, lazyfs.Options{})
	_, err := st.Fetch(context.Background(), d.Digest)
	require.ErrorIs(t, err, blobstore.ErrDigestMismatch)
	ents, err := os.ReadDir(st.FS().Dir())
	require.NoError(t, err)
	require.Empty(t, ents)
	ents, err = os.ReadDir(e.mounts.Root())
	require.NoError(t, err)
	require.Empty(t, ents)
}

// A store that stops answering (connections accepted, nothing said) or
// refuses gives readers EIO once the deadlines and retries are spent, not
// a hang; when it answers again, reads work (no failure is cached).
func TestStoreDownIsErrorNotHang(t *testing.T) {
	for _, mode := range []string{"hang", "refuse"} {
		t.Run(mode, func(t *testing.T) {
			e := newEnv(t)
			src := tree(t)
			d := e.build(src)
			st := e.lazy(e.node, lazyfs.Options{FetchTimeout: time.Second, Attempts: 2})
			dir := e.mount(st, d)
			e.proxy.set(mode)
			errc := make(chan error, 1)
			go func() {
				_, err := os.ReadFile(filepath.Join(dir, "d1/e7/big"))
				errc <- err
			}()
			select {
			case err := <-errc:
				require.ErrorIs(t, err, syscall.EIO)
			case <-time.After(2 * time.Minute):
				// Not a speed check: far beyond 2 attempts of 1 s; only a
				// read that never returns gets here.
				t.Fatal("read from a dead store hung")
			}
			e.proxy.set("pass")
			sameTree(t, src, dir)
		})
	}
}

// The chunk cache stays within its bound, evicting least recently used
// chunks, and evicted chunks are fetched again when read.
func TestCacheBoundEvicts(t *testing.T) {
	e := newEnv(t)
	src := tree(t)
	d := e.build(src)
	const bound = 3 << 20
	st := e.lazy(e.node, lazyfs.Options{CacheBytes: bound})
	dir := e.mount(st, d)
	sameTree(t, src, dir)
	s := st.FS().Stats()
	require.Positive(t, s.Evictions)
	require.LessOrEqual(t, st.FS().CachedBytes(), int64(bound))
	var onDisk int64
	filepath.WalkDir(filepath.Join(e.node, "lazy", "chunks"), func(p string, de fs.DirEntry, err error) error {
		if err == nil && !de.IsDir() {
			info, _ := de.Info()
			onDisk += info.Size()
		}
		return nil
	})
	require.LessOrEqual(t, onDisk, int64(bound))
	require.Greater(t, d.Size, int64(bound), "the layer must not fit")
}

// A first run records what it read, in order; a later node reads ahead
// along that list without being asked.
func TestPrefetchList(t *testing.T) {
	e := newEnv(t)
	d := e.build(tree(t))
	st := e.lazy(e.node, lazyfs.Options{})
	dir := e.mount(st, d)
	_, err := os.ReadFile(filepath.Join(dir, "d0/e6/big"))
	require.NoError(t, err)
	require.NoError(t, st.FS().SavePrefetch(context.Background(), d.Digest))
	// The list: the chunks read, in order; the file is 4.9 MB of one
	// contiguous run of chunks.
	ctx := context.Background()
	ref, err := e.remote.Refs().Get(ctx, layer.PrefetchRef(d.Digest))
	require.NoError(t, err)
	raw, err := blobstore.ReadAll(ctx, e.remote, ref)
	require.NoError(t, err)
	x, err := layer.LoadChunkIndex(ctx, e.remote, d.Digest, d.Size)
	require.NoError(t, err)
	want := x.MetaBytes()
	var list []int
	for i := 8; i+4 <= len(raw); i += 4 {
		c := int(binary.LittleEndian.Uint32(raw[i:]))
		list = append(list, c)
		_, n := x.Extent(c)
		want += n
	}
	require.GreaterOrEqual(t, len(list), int(4900<<10/x.ChunkSize), "list %v", list)
	for i := 1; i < len(list); i++ {
		require.Greater(t, list[i], list[i-1], "a sequential read recorded out of order: %v", list)
	}

	other := t.TempDir()
	st2 := e.lazy(other, lazyfs.Options{})
	_, err = st2.Fetch(ctx, d.Digest)
	require.NoError(t, err)
	// Readahead runs in the background: wait until it has fetched the
	// list (a bound only against hanging for ever).
	deadline := time.Now().Add(time.Minute)
	for st2.FS().Stats().FetchedBytes < want && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	require.Equal(t, want, st2.FS().Stats().FetchedBytes, "readahead did not follow the recorded list")
	require.Zero(t, st2.FS().Stats().ReadBytes, "nobody read the file: the fetches were readahead")
}

// Closing the loader while a layer is still mounted from it does not hang
// (the edge's shutdown must finish): the FUSE mount is detached, and gone
// from the mount table at once.
func TestCloseWhileMounted(t *testing.T) {
	e := newEnv(t)
	d := e.build(tree(t))
	st := e.lazy(e.node, lazyfs.Options{})
	e.mount(st, d)
	done := make(chan error, 1)
	go func() { done <- st.FS().Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		t.Fatal("Close hung with a layer mounted") // a bound against hanging, not a speed check
	}
	requireNotMounted(t, st.FS().Dir())
	require.NoError(t, e.mounts.Release(d.Digest))
}

// A burst of creates of one new image on one node fetches each piece
// once: 8 at once open the layer, mount it and read every file.
func TestBurstFetchesEachPieceOnce(t *testing.T) {
	e := newEnv(t)
	src := tree(t)
	d := e.build(src)
	x, err := layer.LoadChunkIndex(context.Background(), e.remote, d.Digest, d.Size)
	require.NoError(t, err)
	st := e.lazy(e.node, lazyfs.Options{})
	before := e.count.ranges.Load()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			p, err := st.Fetch(context.Background(), d.Digest)
			if !assert.NoError(t, err) {
				return
			}
			dir, err := e.mounts.Acquire(context.Background(), d.Digest, p)
			if !assert.NoError(t, err) {
				return
			}
			defer e.mounts.Release(d.Digest)
			sameTree(t, src, dir)
		})
	}
	wg.Wait()
	require.Equal(t, int64(x.Chunks()+len(x.Meta)), e.count.ranges.Load()-before,
		"%d chunks and %d metadata extents, each read once", x.Chunks(), len(x.Meta))
}

// A piece a previous process cached is checked on its first read: one
// damaged on disk since is fetched again, not served.
func TestDamagedCachedPieceIsFetchedAgain(t *testing.T) {
	e := newEnv(t)
	src := tree(t)
	d := e.build(src)
	st := e.lazy(e.node, lazyfs.Options{})
	sameTree(t, src, e.mount(st, d))
	require.NoError(t, e.mounts.Release(d.Digest))
	require.NoError(t, st.FS().Close())

	chunks := filepath.Join(e.node, "lazy", "chunks")
	ents, err := os.ReadDir(chunks)
	require.NoError(t, err)
	damaged := 0
	for _, de := range ents {
		p := filepath.Join(chunks, de.Name())
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		if len(b) < 64<<10 {
			continue // metadata: keep the mount's own reads simple
		}
		b[100] ^= 0xff
		require.NoError(t, os.WriteFile(p, b, 0o600))
		damaged++
		if damaged == 3 {
			break
		}
	}
	require.Equal(t, 3, damaged)
	before := e.count.ranges.Load()
	st2 := e.lazy(e.node, lazyfs.Options{})
	sameTree(t, src, e.mount(st2, d))
	require.Equal(t, int64(3), e.count.ranges.Load()-before, "the damaged pieces, and only they, fetched again")
}
