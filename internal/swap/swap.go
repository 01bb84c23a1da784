// Package swap sets up the node's swap area: a swap file the edge makes in
// its data directory at start and removes at stop (dsec up|edge --swap).
//
// Sandboxes' memory limits are overcommitted: their sum may be far above
// the node's RAM, because most sandboxes are idle most of the time. What
// keeps that safe is somewhere for idle sandboxes' memory to go when RAM
// runs short, so that nobody within its limit is OOM-killed while the
// node can still page out: the container backend reclaims idle sandboxes
// into this area first (see internal/runtime/container, qos.go).
//
// A swap area is a host-wide resource: once it is on, the kernel may page
// out any process of the host under global memory pressure, not only
// sandboxes. That is why the edge makes none unless asked.
//
// The file is written with a swap header made here (no mkswap process)
// and enabled with swapon(2). It must be fully allocated (fallocate: the
// kernel refuses holes), which ext4 and XFS do; on btrfs it is made
// NOCOW first, as btrfs requires of swap files.
package swap

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/rawfile"
)

// fsNocowFL is FS_NOCOW_FL of linux/fs.h (x/sys/unix has none).
const fsNocowFL = 0x00800000

// MinSize is the smallest swap area Open makes.
const MinSize = 16 << 20

// Options say where the area lives and how large it is.
type Options struct {
	// File is the swap file's path; its directory must exist.
	File string
	// Size in bytes, at least MinSize; rounded down to whole pages.
	Size int64
}

// Area is an enabled swap file.
type Area struct {
	file string
	size int64
}

// Open makes the swap file and enables it. A file already enabled at that
// path (an edge that crashed left it) is kept when it has the size asked
// for: pages of the previous edge's sandboxes may still be in it, and
// turning it off would have to read them all back; otherwise it is turned
// off and made again.
func Open(o Options) (*Area, error) {
	if o.File == "" {
		return nil, errors.New("swap: no file")
	}
	file, err := filepath.Abs(o.File)
	if err != nil {
		return nil, fmt.Errorf("swap: %w", err)
	}
	page := int64(os.Getpagesize())
	size := o.Size / page * page
	if size < MinSize {
		return nil, fmt.Errorf("swap: %d bytes is below the %d MiB minimum", o.Size, MinSize>>20)
	}
	if on, onSize, err := Enabled(file); err != nil {
		return nil, err
	} else if on {
		if onSize == size-page { // /proc/swaps leaves the header page out
			return &Area{file: file, size: size}, nil
		}
		if err := swapoff(file); err != nil {
			return nil, fmt.Errorf("swap: turn off %s left by an earlier edge: %w", file, err)
		}
	}
	if err := os.Remove(file); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("swap: %w", err)
	}
	if err := create(file, size, page); err != nil {
		os.Remove(file)
		return nil, err
	}
	if err := swapon(file); err != nil {
		os.Remove(file)
		return nil, fmt.Errorf("swap: swapon %s: %w", file, err)
	}
	return &Area{file: file, size: size}, nil
}

// File is the swap file's path.
func (a *Area) File() string { return a.file }

// Size is the area's size in bytes (the header page included).
func (a *Area) Size() int64 { return a.size }

// Close turns the area off and removes the file. Turning it off reads back
// every page still in it, so close it after the sandboxes are gone.
func (a *Area) Close() error {
	if err := swapoff(a.file); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		// EINVAL, ENOENT: it was not on (turned off or removed behind our
		// back). Anything else leaves it on, and an enabled swap file
		// must stay.
		return fmt.Errorf("swap: swapoff %s: %w", a.file, err)
	}
	if err := os.Remove(a.file); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("swap: %w", err)
	}
	return nil
}

// create writes a fully allocated file of size bytes with a swap header.
func create(file string, size, page int64) error {
	fd, err := unix.Open(file, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("swap: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err == nil && st.Type == unix.BTRFS_SUPER_MAGIC {
		// btrfs takes swap files only without copy-on-write, set while empty.
		flags, err := unix.IoctlGetUint32(fd, unix.FS_IOC_GETFLAGS)
		if err == nil {
			err = unix.IoctlSetPointerInt(fd, unix.FS_IOC_SETFLAGS, int(flags|fsNocowFL))
		}
		if err != nil {
			return fmt.Errorf("swap: make %s NOCOW (btrfs): %w", file, err)
		}
	}
	if err := unix.Fallocate(fd, 0, 0, size); err != nil {
		return fmt.Errorf("swap: allocate %d bytes for %s: %w", size, file, err)
	}
	if _, err := unix.Pwrite(fd, header(size, page), 0); err != nil {
		return fmt.Errorf("swap: write header: %w", err)
	}
	if err := unix.Fsync(fd); err != nil {
		return fmt.Errorf("swap: %w", err)
	}
	return nil
}

// header is the first page of a swap area: union swap_header of
// linux/swap.h, version 1 ("SWAPSPACE2"), in the host's byte order, with
// no bad pages, label or UUID.
func header(size, page int64) []byte {
	h := make([]byte, page)
	ne := binary.NativeEndian
	ne.PutUint32(h[1024:], 1)                   // version
	ne.PutUint32(h[1028:], uint32(size/page-1)) // last_page
	copy(h[page-10:], "SWAPSPACE2")             // magic
	return h
}

// Enabled reports whether file is an enabled swap area, and its size in
// bytes as /proc/swaps gives it (the header page left out).
func Enabled(file string) (bool, int64, error) {
	f, err := os.Open("/proc/swaps")
	if err != nil {
		return false, 0, fmt.Errorf("swap: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // header line
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 3 || unescape(fields[0]) != file {
			continue
		}
		kib, err := strconv.ParseInt(fields[2], 10, 64)
		if err != nil {
			return false, 0, fmt.Errorf("swap: /proc/swaps: %q", sc.Text())
		}
		return true, kib << 10, nil
	}
	return false, 0, sc.Err()
}

// unescape undoes /proc/swaps' octal escapes (space, tab, newline,
// backslash in a path are written \040 and so on).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
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

func swapon(file string) error {
	p, err := unix.BytePtrFromString(file)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall(unix.SYS_SWAPON, uintptr(unsafe.Pointer(p)), 0, 0); e != 0 {
		return e
	}
	return nil
}

func swapoff(file string) error {
	p, err := unix.BytePtrFromString(file)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall(unix.SYS_SWAPOFF, uintptr(unsafe.Pointer(p)), 0, 0); e != 0 {
		return e
	}
	return nil
}

// Total is the host's swap space in bytes and how much of it is free
// (SwapTotal and SwapFree of /proc/meminfo), whoever set it up.
func Total() (total, free int64, err error) {
	m, err := rawfile.Meminfo()
	if err != nil {
		return 0, 0, fmt.Errorf("swap: %w", err)
	}
	total, free = m["SwapTotal"], m["SwapFree"]
	return total, free, nil
}
