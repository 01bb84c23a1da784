package layer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// ChunkSize is the unit a lazy loader fetches and verifies: big enough that
// a range request's latency is spread over a useful amount of data, small
// enough that reads of scattered small files do not fetch much more than
// they read. A Python start from a 915 MiB Debian image fetched 3.7 times
// what the kernel read with 1 MiB chunks, 1.9 times with 256 KiB, 1.6
// times with 128 KiB (bench/lazybench; metadata, the most scattered, has
// extents of its own). The index records the size, so loaders follow
// whatever a layer was indexed with.
const ChunkSize = 128 << 10

// chunkMagic starts every chunk index. It is not JSON on purpose: gc scans
// JSON blobs named by refs for digests to keep, and an index must not keep
// its layer alive (the layer's own refs decide that).
const chunkMagic = "DSECCHK1"

// ChunkIndex is the digest list stored beside a layer: the sha256 of every
// ChunkSize piece of the layer file (the last one shorter), so that a
// loader reading ranges, which cannot check the whole blob's digest, can
// check each piece it fetches. Meta lists the extents of the file that
// hold EROFS metadata (superblock, inodes, directories, xattrs, symlinks:
// everything but regular files' data blocks), each with its own sha256, so
// that a loader can fetch them before the mount without the data chunks
// around them: in a 915 MiB Debian image 2 MiB of metadata is spread over
// 210 of its 1 MiB chunks.
type ChunkIndex struct {
	Layer     string // the layer's digest (not stored in the blob)
	Size      int64
	ChunkSize int64
	Sums      [][sha256.Size]byte
	Meta      []Extent
}

// Extent is a byte range of a layer file and the sha256 of its bytes.
type Extent struct {
	Off, Len int64
	Sum      [sha256.Size]byte
}

// MetaBytes returns the bytes of all metadata extents.
func (x *ChunkIndex) MetaBytes() int64 {
	var n int64
	for _, e := range x.Meta {
		n += e.Len
	}
	return n
}

// ChunkRef is the ref naming the chunk index of the layer digest.
func ChunkRef(digest string) string {
	return "lazy/chunks/" + strings.TrimPrefix(digest, "sha256:")
}

// PrefetchRef is the ref naming the prefetch list of the layer digest (the
// chunks a first run read, in order; see lazyfs).
func PrefetchRef(digest string) string {
	return "lazy/prefetch/" + strings.TrimPrefix(digest, "sha256:")
}

// Chunks returns how many chunks the layer has.
func (x *ChunkIndex) Chunks() int { return len(x.Sums) }

// Extent returns the byte range of chunk i.
func (x *ChunkIndex) Extent(i int) (off, n int64) {
	off = int64(i) * x.ChunkSize
	n = min(x.ChunkSize, x.Size-off)
	return off, n
}

// MarshalBinary encodes the index: magic, chunk size, layer size, counts,
// the metadata extents (offset, length, sum), then the chunks' raw sums.
func (x *ChunkIndex) MarshalBinary() ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(chunkMagic)
	var hdr [24]byte
	binary.LittleEndian.PutUint32(hdr[0:], uint32(x.ChunkSize))
	binary.LittleEndian.PutUint64(hdr[4:], uint64(x.Size))
	binary.LittleEndian.PutUint32(hdr[12:], uint32(len(x.Sums)))
	binary.LittleEndian.PutUint32(hdr[16:], uint32(len(x.Meta)))
	b.Write(hdr[:])
	for _, m := range x.Meta {
		b.Write(binary.LittleEndian.AppendUint64(nil, uint64(m.Off)))
		b.Write(binary.LittleEndian.AppendUint64(nil, uint64(m.Len)))
		b.Write(m.Sum[:])
	}
	for _, s := range x.Sums {
		b.Write(s[:])
	}
	return b.Bytes(), nil
}

// ParseChunkIndex decodes an index and checks it is consistent with itself.
func ParseChunkIndex(layerDigest string, b []byte) (*ChunkIndex, error) {
	bad := func(why string) (*ChunkIndex, error) {
		return nil, fmt.Errorf("chunk index of %s: %s", layerDigest, why)
	}
	if len(b) < len(chunkMagic)+24 || string(b[:len(chunkMagic)]) != chunkMagic {
		return bad("no magic")
	}
	h := b[len(chunkMagic):]
	x := &ChunkIndex{
		Layer:     layerDigest,
		ChunkSize: int64(binary.LittleEndian.Uint32(h[0:])),
		Size:      int64(binary.LittleEndian.Uint64(h[4:])),
	}
	n := int64(binary.LittleEndian.Uint32(h[12:]))
	nm := int64(binary.LittleEndian.Uint32(h[16:]))
	rest := h[24:]
	if x.ChunkSize <= 0 || x.Size < 0 || n != (x.Size+x.ChunkSize-1)/x.ChunkSize {
		return bad("sizes disagree")
	}
	const extentSize = 16 + sha256.Size
	if int64(len(rest)) != nm*extentSize+n*sha256.Size {
		return bad("wrong length")
	}
	for i := range nm {
		r := rest[i*extentSize:]
		e := Extent{Off: int64(binary.LittleEndian.Uint64(r)), Len: int64(binary.LittleEndian.Uint64(r[8:]))}
		copy(e.Sum[:], r[16:])
		if e.Off < 0 || e.Len <= 0 || e.Off+e.Len > x.Size || (i > 0 && e.Off < x.Meta[i-1].Off+x.Meta[i-1].Len) {
			return bad("metadata extent out of range or order")
		}
		x.Meta = append(x.Meta, e)
	}
	rest = rest[nm*extentSize:]
	x.Sums = make([][sha256.Size]byte, n)
	for i := range x.Sums {
		copy(x.Sums[i][:], rest[i*sha256.Size:])
	}
	return x, nil
}

// IndexFile computes the chunk index of the EROFS file at path. A file
// whose metadata cannot be walked (not EROFS, a layout this walker does
// not know) gets the whole file as one metadata extent: the loader then
// fetches it all up front, correct if not lazy.
func IndexFile(path string) (*ChunkIndex, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	x := &ChunkIndex{Size: fi.Size(), ChunkSize: ChunkSize}
	buf := make([]byte, ChunkSize)
	for off := int64(0); off < x.Size; off += ChunkSize {
		n, err := io.ReadFull(io.NewSectionReader(f, off, ChunkSize), buf)
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("index %s: %w", path, err)
		}
		x.Sums = append(x.Sums, sha256.Sum256(buf[:n]))
	}
	runs, err := erofsMetaRuns(f, x.Size)
	if err != nil {
		runs = [][2]int64{{0, x.Size}}
	}
	for _, r := range runs {
		b := make([]byte, r[1])
		if _, err := f.ReadAt(b, r[0]); err != nil {
			return nil, fmt.Errorf("index %s: %w", path, err)
		}
		x.Meta = append(x.Meta, Extent{Off: r[0], Len: r[1], Sum: sha256.Sum256(b)})
	}
	return x, nil
}

// storeChunkIndex indexes the layer file at path (already stored as desc)
// and stores the index beside it, when the store keeps refs. Layers of one
// chunk or less get none: a loader fetches those whole.
func storeChunkIndex(ctx context.Context, store blobstore.Store, desc blobstore.Descriptor, x *ChunkIndex) error {
	repo, ok := store.(blobstore.Repository)
	if !ok || x == nil || desc.Size <= ChunkSize {
		return nil
	}
	b, _ := x.MarshalBinary()
	idx, err := store.Put(ctx, bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("store chunk index of %s: %w", desc.Digest, err)
	}
	if err := repo.Refs().Set(ctx, ChunkRef(desc.Digest), idx.Digest); err != nil {
		return fmt.Errorf("store chunk index of %s: %w", desc.Digest, err)
	}
	return nil
}

// LoadChunkIndex reads the chunk index stored beside layer digest;
// blobstore.ErrNotFound when it has none (layers stored before indexes
// existed, or of one chunk).
func LoadChunkIndex(ctx context.Context, repo blobstore.Repository, digest string, size int64) (*ChunkIndex, error) {
	idx, err := repo.Refs().Get(ctx, ChunkRef(digest))
	if err != nil {
		return nil, err
	}
	b, err := blobstore.ReadAll(ctx, repo, idx)
	if err != nil {
		return nil, err
	}
	x, err := ParseChunkIndex(digest, b)
	if err != nil {
		return nil, err
	}
	if size >= 0 && x.Size != size {
		return nil, fmt.Errorf("chunk index of %s: says %d bytes, the layer has %d", digest, x.Size, size)
	}
	return x, nil
}

// EROFS on-disk layout (include/uapi/linux/erofs_fs.h), as far as the
// metadata walk needs it.
const (
	sbOffRootNid    = 14
	sbOffMetaBlk    = 40
	inodeSlot       = 32
	layoutFlatPlain = 0
	layoutFlatInl   = 2
	direntSize      = 12
	ftypeReg        = 1
	ftypeDir        = 2
)

// erofsMetaRuns walks the directory tree of the EROFS image in r and
// returns the byte ranges (offset, length) holding anything but
// regular-file data blocks.
func erofsMetaRuns(r io.ReaderAt, size int64) ([][2]int64, error) {
	sb := make([]byte, 128)
	if _, err := r.ReadAt(sb, sbOffset); err != nil {
		return nil, err
	}
	if binary.LittleEndian.Uint32(sb) != sbMagic {
		return nil, errors.New("not EROFS")
	}
	bits := sb[sbOffBlkSzBits]
	if bits < 9 || bits > 16 {
		return nil, errors.New("bad block size")
	}
	blksz := int64(1) << bits
	metaBase := int64(binary.LittleEndian.Uint32(sb[sbOffMetaBlk:])) * blksz
	nblocks := (size + blksz - 1) / blksz
	data := make([]bool, nblocks) // blocks that are regular-file data

	type inode struct {
		layout  int
		mode    uint16
		size    int64
		blkaddr int64
		tailOff int64 // where inline data starts
	}
	readInode := func(nid uint64) (inode, error) {
		off := metaBase + int64(nid)*inodeSlot
		b := make([]byte, 64)
		if _, err := r.ReadAt(b, off); err != nil && !errors.Is(err, io.EOF) {
			return inode{}, err
		}
		format := binary.LittleEndian.Uint16(b[0:])
		icount := int64(binary.LittleEndian.Uint16(b[2:]))
		in := inode{layout: int(format>>1) & 7, mode: binary.LittleEndian.Uint16(b[4:])}
		isize := int64(32)
		if format&1 == 1 {
			isize = 64
			in.size = int64(binary.LittleEndian.Uint64(b[8:]))
		} else {
			in.size = int64(binary.LittleEndian.Uint32(b[8:]))
		}
		in.blkaddr = int64(binary.LittleEndian.Uint32(b[16:]))
		xsize := int64(0)
		if icount > 0 {
			xsize = 12 + (icount-1)*4
		}
		in.tailOff = off + isize + xsize
		return in, nil
	}
	// content returns a flat inode's bytes (directories are small).
	content := func(in inode) ([]byte, error) {
		if in.size < 0 || in.size > 64<<20 {
			return nil, errors.New("directory too large")
		}
		out := make([]byte, in.size)
		switch in.layout {
		case layoutFlatPlain:
			_, err := r.ReadAt(out, in.blkaddr*blksz)
			return out, err
		case layoutFlatInl:
			full := in.size / blksz * blksz
			if full > 0 {
				if _, err := r.ReadAt(out[:full], in.blkaddr*blksz); err != nil {
					return nil, err
				}
			}
			_, err := r.ReadAt(out[full:], in.tailOff)
			return out, err
		}
		return nil, fmt.Errorf("directory layout %d", in.layout)
	}
	seen := map[uint64]bool{}
	var walk func(nid uint64, depth int) error
	walk = func(nid uint64, depth int) error {
		if seen[nid] || depth > 4096 {
			return nil
		}
		seen[nid] = true
		in, err := readInode(nid)
		if err != nil {
			return err
		}
		const sIFMT, sIFDIR, sIFREG = 0o170000, 0o040000, 0o100000
		switch in.mode & sIFMT {
		case sIFREG:
			if in.layout == layoutFlatPlain || in.layout == layoutFlatInl {
				n := (in.size + blksz - 1) / blksz
				if in.layout == layoutFlatInl {
					n = in.size / blksz
				}
				for b := in.blkaddr; b < in.blkaddr+n && b < nblocks; b++ {
					if b >= 0 {
						data[b] = true
					}
				}
			}
			return nil
		case sIFDIR:
		default:
			return nil
		}
		d, err := content(in)
		if err != nil {
			return err
		}
		for start := int64(0); start < int64(len(d)); start += blksz {
			blk := d[start:min(start+blksz, int64(len(d)))]
			if len(blk) < direntSize {
				break
			}
			count := int(binary.LittleEndian.Uint16(blk[8:])) / direntSize
			for i := 0; i < count && (i+1)*direntSize <= len(blk); i++ {
				e := blk[i*direntSize:]
				nameOff := int(binary.LittleEndian.Uint16(e[8:]))
				nameEnd := len(blk)
				if i+1 < count {
					nameEnd = int(binary.LittleEndian.Uint16(blk[(i+1)*direntSize+8:]))
				}
				if nameOff > len(blk) || nameEnd > len(blk) || nameOff > nameEnd {
					return errors.New("bad directory entry")
				}
				name := string(bytes.TrimRight(blk[nameOff:nameEnd], "\x00"))
				if name == "." || name == ".." {
					continue
				}
				child := binary.LittleEndian.Uint64(e[0:])
				switch e[10] {
				case ftypeReg, ftypeDir:
					if err := walk(child, depth+1); err != nil {
						return err
					}
				}
			}
		}
		return nil
	}
	if err := walk(uint64(binary.LittleEndian.Uint16(sb[sbOffRootNid:])), 0); err != nil {
		return nil, err
	}
	// Runs of blocks that are not file data, merged across gaps of up to
	// metaGap blocks: one range read for a few extra KiB beats two.
	const metaGap = 8
	var runs [][2]int64
	for b := int64(0); b < nblocks; b++ {
		if data[b] {
			continue
		}
		start := b
		for b+1 < nblocks && !data[b+1] {
			b++
		}
		off, end := start*blksz, min((b+1)*blksz, size)
		if n := len(runs); n > 0 && off-(runs[n-1][0]+runs[n-1][1]) <= metaGap*blksz {
			runs[n-1][1] = end - runs[n-1][0]
			continue
		}
		runs = append(runs, [2]int64{off, end - off})
	}
	return runs, nil
}
