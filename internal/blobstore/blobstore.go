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
// Store and Refs are the seam; the dir implementation (a local directory or a
// shared POSIX file system such as 3FS, JuiceFS or NFS) is the first one and
// runs the conformance suite in blobstoretest. An s3 implementation belongs
// next to it and must run the same suite.
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
// for the dir store. "s3://bucket/prefix" is reserved for the object-store
// implementation.
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
		// The object-store implementation goes here (s3.go), behind the
		// same Repository interface and conformance suite.
		return nil, fmt.Errorf("blob store URL %q: s3 is not implemented yet", rawURL)
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
