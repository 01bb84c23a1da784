package blobstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Batch is blobs to store and refs to set together, for a writer with many
// small items at once (the trajectories of every sandbox that ended in the
// last moment): see WriteBatch.
type Batch struct {
	Blobs [][]byte
	// Refs each name a blob of the batch or one already stored. When a
	// name appears more than once, the last one wins.
	Refs []Ref
}

// BatchWriter is implemented by repositories that write a Batch with fewer
// flushes to stable storage than a Put per blob and a Set per ref. The
// guarantees are WriteBatch's.
type BatchWriter interface {
	WriteBatch(ctx context.Context, b Batch) error
}

// WriteBatch stores b's blobs and then points b's refs at them, through
// r's own BatchWriter when it has one and otherwise with a Put per blob and
// a Set per ref. No ref is set before every blob of the batch is durably
// stored, so a failure part way leaves each ref either as it was or
// pointing at a stored blob. The refs are not set atomically together: when
// setting some fails, the others may be set, and the error names the
// failed ones. A batch with an invalid ref, or a ref naming a blob that is
// neither in the batch nor stored, is refused before anything is written.
func WriteBatch(ctx context.Context, r Repository, b Batch) error {
	if w, ok := r.(BatchWriter); ok {
		return w.WriteBatch(ctx, b)
	}
	if _, err := b.Check(ctx, r); err != nil {
		return err
	}
	for _, blob := range b.Blobs {
		if _, err := r.Put(ctx, bytes.NewReader(blob)); err != nil {
			return fmt.Errorf("write batch: %w", err)
		}
	}
	refs := r.Refs()
	var errs []error
	for _, ref := range b.LastRefs() {
		if err := refs.Set(ctx, ref.Name, ref.Digest); err != nil {
			errs = append(errs, fmt.Errorf("write batch: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Check validates b against s and returns the digests of its blobs: what a
// BatchWriter does before it writes anything.
func (b Batch) Check(ctx context.Context, s Store) ([]string, error) {
	digests := make([]string, len(b.Blobs))
	in := make(map[string]bool, len(b.Blobs))
	for i, blob := range b.Blobs {
		digests[i] = Digest(blob)
		in[digests[i]] = true
	}
	for _, r := range b.Refs {
		if err := ValidateRefName(r.Name); err != nil {
			return nil, fmt.Errorf("write batch: %w", err)
		}
		if err := ValidateDigest(r.Digest); err != nil {
			return nil, fmt.Errorf("write batch: ref %q: %w", r.Name, err)
		}
		if in[r.Digest] {
			continue
		}
		if _, err := s.Stat(ctx, r.Digest); err != nil {
			return nil, fmt.Errorf("write batch: ref %q names blob %s, which is neither in the batch nor stored: %w", r.Name, r.Digest, err)
		}
	}
	return digests, nil
}

// LastRefs returns b's refs without the ones a later ref of the same name
// overrides, in order.
func (b Batch) LastRefs() []Ref {
	refs := b.Refs
	last := make(map[string]int, len(refs))
	for i, r := range refs {
		last[r.Name] = i
	}
	if len(last) == len(refs) {
		return refs
	}
	out := make([]Ref, 0, len(last))
	for i, r := range refs {
		if last[r.Name] == i {
			out = append(out, r)
		}
	}
	return out
}

// WriteBatch writes b with a few flushes in all instead of two per blob and
// two per ref (Put and Set each fsync their file and its directory):
//
//  1. every new file (blob or ref) is written to tmp/ without a sync;
//  2. one syncfs(2) makes them all durable, where the store's file system
//     is one whose syncfs writes and flushes every dirty file (see
//     syncfsCovers); elsewhere each file is fsynced as it is written;
//  3. the blobs are renamed into place and blobs/sha256 is synced;
//  4. only then are the refs renamed into place and their directories
//     synced, so that no ref can survive a crash without its blob.
//
// Blobs already stored and refs already naming their digest are not written
// again. That is cheaper than writing them, and it spares the file system
// a file created and deleted for nothing: on ext4 without a journal, every
// inode freed in the last half minute or so is one that each later inode
// allocation in its block group scans past.
//
// For the same reason, the refs of a batch that name one digest (the
// sandboxes of a trajectory pack) share one file: its content is written
// once, to the first such ref's temp file, and every other such ref gets a
// hard link to it under a temp name of its own, made before the flush and
// renamed into place like any ref file. Each rename atomically replaces
// only its own name; the inode lives on while any ref names it, so
// nothing is freed either. That is sound only because nothing in the store
// ever writes into a ref file in place: Set and WriteBatch rename a new
// file over it, Delete unlinks it. Where the file system refuses hard links
// (EPERM, EMLINK, EXDEV, ENOTSUP, ENOSYS), the ref gets a file of its own.
func (d *Dir) WriteBatch(ctx context.Context, b Batch) error {
	digests, err := b.Check(ctx, d)
	if err != nil {
		return err
	}
	useSyncfs := d.syncfs && !d.scratch
	perFile := !d.syncfs && !d.scratch
	var root *os.File
	if useSyncfs {
		// Opened before anything is written: syncfs reports the write-back
		// errors of the file system since the descriptor was opened, which
		// then covers every file of the batch.
		if root, err = os.Open(d.root); err != nil {
			return fmt.Errorf("write batch: %w", err)
		}
		defer root.Close()
	}
	type pending struct {
		name, tmp, final string // name: the ref's; "" for a blob
		placed           bool
	}
	var blobs, refs []*pending
	defer func() {
		for _, p := range append(blobs, refs...) {
			if !p.placed {
				os.Remove(p.tmp)
			}
		}
	}()
	now := time.Now()
	seen := make(map[string]bool, len(b.Blobs))
	for i, blob := range b.Blobs {
		if seen[digests[i]] {
			continue
		}
		seen[digests[i]] = true
		final := filepath.Join(d.blobs, strings.TrimPrefix(digests[i], digestPrefix))
		if _, err := os.Lstat(final); err == nil {
			// Stored already: its times move to now, as in commit.
			if err := os.Chtimes(final, now, now); err != nil {
				return fmt.Errorf("write batch: put blob %s: refresh its time: %w", digests[i], err)
			}
			continue
		}
		tmp, err := d.writeTemp(ctx, "put-*", blob, 0o444, perFile)
		if err != nil {
			return fmt.Errorf("write batch: put blob %s: %w", digests[i], err)
		}
		blobs = append(blobs, &pending{tmp: tmp, final: final})
	}
	// shared: for each digest, the temp file of this batch the next ref
	// naming it links to. links: the file system makes hard links.
	shared := map[string]string{}
	links := true
	for _, r := range b.LastRefs() {
		p, err := d.refPath(r.Name)
		if err != nil {
			return err
		}
		if cur, err := readRef(r.Name, p); err == nil && cur == r.Digest {
			continue
		}
		tmp := ""
		if src, ok := shared[r.Digest]; ok && links {
			tmp, err = d.linkTemp(ctx, "ref-", src)
			if err != nil && !noLink(err) {
				return fmt.Errorf("write batch: set ref %q: %w", r.Name, err)
			}
			// EMLINK: src has all the links it can; the file written
			// next takes over.
			links = err == nil || errors.Is(err, syscall.EMLINK)
		}
		if tmp == "" {
			tmp, err = d.writeTemp(ctx, "ref-*", []byte(r.Digest+"\n"), 0o644, perFile)
			if err != nil {
				return fmt.Errorf("write batch: set ref %q: %w", r.Name, err)
			}
			shared[r.Digest] = tmp
		}
		refs = append(refs, &pending{name: r.Name, tmp: tmp, final: p})
	}
	if len(blobs)+len(refs) == 0 {
		return nil
	}
	if useSyncfs {
		d.syncs.Add(1)
		if err := unix.Syncfs(int(root.Fd())); err != nil {
			return fmt.Errorf("write batch: syncfs %s: %w", d.root, err)
		}
	}
	for _, p := range blobs {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := os.Rename(p.tmp, p.final); err != nil {
			return fmt.Errorf("write batch: put blob: %w", err)
		}
		p.placed = true
	}
	if len(blobs) > 0 && !d.scratch {
		if err := d.syncDir(d.blobs); err != nil {
			return fmt.Errorf("write batch: %w", err)
		}
	}
	var errs []error
	var dirs []string
	for _, p := range refs {
		if err := d.placeRef(ctx, p.name, p.tmp, p.final); err != nil {
			errs = append(errs, fmt.Errorf("write batch: %w", err))
			continue
		}
		p.placed = true
		if dir := filepath.Dir(p.final); !slices.Contains(dirs, dir) {
			dirs = append(dirs, dir)
		}
	}
	if !d.scratch {
		for _, dir := range dirs {
			if err := d.syncDir(dir); err != nil {
				errs = append(errs, fmt.Errorf("write batch: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}

// writeTemp writes data to a new file in tmp/ with the given mode, fsynced
// if sync, and returns its name.
func (d *Dir) writeTemp(ctx context.Context, pattern string, data []byte, mode os.FileMode, sync bool) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(d.tmp, pattern)
	if err != nil {
		return "", err
	}
	_, err = f.Write(data)
	if err == nil {
		// Through the descriptor: cheaper than chmod by path. The blob's
		// ctime (its age for garbage collection) is still set within the
		// batch that publishes it.
		err = f.Chmod(mode)
	}
	if err == nil && sync {
		d.syncs.Add(1)
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}

// linkTemp makes a hard link to src, a file in tmp/, under a new name in
// tmp/ starting with prefix, and returns that name.
func (d *Dir) linkTemp(ctx context.Context, prefix, src string) (string, error) {
	for {
		if err := ctx.Err(); err != nil {
			return "", err
		}
		name := filepath.Join(d.tmp, prefix+strconv.FormatUint(rand.Uint64(), 36))
		err := os.Link(src, name)
		if errors.Is(err, fs.ErrExist) {
			continue // another writer's temp file: draw again
		}
		if err != nil {
			return "", err
		}
		return name, nil
	}
}

// noLink reports whether err from link(2) means that the file system (or
// the file, having as many links as it may) takes no more hard links
// rather than that something failed.
func noLink(err error) bool {
	for _, e := range []error{syscall.EPERM, syscall.EMLINK, syscall.EXDEV, syscall.ENOTSUP, syscall.ENOSYS} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// syncfsCovers reports whether syncfs(2) on the file system holding dir
// makes every file written on it durable, as an fsync of each would: true
// for local file systems whose sync_fs writes back every dirty inode and
// then commits or flushes (ext2/3/4, XFS, btrfs; tmpfs has nothing to make
// durable). Network and FUSE file systems (NFS, 3FS, JuiceFS) get an fsync
// per file instead: a FUSE file system may not pass syncfs on to its server
// at all.
func syncfsCovers(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	switch uint32(st.Type) {
	case unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC, unix.TMPFS_MAGIC:
		return true
	}
	return false
}
