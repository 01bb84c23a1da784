package blobstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// staleTemp is how old a temp file must be before NewDir deletes it. Several
// processes may share one directory (a shared file system), so a temp file
// can belong to a live writer; nobody writes one blob for a day.
const staleTemp = 24 * time.Hour

// Dir is the directory-backed Repository:
//
//	<root>/blobs/sha256/<hex>   blobs, read-only files
//	<root>/refs/<name>          refs, one file each holding "<digest>\n"
//	<root>/tmp/                 files being written; renamed into place
//
// Every write goes to a temp file in the same file system, is fsynced, and
// is renamed into place, so readers never see partial blobs or refs and
// concurrent writers of the same content simply race to an identical rename.
// WriteBatch does the same for many blobs and refs with a few flushes in
// all (see batch.go).
//
// Ref files are never written in place: Set and WriteBatch rename a new
// file over the old one and Delete unlinks it. WriteBatch relies on that
// when it gives several refs naming one digest one inode (hard links): a
// write through one name would change them all.
type Dir struct {
	root  string
	blobs string
	refs  string
	tmp   string
	// scratch skips every fsync (see Scratch).
	scratch bool
	// syncfs: syncfs(2) on the store's file system makes every file
	// written before it durable (see syncfsCovers).
	syncfs bool
	// syncs counts fsync and syncfs calls, each a flush of the device's
	// write cache on a local disk (see Syncs).
	syncs atomic.Int64
}

// Scratch makes d skip fsync when it stores blobs: for node-local stores
// whose content does not outlive the process that wrote it (checkpoints,
// emptied at every start), where durability buys nothing and costs a
// journal commit per blob.
func (d *Dir) Scratch() *Dir {
	d.scratch = true
	return d
}

func (d *Dir) sync(f *os.File) error {
	if d.scratch {
		return nil
	}
	d.syncs.Add(1)
	return f.Sync()
}

// Syncs returns how many fsync and syncfs calls d has made. Each one
// flushes the disk's write cache, which is most of what durability costs
// on a local disk; benchmarks report it per operation.
func (d *Dir) Syncs() int64 { return d.syncs.Load() }

var (
	_ Repository  = (*Dir)(nil)
	_ Local       = (*Dir)(nil)
	_ Ingester    = (*Dir)(nil)
	_ RangeReader = (*Dir)(nil)
	_ Refs        = dirRefs{}
)

// NewDir opens (creating if needed) a dir store rooted at root, and deletes
// temp files left by writers that died more than a day ago.
func NewDir(root string) (*Dir, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("blob store root %q: %w", root, err)
	}
	d := &Dir{
		root:  abs,
		blobs: filepath.Join(abs, "blobs", "sha256"),
		refs:  filepath.Join(abs, "refs"),
		tmp:   filepath.Join(abs, "tmp"),
	}
	for _, dir := range []string{d.blobs, d.refs, d.tmp} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("blob store root %q: %w", root, err)
		}
	}
	d.syncfs = syncfsCovers(abs)
	d.removeStaleTemp()
	return d, nil
}

// Root returns the store's root directory.
func (d *Dir) Root() string { return d.root }

// TempDir returns a directory on the same file system as the blobs.
func (d *Dir) TempDir() string { return d.tmp }

func (d *Dir) removeStaleTemp() {
	entries, err := os.ReadDir(d.tmp)
	if err != nil {
		return
	}
	for _, e := range entries {
		info, err := e.Info()
		if err != nil || time.Since(info.ModTime()) < staleTemp {
			continue
		}
		if err := os.RemoveAll(filepath.Join(d.tmp, e.Name())); err == nil {
			slog.Info("blobstore: removed stale temp file", "path", filepath.Join(d.tmp, e.Name()))
		}
	}
}

func (d *Dir) blobPath(digest string) (string, error) {
	if err := ValidateDigest(digest); err != nil {
		return "", err
	}
	return filepath.Join(d.blobs, strings.TrimPrefix(digest, digestPrefix)), nil
}

// Put streams r into a temp file, hashing as it goes, then renames it into
// place.
func (d *Dir) Put(ctx context.Context, r io.Reader) (Descriptor, error) {
	f, err := os.CreateTemp(d.tmp, "put-*")
	if err != nil {
		return Descriptor{}, fmt.Errorf("put blob: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op once renamed
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), ctxReader{ctx, r})
	if err != nil {
		f.Close()
		return Descriptor{}, fmt.Errorf("put blob: %w", err)
	}
	if err := d.sync(f); err != nil {
		f.Close()
		return Descriptor{}, fmt.Errorf("put blob: sync %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return Descriptor{}, fmt.Errorf("put blob: %w", err)
	}
	desc := Descriptor{Digest: digestPrefix + hex.EncodeToString(h.Sum(nil)), Size: n}
	return desc, d.commit(tmp, desc)
}

// Ingest hashes the file at path and renames it into the store. If path is
// on another file system it is copied instead. The file is removed either way.
func (d *Dir) Ingest(ctx context.Context, path string) (Descriptor, error) {
	defer os.Remove(path)
	f, err := os.Open(path)
	if err != nil {
		return Descriptor{}, fmt.Errorf("ingest: %w", err)
	}
	h := sha256.New()
	n, err := io.Copy(h, ctxReader{ctx, f})
	if err == nil {
		err = d.sync(f)
	}
	f.Close()
	if err != nil {
		return Descriptor{}, fmt.Errorf("ingest %s: %w", path, err)
	}
	desc := Descriptor{Digest: digestPrefix + hex.EncodeToString(h.Sum(nil)), Size: n}
	err = d.commit(path, desc)
	if errors.Is(err, syscall.EXDEV) {
		return PutFile(ctx, d, path)
	}
	return desc, err
}

// commit moves a finished, synced temp file into place as blob desc.
func (d *Dir) commit(tmp string, desc Descriptor) error {
	final, err := d.blobPath(desc.Digest)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(final); err == nil {
		// Already stored; the caller removes tmp. Its times move to now:
		// garbage collection spares blobs stored within its grace period,
		// and a blob stored again is about to be referenced again.
		now := time.Now()
		if err := os.Chtimes(final, now, now); err != nil {
			return fmt.Errorf("put blob %s: refresh its time: %w", desc.Digest, err)
		}
		return nil
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return fmt.Errorf("put blob %s: %w", desc.Digest, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return fmt.Errorf("put blob %s: %w", desc.Digest, err)
	}
	if d.scratch {
		return nil
	}
	return d.syncDir(d.blobs)
}

// Open returns a reader that verifies the blob's digest at EOF.
func (d *Dir) Open(ctx context.Context, digest string) (io.ReadCloser, error) {
	p, err := d.blobPath(digest)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, d.notFound(digest, err)
	}
	info, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("open blob %s: %w", digest, err)
	}
	return VerifyingReader(f, digest, info.Size()), nil
}

// OpenRange returns n bytes of the blob from off, unverified (see
// RangeReader).
func (d *Dir) OpenRange(ctx context.Context, digest string, off, n int64) (io.ReadCloser, error) {
	if err := checkRange(digest, off, n); err != nil {
		return nil, err
	}
	p, err := d.blobPath(digest)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, d.notFound(digest, err)
	}
	return ExactReader(struct {
		io.Reader
		io.Closer
	}{io.NewSectionReader(f, off, n), f}, digest, off, n), nil
}

func (d *Dir) notFound(digest string, err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("blob %s: %w", digest, ErrNotFound)
	}
	return fmt.Errorf("blob %s: %w", digest, err)
}

// Stat returns the blob's descriptor.
func (d *Dir) Stat(ctx context.Context, digest string) (Descriptor, error) {
	p, err := d.blobPath(digest)
	if err != nil {
		return Descriptor{}, err
	}
	info, err := os.Stat(p)
	if err != nil {
		return Descriptor{}, d.notFound(digest, err)
	}
	return Descriptor{Digest: digest, Size: info.Size()}, nil
}

// Path returns the blob's file; ErrNotFound if it is absent.
func (d *Dir) Path(digest string) (string, error) {
	p, err := d.blobPath(digest)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(p); err != nil {
		return "", d.notFound(digest, err)
	}
	return p, nil
}

// Verify re-hashes a stored blob; ErrDigestMismatch if it is corrupt.
func (d *Dir) Verify(ctx context.Context, digest string) error {
	rc, err := d.Open(ctx, digest)
	if err != nil {
		return err
	}
	defer rc.Close()
	_, err = io.Copy(io.Discard, ctxReader{ctx, rc})
	return err
}

// Delete removes a blob.
func (d *Dir) Delete(ctx context.Context, digest string) error {
	p, err := d.blobPath(digest)
	if err != nil {
		return err
	}
	if err := os.Remove(p); err != nil {
		return d.notFound(digest, err)
	}
	return nil
}

// Walk calls fn for every blob in digest order. Blobs deleted during the
// walk are skipped.
func (d *Dir) Walk(ctx context.Context, fn func(Descriptor) error) error {
	entries, err := os.ReadDir(d.blobs)
	if err != nil {
		return fmt.Errorf("walk blobs: %w", err)
	}
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return err
		}
		digest := digestPrefix + e.Name()
		if ValidateDigest(digest) != nil {
			continue
		}
		info, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("walk blobs: %w", err)
		}
		if err := fn(Descriptor{Digest: digest, Size: info.Size()}); err != nil {
			return err
		}
	}
	return nil
}

// Refs returns the store's refs, kept under <root>/refs.
func (d *Dir) Refs() Refs { return dirRefs{d} }

// dirRefs is a separate type because Refs and Store both have Delete.
type dirRefs struct{ d *Dir }

func (d *Dir) refPath(name string) (string, error) {
	if err := ValidateRefName(name); err != nil {
		return "", err
	}
	return filepath.Join(d.refs, filepath.FromSlash(name)), nil
}

// Get returns the digest a ref points at.
func (r dirRefs) Get(ctx context.Context, name string) (string, error) {
	d := r.d
	p, err := d.refPath(name)
	if err != nil {
		return "", err
	}
	return readRef(name, p)
}

func readRef(name, p string) (string, error) {
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.EISDIR) {
		return "", fmt.Errorf("ref %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("ref %q: %w", name, err)
	}
	digest := strings.TrimSuffix(string(b), "\n")
	if err := ValidateDigest(digest); err != nil {
		return "", fmt.Errorf("ref %q is corrupt: %w", name, err)
	}
	return digest, nil
}

// Set points a ref at digest, atomically: a new file is renamed over the
// old one, never written in place, since the old one's inode may be shared
// with other refs (see WriteBatch).
func (r dirRefs) Set(ctx context.Context, name, digest string) error {
	d := r.d
	p, err := d.refPath(name)
	if err != nil {
		return err
	}
	if err := ValidateDigest(digest); err != nil {
		return fmt.Errorf("set ref %q: %w", name, err)
	}
	f, err := os.CreateTemp(d.tmp, "ref-*")
	if err != nil {
		return fmt.Errorf("set ref %q: %w", name, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, err = f.WriteString(digest + "\n")
	if err == nil {
		d.syncs.Add(1)
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("set ref %q: %w", name, err)
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return fmt.Errorf("set ref %q: %w", name, err)
	}
	if err := d.placeRef(ctx, name, tmp, p); err != nil {
		return err
	}
	return d.syncDir(filepath.Dir(p))
}

// placeRef renames the finished ref file tmp to p, the file of ref name,
// creating its directories. The rename still has to be made durable by
// syncing p's directory.
func (d *Dir) placeRef(ctx context.Context, name, tmp, p string) error {
	parent := filepath.Dir(p)
	// A concurrent Delete may prune the parent directory between MkdirAll
	// and Rename; try again a few times rather than fail.
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		err := os.MkdirAll(parent, 0o755)
		if err == nil {
			err = os.Rename(tmp, p)
		}
		switch {
		case err == nil:
			return nil
		case errors.Is(err, fs.ErrNotExist) && attempt < 10:
			continue
		case errors.Is(err, syscall.EISDIR) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, fs.ErrExist) || errors.Is(err, syscall.ENOTEMPTY):
			return fmt.Errorf("set ref %q: conflicts with another ref (a name cannot also be a prefix directory of other names): %w", name, err)
		default:
			return fmt.Errorf("set ref %q: %w", name, err)
		}
	}
}

// Delete removes a ref and prunes the directories it leaves empty. It
// unlinks the ref's name only: other refs sharing its inode (see
// WriteBatch) keep it.
func (r dirRefs) Delete(ctx context.Context, name string) error {
	d := r.d
	p, err := d.refPath(name)
	if err != nil {
		return err
	}
	info, err := os.Lstat(p)
	if err != nil || !info.Mode().IsRegular() {
		return fmt.Errorf("ref %q: %w", name, ErrNotFound)
	}
	if err := os.Remove(p); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("ref %q: %w", name, ErrNotFound)
		}
		return fmt.Errorf("delete ref %q: %w", name, err)
	}
	dir := filepath.Dir(p)
	for ; dir != d.refs && strings.HasPrefix(dir, d.refs); dir = filepath.Dir(dir) {
		if os.Remove(dir) != nil {
			break // not empty (or raced with a Set): stop pruning
		}
	}
	if err := d.syncDir(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// List returns refs whose names start with prefix, sorted by name.
func (r dirRefs) List(ctx context.Context, prefix string) ([]Ref, error) {
	d := r.d
	start := d.refs
	if i := strings.LastIndex(prefix, "/"); i > 0 {
		dir := prefix[:i]
		if err := ValidateRefName(dir); err != nil {
			return nil, fmt.Errorf("list refs with prefix %q: %w", prefix, err)
		}
		start = filepath.Join(d.refs, filepath.FromSlash(dir))
	}
	var refs []Ref
	err := filepath.WalkDir(start, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // raced with a Delete, or no such prefix
			}
			return err
		}
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if !e.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(d.refs, p)
		if err != nil {
			return err
		}
		name := filepath.ToSlash(rel)
		if !strings.HasPrefix(name, prefix) {
			return nil
		}
		digest, err := readRef(name, p)
		if errors.Is(err, ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		refs = append(refs, Ref{Name: name, Digest: digest})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list refs with prefix %q: %w", prefix, err)
	}
	sort.Slice(refs, func(i, j int) bool { return refs[i].Name < refs[j].Name })
	return refs, nil
}

// syncDir makes a rename in dir durable.
func (d *Dir) syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync dir %s: %w", dir, err)
	}
	defer f.Close()
	d.syncs.Add(1)
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync dir %s: %w", dir, err)
	}
	return nil
}

// ContextReader returns r wrapped so that a long copy from it stops with
// ctx's error once ctx is cancelled.
func ContextReader(ctx context.Context, r io.Reader) io.Reader { return ctxReader{ctx, r} }

// ctxReader stops a long copy when its context is cancelled.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
