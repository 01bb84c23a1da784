// Package layer turns root filesystems into EROFS layers and mounts them.
//
// A layer is one uncompressed EROFS image, named by the sha256 of its bytes
// and kept in the blob store. Inputs are a directory, a rootfs tarball
// (plain, gzip or zstd), an OCI image layout or a `docker save` archive;
// each OCI layer becomes one EROFS layer so that layers shared between images
// are stored once. OCI whiteouts become overlayfs whiteouts (a 0:0 character
// device, and the trusted.overlay.opaque xattr) so a stack of layers composes
// with a plain overlay mount.
//
// Mounts is the node-wide cache of mounted layers: each layer is mounted
// once, read-only, and shared by every sandbox's overlay.
//
// A checkpoint's layer is the exception to "a layer is an EROFS file": it
// never leaves the node, so DirLayers keeps it as a plain directory copied
// from the sandbox's overlay upper directory (CopyTree), which an overlay
// stacks as a lower directory as is, and Mounts hands out without a mount.
package layer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// mkfsUUID is the filesystem UUID of every layer. A random one would make
// identical trees produce different bytes, so different digests.
const mkfsUUID = "d5ec1a7e-0000-4000-8000-000000000001"

// Build packs the directory dir into an EROFS image and stores it.
//
// The image is uncompressed with data never inlined into inode blocks, so
// that a lazy loader can fetch metadata and data blocks separately; modes,
// owners, mtimes, xattrs (trusted.overlay.* included), hard links and device
// nodes are kept. Builds are reproducible: the same tree (same contents and
// metadata) gives the same bytes and digest. mkfs.erofs 1.5 offers only -T,
// which also overwrites every file's mtime, so instead its one varying field,
// the superblock build time, is zeroed afterwards and the superblock checksum
// recomputed.
func Build(ctx context.Context, store blobstore.Store, dir string) (blobstore.Descriptor, error) {
	if err := checkMkfs(); err != nil {
		return blobstore.Descriptor{}, err
	}
	info, err := os.Stat(dir)
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer: %w", err)
	}
	if !info.IsDir() {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: not a directory", dir)
	}
	ing, canIngest := store.(blobstore.Ingester)
	tmpDir := ""
	if canIngest {
		tmpDir = ing.TempDir()
	}
	f, err := os.CreateTemp(tmpDir, "layer-*.erofs")
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	out := f.Name()
	f.Close()
	defer os.Remove(out) // Ingest moves it away on success

	if err := mkfs(ctx, out, dir); err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	if err := normalizeSuperblock(out); err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	// Indexed before it is stored: Ingest moves the file away.
	index, err := IndexFile(out)
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	var desc blobstore.Descriptor
	if canIngest {
		desc, err = ing.Ingest(ctx, out)
	} else {
		desc, err = blobstore.PutFile(ctx, store, out)
	}
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: store: %w", dir, err)
	}
	// Every layer entering the store (import, pull, snapshot, merge) passes
	// here, so every one gets the chunk index lazy loading needs.
	if err := storeChunkIndex(ctx, store, desc, index); err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	return desc, nil
}

func mkfs(ctx context.Context, out, dir string) error {
	cmd := exec.CommandContext(ctx, "mkfs.erofs",
		"-Enoinline_data", // data blocks stay separate from metadata, for lazy loading
		"-U"+mkfsUUID,
		"--quiet",
		out, dir)
	var stderr bytes.Buffer
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("mkfs.erofs: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}

// EROFS on-disk superblock fields (include/uapi/linux/erofs_fs.h).
const (
	sbOffset        = 1024
	sbMagic         = 0xE0F5E1E2
	sbOffChecksum   = 4
	sbOffFeatCompat = 8
	sbOffBlkSzBits  = 12
	sbOffBuildTime  = 24 // __le64 seconds, then __le32 nanoseconds
	featSBChecksum  = 0x1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// normalizeSuperblock zeroes the build time mkfs.erofs stamps into the
// superblock and fixes up the superblock checksum.
func normalizeSuperblock(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	head := make([]byte, sbOffset+64)
	if _, err := io.ReadFull(f, head); err != nil {
		return fmt.Errorf("read EROFS superblock of %s: %w", path, err)
	}
	sb := head[sbOffset:]
	if binary.LittleEndian.Uint32(sb) != sbMagic {
		return fmt.Errorf("%s: no EROFS superblock magic", path)
	}
	blkSzBits := sb[sbOffBlkSzBits]
	if blkSzBits < 9 || blkSzBits > 16 {
		return fmt.Errorf("%s: EROFS block size 2^%d out of range", path, blkSzBits)
	}
	// The checksum covers the superblock to the end of block 0.
	region := make([]byte, (1<<blkSzBits)-sbOffset)
	if _, err := f.ReadAt(region, sbOffset); err != nil {
		return fmt.Errorf("read EROFS superblock of %s: %w", path, err)
	}
	clear(region[sbOffBuildTime : sbOffBuildTime+12])
	if binary.LittleEndian.Uint32(region[sbOffFeatCompat:])&featSBChecksum != 0 {
		clear(region[sbOffChecksum : sbOffChecksum+4])
		// The kernel computes crc32c seeded with ~0 and without the final
		// inversion that Go's crc32 applies.
		sum := ^crc32.Checksum(region, castagnoli)
		binary.LittleEndian.PutUint32(region[sbOffChecksum:], sum)
	}
	if _, err := f.WriteAt(region, sbOffset); err != nil {
		return fmt.Errorf("write EROFS superblock of %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", path, err)
	}
	return nil
}

var errNoMkfs = errors.New("mkfs.erofs not found on PATH (install erofs-utils)")

// checkMkfs reports early, with a clear message, when mkfs.erofs is missing.
func checkMkfs() error {
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		return errNoMkfs
	}
	return nil
}
