package layer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"slices"
	"strings"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// Compression of a tar stream, detected from its first bytes.
type compression int

const (
	compressNone compression = iota
	compressGzip
	compressZstd
)

var (
	magicGzip  = []byte{0x1f, 0x8b}
	magicZstd  = []byte{0x28, 0xb5, 0x2f, 0xfd}
	magicBzip2 = []byte("BZh")
	magicXz    = []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}
)

func detect(head []byte) (compression, error) {
	switch {
	case bytes.HasPrefix(head, magicGzip):
		return compressGzip, nil
	case bytes.HasPrefix(head, magicZstd):
		return compressZstd, nil
	case bytes.HasPrefix(head, magicBzip2):
		return 0, errors.New("bzip2 compression is not supported (use gzip or zstd)")
	case bytes.HasPrefix(head, magicXz):
		return 0, errors.New("xz compression is not supported (use gzip or zstd)")
	}
	return compressNone, nil
}

// decompress returns the tar stream inside r, which may be plain, gzip or
// zstd; the kind is told by magic bytes, not by a file name.
func decompress(r io.Reader) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, err := br.Peek(6)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	kind, err := detect(head)
	if err != nil {
		return nil, err
	}
	switch kind {
	case compressGzip:
		return gzip.NewReader(br)
	case compressZstd:
		zr, err := zstd.NewReader(br)
		if err != nil {
			return nil, err
		}
		return zr.IOReadCloser(), nil
	}
	return io.NopCloser(br), nil
}

const (
	whiteoutPrefix = ".wh."
	whiteoutMeta   = ".wh..wh."
	whiteoutOpaque = ".wh..wh..opq"
	opaqueXattr    = "trusted.overlay.opaque"
	paxXattrPrefix = "SCHILY.xattr."
)

// Extract unpacks a tar stream (plain, gzip or zstd) into dir, which must
// exist and should be empty. It runs as root: owners, modes, mtimes, device
// nodes and xattrs (from PAX records) are restored.
//
// Every path is resolved inside dir, as if dir were the root directory:
// ".." cannot climb out and symlinks in the archive, absolute or relative,
// point back into dir (openat2 RESOLVE_IN_ROOT), so a hostile archive cannot
// write outside it.
//
// OCI whiteouts become overlayfs ones: ".wh.NAME" a 0:0 character device
// NAME, and ".wh..wh..opq" the xattr trusted.overlay.opaque=y on its
// directory.
func Extract(ctx context.Context, r io.Reader, dir string) error {
	return extract(ctx, r, dir, nil)
}

// ErrTooLarge is matched by every *SizeLimitError.
var ErrTooLarge = errors.New("import size limit exceeded")

// SizeLimitError says that an import expands past its limit.
type SizeLimitError struct {
	// Limit is the bound in bytes, counted after decompression.
	Limit int64
}

func (e *SizeLimitError) Error() string {
	return fmt.Sprintf("the image expands to more than %d bytes after decompression, the import size limit", e.Limit)
}

// Unwrap makes errors.Is(err, ErrTooLarge) hold.
func (e *SizeLimitError) Unwrap() error { return ErrTooLarge }

// entryCost is what every archive entry is charged besides its content:
// a tar header's size, so that millions of empty files cost too.
const entryCost = 512

// budget bounds what one import may expand to, over all its layers. A nil
// budget is unbounded.
type budget struct{ limit, used int64 }

// take charges n bytes, or fails without charging when the limit would
// be passed.
func (b *budget) take(n int64) error {
	if b == nil {
		return nil
	}
	if n < 0 || n > b.limit-b.used {
		return &SizeLimitError{Limit: b.limit}
	}
	b.used += n
	return nil
}

// boundedReader fails once more than its budget's limit has been read
// through it: the decompressed stream itself (PAX records, padding) is
// bounded as well as the entries it describes.
type boundedReader struct {
	r     io.Reader
	n     int64
	limit int64
}

func (br *boundedReader) Read(p []byte) (int, error) {
	n, err := br.r.Read(p)
	br.n += int64(n)
	if br.n > br.limit {
		return n, &SizeLimitError{Limit: br.limit}
	}
	return n, err
}

func extract(ctx context.Context, r io.Reader, dir string, b *budget) error {
	decompressed, err := decompress(r)
	if err != nil {
		return fmt.Errorf("extract into %s: %w", dir, err)
	}
	defer decompressed.Close()
	var stream io.Reader = decompressed
	if b != nil {
		stream = &boundedReader{r: decompressed, limit: b.limit}
	}
	x, err := newExtractor(dir)
	if err != nil {
		return err
	}
	defer x.close()
	tr := tar.NewReader(stream)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("extract into %s: read tar: %w", dir, err)
		}
		// Charged before anything is written: a sparse entry's size is
		// what it would take on disk, whatever the stream holds.
		if err := b.take(entryCost + max(hdr.Size, 0)); err != nil {
			return err
		}
		if err := x.entry(ctx, hdr, tr); err != nil {
			return fmt.Errorf("extract into %s: entry %q: %w", dir, hdr.Name, err)
		}
	}
	return x.finish()
}

type extractor struct {
	dir    string
	rootfd int
	// The parent directory of the previous entry, kept open because tar
	// entries come grouped by directory. It cannot go stale: an entry only
	// ever removes or replaces a child of its own parent, and any entry
	// with a different parent replaces the cache.
	cacheRel string
	cacheFd  int
	// Directory mtimes are set last: creating entries inside a directory
	// changes its mtime.
	dirTimes []dirTime
}

type dirTime struct {
	rel  string
	time unix.Timespec
}

func newExtractor(dir string) (*extractor, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("extract into %s: %w", dir, err)
	}
	// An archive without a "./" entry still yields a usable root, owned
	// by root with mode 0755.
	if err := unix.Fchmodat(fd, ".", 0o755, 0); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("extract into %s: %w", dir, err)
	}
	// Its mtime defaults to the epoch, not the extraction time, so the
	// layer's bytes do not depend on when it was built.
	x := &extractor{dir: dir, rootfd: fd, cacheFd: -1}
	x.dirTimes = append(x.dirTimes, dirTime{rel: "", time: unix.Timespec{}})
	return x, nil
}

func (x *extractor) close() {
	x.dropCache()
	unix.Close(x.rootfd)
}

func (x *extractor) dropCache() {
	if x.cacheFd >= 0 {
		unix.Close(x.cacheFd)
	}
	x.cacheFd, x.cacheRel = -1, ""
}

// cleanName maps an archive path to a path relative to the root ("" is the
// root itself); ".." at the top is dropped, as a chroot would.
func cleanName(name string) string {
	p := path.Clean("/" + name)
	return strings.TrimPrefix(p, "/")
}

func resolveInRoot(rootfd int, rel string, flags uint64) (int, error) {
	if rel == "" {
		rel = "."
	}
	return unix.Openat2(rootfd, rel, &unix.OpenHow{
		Flags:   flags | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
}

// parent returns an O_PATH descriptor of directory rel, creating missing
// directories (0755, root-owned, mtime ts: the time of the entry that needs
// them, so extraction is reproducible) as it goes. The descriptor belongs to
// the extractor's cache: callers must not close it.
func (x *extractor) parent(rel string, ts unix.Timespec) (int, error) {
	if rel == "." {
		rel = ""
	}
	if x.cacheFd >= 0 && x.cacheRel == rel {
		return x.cacheFd, nil
	}
	x.dropCache()
	fd, err := resolveInRoot(x.rootfd, rel, unix.O_PATH|unix.O_DIRECTORY)
	if errors.Is(err, unix.ENOENT) {
		fd, err = x.mkdirAll(rel, ts)
	}
	if err != nil {
		return -1, fmt.Errorf("parent directory %q: %w", rel, err)
	}
	x.cacheFd, x.cacheRel = fd, rel
	return fd, nil
}

func (x *extractor) mkdirAll(rel string, ts unix.Timespec) (int, error) {
	cur, err := unix.Dup(x.rootfd)
	if err != nil {
		return -1, err
	}
	prefix := ""
	for comp := range strings.SplitSeq(rel, "/") {
		prefix = path.Join(prefix, comp)
		next, err := resolveInRoot(x.rootfd, prefix, unix.O_PATH|unix.O_DIRECTORY)
		if errors.Is(err, unix.ENOENT) {
			// cur is already resolved inside the root, and comp is one plain
			// name, so creating it cannot escape.
			if err = unix.Mkdirat(cur, comp, 0o755); err == nil {
				err = unix.Fchmodat(cur, comp, 0o755, 0) // whatever the umask
			}
			if err == nil {
				x.dirTimes = append(x.dirTimes, dirTime{rel: prefix, time: ts})
			}
			if err == nil || errors.Is(err, unix.EEXIST) {
				next, err = resolveInRoot(x.rootfd, prefix, unix.O_PATH|unix.O_DIRECTORY)
			}
		}
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// procPath names base inside the directory open as fd, for the calls that
// have no *at form (lsetxattr, RemoveAll).
func procPath(fd int, base string) string {
	return fmt.Sprintf("/proc/self/fd/%d/%s", fd, base)
}

// removeExisting clears the way for a new entry: a later entry for the same
// path replaces the earlier one, as tar extraction always has.
func (x *extractor) removeExisting(pfd int, base string, keepDir bool) error {
	var st unix.Stat_t
	err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if keepDir {
			return nil
		}
		return os.RemoveAll(procPath(pfd, base))
	}
	return unix.Unlinkat(pfd, base, 0)
}

func (x *extractor) entry(ctx context.Context, hdr *tar.Header, r io.Reader) error {
	name := cleanName(hdr.Name)
	if name == "" {
		if hdr.Typeflag != tar.TypeDir {
			return errors.New("root entry is not a directory")
		}
		return x.meta(x.rootfd, ".", "", hdr)
	}
	dirRel, base := path.Split(name)
	dirRel = strings.TrimSuffix(dirRel, "/")
	pfd, err := x.parent(dirRel, unix.NsecToTimespec(hdr.ModTime.UnixNano()))
	if err != nil {
		return err
	}

	if strings.HasPrefix(base, whiteoutPrefix) {
		return x.whiteout(pfd, base, hdr)
	}

	isDir := hdr.Typeflag == tar.TypeDir
	if err := x.removeExisting(pfd, base, isDir); err != nil {
		return err
	}
	perm := uint32(hdr.Mode & 0o7777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
	case tar.TypeReg, tar.TypeRegA:
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), name)
		_, err = io.Copy(f, blobstore.ContextReader(ctx, r))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case tar.TypeSymlink:
		err = unix.Symlinkat(hdr.Linkname, pfd, base)
	case tar.TypeLink:
		return x.hardlink(pfd, name, base, hdr.Linkname)
	case tar.TypeChar:
		err = x.mknod(pfd, base, unix.S_IFCHR|perm, hdr)
	case tar.TypeBlock:
		err = x.mknod(pfd, base, unix.S_IFBLK|perm, hdr)
	case tar.TypeFifo:
		err = x.mknod(pfd, base, unix.S_IFIFO|perm, hdr)
	default:
		return fmt.Errorf("unsupported tar entry type %q", hdr.Typeflag)
	}
	if err != nil {
		return err
	}
	return x.meta(pfd, base, name, hdr)
}

func (x *extractor) mknod(pfd int, base string, mode uint32, hdr *tar.Header) error {
	return unix.Mknodat(pfd, base, mode, int(unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))))
}

func (x *extractor) hardlink(pfd int, name, base, linkname string) error {
	target := cleanName(linkname)
	if target == "" || target == name {
		return fmt.Errorf("hard link to %q: invalid target", linkname)
	}
	tdir, tbase := path.Split(target)
	tfd, err := resolveInRoot(x.rootfd, strings.TrimSuffix(tdir, "/"), unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return fmt.Errorf("hard link target %q: %w", linkname, err)
	}
	defer unix.Close(tfd)
	// Flags 0: link the target entry itself, never what a symlink points to.
	if err := unix.Linkat(tfd, tbase, pfd, base, 0); err != nil {
		return fmt.Errorf("hard link to %q: %w", linkname, err)
	}
	return nil // a hard link shares its target's metadata
}

func (x *extractor) whiteout(pfd int, base string, hdr *tar.Header) error {
	switch {
	case base == whiteoutOpaque:
		return unix.Lsetxattr(procPath(pfd, "."), opaqueXattr, []byte("y"), 0)
	case strings.HasPrefix(base, whiteoutMeta):
		return nil // other AUFS metadata has no overlay meaning
	}
	target := strings.TrimPrefix(base, whiteoutPrefix)
	if target == "" {
		return errors.New("whiteout names no file")
	}
	if err := x.removeExisting(pfd, target, false); err != nil {
		return err
	}
	if err := unix.Mknodat(pfd, target, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("whiteout %q: %w", target, err)
	}
	ts := unix.NsecToTimespec(hdr.ModTime.UnixNano())
	return unix.UtimesNanoAt(pfd, target, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
}

// meta applies owner, mode, xattrs and (except for directories, which wait
// for finish) times to base in pfd, which is rel from the root.
func (x *extractor) meta(pfd int, base, rel string, hdr *tar.Header) error {
	if err := unix.Fchownat(pfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if hdr.Typeflag != tar.TypeSymlink {
		// After chown, which clears set-id bits.
		if err := unix.Fchmodat(pfd, base, uint32(hdr.Mode&0o7777), 0); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	// Sorted: mkfs.erofs stores xattrs in listxattr order, which follows
	// insertion order, and the layer digest must not depend on map order.
	for _, k := range slices.Sorted(maps.Keys(hdr.PAXRecords)) {
		attr, ok := strings.CutPrefix(k, paxXattrPrefix)
		if !ok {
			continue
		}
		if err := unix.Lsetxattr(procPath(pfd, base), attr, []byte(hdr.PAXRecords[k]), 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", attr, err)
		}
	}
	ts := unix.NsecToTimespec(hdr.ModTime.UnixNano())
	if hdr.Typeflag == tar.TypeDir {
		x.dirTimes = append(x.dirTimes, dirTime{rel: rel, time: ts})
		return nil
	}
	if err := unix.UtimesNanoAt(pfd, base, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

// finish sets directory times once nothing more is created inside them.
func (x *extractor) finish() error {
	x.dropCache()
	for _, d := range x.dirTimes {
		fd, err := resolveInRoot(x.rootfd, d.rel, unix.O_PATH|unix.O_DIRECTORY)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			continue // replaced or removed by a later entry
		}
		if err != nil {
			return fmt.Errorf("extract into %s: directory %q: %w", x.dir, d.rel, err)
		}
		err = unix.UtimesNanoAt(fd, "", []unix.Timespec{d.time, d.time}, unix.AT_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("extract into %s: directory %q: set times: %w", x.dir, d.rel, err)
		}
	}
	return nil
}
