// Package scratchfs is the file system the container backend's sandboxes
// write to: their overlay upper and work directories live on it, each
// sandbox in a volume of its own whose size the kernel bounds, so a
// sandbox that fills its writable layer gets ENOSPC/EDQUOT and no other
// sandbox, nor the host, notices.
//
// It is btrfs in a sparse file under the edge's data directory, attached
// to a loop device and mounted once per node, with simple quotas
// (squota, Linux 6.7+); a volume is a subvolume, its limit a qgroup limit
// on the subvolume's own qgroup. Why btrfs and not ext4 or XFS project
// quotas: the kernels DSec runs on (checked on 6.18 here) are built
// without the quota formats ext4 needs (CONFIG_QFMT_V2) and without XFS
// quota (CONFIG_XFS_QUOTA), while btrfs qgroups live in the file system
// itself; squota accounts an extent to the subvolume that allocated it at
// allocation time (no backref walks at commit, which full qgroups do), the
// limit holds for root and for every capability but a sysfs override
// (quota_override) nothing in a sandbox can reach, and a subvolume is made
// and deleted with one ioctl each whatever it holds (the cleaner frees its
// extents in the background). Subvolume IDs, and so qgroup IDs, are never
// reused within a file system, so a new sandbox can never inherit an old
// one's usage or limit. What btrfs does not do: statfs of a subvolume
// reports the whole file system, so `df` inside a sandbox shows the node's
// scratch file system, not the sandbox's limit.
//
// The file system is made afresh by Open (sandboxes do not survive their
// edge), or reused when a crashed predecessor left it mounted (so that its
// stale sandboxes can be found and removed), and Close unmounts it and
// removes the file; the loop device is set to clear itself when the file
// system's last user is gone. Space freed inside is handed back to the
// host by btrfs's asynchronous discard, which a loop device turns into
// holes punched in the file.
package scratchfs

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Options say where the file system lives and how large it is.
type Options struct {
	// Image is the sparse file holding the file system (created or
	// replaced by Open, removed by Close).
	Image string
	// Dir is where it is mounted: the container backend's state directory.
	Dir string
	// Size of the file system in bytes; 0 means DefaultFraction of the
	// free space of the file system Image is on. At least MinSize.
	Size int64
	// Logger, default slog.Default().
	Logger *slog.Logger
}

// MinSize is the smallest file system Open makes (btrfs needs ~110 MiB
// of its own with single profiles).
const MinSize = 256 << 20

// DefaultFraction of the host's free space is the file system's size when
// Options.Size is 0. The file is sparse: it takes host space only for
// what sandboxes have written and not yet deleted.
const DefaultFraction = 0.5

// FS is a mounted scratch file system.
type FS struct {
	dir, image string
	size       int64
	log        *slog.Logger
	// rootFD is the mount's root directory: subvolumes are made and
	// deleted relative to it and qgroup ioctls sent through it.
	rootFD int
	// qgroups is the file system's qgroup directory in sysfs.
	qgroups string

	closeOnce sync.Once
	closeErr  error
}

// Open makes (or reuses, see the package comment) the scratch file system
// and mounts it at o.Dir. It needs root and mkfs.btrfs (btrfs-progs).
func Open(o Options) (_ *FS, err error) {
	if o.Image == "" || o.Dir == "" {
		return nil, errors.New("scratchfs: Options.Image and Options.Dir are required")
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	f := &FS{dir: o.Dir, image: o.Image, log: o.Logger, rootFD: -1}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("scratchfs: %w", err)
	}
	reused, err := isBtrfsMount(o.Dir)
	if err != nil {
		return nil, err
	}
	if reused {
		f.log.Info("scratch file system: reusing the mount a previous process left", "dir", o.Dir)
	} else {
		if err := f.make(o.Size); err != nil {
			return nil, err
		}
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if f.rootFD, err = unix.Open(o.Dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("scratchfs: open %s: %w", o.Dir, err)
	}
	// The state directory is the edge's alone, like the one it replaces.
	if err := unix.Fchmod(f.rootFD, 0o700); err != nil {
		return nil, fmt.Errorf("scratchfs: chmod %s: %w", o.Dir, err)
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(f.rootFD, &st); err != nil {
		return nil, fmt.Errorf("scratchfs: statfs: %w", err)
	}
	f.size = int64(st.Blocks) * st.Bsize
	if err := ioctl(f.rootFD, iocQuotaCtl, unsafe.Pointer(&quotaCtlArgs{cmd: quotaCtlEnableSimple})); err != nil &&
		!errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("scratchfs: enable simple quotas on %s (needs Linux 6.7+): %w", o.Dir, err)
	}
	var info fsInfoArgs
	if err := ioctl(f.rootFD, iocFSInfo, unsafe.Pointer(&info)); err != nil {
		return nil, fmt.Errorf("scratchfs: fs info: %w", err)
	}
	f.qgroups = filepath.Join("/sys/fs/btrfs", formatUUID(info.fsid[:]), "qgroups")
	return f, nil
}

// make creates the sparse file, the file system in it, a loop device over
// it, and mounts it at f.dir.
func (f *FS) make(size int64) error {
	if size == 0 {
		var st unix.Statfs_t
		if err := unix.Statfs(filepath.Dir(f.image), &st); err != nil {
			return fmt.Errorf("scratchfs: free space for %s: %w", f.image, err)
		}
		size = int64(float64(st.Bavail) * float64(st.Bsize) * DefaultFraction)
	}
	size &^= 1<<20 - 1 // whole MiB
	if size < MinSize {
		return fmt.Errorf("scratchfs: %d MiB is below the %d MiB minimum for the sandboxes' file system", size>>20, MinSize>>20)
	}
	// Whatever a previous process left in the directory (not mounted) is
	// stale sandbox state; the new file system would hide it.
	if entries, err := os.ReadDir(f.dir); err == nil && len(entries) > 0 {
		f.log.Warn("scratch file system: removing stale entries under its mount point", "dir", f.dir, "entries", len(entries))
		for _, e := range entries {
			os.RemoveAll(filepath.Join(f.dir, e.Name()))
		}
	}
	// A new file, never the old one rewritten: a loop device a previous
	// process left attached keeps the old inode to itself.
	os.Remove(f.image)
	img, err := os.OpenFile(f.image, os.O_RDWR|os.O_CREATE|os.O_EXCL|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("scratchfs: %w", err)
	}
	defer img.Close()
	if err := img.Truncate(size); err != nil {
		os.Remove(f.image)
		return fmt.Errorf("scratchfs: size %s: %w", f.image, err)
	}
	// Single profiles: one device, and the data is disposable.
	out, err := exec.Command("mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", f.image).CombinedOutput()
	if err != nil {
		os.Remove(f.image)
		if errors.Is(err, exec.ErrNotFound) {
			return errors.New("scratchfs: mkfs.btrfs not found: install btrfs-progs (scripts/deps.sh)")
		}
		return fmt.Errorf("scratchfs: mkfs.btrfs %s: %w: %s", f.image, err, bytes.TrimSpace(out))
	}
	loop, err := attachLoop(int(img.Fd()))
	if err != nil {
		os.Remove(f.image)
		return err
	}
	defer unix.Close(loop.fd)
	// discard=async hands freed space back to the host (holes in the file)
	// off the deleting process's path. nodev as the sandboxes' overlays
	// are; not nosuid, which would be a change from the host's file system
	// the upper directories lived on before (the state directory is the
	// edge's alone, mode 0700).
	if err := unix.Mount(loop.path, f.dir, "btrfs", unix.MS_NOATIME|unix.MS_NODEV, "discard=async"); err != nil {
		os.Remove(f.image)
		// The loop device clears itself when loop.fd is closed.
		return fmt.Errorf("scratchfs: mount %s (%s) on %s: %w", f.image, loop.path, f.dir, err)
	}
	return nil
}

// Dir is where the file system is mounted.
func (f *FS) Dir() string { return f.dir }

// Size is the file system's size in bytes.
func (f *FS) Size() int64 { return f.size }

// Close unmounts the file system and removes its file. A sandbox still
// alive keeps it (and its loop device) until it is gone: the unmount is
// lazy and the loop device clears itself.
func (f *FS) Close() error {
	f.closeOnce.Do(func() {
		if f.rootFD >= 0 {
			unix.Close(f.rootFD)
			f.rootFD = -1
		}
		if err := unix.Unmount(f.dir, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			f.closeErr = fmt.Errorf("scratchfs: unmount %s: %w", f.dir, err)
		}
		if err := os.Remove(f.image); err != nil && !errors.Is(err, os.ErrNotExist) {
			f.closeErr = errors.Join(f.closeErr, fmt.Errorf("scratchfs: %w", err))
		}
	})
	return f.closeErr
}

// Volume is one sandbox's part of the file system (or one generation of
// its writable layer): a subvolume, with its own usage and limit.
type Volume struct {
	// ID is the subvolume's ID, also its qgroup's (0/ID).
	ID uint64
	// Path is its directory.
	Path string
}

// parent opens the directory that holds path, which must be on the file
// system, and returns it with path's last element; closeParent closes it.
func (f *FS) parent(path string) (fd int, name string, err error) {
	dir, name := filepath.Split(filepath.Clean(path))
	dir = filepath.Clean(dir)
	var a volArgs
	if len(name) == 0 || len(name) >= len(a.name) || name == "." || name == ".." {
		return -1, "", fmt.Errorf("scratchfs: bad volume path %q", path)
	}
	if dir == f.dir {
		return f.rootFD, name, nil
	}
	if rel, err := filepath.Rel(f.dir, dir); err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return -1, "", fmt.Errorf("scratchfs: volume path %q is not under %s", path, f.dir)
	}
	fd, err = unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, "", fmt.Errorf("scratchfs: %w", err)
	}
	return fd, name, nil
}

func (f *FS) closeParent(fd int) {
	if fd != f.rootFD {
		unix.Close(fd)
	}
}

// NewVolume makes the subvolume at path (mode 0700; its parent must be a
// directory of the file system) and sets its limit (bytes; 0: none).
func (f *FS) NewVolume(path string, limit int64) (Volume, error) {
	pfd, name, err := f.parent(path)
	if err != nil {
		return Volume{}, err
	}
	defer f.closeParent(pfd)
	var a volArgs
	copy(a.name[:], name)
	if err := ioctl(pfd, iocSubvolCreate, unsafe.Pointer(&a)); err != nil {
		return Volume{}, fmt.Errorf("scratchfs: create volume %s: %w", path, err)
	}
	v := Volume{Path: filepath.Clean(path)}
	err = func() error {
		fd, err := unix.Openat(pfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := unix.Fchmod(fd, 0o700); err != nil {
			return err
		}
		l := inoLookupArgs{objectid: firstFreeObjectID}
		if err := ioctl(fd, iocInoLookup, unsafe.Pointer(&l)); err != nil {
			return fmt.Errorf("subvolume id: %w", err)
		}
		v.ID = l.treeid
		return nil
	}()
	if err == nil && limit > 0 {
		err = f.SetLimit(v.ID, limit)
	}
	if err != nil {
		f.DeleteVolume(path)
		return Volume{}, fmt.Errorf("scratchfs: volume %s: %w", path, err)
	}
	return v, nil
}

// SetLimit bounds what volume id may hold, data and metadata (bytes; 0
// removes the limit). One ioctl.
func (f *FS) SetLimit(id uint64, limit int64) error {
	if limit < 0 {
		return fmt.Errorf("scratchfs: negative limit %d", limit)
	}
	a := qgroupLimitArgs{qgroupid: id, flags: qgroupLimitMaxRfer, maxRfer: uint64(limit)}
	if limit == 0 {
		a.maxRfer = clearLimit
	}
	if err := ioctl(f.rootFD, iocQgroupLimit, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("scratchfs: limit volume %d to %d bytes: %w", id, limit, err)
	}
	return nil
}

// Usage is what volume id holds and has reserved for writes in flight,
// the sum btrfs compares with its limit, and that limit (0: none).
func (f *FS) Usage(id uint64) (used, limit int64, err error) {
	dir := filepath.Join(f.qgroups, "0_"+strconv.FormatUint(id, 10))
	buf := make([]byte, 32)
	for _, name := range [...]string{"referenced", "rsv_data", "rsv_meta_pertrans", "rsv_meta_prealloc", "max_referenced"} {
		n, err := readInt(filepath.Join(dir, name), buf)
		if err != nil {
			return 0, 0, fmt.Errorf("scratchfs: usage of volume %d: %w", id, err)
		}
		if name == "max_referenced" {
			limit = n
		} else {
			used += n
		}
	}
	return used, limit, nil
}

// Available is the free space of the whole file system in bytes.
func (f *FS) Available() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(f.rootFD, &st); err != nil {
		return 0, fmt.Errorf("scratchfs: statfs: %w", err)
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// FullSlack is how close to its limit a volume (or to full the file
// system) counts as full: a write is refused when it does not fit whole,
// so a filled volume can be up to one write's reservation short of its
// limit.
const FullSlack = 4 << 20

// Full reports whether volume id has (nearly) reached its limit, or the
// file system (nearly) its size: a write there would fail for lack of
// space. An error reading either counts as not full.
func (f *FS) Full(id uint64) bool {
	used, limit, err := f.Usage(id)
	if err == nil && limit > 0 && limit-used < min(FullSlack, limit/16) {
		return true
	}
	avail, err := f.Available()
	return err == nil && avail < FullSlack
}

// DeleteVolume deletes the subvolume at path with everything in it,
// volumes nested in it included (one ioctl each; btrfs frees their extents
// in the background, and their usage with them). A path that is not a
// subvolume is removed as a directory tree; one that does not exist is
// not an error.
func (f *FS) DeleteVolume(path string) error {
	pfd, name, err := f.parent(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.closeParent(pfd)
	var a volArgs
	copy(a.name[:], name)
	err = ioctl(pfd, iocSnapDestroy, unsafe.Pointer(&a))
	if errors.Is(err, unix.ENOTEMPTY) {
		// Volumes inside: they go first.
		entries, _ := os.ReadDir(path)
		for _, e := range entries {
			if e.IsDir() && isVolume(filepath.Join(path, e.Name())) {
				if err := f.DeleteVolume(filepath.Join(path, e.Name())); err != nil {
					return err
				}
			}
		}
		err = ioctl(pfd, iocSnapDestroy, unsafe.Pointer(&a))
	}
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOTDIR):
		// Not a subvolume (a plain directory or file).
		return os.RemoveAll(path)
	}
	return fmt.Errorf("scratchfs: delete volume %s: %w", path, err)
}

// isVolume reports whether dir is a subvolume's root (its inode number is
// always BTRFS_FIRST_FREE_OBJECTID).
func isVolume(dir string) bool {
	var st unix.Stat_t
	return unix.Lstat(dir, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Ino == firstFreeObjectID
}

// readInt reads a sysfs file holding one decimal number.
func readInt(path string, buf []byte) (int64, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	n, err := unix.Read(fd, buf)
	unix.Close(fd)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(buf[:n])), 10, 64)
}

// isBtrfsMount reports whether dir is the root of a mounted btrfs (not
// just a directory on one).
func isBtrfsMount(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, fmt.Errorf("scratchfs: %w", err)
	}
	if st.Type != unix.BTRFS_SUPER_MAGIC {
		return false, nil
	}
	var a, b unix.Stat_t
	if err := unix.Stat(dir, &a); err != nil {
		return false, fmt.Errorf("scratchfs: %w", err)
	}
	if err := unix.Stat(filepath.Dir(dir), &b); err != nil {
		return false, fmt.Errorf("scratchfs: %w", err)
	}
	if a.Dev == b.Dev {
		return false, nil
	}
	// A subvolume also has a device of its own: the mount table decides.
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false, fmt.Errorf("scratchfs: %w", err)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return false, err
	}
	for _, line := range strings.Split(string(mi), "\n") {
		fields := strings.Fields(line)
		if len(fields) > 4 && unescapeMountPath(fields[4]) == abs {
			return true, nil
		}
	}
	return false, nil
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func formatUUID(u []byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}
