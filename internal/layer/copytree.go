package layer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// treeDigestHeader starts the stream a tree digest is the sha256 of, so a
// tree digest cannot equal the digest of a blob (an EROFS file starts with
// 1 KiB of zeros).
const treeDigestHeader = "dsec-tree-v1\n"

// CopyTree copies the directory tree src into dst, which must not exist,
// keeping all an overlay layer is made of: regular files, directories,
// symlinks, device nodes (overlay whiteouts are 0:0 character devices),
// fifos and sockets; modes, owners, mtimes and atimes to the nanosecond,
// every xattr (trusted.overlay.opaque among them) and hard links within the
// tree. It never follows a symlink. src must not change meanwhile (a
// sandbox's upper directory is copied while the sandbox is frozen).
//
// It returns the tree's digest: "sha256:" and the hex sha256 of a
// canonical listing of the tree (depth first, names in byte order; each
// entry's path, type and mode, owner, mtime, device number, symlink
// target, xattrs, hard-link target and the sha256 of its content),
// computed while copying. Two trees have the same digest exactly when they
// hold the same things (atimes aside); it is not the digest of any blob.
//
// On error dst may be left half-written; the caller removes it.
func CopyTree(ctx context.Context, src, dst string) (string, error) {
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return "", fmt.Errorf("copy tree %s: %w", src, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return "", fmt.Errorf("copy tree %s: not a directory", src)
	}
	c := &treeCopier{
		ctx:   ctx,
		dst:   dst,
		tree:  sha256.New(),
		file:  sha256.New(),
		buf:   [][]byte{make([]byte, 256<<10), make([]byte, 256<<10), make([]byte, 256<<10)},
		links: map[[2]uint64]string{},
	}
	c.tree.Write([]byte(treeDigestHeader))
	if err := c.copyDir(".", src, dst, &st); err != nil {
		return "", fmt.Errorf("copy tree %s: %w", src, err)
	}
	return "sha256:" + hex.EncodeToString(c.tree.Sum(nil)), nil
}

type treeCopier struct {
	ctx  context.Context
	dst  string    // the copy's root
	tree hash.Hash // the canonical listing
	file hash.Hash // one regular file's content, reset per file
	buf  [][]byte  // chunks in flight between copying and hashing
	// links maps a multiply-linked inode (dev, ino) to the path of its
	// first copy, relative to the tree root.
	links map[[2]uint64]string
	rec   []byte // one entry's record, reused
	xbuf  []byte // xattr names and values, reused
}

// copyDir copies the directory src (relative path rel, metadata st) and
// everything under it, children in name order.
func (c *treeCopier) copyDir(rel, src, dst string, st *unix.Stat_t) error {
	if err := unix.Mkdir(dst, 0o700); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	f, err := os.OpenFile(src, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	// The directory's own record comes before its children's.
	xattrs, err := c.xattrs(src)
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	c.record(rel, st, "", xattrs, "", nil)
	slices.Sort(names)
	for _, name := range names {
		if err := c.ctx.Err(); err != nil {
			return err
		}
		crel := name
		if rel != "." {
			crel = rel + "/" + name
		}
		if err := c.copyEntry(crel, filepath.Join(src, name), filepath.Join(dst, name)); err != nil {
			return err
		}
	}
	// Owner, mode, xattrs and times last: children's creation would move
	// the times, and a mode may not let them be created.
	if err := c.setMeta(dst, st, xattrs, true); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	return nil
}

func (c *treeCopier) copyEntry(rel, src, dst string) error {
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	typ := st.Mode & unix.S_IFMT
	if typ == unix.S_IFDIR {
		return c.copyDir(rel, src, dst, &st)
	}
	if st.Nlink > 1 {
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := c.links[key]; ok {
			if err := unix.Link(filepath.Join(c.dst, first), dst); err != nil {
				return fmt.Errorf("%s: hard link to %s: %w", rel, first, err)
			}
			c.record(rel, nil, first, nil, "", nil)
			return nil
		}
		c.links[key] = rel
	}
	xattrs, err := c.xattrs(src)
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	switch typ {
	case unix.S_IFREG:
		sum, err := c.copyFile(src, dst, st.Size)
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		c.record(rel, &st, "", xattrs, "", sum)
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		if err := unix.Symlink(target, dst); err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		c.record(rel, &st, "", xattrs, target, nil)
	case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		if err := unix.Mknod(dst, typ|0o600, int(st.Rdev)); err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		c.record(rel, &st, "", xattrs, "", nil)
	default:
		return fmt.Errorf("%s: unknown file type %#o", rel, typ)
	}
	if err := c.setMeta(dst, &st, xattrs, typ != unix.S_IFLNK); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	return nil
}

// pipelineMin is the size from which a file's bytes are hashed by a
// second goroutine while the next chunk is copied: hashing costs about as
// much as copying, and a sandbox's frozen time is what a checkpoint costs.
// Smaller files are hashed inline, where handing chunks over would cost
// more than it saves.
const pipelineMin = 1 << 20

// copyFile copies a regular file's bytes, returning the sha256 of its
// content. The bytes pass through user space (not copy_file_range)
// because they are hashed on the way.
func (c *treeCopier) copyFile(src, dst string, size int64) ([]byte, error) {
	in, err := unix.Open(src, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(in)
	out, err := unix.Open(dst, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	defer unix.Close(out)
	c.file.Reset()
	if size < pipelineMin {
		for {
			n, err := copyChunk(in, out, c.buf[0])
			if err != nil || n == 0 {
				return c.file.Sum(nil), err
			}
			c.file.Write(c.buf[0][:n])
		}
	}
	// Chunks go round: free -> copied -> hashed -> free.
	free := make(chan []byte, len(c.buf))
	for _, b := range c.buf {
		free <- b
	}
	copied := make(chan []byte, len(c.buf))
	sum := make(chan []byte)
	go func() {
		for b := range copied {
			c.file.Write(b)
			free <- b[:cap(b)]
		}
		sum <- c.file.Sum(nil)
	}()
	for {
		b := <-free
		n, err := copyChunk(in, out, b)
		if err != nil || n == 0 {
			close(copied)
			return <-sum, err
		}
		copied <- b[:n]
	}
}

// copyChunk reads up to len(buf) bytes from in and writes them to out;
// 0 means the end of in.
func copyChunk(in, out int, buf []byte) (int, error) {
	var n int
	for {
		var err error
		n, err = unix.Read(in, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("read: %w", err)
		}
		break
	}
	for b := buf[:n]; len(b) > 0; {
		w, err := unix.Write(out, b)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("write: %w", err)
		}
		b = b[w:]
	}
	return n, nil
}

// setMeta gives dst src's owner, mode (unless a symlink: chmod), xattrs
// and times. Owner before mode: chown clears set-user-ID bits.
func (c *treeCopier) setMeta(dst string, st *unix.Stat_t, xattrs []xattr, chmod bool) error {
	if err := unix.Lchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if chmod {
		if err := unix.Chmod(dst, st.Mode&0o7777); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	for _, x := range xattrs {
		if err := unix.Lsetxattr(dst, x.name, x.value, 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", x.name, err)
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, dst, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

type xattr struct {
	name  string
	value []byte
}

// xattrs lists p's extended attributes, sorted by name. Most entries have
// none, which costs one llistxattr.
func (c *treeCopier) xattrs(p string) ([]xattr, error) {
	if c.xbuf == nil {
		c.xbuf = make([]byte, 4<<10)
	}
	var n int
	for {
		var err error
		n, err = unix.Llistxattr(p, c.xbuf)
		if errors.Is(err, unix.ERANGE) {
			c.xbuf = make([]byte, 2*len(c.xbuf))
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("list xattrs: %w", err)
		}
		break
	}
	if n == 0 {
		return nil, nil
	}
	var out []xattr
	for _, name := range bytes.Split(bytes.TrimRight(c.xbuf[:n], "\x00"), []byte{0}) {
		x := xattr{name: string(name)}
		for size := 256; ; size *= 2 {
			v := make([]byte, size)
			vn, err := unix.Lgetxattr(p, x.name, v)
			if errors.Is(err, unix.ERANGE) && size < 1<<20 {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("get xattr %s: %w", x.name, err)
			}
			x.value = v[:vn]
			break
		}
		out = append(out, x)
	}
	slices.SortFunc(out, func(a, b xattr) int { return strings.Compare(a.name, b.name) })
	return out, nil
}

// record adds one entry to the tree listing: either a hard link to the
// entry first (st nil), or the entry's metadata, link target and content
// sum. Every field is length-prefixed, so no two listings run together.
func (c *treeCopier) record(rel string, st *unix.Stat_t, first string, xattrs []xattr, target string, sum []byte) {
	b := c.rec[:0]
	str := func(s []byte) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	num := func(v uint64) { b = binary.AppendUvarint(b, v) }
	str([]byte(rel))
	if st == nil {
		b = append(b, 'h')
		str([]byte(first))
	} else {
		b = append(b, 'e')
		num(uint64(st.Mode))
		num(uint64(st.Uid))
		num(uint64(st.Gid))
		num(uint64(st.Mtim.Sec))
		num(uint64(st.Mtim.Nsec))
		if t := st.Mode & unix.S_IFMT; t == unix.S_IFCHR || t == unix.S_IFBLK {
			num(st.Rdev)
		}
		str([]byte(target))
		num(uint64(len(xattrs)))
		for _, x := range xattrs {
			str([]byte(x.name))
			str(x.value)
		}
		str(sum)
	}
	c.tree.Write(b)
	c.rec = b
}
