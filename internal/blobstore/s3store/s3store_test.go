package s3store_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/blobstoretest"
	"github.com/dsec-dev/dsec/internal/blobstore/s3store"
	"github.com/dsec-dev/dsec/internal/blobstore/s3test"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/gc"
)

// open returns a store on srv under a prefix of its own: empty, and apart
// from every other test's.
func open(t *testing.T, srv *s3test.Server) *s3store.Store {
	t.Helper()
	s, err := s3store.Open(context.Background(), s3store.Config{
		Bucket: srv.Bucket, Prefix: s3test.NewPrefix(), Endpoint: srv.Endpoint,
		AccessKey: srv.AccessKey, SecretKey: srv.SecretKey, TempDir: t.TempDir(),
	})
	require.NoError(t, err)
	return s
}

// One server for the package's tests: it takes seconds to start, and a
// prefix per test keeps them apart.
var (
	srvOnce sync.Once
	srv     *s3test.Server
	srvErr  error
)

func server(t *testing.T) *s3test.Server {
	t.Helper()
	s3test.Need(t)
	srvOnce.Do(func() {
		dir, err := os.MkdirTemp("", "s3store-test-")
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

func TestConformance(t *testing.T) {
	s := server(t)
	blobstoretest.Run(t, func(t *testing.T) blobstore.Store { return open(t, s) })
}

// TestConformanceThroughCache runs the suite on a Cache over the s3 store,
// as the daemons use it.
func TestConformanceThroughCache(t *testing.T) {
	s := server(t)
	blobstoretest.Run(t, func(t *testing.T) blobstore.Store {
		local, err := blobstore.NewDir(t.TempDir())
		require.NoError(t, err)
		return blobstore.NewCache(open(t, s), local)
	})
}

func TestParseURL(t *testing.T) {
	for _, tc := range []struct{ url, bucket, prefix, err string }{
		{"s3://b", "b", "", ""},
		{"s3://b/", "b", "", ""},
		{"s3://b/p/q/", "b", "p/q", ""},
		{"s3:///p", "", "", "no bucket"},
		{"dir:///x", "", "", "want s3://"},
		{"s3://b/p?x=1", "", "", "nothing else"},
	} {
		b, p, err := s3store.ParseURL(tc.url)
		if tc.err != "" {
			assert.ErrorContains(t, err, tc.err, tc.url)
			continue
		}
		require.NoError(t, err, tc.url)
		assert.Equal(t, tc.bucket, b, tc.url)
		assert.Equal(t, tc.prefix, p, tc.url)
	}
}

// TestOpenRefuses: a missing bucket, a bad endpoint and wrong credentials
// are refused when the store is opened, not at its first use.
func TestOpenRefuses(t *testing.T) {
	s := server(t)
	ctx := context.Background()
	_, err := s3store.Open(ctx, s3store.Config{Bucket: "no-such-bucket", Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: s.SecretKey})
	assert.ErrorContains(t, err, `bucket "no-such-bucket" does not exist`)
	_, err = s3store.Open(ctx, s3store.Config{Bucket: s.Bucket, Endpoint: "ftp://x", AccessKey: s.AccessKey, SecretKey: s.SecretKey})
	assert.ErrorContains(t, err, "want http[s]://HOST[:PORT]")
	_, err = s3store.Open(ctx, s3store.Config{Bucket: s.Bucket, Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: "wrong"})
	require.Error(t, err)
	assert.Equal(t, fail.Internal, fail.KindOf(err), "wrong credentials are the deployment's fault: %v", err)
}

// TestCredentialsFromEnvironment: with no keys in the config, the usual
// AWS variables sign the requests.
func TestCredentialsFromEnvironment(t *testing.T) {
	s := server(t)
	t.Setenv("AWS_ACCESS_KEY_ID", s.AccessKey)
	t.Setenv("AWS_SECRET_ACCESS_KEY", s.SecretKey)
	st, err := s3store.Open(context.Background(), s3store.Config{Bucket: s.Bucket, Prefix: s3test.NewPrefix(), Endpoint: s.Endpoint})
	require.NoError(t, err)
	_, err = st.Put(context.Background(), strings.NewReader("signed from the environment"))
	require.NoError(t, err)
}

// TestUnreachable: a store whose server is gone fails with Unavailable
// (a retry may work), not with NotFound or a hang.
func TestUnreachable(t *testing.T) {
	s := server(t)
	st := open(t, s)
	d, err := st.Put(context.Background(), strings.NewReader("x"))
	require.NoError(t, err)
	dead, err := s3store.Open(context.Background(), s3store.Config{Bucket: s.Bucket, Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: s.SecretKey})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = dead.Stat(ctx, d.Digest)
	assert.ErrorIs(t, err, context.Canceled)
	// A port nothing listens on.
	_, err = s3store.Open(context.Background(), s3store.Config{Bucket: s.Bucket, Endpoint: "http://127.0.0.1:1", AccessKey: s.AccessKey, SecretKey: s.SecretKey, MaxRetries: 1})
	require.Error(t, err)
	assert.Equal(t, fail.Unavailable, fail.KindOf(err), "%v", err)
}

// client returns a raw client of the server, to look at or damage the
// objects behind the store's back.
func client(t *testing.T, s *s3test.Server) *minio.Client {
	t.Helper()
	c, err := s.Client()
	require.NoError(t, err)
	return c
}

// TestLayout: blobs and refs are where the package doc says, under the
// prefix.
func TestLayout(t *testing.T) {
	s := server(t)
	prefix := s3test.NewPrefix()
	st, err := s3store.Open(context.Background(), s3store.Config{Bucket: s.Bucket, Prefix: prefix + "/", Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: s.SecretKey})
	require.NoError(t, err)
	ctx := context.Background()
	d, err := st.Put(ctx, strings.NewReader("laid out"))
	require.NoError(t, err)
	require.NoError(t, st.Refs().Set(ctx, "images/a:b", d.Digest))
	var keys []string
	for obj := range client(t, s).ListObjects(ctx, s.Bucket, minio.ListObjectsOptions{Prefix: prefix + "/", Recursive: true}) {
		require.NoError(t, obj.Err)
		keys = append(keys, obj.Key)
	}
	assert.Equal(t, []string{
		prefix + "/blobs/sha256/" + strings.TrimPrefix(d.Digest, "sha256:"),
		prefix + "/refs/images/a:b",
	}, keys)
	obj, err := client(t, s).GetObject(ctx, s.Bucket, prefix+"/refs/images/a:b", minio.GetObjectOptions{})
	require.NoError(t, err)
	b, err := io.ReadAll(obj)
	require.NoError(t, err)
	assert.Equal(t, d.Digest+"\n", string(b))
}

// TestCorrupt damages a stored object behind the store's back (the suite's
// corruption test needs local files): reading it fails with
// ErrDigestMismatch at EOF, through the store and through a Cache, which
// then keeps no copy.
func TestCorrupt(t *testing.T) {
	s := server(t)
	prefix := s3test.NewPrefix()
	ctx := context.Background()
	st, err := s3store.Open(ctx, s3store.Config{Bucket: s.Bucket, Prefix: prefix, Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: s.SecretKey})
	require.NoError(t, err)
	data := make([]byte, 64<<10)
	rand.Read(data)
	d, err := st.Put(ctx, bytes.NewReader(data))
	require.NoError(t, err)
	key := prefix + "/blobs/sha256/" + strings.TrimPrefix(d.Digest, "sha256:")
	for _, tc := range []struct {
		name string
		bad  []byte
	}{
		{"flipped byte", func() []byte { b := bytes.Clone(data); b[100] ^= 1; return b }()},
		{"truncated", data[:len(data)-1]},
		{"extended", append(bytes.Clone(data), 0)},
	} {
		_, err := client(t, s).PutObject(ctx, s.Bucket, key, bytes.NewReader(tc.bad), int64(len(tc.bad)), minio.PutObjectOptions{})
		require.NoError(t, err)
		_, err = blobstore.ReadAll(ctx, st, d.Digest)
		assert.ErrorIs(t, err, blobstore.ErrDigestMismatch, tc.name)
		assert.ErrorContains(t, err, d.Digest, tc.name)

		local, err := blobstore.NewDir(t.TempDir())
		require.NoError(t, err)
		c := blobstore.NewCache(st, local)
		_, err = c.Fetch(ctx, d.Digest)
		assert.ErrorIs(t, err, blobstore.ErrDigestMismatch, tc.name)
		assert.Empty(t, blobstoretest.WalkAll(t, local), "%s: the cache kept a copy of a damaged blob", tc.name)
	}
	// Storing the content again repairs it: a wrong-sized object under the
	// digest is replaced, not taken as stored.
	_, err = client(t, s).PutObject(ctx, s.Bucket, key, bytes.NewReader(data[:10]), 10, minio.PutObjectOptions{})
	require.NoError(t, err)
	_, err = st.Put(ctx, bytes.NewReader(data))
	require.NoError(t, err)
	got, err := blobstore.ReadAll(ctx, st, d.Digest)
	require.NoError(t, err)
	assert.Equal(t, data, got)
}

// TestLargePutSpools: a blob past what Put keeps in memory is spooled to
// the temp dir, uploaded (in parts) and the spool file removed.
func TestLargePutSpools(t *testing.T) {
	s := server(t)
	tmp := t.TempDir()
	st, err := s3store.Open(context.Background(), s3store.Config{Bucket: s.Bucket, Prefix: s3test.NewPrefix(), Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: s.SecretKey, TempDir: tmp})
	require.NoError(t, err)
	data := make([]byte, 40<<20+5)
	rand.Read(data)
	d, err := st.Put(context.Background(), struct{ io.Reader }{bytes.NewReader(data)})
	require.NoError(t, err)
	assert.Equal(t, blobstore.Digest(data), d.Digest)
	got, err := blobstore.ReadAll(context.Background(), st, d.Digest)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(data, got))
	left, err := os.ReadDir(tmp)
	require.NoError(t, err)
	assert.Empty(t, left, "spool files left behind")
}

// TestIngest: a file built in TempDir is uploaded and removed; Upload
// leaves it.
func TestIngest(t *testing.T) {
	s := server(t)
	st := open(t, s)
	ctx := context.Background()
	p := filepath.Join(st.TempDir(), "layer.erofs")
	require.NoError(t, os.WriteFile(p, []byte("a layer"), 0o644))
	d, err := st.Upload(ctx, p)
	require.NoError(t, err)
	assert.FileExists(t, p)
	d2, err := st.Ingest(ctx, p)
	require.NoError(t, err)
	assert.Equal(t, d, d2)
	assert.NoFileExists(t, p)
	got, err := blobstore.ReadAll(ctx, st, d.Digest)
	require.NoError(t, err)
	assert.Equal(t, "a layer", string(got))
}

// TestBlobTime: a blob's age is its object's LastModified, and storing
// stored content again makes it young again once it is older than a
// minute (garbage collection spares it), as the dir store does.
func TestBlobTime(t *testing.T) {
	s := server(t)
	prefix := s3test.NewPrefix()
	ctx := context.Background()
	st, err := s3store.Open(ctx, s3store.Config{Bucket: s.Bucket, Prefix: prefix, Endpoint: s.Endpoint, AccessKey: s.AccessKey, SecretKey: s.SecretKey})
	require.NoError(t, err)
	before := time.Now().Add(-5 * time.Second) // the server's clock is this machine's, at a second's resolution
	d, err := st.Put(ctx, strings.NewReader("aged"))
	require.NoError(t, err)
	t0, err := st.BlobTime(ctx, d.Digest)
	require.NoError(t, err)
	assert.True(t, t0.After(before), "LastModified %v before the Put at %v", t0, before)
	_, err = st.BlobTime(ctx, blobstore.Digest([]byte("never stored")))
	assert.ErrorIs(t, err, blobstore.ErrNotFound)

	// Pretend the Put happens two minutes later: the object is old enough
	// to be refreshed, so its LastModified moves.
	later := s3store.WithClock(st, func() time.Time { return time.Now().Add(2 * time.Minute) })
	_, err = later.Put(ctx, strings.NewReader("aged"))
	require.NoError(t, err)
	t1, err := st.BlobTime(ctx, d.Digest)
	require.NoError(t, err)
	assert.True(t, !t1.Before(t0), "LastModified went back: %v then %v", t0, t1)
	// LastModified has a second's resolution and the server's clock did
	// not move two minutes: that the object was rewritten shows in the
	// metadata the copy sets.
	info, err := client(t, s).StatObject(ctx, s.Bucket, prefix+"/blobs/sha256/"+strings.TrimPrefix(d.Digest, "sha256:"), minio.StatObjectOptions{})
	require.NoError(t, err)
	assert.NotEmpty(t, info.UserMetadata["Stored"], "the object was not refreshed: metadata %v", info.UserMetadata)
	got, err := blobstore.ReadAll(ctx, st, d.Digest)
	require.NoError(t, err, "refreshing damaged the blob")
	assert.Equal(t, "aged", string(got))
}

// TestCacheFetch: a Cache fetches a blob once into its local store, however
// many callers ask at once, and serves later reads and ranges from it.
func TestCacheFetch(t *testing.T) {
	s := server(t)
	st := open(t, s)
	ctx := context.Background()
	data := make([]byte, 3<<20)
	rand.Read(data)
	d, err := st.Put(ctx, bytes.NewReader(data))
	require.NoError(t, err)
	local, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	c := blobstore.NewCache(st, local)

	const n = 8
	paths := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { paths[i], errs[i] = blobstore.LocalPath(ctx, c, d.Digest) })
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		assert.Equal(t, paths[0], paths[i])
	}
	got, err := os.ReadFile(paths[0])
	require.NoError(t, err)
	assert.True(t, bytes.Equal(data, got))
	assert.Equal(t, []blobstore.Descriptor{d}, blobstoretest.WalkAll(t, local))

	// A blob the remote store lacks is not found, and the cache holds
	// nothing for it.
	_, err = c.Fetch(ctx, blobstore.Digest([]byte("nowhere")))
	assert.ErrorIs(t, err, blobstore.ErrNotFound)

	// Ingest stores remotely and keeps the file as the node's copy.
	p := filepath.Join(c.TempDir(), "built")
	require.NoError(t, os.WriteFile(p, []byte("built here"), 0o644))
	bd, err := c.Ingest(ctx, p)
	require.NoError(t, err)
	_, err = st.Stat(ctx, bd.Digest)
	require.NoError(t, err, "ingested blob not in the remote store")
	_, err = local.Path(bd.Digest)
	require.NoError(t, err, "ingested blob not kept locally")

	// Delete deletes both.
	require.NoError(t, c.Delete(ctx, bd.Digest))
	_, err = st.Stat(ctx, bd.Digest)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	_, err = local.Path(bd.Digest)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
}

// TestGC collects an s3 store through a Cache, as the server does: the
// blob a ref names stays, an unreferenced one goes (from the bucket and
// the node's copy), and ages come from the objects (blobstore.Ager), not
// from the node's files, so gc fetches nothing into the cache.
func TestGC(t *testing.T) {
	s := server(t)
	st := open(t, s)
	local, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	c := blobstore.NewCache(st, local)
	ctx := context.Background()
	keep, err := c.Put(ctx, strings.NewReader("named by a ref"))
	require.NoError(t, err)
	require.NoError(t, c.Refs().Set(ctx, "other/keep", keep.Digest))
	orphan, err := c.Put(ctx, strings.NewReader("named by nothing"))
	require.NoError(t, err)
	_, err = c.Fetch(ctx, orphan.Digest) // the node holds a copy
	require.NoError(t, err)

	res, err := gc.Run(ctx, c, gc.Options{Grace: 0})
	require.NoError(t, err)
	assert.Equal(t, []string{orphan.Digest}, res.Freed)
	_, err = st.Stat(ctx, orphan.Digest)
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	_, err = local.Stat(ctx, orphan.Digest)
	assert.ErrorIs(t, err, blobstore.ErrNotFound, "the node's copy of a freed blob stayed")
	_, err = st.Stat(ctx, keep.Digest)
	assert.NoError(t, err)
	_, err = local.Stat(ctx, keep.Digest)
	assert.ErrorIs(t, err, blobstore.ErrNotFound, "gc fetched a blob into the cache")

	// With a grace period, young blobs stay: their age is the object's.
	young, err := c.Put(ctx, strings.NewReader("just stored"))
	require.NoError(t, err)
	res, err = gc.Run(ctx, c, gc.Options{Grace: time.Hour})
	require.NoError(t, err)
	assert.Empty(t, res.Freed)
	assert.Equal(t, int64(1), res.Young)
	_, err = st.Stat(ctx, young.Digest)
	assert.NoError(t, err)
}
