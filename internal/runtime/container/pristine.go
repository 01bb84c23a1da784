package container

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A pristine state is the fingerprint of everything in a sandbox that its
// users can write, taken when the sandbox is as Create or a full Reset left
// it. Reset compares the sandbox with it after killing the user's
// processes; if nothing differs, nothing was written and the overlay, /dev
// and every mount are kept as they are (see Reset for why the comparison
// is exact).
//
// What it covers:
//
//   - the sandbox's mount table (the agent's mountinfo), byte for byte:
//     the same mounts, with the same IDs, sources and options;
//   - the overlay's upper directory and work directory on the host, as a
//     tree: every entry's path, device and inode numbers, type and mode,
//     owner, link count, device number, size, mtime and ctime, its
//     extended attributes with their values, and a directory's names;
//   - the sandbox's /dev tmpfs with everything mounted below it (/dev/pts,
//     /dev/shm), as a tree the same way;
//   - the free blocks and inodes of the /dev and /dev/shm tmpfs.
//
// The comparison walks the stored entries, not the trees: one fstatat per
// entry, relative to a descriptor of its tree opened for the comparison,
// stopping at the first difference. An entry's extended attributes and a
// directory's names are read again only where its times do not already
// tell (see recent): every entry is stat'ed, but a Reset of a sandbox
// whose entries have not changed for a second reads no directory and no
// attribute but those of /dev/pts.
//
// A tree that holds a non-empty regular file (or more than
// maxPristineEntries entries) has no pristine state: the fingerprint holds
// entries and attributes, which are the whole content of directories,
// device nodes, symbolic links and empty files, but not a regular file's
// data. Create and Reset leave one regular file in these trees: the empty
// marker overlayfs keeps in the work directory of a volatile mount
// (work/incompat/volatile/dirty), which no sandbox process can reach.
type pristine struct {
	// Descriptors the state is read through, opened for each comparison
	// and closed after it (open, close), so that a sandbox keeps none in
	// the edge between Resets: the sandbox's directory on the host, which
	// holds the upper and work directories (O_PATH, by its path: the
	// edge's own directories), the sandbox's /dev (O_PATH, through the
	// agent's /proc/PID directory and its root: the agent's root now),
	// and the agent's mountinfo (the mounts seen from the agent's root).
	// Nothing a sandbox process does can redirect them: the /dev mount
	// point cannot be renamed or replaced without mounting, the entry
	// "." of the /dev tree pins the mount found there (its device and
	// inode numbers are compared first), and by the time a comparison
	// runs every user process is dead.
	sdir, dev, mountsFD int
	// sdirPath names sdir; devPath names dev while it is open (through
	// this process's /proc/self/fd), for statfs of /dev/shm and for
	// kernels without listxattrat (attributes are then read by path).
	sdirPath, devPath string

	entries []fsEntry
	mounts  []byte
	// free blocks and inodes of /dev and /dev/shm
	free [2][2]uint64
	// verified is the second (of the coarse clock that file times come
	// from) in which the last full comparison started: when the state was
	// taken, or the last Reset that found it unchanged. See recent.
	verified int64

	w   *fsWalker
	buf []byte // scratch for mountinfo
}

// maxPristineEntries bounds the trees a pristine state is taken of (a
// fresh sandbox has ~20 entries), so comparing stays cheap.
const maxPristineEntries = 256

// Trees, each read relative to one of the state's descriptors.
const (
	treeSandboxDir = iota // the sandbox's directory: "upper.N/...", "work.N/..."
	treeDev               // the sandbox's /dev: ".", "pts/ptmx", ...
)

// fsStat is what is compared of an entry's stat. Access times are left
// out: reading a directory moves its atime (relatime, once), and that
// changes nothing a process can rely on (see Reset).
type fsStat struct {
	dev, ino       uint64
	nlink, rdev    uint64
	mode, uid, gid uint32
	size           int64
	mtime, ctime   unix.Timespec
}

// fsEntry is one fingerprinted entry.
type fsEntry struct {
	tree int
	// rel is the entry's path relative to its tree's descriptor, and
	// crel the same NUL-terminated, for system calls.
	rel  string
	crel []byte
	st   fsStat
	// xattrs is "name=value\x00" for each attribute, in the order the
	// file system lists them.
	xattrs string
	// names are a directory's entries, sorted, without "." and "..".
	names []string
	// timesTell is set when the entry's file system moves its ctime on
	// every change of its attributes and extended attributes, and a
	// directory's mtime and ctime on every change of its names (see
	// recent).
	timesTell bool
}

var (
	errChanged    = errors.New("changed since the pristine state")
	errIneligible = errors.New("holds a non-empty regular file or too many entries")
)

// timesTellFS are the file systems known to set the ctime of an inode to
// the current time on every change of its attributes, extended
// attributes included (ACLs and overlayfs's own trusted.overlay.* ones
// are extended attributes too), and a directory's mtime and ctime on
// every entry created, removed or renamed in or out of it: the local
// file systems of the VFS, whose inode operations do so for every change.
// The upper and work directories live on the host's file system (one of
// these in practice), /dev and /dev/shm on tmpfs. devpts is the
// exception the list exists for: a new pseudo-terminal appears in
// /dev/pts without touching the directory, and it has no attributes of
// its own, so its entries are always read in full.
var timesTellFS = []int64{unix.TMPFS_MAGIC, unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC}

// recent reports whether entry e (stored in state p) may have changed
// since the last full comparison without its stat showing it, so that its
// extended attributes and names must be read again to know.
//
// Why an entry that is not recent needs only its stat compared. A change
// of an extended attribute sets the entry's ctime, and a change of a
// directory's names its mtime and ctime, to the current time of the
// coarse clock file times come from (or a finer-grained one, never
// earlier), truncated to the file system's granularity (at most a second
// on every file system in timesTellFS; ext4 with small inodes has
// seconds). The last full comparison read the clock before it looked at
// anything, in second p.verified. A change after that comparison gets a
// ctime of second p.verified or later; an entry whose stored ctime lies in
// an earlier second therefore cannot have changed without its ctime
// differing from the stored one, and an equal stat means equal attributes
// and names. (As for the rest of the fingerprint, this rests on the clock
// not being set back, which needs CAP_SYS_TIME: see Reset.) Entries
// changed within the second of the last full comparison, or later, and
// entries on other file systems, are read in full: after Create or a new
// root that is all of them until a Reset a second later finds them
// unchanged.
func (p *pristine) recent(e *fsEntry) bool {
	return !e.timesTell || e.st.ctime.Sec >= p.verified
}

// coarseSecond reads the second of the clock file times are taken from.
func coarseSecond() (int64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_REALTIME_COARSE, &ts); err != nil {
		return 0, fmt.Errorf("read the clock: %w", err)
	}
	return ts.Sec, nil
}

// open opens the descriptors the state is read through, with proc the
// agent's /proc/PID directory (openProc); close closes them.
func (p *pristine) open(proc int) (err error) {
	p.sdir, p.dev, p.mountsFD = -1, -1, -1
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	const dirFlags = unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	if p.sdir, err = unix.Open(p.sdirPath, dirFlags, 0); err != nil {
		return fmt.Errorf("open %s: %w", p.sdirPath, err)
	}
	if p.dev, err = unix.Openat(proc, "root/dev", dirFlags, 0); err != nil {
		return fmt.Errorf("open the sandbox's /dev: %w", err)
	}
	if p.mountsFD, err = unix.Openat(proc, "mountinfo", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return fmt.Errorf("open the agent's mountinfo: %w", err)
	}
	p.devPath = "/proc/self/fd/" + strconv.Itoa(p.dev)
	return nil
}

func (p *pristine) close() {
	for _, fd := range []*int{&p.sdir, &p.dev, &p.mountsFD} {
		if *fd >= 0 {
			unix.Close(*fd)
			*fd = -1
		}
	}
	p.devPath = ""
}

// dropPristine discards the sandbox's pristine state (the next Reset
// builds a new root).
func (s *sandbox) dropPristine() {
	s.pristine = nil
}

// treeFD and treePath are the descriptor and the path entries of tree t
// are relative to.
func (p *pristine) treeFD(t int) int {
	if t == treeDev {
		return p.dev
	}
	return p.sdir
}

func (p *pristine) treePath(t int) string {
	if t == treeDev {
		return p.devPath
	}
	return p.sdirPath
}

// takePristine fingerprints sandbox s as it is now, with upper and work
// its overlay directories (both in the sandbox's directory), reading the
// agent's files through proc (openProc). It fails with errIneligible when
// the sandbox cannot have one (see pristine).
func (s *sandbox) takePristine(upper, work string, proc int) (_ *pristine, err error) {
	sdir := filepath.Dir(upper)
	if filepath.Dir(work) != sdir {
		return nil, fmt.Errorf("upper %s and work %s are not in one directory", upper, work)
	}
	upperName, workName := filepath.Base(upper), filepath.Base(work)
	if filepath.Dir(sdir) == s.dir {
		// A root's own volume (disk.go): named from the sandbox's
		// directory, so the directory opened is the same for every root.
		sdir = s.dir
		upperName, workName = filepath.Join(filepath.Base(filepath.Dir(upper)), upperName), filepath.Join(filepath.Base(filepath.Dir(work)), workName)
	}
	p := &pristine{sdirPath: sdir, w: newFSWalker()}
	// Read before anything is looked at (see recent).
	if p.verified, err = coarseSecond(); err != nil {
		return nil, err
	}
	if err := p.open(proc); err != nil {
		return nil, err
	}
	defer p.close()
	// The file system of each device number, seeded with those statfs
	// reads anyway.
	magic := map[uint64]int64{}
	for i, fd := range []int{p.dev, -1, p.sdir} {
		var st unix.Stat_t
		var sfs unix.Statfs_t
		if fd >= 0 {
			err = errors.Join(unix.Fstat(fd, &st), unix.Fstatfs(fd, &sfs))
		} else { // /dev/shm
			err = errors.Join(unix.Stat(p.devPath+"/shm", &st), unix.Statfs(p.devPath+"/shm", &sfs))
		}
		if err != nil {
			return nil, fmt.Errorf("stat: %w", err)
		}
		magic[st.Dev] = sfs.Type
		if i < 2 {
			if sfs.Type != unix.TMPFS_MAGIC {
				return nil, fmt.Errorf("the sandbox's /dev%s is not a tmpfs (%#x)", []string{"", "/shm"}[i], sfs.Type)
			}
			p.free[i] = [2]uint64{sfs.Bfree, sfs.Ffree}
		}
	}
	for _, root := range []struct {
		tree int
		rel  string
	}{{treeSandboxDir, upperName}, {treeSandboxDir, workName}, {treeDev, "."}} {
		if err := p.add(root.tree, root.rel, magic); err != nil {
			return nil, err
		}
	}
	if p.mounts, err = p.readMounts(); err != nil {
		return nil, err
	}
	return p, nil
}

// add fingerprints the entry rel of tree t and, for a directory,
// everything below it, in the order unchanged compares them: depth first,
// names sorted.
func (p *pristine) add(t int, rel string, magic map[uint64]int64) error {
	fd := p.treeFD(t)
	e := fsEntry{tree: t, rel: rel, crel: append([]byte(rel), 0)}
	var err error
	if e.st, err = statAt(fd, e.crel); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	if e.st.mode&unix.S_IFMT == unix.S_IFREG && e.st.size != 0 || len(p.entries) >= maxPristineEntries {
		return errIneligible
	}
	m, ok := magic[e.st.dev]
	if !ok {
		if m, err = statfsAt(fd, rel); err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
		magic[e.st.dev] = m
	}
	e.timesTell = slices.Contains(timesTellFS, m)
	if e.xattrs, err = p.w.xattrsAt(fd, e.crel, p.treePath(t)+"/"+rel); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	dir := e.st.mode&unix.S_IFMT == unix.S_IFDIR
	if dir {
		if e.names, err = p.w.list(fd, rel); err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
	}
	p.entries = append(p.entries, e)
	for _, name := range e.names {
		child := name
		if rel != "." {
			child = rel + "/" + name
		}
		if err := p.add(t, child, magic); err != nil {
			return err
		}
	}
	return nil
}

// unchanged reports whether sandbox s is still in pristine state p,
// reading the agent's files through proc (openProc). Any error (a file
// that cannot be read, an agent that died meanwhile) counts as a change.
//
// Entries are reached by their paths below the trees' descriptors. A path
// resolves through the entries stored before it (its parent directories),
// compared first; had one of them been replaced (by a symbolic link, say),
// the comparison would have stopped there.
func (s *sandbox) unchanged(p *pristine, proc int) error {
	start, err := coarseSecond()
	if err != nil {
		return err
	}
	if err := p.open(proc); err != nil {
		return fmt.Errorf("%w: %v", errChanged, err)
	}
	defer p.close()
	// The mount table first: cheap, and the paths below mean what they
	// meant only under the same mounts.
	mounts, err := p.readMounts()
	if err != nil {
		return err
	}
	if !bytes.Equal(mounts, p.mounts) {
		return fmt.Errorf("%w: mounts", errChanged)
	}
	for i := range p.entries {
		e := &p.entries[i]
		fd := p.treeFD(e.tree)
		st, err := statAt(fd, e.crel)
		if err != nil {
			return fmt.Errorf("%w: %s: %v", errChanged, e.rel, err)
		}
		if st != e.st {
			return fmt.Errorf("%w: %s", errChanged, e.rel)
		}
		if !p.recent(e) {
			continue
		}
		xa, err := p.w.xattrsAt(fd, e.crel, p.treePath(e.tree)+"/"+e.rel)
		if err != nil {
			return fmt.Errorf("%w: %s: %v", errChanged, e.rel, err)
		}
		if xa != e.xattrs {
			return fmt.Errorf("%w: %s: extended attributes", errChanged, e.rel)
		}
		if st.mode&unix.S_IFMT == unix.S_IFDIR {
			names, err := p.w.list(fd, e.rel)
			if err != nil {
				return fmt.Errorf("%w: %s: %v", errChanged, e.rel, err)
			}
			if !slices.Equal(names, e.names) {
				return fmt.Errorf("%w: %s: entries", errChanged, e.rel)
			}
		}
	}
	for i, path := range []string{p.devPath, p.devPath + "/shm"} {
		var st unix.Statfs_t
		if err := unix.Statfs(path, &st); err != nil {
			return fmt.Errorf("%w: statfs: %v", errChanged, err)
		}
		if [2]uint64{st.Bfree, st.Ffree} != p.free[i] {
			return fmt.Errorf("%w: tmpfs usage", errChanged)
		}
	}
	// The mount table and /dev were read through proc, which names the
	// agent (openProc).
	p.verified = start
	return nil
}

// readMounts reads the agent's mount table from offset 0 to the end of
// file (a seq_file starts over at offset 0).
func (p *pristine) readMounts() ([]byte, error) {
	if p.buf == nil {
		p.buf = make([]byte, 16<<10)
	}
	n := 0
	for {
		if n == len(p.buf) {
			p.buf = append(p.buf, make([]byte, len(p.buf))...)
		}
		m, err := unix.Pread(p.mountsFD, p.buf[n:], int64(n))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read the agent's mountinfo: %w", err)
		}
		if m == 0 {
			return p.buf[:n:n], nil
		}
		n += m
	}
}

// statAt stats the entry path (NUL-terminated) below dirfd, without
// following a final symbolic link. A plain system call: the path is kept
// NUL-terminated, so nothing is allocated per entry.
func statAt(dirfd int, path []byte) (fsStat, error) {
	var st unix.Stat_t
	_, _, e := unix.Syscall6(unix.SYS_NEWFSTATAT, uintptr(dirfd), uintptr(unsafe.Pointer(&path[0])),
		uintptr(unsafe.Pointer(&st)), unix.AT_SYMLINK_NOFOLLOW, 0, 0)
	if e != 0 {
		return fsStat{}, e
	}
	return fsStat{
		dev: st.Dev, ino: st.Ino, nlink: st.Nlink, rdev: st.Rdev,
		mode: st.Mode, uid: st.Uid, gid: st.Gid, size: st.Size, mtime: st.Mtim, ctime: st.Ctim,
	}, nil
}

// statfsAt returns the file system type of the entry path below dirfd.
func statfsAt(dirfd int, path string) (int64, error) {
	fd, err := unix.Openat(dirfd, path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return 0, err
	}
	return st.Type, nil
}

// fsWalker holds the buffers for reading directories and extended
// attributes.
type fsWalker struct {
	dents []byte
	names []byte
	value []byte
	// noXattrAt is set once listxattrat is known to be missing (before
	// Linux 6.13): attributes are then read by path.
	noXattrAt bool
}

func newFSWalker() *fsWalker {
	return &fsWalker{dents: make([]byte, 4096), names: make([]byte, 1024), value: make([]byte, 256)}
}

// list returns the names in directory path below dirfd, sorted, without
// "." and "..".
func (w *fsWalker) list(dirfd int, path string) ([]string, error) {
	fd, err := unix.Openat(dirfd, path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
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

// xattrsAt lists the extended attributes of the entry name
// (NUL-terminated) below dirfd (of the entry itself, not of a symbolic
// link's target; device nodes are not opened), with listxattrat and
// getxattrat, or by path (the entry's full path) on kernels without them.
func (w *fsWalker) xattrsAt(dirfd int, name []byte, path string) (string, error) {
	if !w.noXattrAt {
		p := &name[0]
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

// preadSmall reads a small procfs or cgroupfs file that the kernel
// generates in one piece (a single_open seq_file, or a value formatted
// into a buffer) from offset 0 of fd, kept open between calls, into buf.
// One read returns the whole file when it fits: ok is false when it may
// not have (buf filled).
func preadSmall(fd int, buf []byte) (b []byte, ok bool, err error) {
	for {
		n, err := unix.Pread(fd, buf, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, false, err
		}
		return buf[:n], n < len(buf), nil
	}
}
