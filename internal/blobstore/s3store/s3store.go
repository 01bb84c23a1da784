// Package s3store is the blob store kept in an S3-compatible object store
// (AWS S3, SeaweedFS, Ceph RGW, ...), named by s3://BUCKET[/PREFIX]:
//
//	PREFIX/blobs/sha256/<hex>   blobs
//	PREFIX/refs/<name>          refs, one object each holding "<digest>\n"
//
// It gives what the dir store gives, with the object store's own
// guarantees instead of renames and fsyncs:
//
//   - No partial blob or ref is ever visible: an object appears only when
//     its PUT (or multipart upload) completes, and a blob is PUT under its
//     digest only after the bytes were hashed (spooled first, so the key is
//     known before the upload starts).
//   - A ref is replaced atomically: a reader GETs the old object or the new
//     one, never a mix.
//   - Concurrent writers of one digest upload identical bytes to one key;
//     whichever PUT lands last, readers see the same content.
//   - Durability is the store's: a PUT answered 200 is stored.
//   - Reads are verified against the digest at EOF (blobstore.VerifyingReader),
//     so corruption in the store or on the wire is an error, not data.
//
// Where it differs: a ref name may also be a prefix of other names ("a" and
// "a/b" coexist; the dir store refuses that since its names are
// directories), and a blob's age for garbage collection is its object's
// LastModified, moved to now by a copy onto itself when content already
// stored is stored again (see refreshAfter).
//
// The package is apart from internal/blobstore so that the CLI, which
// links that one, does not link the S3 client.
package s3store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"golang.org/x/sync/errgroup"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/fail"
)

const (
	digestPrefix = "sha256:"
	// spoolMemory is the largest blob Put keeps in memory before its
	// digest (its key) is known; larger ones are spooled to a temp file.
	// Manifests and trajectory segments fit; layers go through Ingest.
	spoolMemory = 8 << 20
	// refreshAfter: storing content that is already stored refreshes its
	// LastModified (garbage collection's age) only when it is older than
	// this, sparing a copy request per Put of fresh content. Garbage
	// collection's grace period must exceed it (gc.DefaultGrace is 15m).
	refreshAfter = time.Minute
	// parallel bounds the requests a batch or a ref listing has in
	// flight.
	parallel = 16
	// maxRefBytes bounds a ref object read: "sha256:<64 hex>\n" is 72.
	maxRefBytes = 1024
)

// Config says where the store is and how to reach it.
type Config struct {
	// Bucket holds the store; it must exist.
	Bucket string
	// Prefix, when set, puts every key under PREFIX/.
	Prefix string
	// Endpoint is the server's base URL; http:// or https:// decides TLS.
	Endpoint string
	// AccessKey and SecretKey sign requests; empty takes AWS_ACCESS_KEY_ID
	// and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) from the
	// environment, and none at all means anonymous requests.
	AccessKey, SecretKey string
	// Region, default AWS_REGION or us-east-1.
	Region string
	// TempDir holds blobs being spooled and files being built for Ingest
	// (default os.TempDir()).
	TempDir string
	// Transport, default minio-go's.
	Transport http.RoundTripper
	// MaxRetries is how many times a request that failed in a way a retry
	// may cure is sent in all, with backoff (default minio-go's 10; 1
	// sends each request once).
	MaxRetries int
}

// ParseURL splits s3://BUCKET[/PREFIX] into its bucket and prefix.
func ParseURL(raw string) (bucket, prefix string, err error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", "", fmt.Errorf("blob store URL %q: %w", raw, err)
	}
	if u.Scheme != "s3" {
		return "", "", fmt.Errorf("blob store URL %q: want s3://BUCKET[/PREFIX]", raw)
	}
	if u.Host == "" {
		return "", "", fmt.Errorf("blob store URL %q: no bucket (want s3://BUCKET[/PREFIX])", raw)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return "", "", fmt.Errorf("blob store URL %q: want s3://BUCKET[/PREFIX], nothing else (the endpoint is --s3-endpoint)", raw)
	}
	return u.Host, strings.Trim(u.Path, "/"), nil
}

// Store is the S3-backed blobstore.Repository.
type Store struct {
	client *minio.Client
	bucket string
	// prefix is "" or ends in "/".
	prefix string
	tmp    string
	now    func() time.Time
}

var (
	_ blobstore.Repository  = (*Store)(nil)
	_ blobstore.BatchWriter = (*Store)(nil)
	_ blobstore.RangeReader = (*Store)(nil)
	_ blobstore.Ager        = (*Store)(nil)
	_ blobstore.Ingester    = (*Store)(nil)
	_ blobstore.Uploader    = (*Store)(nil)
)

// Open connects to the store and checks that its bucket exists.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Bucket == "" {
		return nil, errors.New("s3 store: no bucket")
	}
	if cfg.Endpoint == "" {
		return nil, errors.New("s3 store: no endpoint (--s3-endpoint http[s]://HOST[:PORT])")
	}
	u, err := url.Parse(cfg.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return nil, fmt.Errorf("s3 store: endpoint %q: want http[s]://HOST[:PORT]", cfg.Endpoint)
	}
	var creds *credentials.Credentials
	if cfg.AccessKey != "" || cfg.SecretKey != "" {
		creds = credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, "")
	} else {
		creds = credentials.NewEnvAWS()
	}
	region := cfg.Region
	if region == "" {
		region = os.Getenv("AWS_REGION")
	}
	if region == "" {
		// Set, so that the client does not ask the server for the bucket's
		// location before its first request.
		region = "us-east-1"
	}
	client, err := minio.New(u.Host, &minio.Options{
		Creds:      creds,
		Secure:     u.Scheme == "https",
		Region:     region,
		Transport:  cfg.Transport,
		MaxRetries: cfg.MaxRetries,
	})
	if err != nil {
		return nil, fmt.Errorf("s3 store %s: %w", cfg.Endpoint, err)
	}
	tmp := cfg.TempDir
	if tmp == "" {
		tmp = os.TempDir()
	}
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return nil, fmt.Errorf("s3 store temp dir: %w", err)
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	if prefix != "" {
		prefix += "/"
	}
	s := &Store{client: client, bucket: cfg.Bucket, prefix: prefix, tmp: tmp, now: time.Now}
	ok, err := client.BucketExists(ctx, cfg.Bucket)
	if err != nil {
		return nil, s.errorf(err, "s3 store %s: bucket %q", cfg.Endpoint, cfg.Bucket)
	}
	if !ok {
		return nil, fail.Errorf(fail.FailedPrecondition, "s3 store %s: bucket %q does not exist", cfg.Endpoint, cfg.Bucket)
	}
	return s, nil
}

func (s *Store) blobKey(digest string) (string, error) {
	if err := blobstore.ValidateDigest(digest); err != nil {
		return "", err
	}
	return s.prefix + "blobs/sha256/" + strings.TrimPrefix(digest, digestPrefix), nil
}

func (s *Store) refKey(name string) (string, error) {
	if err := blobstore.ValidateRefName(name); err != nil {
		return "", err
	}
	return s.prefix + "refs/" + name, nil
}

// errorf wraps err, an error of the client, in a message and a kind:
// blobstore.ErrNotFound for a missing object, fail.Unavailable for what a
// retry may cure (the server unreachable, busy or failing), fail.Internal
// for the rest (credentials refused, no such bucket: the deployment is
// wrong). Context errors stay as they are.
func (s *Store) errorf(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s: %w", msg, err)
	}
	resp := minio.ToErrorResponse(err)
	switch {
	case resp.Code == "NoSuchKey" || resp.StatusCode == 404 && resp.Code != "NoSuchBucket":
		return fmt.Errorf("%s: %w", msg, blobstore.ErrNotFound)
	case resp.StatusCode >= 500 || resp.Code == "SlowDown" || resp.StatusCode == 0 || isNetError(err):
		return fail.New(fail.Unavailable, fmt.Errorf("%s: %w", msg, err))
	default:
		return fail.New(fail.Internal, fmt.Errorf("%s: %w", msg, err))
	}
}

func isNetError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne)
}

// Put hashes r's bytes as it spools them (in memory, or in a temp file
// past spoolMemory) and then uploads them under their digest.
func (s *Store) Put(ctx context.Context, r io.Reader) (blobstore.Descriptor, error) {
	sp, err := s.spool(ctx, r)
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("put blob: %w", err)
	}
	defer sp.close()
	if err := s.store(ctx, sp.desc, sp.body()); err != nil {
		return blobstore.Descriptor{}, err
	}
	return sp.desc, nil
}

// spooled is a blob's bytes, hashed, ready to be uploaded (and uploaded
// again if need be).
type spooled struct {
	desc blobstore.Descriptor
	mem  []byte
	file *os.File
}

func (sp *spooled) body() io.ReaderAt {
	if sp.file != nil {
		return sp.file
	}
	return bytes.NewReader(sp.mem)
}

func (sp *spooled) close() {
	if sp.file != nil {
		sp.file.Close()
		os.Remove(sp.file.Name())
	}
}

func (s *Store) spool(ctx context.Context, r io.Reader) (*spooled, error) {
	h := sha256.New()
	r = io.TeeReader(blobstore.ContextReader(ctx, r), h)
	mem, err := io.ReadAll(io.LimitReader(r, spoolMemory+1))
	if err != nil {
		return nil, err
	}
	sp := &spooled{mem: mem}
	size := int64(len(mem))
	if size > spoolMemory {
		f, err := os.CreateTemp(s.tmp, "s3-put-*")
		if err != nil {
			return nil, err
		}
		sp.file, sp.mem = f, nil
		_, err = f.Write(mem)
		if err == nil {
			var n int64
			n, err = io.Copy(f, r)
			size += n
		}
		if err != nil {
			sp.close()
			return nil, err
		}
	}
	sp.desc = blobstore.Descriptor{Digest: digestPrefix + hex.EncodeToString(h.Sum(nil)), Size: size}
	return sp, nil
}

// store uploads desc's bytes from body unless the store holds them already
// (then it refreshes the object's age, see refreshAfter).
func (s *Store) store(ctx context.Context, desc blobstore.Descriptor, body io.ReaderAt) error {
	key, err := s.blobKey(desc.Digest)
	if err != nil {
		return err
	}
	info, err := s.client.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{})
	switch {
	case err == nil && info.Size == desc.Size:
		if s.now().Sub(info.LastModified) < refreshAfter || s.touch(ctx, key) == nil {
			return nil
		}
		// The copy failed (deleted meanwhile, or a server that cannot
		// copy an object onto itself): upload it again instead.
	case err == nil:
		// A damaged object under the digest: replace it.
	default:
		if err := s.errorf(err, "put blob %s", desc.Digest); !errors.Is(err, blobstore.ErrNotFound) {
			return err
		}
	}
	_, err = s.client.PutObject(ctx, s.bucket, key, io.NewSectionReader(body, 0, desc.Size), desc.Size,
		minio.PutObjectOptions{ContentType: "application/octet-stream"})
	if err != nil {
		return s.errorf(err, "put blob %s", desc.Digest)
	}
	return nil
}

// touch moves an object's LastModified to now by copying it onto itself
// with its metadata replaced (S3 refuses a self-copy that changes nothing).
func (s *Store) touch(ctx context.Context, key string) error {
	_, err := s.client.CopyObject(ctx,
		minio.CopyDestOptions{Bucket: s.bucket, Object: key, ReplaceMetadata: true,
			UserMetadata: map[string]string{"Stored": s.now().UTC().Format(time.RFC3339)}},
		minio.CopySrcOptions{Bucket: s.bucket, Object: key})
	return err
}

// TempDir is where files to Ingest are built: a local directory, since
// the object store has no file system.
func (s *Store) TempDir() string { return s.tmp }

// Ingest uploads the file at path and removes it.
func (s *Store) Ingest(ctx context.Context, path string) (blobstore.Descriptor, error) {
	defer os.Remove(path)
	return s.Upload(ctx, path)
}

// Upload hashes the file at path and uploads it, leaving it in place.
func (s *Store) Upload(ctx context.Context, path string) (blobstore.Descriptor, error) {
	f, err := os.Open(path)
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("upload: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, blobstore.ContextReader(ctx, f))
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("upload %s: %w", path, err)
	}
	desc := blobstore.Descriptor{Digest: digestPrefix + hex.EncodeToString(h.Sum(nil)), Size: n}
	return desc, s.store(ctx, desc, f)
}

// Open returns a reader that verifies the blob's digest at EOF.
func (s *Store) Open(ctx context.Context, digest string) (io.ReadCloser, error) {
	key, err := s.blobKey(digest)
	if err != nil {
		return nil, err
	}
	obj, err := s.client.GetObject(ctx, s.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return nil, s.errorf(err, "blob %s", digest)
	}
	// Stat sends the GET: a missing blob fails here, not at the first Read.
	info, err := obj.Stat()
	if err != nil {
		obj.Close()
		return nil, s.errorf(err, "blob %s", digest)
	}
	return blobstore.VerifyingReader(obj, digest, info.Size), nil
}

// OpenRange returns n bytes of the blob from off, unverified (see
// blobstore.RangeReader).
func (s *Store) OpenRange(ctx context.Context, digest string, off, n int64) (io.ReadCloser, error) {
	key, err := s.blobKey(digest)
	if err != nil {
		return nil, err
	}
	if off < 0 || n < 0 {
		return nil, fmt.Errorf("blob %s: range of %d bytes at %d: offset and length must not be negative", digest, n, off)
	}
	if n == 0 {
		// S3 has no empty range; the blob must still exist and reach off.
		d, err := s.Stat(ctx, digest)
		if err != nil {
			return nil, err
		}
		if d.Size < off {
			return nil, fmt.Errorf("blob %s of %d bytes ends before offset %d: %w", digest, d.Size, off, io.ErrUnexpectedEOF)
		}
		return io.NopCloser(strings.NewReader("")), nil
	}
	var opts minio.GetObjectOptions
	if err := opts.SetRange(off, off+n-1); err != nil {
		return nil, fmt.Errorf("blob %s: %w", digest, err)
	}
	// One GET with the range (Core's): the plain client's object sends a
	// HEAD before its first read, doubling the lazy loader's requests.
	obj, _, _, err := minio.Core{Client: s.client}.GetObject(ctx, s.bucket, key, opts)
	if err != nil {
		// Past the end: S3 answers 416 InvalidRange (SeaweedFS without
		// the code).
		if resp := minio.ToErrorResponse(err); resp.Code == "InvalidRange" || resp.StatusCode == http.StatusRequestedRangeNotSatisfiable {
			return nil, fmt.Errorf("blob %s ends before offset %d: %w", digest, off, io.ErrUnexpectedEOF)
		}
		return nil, s.errorf(err, "blob %s", digest)
	}
	return blobstore.ExactReader(obj, digest, off, n), nil
}

// Stat returns the blob's descriptor.
func (s *Store) Stat(ctx context.Context, digest string) (blobstore.Descriptor, error) {
	key, err := s.blobKey(digest)
	if err != nil {
		return blobstore.Descriptor{}, err
	}
	info, err := s.client.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{})
	if err != nil {
		return blobstore.Descriptor{}, s.errorf(err, "blob %s", digest)
	}
	return blobstore.Descriptor{Digest: digest, Size: info.Size}, nil
}

// BlobTime is the blob object's LastModified.
func (s *Store) BlobTime(ctx context.Context, digest string) (time.Time, error) {
	key, err := s.blobKey(digest)
	if err != nil {
		return time.Time{}, err
	}
	info, err := s.client.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{})
	if err != nil {
		return time.Time{}, s.errorf(err, "blob %s", digest)
	}
	return info.LastModified, nil
}

// Delete removes a blob; ErrNotFound if it was not there (S3's DELETE
// succeeds either way, so it is asked first).
func (s *Store) Delete(ctx context.Context, digest string) error {
	key, err := s.blobKey(digest)
	if err != nil {
		return err
	}
	return s.remove(ctx, key, "blob "+digest)
}

func (s *Store) remove(ctx context.Context, key, what string) error {
	if _, err := s.client.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{}); err != nil {
		return s.errorf(err, "%s", what)
	}
	if err := s.client.RemoveObject(ctx, s.bucket, key, minio.RemoveObjectOptions{}); err != nil {
		return s.errorf(err, "delete %s", what)
	}
	return nil
}

// Walk calls fn for every blob, in digest order (S3 lists keys in order).
func (s *Store) Walk(ctx context.Context, fn func(blobstore.Descriptor) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops the listing when fn stops the walk
	dir := s.prefix + "blobs/sha256/"
	for obj := range s.client.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: dir, Recursive: true}) {
		if obj.Err != nil {
			return s.errorf(obj.Err, "walk blobs")
		}
		digest := digestPrefix + strings.TrimPrefix(obj.Key, dir)
		if blobstore.ValidateDigest(digest) != nil {
			continue
		}
		if err := fn(blobstore.Descriptor{Digest: digest, Size: obj.Size}); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// Refs returns the store's refs, kept under PREFIX/refs/.
func (s *Store) Refs() blobstore.Refs { return refs{s} }

// refs is a separate type because Refs and Store both have Delete.
type refs struct{ s *Store }

// Get returns the digest a ref points at.
func (r refs) Get(ctx context.Context, name string) (string, error) {
	key, err := r.s.refKey(name)
	if err != nil {
		return "", err
	}
	return r.s.readRef(ctx, name, key)
}

func (s *Store) readRef(ctx context.Context, name, key string) (string, error) {
	obj, err := s.client.GetObject(ctx, s.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return "", s.errorf(err, "ref %q", name)
	}
	defer obj.Close()
	b, err := io.ReadAll(io.LimitReader(obj, maxRefBytes))
	if err != nil {
		return "", s.errorf(err, "ref %q", name)
	}
	digest := strings.TrimSuffix(string(b), "\n")
	if err := blobstore.ValidateDigest(digest); err != nil {
		return "", fmt.Errorf("ref %q is corrupt: %w", name, err)
	}
	return digest, nil
}

// Set points a ref at digest with one PUT: atomic, as S3 replaces whole
// objects.
func (r refs) Set(ctx context.Context, name, digest string) error {
	key, err := r.s.refKey(name)
	if err != nil {
		return err
	}
	if err := blobstore.ValidateDigest(digest); err != nil {
		return fmt.Errorf("set ref %q: %w", name, err)
	}
	return r.s.putRef(ctx, name, key, digest)
}

func (s *Store) putRef(ctx context.Context, name, key, digest string) error {
	body := digest + "\n"
	_, err := s.client.PutObject(ctx, s.bucket, key, strings.NewReader(body), int64(len(body)),
		minio.PutObjectOptions{ContentType: "text/plain"})
	if err != nil {
		return s.errorf(err, "set ref %q", name)
	}
	return nil
}

// Delete removes a ref.
func (r refs) Delete(ctx context.Context, name string) error {
	key, err := r.s.refKey(name)
	if err != nil {
		return err
	}
	return r.s.remove(ctx, key, fmt.Sprintf("ref %q", name))
}

// List returns refs whose names start with prefix, sorted by name: one
// listing, then the refs read, parallel requests at a time.
func (r refs) List(ctx context.Context, prefix string) ([]blobstore.Ref, error) {
	s := r.s
	dir := s.prefix + "refs/"
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var names []string
	for obj := range s.client.ListObjects(lctx, s.bucket, minio.ListObjectsOptions{Prefix: dir + prefix, Recursive: true}) {
		if obj.Err != nil {
			return nil, s.errorf(obj.Err, "list refs with prefix %q", prefix)
		}
		name := strings.TrimPrefix(obj.Key, dir)
		if blobstore.ValidateRefName(name) != nil {
			continue
		}
		names = append(names, name)
	}
	out := make([]blobstore.Ref, len(names))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(parallel)
	for i, name := range names {
		g.Go(func() error {
			d, err := s.readRef(gctx, name, dir+name)
			if errors.Is(err, blobstore.ErrNotFound) {
				return nil // deleted since the listing
			}
			out[i] = blobstore.Ref{Name: name, Digest: d}
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return nil, fmt.Errorf("list refs with prefix %q: %w", prefix, err)
	}
	// S3 lists keys in byte order, which is the order of names; refs
	// deleted since the listing leave holes.
	kept := out[:0]
	for _, ref := range out {
		if ref.Name != "" {
			kept = append(kept, ref)
		}
	}
	return kept, nil
}

// WriteBatch uploads the batch's blobs, parallel requests at a time, and
// only when every one is stored sets its refs the same way: no ref can
// name a blob that failed to store.
func (s *Store) WriteBatch(ctx context.Context, b blobstore.Batch) error {
	digests, err := b.Check(ctx, s)
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(parallel)
	seen := map[string]bool{}
	for i, blob := range b.Blobs {
		if seen[digests[i]] {
			continue
		}
		seen[digests[i]] = true
		key, err := s.blobKey(digests[i])
		if err != nil {
			return err
		}
		g.Go(func() error {
			// One PUT, not a HEAD first: a batch's blobs are small, so
			// storing one again costs what asking would, and refreshes
			// its age as well.
			_, err := s.client.PutObject(gctx, s.bucket, key, bytes.NewReader(blob), int64(len(blob)),
				minio.PutObjectOptions{ContentType: "application/octet-stream"})
			if err != nil {
				return s.errorf(err, "write batch: put blob %s", digests[i])
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	refs := b.LastRefs()
	errs := make([]error, len(refs))
	g = &errgroup.Group{}
	g.SetLimit(parallel)
	for i, ref := range refs {
		g.Go(func() error {
			key, err := s.refKey(ref.Name)
			if err == nil {
				err = s.putRef(ctx, ref.Name, key, ref.Digest)
			}
			if err != nil {
				errs[i] = fmt.Errorf("write batch: %w", err)
			}
			return nil
		})
	}
	g.Wait()
	return errors.Join(errs...)
}
