package image

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// Disk marks an image that is one bootable disk (the fullvm backend's)
// rather than a stack of EROFS layers: its manifest's only layer is the
// disk file, stored as it was imported.
type Disk struct {
	// Format is DiskQCOW2 or DiskRaw. QEMU is always told it, never left to
	// probe it: a raw disk whose guest wrote a qcow2 header into its first
	// sector would otherwise be opened as a qcow2 pointing at host files.
	Format string `json:"format"`
}

// The disk formats ImportDisk accepts.
const (
	DiskQCOW2 = "qcow2"
	DiskRaw   = "raw"
)

// ErrBackend wraps the refusal of an image by a backend that cannot run
// it (CheckBackend): the caller's to fix, an invalid argument.
var ErrBackend = errors.New("image does not suit the backend")

// ErrBadDisk wraps the refusal of a disk file at import: a qcow2 that
// names a backing file or an external data file (QEMU would read a host
// path), or one it cannot parse.
var ErrBadDisk = errors.New("unusable disk image")

// qcow2 header fields (docs/interop/qcow2.txt in QEMU's sources): all
// big-endian, at these byte offsets.
const (
	qcow2Magic            = 0x514649fb // "QFI\xfb"
	qcow2BackingOffset    = 8          // u64 backing_file_offset
	qcow2HeaderV2Len      = 72
	qcow2IncompatOffset   = 72 // u64 incompatible_features (version 3)
	qcow2HeaderV3MinLen   = 104
	qcow2ExternalDataFile = 1 << 2 // incompatible feature bit 2
)

// DetectDisk reads the head of the disk file at path and returns its
// format: qcow2 when it starts with the qcow2 magic, raw otherwise. A
// qcow2 that depends on another file is refused (ErrBadDisk): a backing
// file or an external data file is a path on the host, which the
// sandbox's QEMU would open and expose to the guest.
func DetectDisk(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return "", err
	}
	if !info.Mode().IsRegular() {
		return "", fmt.Errorf("%w: not a regular file", ErrBadDisk)
	}
	if info.Size() == 0 {
		return "", fmt.Errorf("%w: empty file", ErrBadDisk)
	}
	var h [qcow2HeaderV3MinLen]byte
	n, err := io.ReadFull(f, h[:])
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", err
	}
	if n < 4 || binary.BigEndian.Uint32(h[:4]) != qcow2Magic {
		return DiskRaw, nil
	}
	if n < qcow2HeaderV2Len {
		return "", fmt.Errorf("%w: qcow2 header cut short (%d bytes)", ErrBadDisk, n)
	}
	switch version := binary.BigEndian.Uint32(h[4:8]); version {
	case 2:
	case 3:
		if n < qcow2HeaderV3MinLen {
			return "", fmt.Errorf("%w: qcow2 version 3 header cut short (%d bytes)", ErrBadDisk, n)
		}
		if binary.BigEndian.Uint64(h[qcow2IncompatOffset:])&qcow2ExternalDataFile != 0 {
			return "", fmt.Errorf("%w: the qcow2 keeps its data in an external data file (a host path); convert it to a standalone image (qemu-img convert -O qcow2)", ErrBadDisk)
		}
	default:
		return "", fmt.Errorf("%w: qcow2 version %d not supported", ErrBadDisk, version)
	}
	if binary.BigEndian.Uint64(h[qcow2BackingOffset:]) != 0 {
		return "", fmt.Errorf("%w: the qcow2 has a backing file (a host path); flatten it first (qemu-img convert -O qcow2)", ErrBadDisk)
	}
	return DiskQCOW2, nil
}

// ImportDisk stores the disk file at path (qcow2 or raw, see DetectDisk)
// as one blob and tags ref with a manifest whose only layer it is and
// whose Disk says its format. maxBytes bounds the file's size (0: none).
func ImportDisk(ctx context.Context, store blobstore.Store, images *Store, ref, path string, maxBytes int64) (Manifest, error) {
	if _, err := ParseRef(ref); err != nil {
		return Manifest{}, err
	}
	format, err := DetectDisk(path)
	if err != nil {
		return Manifest{}, fmt.Errorf("import disk %s: %w", path, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return Manifest{}, fmt.Errorf("import disk %s: %w", path, err)
	}
	defer f.Close()
	if maxBytes > 0 {
		info, err := f.Stat()
		if err != nil {
			return Manifest{}, fmt.Errorf("import disk %s: %w", path, err)
		}
		if info.Size() > maxBytes {
			return Manifest{}, fmt.Errorf("import disk %s: %w: %d bytes, the bound is %d", path, ErrDiskTooLarge, info.Size(), maxBytes)
		}
	}
	desc, err := store.Put(ctx, f)
	if err != nil {
		return Manifest{}, fmt.Errorf("import disk %s: %w", path, err)
	}
	m := Manifest{
		Layers:  []blobstore.Descriptor{desc},
		Disk:    &Disk{Format: format},
		Created: time.Now().UTC().Truncate(time.Second),
	}
	if _, err := images.Put(ctx, ref, m); err != nil {
		return Manifest{}, fmt.Errorf("import disk %s: %w", path, err)
	}
	m.SchemaVersion = SchemaVersion
	return m, nil
}

// ErrDiskTooLarge: the disk file is larger than ImportDisk's bound.
var ErrDiskTooLarge = errors.New("disk image too large")

// The backend kinds CheckBackend knows (runtime.Kind's values; this
// package does not depend on internal/runtime).
const fullVM = "fullvm"

// CheckBackend checks that the images a sandbox of backend kind is
// composed from suit it: a fullvm boots exactly one disk image (spec.image,
// with no workspace and no toolkits: they are EROFS layers a disk cannot
// take), and every other backend composes EROFS layers, so takes no disk
// image anywhere. ms are the manifests in spec order (base, then the
// workspace's if any, then each toolkit's); fields names each one as the
// spec does ("spec.image", "spec.workspace", "spec.toolkits[0]"), see
// SpecFields. The error wraps ErrBackend and names the field at fault.
func CheckBackend(kind string, ms []Manifest, fields []string) error {
	if len(ms) != len(fields) {
		return fmt.Errorf("check backend: %d manifests, %d field names", len(ms), len(fields))
	}
	for i, m := range ms {
		switch {
		case kind == fullVM && m.Disk == nil:
			return fmt.Errorf("%s: %w: backend fullvm boots a disk image (dsec image import --disk), and this one is a layered image", fields[i], ErrBackend)
		case kind == fullVM && i > 0:
			return fmt.Errorf("%s: %w: backend fullvm boots spec.image alone; a disk image takes no workspace or toolkits", fields[i], ErrBackend)
		case kind != fullVM && m.Disk != nil:
			return fmt.Errorf("%s: %w: it is a disk image, which only backend fullvm boots, not %s", fields[i], ErrBackend, kind)
		}
	}
	return nil
}

// SpecFields names the images of a spec with a workspace (or not) and n
// toolkits, in the order CheckBackend takes them.
func SpecFields(workspace bool, toolkits int) []string {
	fields := []string{"spec.image"}
	if workspace {
		fields = append(fields, "spec.workspace")
	}
	for i := range toolkits {
		fields = append(fields, fmt.Sprintf("spec.toolkits[%d]", i))
	}
	return fields
}
