package container

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A pristine state is the fingerprint of everything in a sandbox that its
// users can write, taken when the sandbox is as Create or a full Reset left
// it. Reset takes it again after killing the user's processes; if the two
// are equal, nothing was written and the overlay, /dev and every mount are
// kept as they are (see Reset for why the comparison is exact).
//
// What it covers:
//
//   - the sandbox's mount table (/proc/PID/mountinfo of the agent), byte for
//     byte: the same mounts, with the same IDs, sources and options;
//   - the overlay's upper directory and work directory on the host, as a
//     tree: every entry's path, device and inode numbers, type and mode,
//     owner, link count, device number, size, mtime and ctime, and every
//     extended attribute with its value;
//   - the sandbox's /dev tmpfs with everything mounted below it (/dev/pts,
//     /dev/shm), as a tree the same way, read through /proc/PID/root;
//   - the free blocks and inodes of the /dev and /dev/shm tmpfs.
//
// A tree that holds a non-empty regular file (or more than
// maxPristineEntries entries) has no pristine state: the fingerprint holds
// entries and attributes, which are the whole content of directories,
// device nodes, symbolic links and empty files, but not a regular file's
// data. Create and Reset leave one regular file in these trees: the empty
// marker overlayfs keeps in the work directory of a volatile mount
// (work/incompat/volatile/dirty), which no sandbox process can reach.
type pristine struct {
	mounts  []byte
	entries []fsEntry
	// free blocks and inodes of /dev and /dev/shm
	free [2][2]uint64
}

// maxPristineEntries bounds the trees a pristine state is taken of (a
// fresh sandbox has ~20 entries), so comparing stays cheap.
const maxPristineEntries = 256

// fsEntry is one fingerprinted directory entry. Access times are left out:
// reading a directory moves its atime (relatime, once), and that changes
// nothing a process can rely on (see Reset).
type fsEntry struct {
	path           string
	dev, ino       uint64
	nlink, rdev    uint64
	mode, uid, gid uint32
	size           int64
	mtime, ctime   unix.Timespec
	xattrs         string // "name=value\x00" for each attribute, in order
}

var (
	errChanged    = errors.New("changed since the pristine state")
	errIneligible = errors.New("holds a non-empty regular file or too many entries")
)

// pristineTrees are the trees of sandbox s that are fingerprinted: name
// (the prefix of the entries' paths) and host path.
func (s *sandbox) pristineTrees(upper, work string) [3][2]string {
	return [3][2]string{
		{"upper", upper},
		{"work", work},
		{"dev", "/proc/" + strconv.Itoa(s.cmd.Process.Pid) + "/root/dev"},
	}
}

// takePristine fingerprints sandbox s as it is now. It fails with
// errIneligible when the sandbox cannot have one (see pristine).
func (s *sandbox) takePristine(upper, work string) (*pristine, error) {
	p := &pristine{}
	w := newFSWalker(func(e *fsEntry) error {
		if e.mode&unix.S_IFMT == unix.S_IFREG && e.size != 0 || len(p.entries) >= maxPristineEntries {
			return errIneligible
		}
		p.entries = append(p.entries, *e)
		return nil
	})
	if err := s.fingerprint(w, upper, work, &p.mounts, &p.free); err != nil {
		return nil, err
	}
	return p, nil
}

// unchanged reports whether sandbox s is still in pristine state p, with
// upper and work its overlay directories. Any error (a file that cannot be
// read, an agent that died meanwhile) counts as a change.
func (s *sandbox) unchanged(p *pristine, upper, work string) error {
	i := 0
	w := newFSWalker(func(e *fsEntry) error {
		if i >= len(p.entries) || *e != p.entries[i] {
			return fmt.Errorf("%w: %s", errChanged, e.path)
		}
		i++
		return nil
	})
	var mounts []byte
	var free [2][2]uint64
	if err := s.fingerprint(w, upper, work, &mounts, &free); err != nil {
		return err
	}
	switch {
	case i != len(p.entries):
		return fmt.Errorf("%w: entries removed", errChanged)
	case !bytes.Equal(mounts, p.mounts):
		return fmt.Errorf("%w: mounts", errChanged)
	case free != p.free:
		return fmt.Errorf("%w: tmpfs usage", errChanged)
	}
	// Everything above was read through the agent's PID. The agent is the
	// edge's child, so its PID cannot be reused before the edge reaps it,
	// and signalling its pidfd fails once it is reaped: if this succeeds,
	// the PID named the agent all along.
	if s.pidfd >= 0 {
		if err := unix.PidfdSendSignal(s.pidfd, 0, nil, 0); err != nil {
			return fmt.Errorf("agent: %w", err)
		}
	}
	return nil
}

// fingerprint walks the sandbox's trees with w and reads its mount table
// and tmpfs usage into mounts and free.
func (s *sandbox) fingerprint(w *fsWalker, upper, work string, mounts *[]byte, free *[2][2]uint64) error {
	trees := s.pristineTrees(upper, work)
	for _, t := range trees {
		if err := w.walk(t[0], t[1]); err != nil {
			return err
		}
	}
	dev := trees[2][1]
	for i, d := range []string{dev, dev + "/shm"} {
		var st unix.Statfs_t
		if err := unix.Statfs(d, &st); err != nil {
			return fmt.Errorf("statfs %s: %w", d, err)
		}
		if st.Type != unix.TMPFS_MAGIC {
			return fmt.Errorf("%s is not a tmpfs (%#x)", d, st.Type)
		}
		free[i] = [2]uint64{st.Bfree, st.Ffree}
	}
	b, err := readFileRaw("/proc/"+strconv.Itoa(s.cmd.Process.Pid)+"/mountinfo", 16<<10)
	if err != nil {
		return err
	}
	*mounts = b
	return nil
}

// fsWalker visits every entry of a tree in a fixed order (depth first,
// names sorted), without following symbolic links, and stops at the first
// error visit returns. Entries are reached relative to their directory's
// descriptor: the trees sit behind long paths (/proc/PID/root/dev/...)
// that would otherwise be resolved again for every entry.
type fsWalker struct {
	visit func(*fsEntry) error
	dents []byte
	names []byte
	value []byte
	// noXattrAt is set once listxattrat is known to be missing (before
	// Linux 6.13): attributes of non-directories are then read by path.
	noXattrAt bool
}

func newFSWalker(visit func(*fsEntry) error) *fsWalker {
	return &fsWalker{visit: visit, dents: make([]byte, 4096), names: make([]byte, 1024), value: make([]byte, 256)}
}

// walk visits the tree at path, naming its entries rel, rel/a, rel/a/b...
func (w *fsWalker) walk(rel, path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	defer unix.Close(fd)
	return w.dir(fd, rel, path)
}

// dir visits the directory open as fd and everything below it.
func (w *fsWalker) dir(fd int, rel, path string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	n, err := unix.Flistxattr(fd, w.names)
	if err != nil && err != unix.ENOTSUP {
		return fmt.Errorf("%s: list xattrs: %w", rel, err)
	}
	xa, err := w.xattrValues(w.names[:max(n, 0)], func(name string) (int, error) { return unix.Fgetxattr(fd, name, w.value) })
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	if err := w.visit(entryOf(rel, &st, xa)); err != nil {
		return err
	}
	names, err := w.readdir(fd)
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	for _, name := range names {
		crel, cpath := rel+"/"+name, path+"/"+name
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", crel, err)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("%s: %w", crel, err)
			}
			err = w.dir(cfd, crel, cpath)
			unix.Close(cfd)
			if err != nil {
				return err
			}
			continue
		}
		// Device nodes, symbolic links and files are not opened (opening
		// a device node opens the device).
		xa, err := w.xattrsAt(fd, name, cpath)
		if err != nil {
			return fmt.Errorf("%s: %w", crel, err)
		}
		if err := w.visit(entryOf(crel, &st, xa)); err != nil {
			return err
		}
	}
	return nil
}

func entryOf(rel string, st *unix.Stat_t, xattrs string) *fsEntry {
	return &fsEntry{
		path: rel, dev: st.Dev, ino: st.Ino, nlink: st.Nlink, rdev: st.Rdev,
		mode: st.Mode, uid: st.Uid, gid: st.Gid, size: st.Size, mtime: st.Mtim, ctime: st.Ctim,
		xattrs: xattrs,
	}
}

// readdir lists the directory open as fd: names sorted, without "." and
// "..".
func (w *fsWalker) readdir(fd int) ([]string, error) {
	var names []string
	for {
		n, err := unix.ReadDirent(fd, w.dents)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			break
		}
		_, _, names = unix.ParseDirent(w.dents[:n], -1, names)
		if len(names) > maxPristineEntries {
			return nil, errIneligible
		}
	}
	slices.Sort(names)
	return names, nil
}

// xattrArgs is struct xattr_args of getxattrat(2).
type xattrArgs struct {
	value uint64
	size  uint32
	flags uint32
}

// xattrsAt lists the extended attributes of the entry name in directory
// dirfd (of the entry itself, not of a symbolic link's target), with
// listxattrat and getxattrat, or by path (the entry's full path) on
// kernels without them.
func (w *fsWalker) xattrsAt(dirfd int, name, path string) (string, error) {
	if !w.noXattrAt {
		p, err := unix.BytePtrFromString(name)
		if err != nil {
			return "", err
		}
		n, _, e := unix.Syscall6(unix.SYS_LISTXATTRAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)), unix.AT_SYMLINK_NOFOLLOW,
			uintptr(unsafe.Pointer(&w.names[0])), uintptr(len(w.names)), 0)
		switch e {
		case 0:
			return w.xattrValues(w.names[:n], func(attr string) (int, error) {
				a, err := unix.BytePtrFromString(attr)
				if err != nil {
					return 0, err
				}
				args := xattrArgs{value: uint64(uintptr(unsafe.Pointer(&w.value[0]))), size: uint32(len(w.value))}
				v, _, e := unix.Syscall6(unix.SYS_GETXATTRAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)), unix.AT_SYMLINK_NOFOLLOW,
					uintptr(unsafe.Pointer(a)), uintptr(unsafe.Pointer(&args)), unsafe.Sizeof(args))
				if e != 0 {
					return 0, e
				}
				return int(v), nil
			})
		case unix.ENOTSUP:
			return "", nil
		case unix.ENOSYS:
			w.noXattrAt = true
		default:
			return "", fmt.Errorf("list xattrs: %w", e)
		}
	}
	n, err := unix.Llistxattr(path, w.names)
	if err != nil {
		if err == unix.ENOTSUP {
			return "", nil
		}
		return "", fmt.Errorf("list xattrs: %w", err)
	}
	return w.xattrValues(w.names[:n], func(attr string) (int, error) { return unix.Lgetxattr(path, attr, w.value) })
}

// xattrValues turns a list of attribute names into "name=value\x00..."
// with get reading each value into w.value.
func (w *fsWalker) xattrValues(list []byte, get func(name string) (int, error)) (string, error) {
	if len(list) == 0 {
		return "", nil
	}
	var b []byte
	for name := range bytes.SplitSeq(list, []byte{0}) {
		if len(name) == 0 {
			continue
		}
		v, err := get(string(name))
		if err != nil {
			return "", fmt.Errorf("xattr %s: %w", name, err)
		}
		b = append(append(append(append(b, name...), '='), w.value[:v]...), 0)
	}
	return string(b), nil
}

// readFileRaw reads a small file (procfs, cgroupfs) with plain system
// calls: open, reads until end of file, close. os.ReadFile would also stat
// it and register it with the runtime poller, which Reset pays for on
// every file it reads. size is the first buffer's size.
func readFileRaw(path string, size int) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	buf := make([]byte, 0, size)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(fd, buf[len(buf):cap(buf)])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			return buf, nil
		}
		buf = buf[:len(buf)+n]
	}
}
