// Package blobstore is DSec's content-addressed store: layers, image
// manifests, snapshots and trajectory segments are all blobs named by the
// sha256 of their bytes, so they are immutable, deduplicated for free and can
// be checked end to end. Named, mutable pointers to blobs (image tags and the
// like) are Refs, kept beside the blobs so that one URL names everything
// durable a deployment owns.
//
// WriteBatch stores many small blobs and sets their refs together, with a
// few flushes to stable storage in all rather than a few per item, for
// writers that produce them in bursts (trajectories of ended sandboxes).
//
// Store and Refs are the seam. Two implementations run the conformance
// suite in blobstoretest: Dir (a local directory or a shared POSIX file
// system such as 3FS, JuiceFS or NFS) and s3store (an S3-compatible object
// store; a package of its own so that this one, which the CLI links, needs
// only the standard library). Cache puts a node-local Dir in front of a
// remote store, so that layers can still be mounted from local files.
package blobstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/url"
	"os"
	"path"
	"strings"
	"time"
)

// Errors callers test for with errors.Is; the wrapping message names the
// digest or ref concerned.
var (
	// ErrNotFound means no blob (or ref) exists under that name.
	ErrNotFound = errors.New("not found")
	// ErrDigestMismatch means stored bytes no longer hash to their name:
	// the blob is corrupt and must not be used.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrInvalidDigest means a string is not of the form "sha256:<64 hex>".
	ErrInvalidDigest = errors.New("invalid digest")
	// ErrInvalidRef means a ref name is not acceptable (see ValidateRefName).
	ErrInvalidRef = errors.New("invalid ref name")
)

// Descriptor names a blob and says how big it is.
type Descriptor struct {
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
}

// Store keeps immutable blobs by digest. Implementations are safe for
// concurrent use, including by several processes sharing the same backing
// storage.
type Store interface {
	// Put stores everything r yields and returns its descriptor. Storing
	// content that is already present is cheap and not an error.
	Put(ctx context.Context, r io.Reader) (Descriptor, error)
	// Open returns the blob's bytes. The reader re-hashes what it yields and
	// fails with ErrDigestMismatch at EOF if the bytes are corrupt, so a
	// caller that reads to EOF never silently consumes bad data.
	Open(ctx context.Context, digest string) (io.ReadCloser, error)
	Stat(ctx context.Context, digest string) (Descriptor, error)
	// Delete removes a blob; ErrNotFound if it was not there.
	Delete(ctx context.Context, digest string) error
	// Walk calls fn for every blob, in digest order for the dir store. An
	// error from fn stops the walk and is returned.
	Walk(ctx context.Context, fn func(Descriptor) error) error
}

// Local is implemented by stores whose blobs are files on this node, so that
// the container runtime can mount a layer with mount(2) straight from the
// store without copying it.
type Local interface {
	// Path returns the blob's file; callers must not modify it.
	Path(digest string) (string, error)
}

// Ingester is implemented by stores that can adopt a finished file by
// renaming it instead of copying its bytes. Builders write into TempDir
// (same file system as the blobs) and then Ingest.
type Ingester interface {
	TempDir() string
	// Ingest hashes the file at path and moves it into the store. The file
	// is gone afterwards whether or not Ingest succeeds.
	Ingest(ctx context.Context, path string) (Descriptor, error)
}

// RangeReader is implemented by stores that can read part of a blob without
// the rest (the lazy layer loader reads chunks). The bytes are NOT verified:
// a part cannot be checked against the whole blob's digest, so callers check
// them against digests of their own (a chunk list stored beside the layer).
type RangeReader interface {
	// OpenRange returns the n bytes of the blob starting at off. Reading
	// fails with io.ErrUnexpectedEOF when the blob ends first; off or n
	// negative is an error before anything is read.
	OpenRange(ctx context.Context, digest string, off, n int64) (io.ReadCloser, error)
}

// Ager is implemented by stores that know when each blob entered the store
// (or was last stored again): garbage collection spares young blobs.
// ErrNotFound when the blob is gone.
type Ager interface {
	BlobTime(ctx context.Context, digest string) (time.Time, error)
}

// Fetcher is implemented by Local stores whose blobs may have to be copied
// to this node before they have a file (Cache): Fetch is Path with a
// context for the copy.
type Fetcher interface {
	Fetch(ctx context.Context, digest string) (string, error)
}

// LocalPath returns the file of a blob of l, fetching it first, within ctx,
// when l is a Fetcher.
func LocalPath(ctx context.Context, l Local, digest string) (string, error) {
	if f, ok := l.(Fetcher); ok {
		return f.Fetch(ctx, digest)
	}
	return l.Path(digest)
}

// Uploader is implemented by remote stores that store a file's bytes
// straight from the file, which stays where it is (Cache moves it into the
// node's copy afterwards).
type Uploader interface {
	Upload(ctx context.Context, path string) (Descriptor, error)
}

// Ref is one named pointer to a blob.
type Ref struct {
	Name   string `json:"name"`
	Digest string `json:"digest"`
}

// Refs keeps named, mutable pointers to blobs. Set is atomic: a reader sees
// the old digest or the new one, never a torn or empty value.
type Refs interface {
	Get(ctx context.Context, name string) (string, error)
	Set(ctx context.Context, name, digest string) error
	// Delete removes a ref; ErrNotFound if it was not there.
	Delete(ctx context.Context, name string) error
	// List returns the refs whose names start with prefix, sorted by name.
	List(ctx context.Context, prefix string) ([]Ref, error)
}

// Repository is a blob store together with its refs: what a blob store URL
// names. Refs is a method, not an embedded interface, because both have a
// Delete.
type Repository interface {
	Store
	Refs() Refs
}

// New opens the repository named by a URL: "dir:///path" or a plain path
// for the dir store. "s3://bucket/prefix" names an s3store, which callers
// that link it open with s3store.Open (this package stays free of its
// dependencies).
func New(rawURL string) (Repository, error) {
	if rawURL == "" {
		return nil, errors.New("blob store URL is empty")
	}
	if !strings.Contains(rawURL, "://") {
		return NewDir(rawURL)
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("blob store URL %q: %w", rawURL, err)
	}
	switch u.Scheme {
	case "dir", "file":
		if u.Host != "" {
			return nil, fmt.Errorf("blob store URL %q: host %q not allowed, use %s:///absolute/path", rawURL, u.Host, u.Scheme)
		}
		if u.Path == "" {
			return nil, fmt.Errorf("blob store URL %q: path is empty", rawURL)
		}
		return NewDir(u.Path)
	case "s3":
		return nil, fmt.Errorf("blob store URL %q: s3 stores are opened with s3store.Open", rawURL)
	default:
		return nil, fmt.Errorf("blob store URL %q: unknown scheme %q (want dir:// or s3://)", rawURL, u.Scheme)
	}
}

const digestPrefix = "sha256:"

// ValidateDigest checks that d is "sha256:" followed by 64 lowercase hex
// digits.
func ValidateDigest(d string) error {
	hexPart, ok := strings.CutPrefix(d, digestPrefix)
	if !ok {
		return fmt.Errorf("%w %q: want sha256:<64 hex digits>", ErrInvalidDigest, d)
	}
	if len(hexPart) != 64 {
		return fmt.Errorf("%w %q: want 64 hex digits, got %d characters", ErrInvalidDigest, d, len(hexPart))
	}
	for _, c := range hexPart {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return fmt.Errorf("%w %q: %q is not a lowercase hex digit", ErrInvalidDigest, d, c)
		}
	}
	return nil
}

// Digest returns the digest of b.
func Digest(b []byte) string {
	sum := sha256.Sum256(b)
	return digestPrefix + hex.EncodeToString(sum[:])
}

// ValidateRefName checks a ref name: '/'-separated components of
// [A-Za-z0-9._:@+-], none empty, "." or "..", at most 1024 bytes. The
// components map to directories in the dir store, so a name cannot also be
// the parent of another name ("a" and "a/b" conflict).
func ValidateRefName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty", ErrInvalidRef)
	}
	if len(name) > 1024 {
		return fmt.Errorf("%w %q: longer than 1024 bytes", ErrInvalidRef, name)
	}
	for comp := range strings.SplitSeq(name, "/") {
		if comp == "" || comp == "." || comp == ".." {
			return fmt.Errorf("%w %q: empty, \".\" or \"..\" path component", ErrInvalidRef, name)
		}
		for _, c := range comp {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("._:@+-", c)) {
				return fmt.Errorf("%w %q: character %q not allowed", ErrInvalidRef, name, c)
			}
		}
	}
	if path.Clean(name) != name {
		return fmt.Errorf("%w %q: not a clean path", ErrInvalidRef, name)
	}
	return nil
}

// PutFile stores the contents of the file at path.
func PutFile(ctx context.Context, s Store, path string) (Descriptor, error) {
	f, err := os.Open(path)
	if err != nil {
		return Descriptor{}, fmt.Errorf("put file: %w", err)
	}
	defer f.Close()
	return s.Put(ctx, f)
}

// ReadAll returns a whole blob, verified.
func ReadAll(ctx context.Context, s Store, digest string) ([]byte, error) {
	rc, err := s.Open(ctx, digest)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return nil, fmt.Errorf("read blob %s: %w", digest, err)
	}
	return b, nil
}

// VerifyingReader wraps r, the bytes of blob digest of the given size, and
// fails at EOF with ErrDigestMismatch unless they hash to digest. Store
// implementations use it for Open.
func VerifyingReader(r io.ReadCloser, digest string, size int64) io.ReadCloser {
	return &verifier{r: r, h: sha256.New(), digest: digest, size: size}
}

type verifier struct {
	r      io.ReadCloser
	h      hash.Hash
	digest string
	size   int64
	n      int64
	err    error
}

func (v *verifier) Read(p []byte) (int, error) {
	if v.err != nil {
		return 0, v.err
	}
	n, err := v.r.Read(p)
	v.h.Write(p[:n])
	v.n += int64(n)
	if err == io.EOF {
		got := digestPrefix + hex.EncodeToString(v.h.Sum(nil))
		if got != v.digest || (v.size >= 0 && v.n != v.size) {
			v.err = fmt.Errorf("blob %s: read %d bytes hashing to %s: %w", v.digest, v.n, got, ErrDigestMismatch)
			return n, v.err
		}
	}
	if err != nil {
		v.err = err
	}
	return n, err
}

func (v *verifier) Close() error { return v.r.Close() }

// checkRange refuses a range that cannot be read before any I/O.
func checkRange(digest string, off, n int64) error {
	if err := ValidateDigest(digest); err != nil {
		return err
	}
	if off < 0 || n < 0 {
		return fmt.Errorf("blob %s: range of %d bytes at %d: offset and length must not be negative", digest, n, off)
	}
	return nil
}

// ExactReader wraps r, which should yield the n bytes of blob digest from
// off, so that it fails with io.ErrUnexpectedEOF when r ends early (the
// blob is shorter than the range) and yields nothing past n. Store
// implementations use it for OpenRange.
func ExactReader(r io.ReadCloser, digest string, off, n int64) io.ReadCloser {
	return &exact{r: r, digest: digest, off: off, left: n}
}

type exact struct {
	r         io.ReadCloser
	digest    string
	off, left int64
}

func (e *exact) Read(p []byte) (int, error) {
	if e.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > e.left {
		p = p[:e.left]
	}
	n, err := e.r.Read(p)
	e.left -= int64(n)
	e.off += int64(n)
	if err == io.EOF {
		if e.left > 0 {
			return n, fmt.Errorf("blob %s ends before offset %d: %w", e.digest, e.off+e.left, io.ErrUnexpectedEOF)
		}
		return n, io.EOF
	}
	if err == nil && e.left == 0 {
		err = io.EOF
	}
	return n, err
}

func (e *exact) Close() error { return e.r.Close() }
