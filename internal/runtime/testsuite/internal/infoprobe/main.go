// Command infoprobe asks the kernel what busybox cannot, for the
// conformance suite's information-leak and file system checks:
//
//	infoprobe blockmaps FILE...   tries every block-mapping ioctl on each
//	                              FILE and prints "NAME FILE RESULT", RESULT
//	                              an errno name or "ok" (with FIEMAP's
//	                              first physical offset)
//	infoprobe inodes DIR...       compares, for every entry of each DIR,
//	                              readdir's d_ino with lstat's st_ino and
//	                              st_dev with DIR's, skipping mount points
//	                              (and a mount root's "..");
//	                              prints each difference, then "checked N"
//
// It uses raw system calls only, so it builds as a small static binary
// that runs in any sandbox of the host's architecture (x86_64 numbers).
package main

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"unsafe"
)

func main() {
	if len(os.Args) < 3 {
		fail(fmt.Errorf("usage: infoprobe blockmaps FILE... | inodes DIR..."))
	}
	var err error
	switch args := os.Args[2:]; os.Args[1] {
	case "blockmaps":
		err = blockmaps(args)
	case "inodes":
		err = inodes(args)
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	fail(err)
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "infoprobe:", err)
		os.Exit(1)
	}
}

// The block-mapping ioctls (x86_64 request numbers) and their argument
// sizes; fsmap's header is followed by room for entries.
var mapIoctls = []struct {
	name string
	cmd  uintptr
}{
	{"FS_IOC_FIEMAP", 0xc020660b},
	{"FIBMAP", 0x1},
	{"FS_IOC_GETFSMAP", 0xc0c0583b},
	{"EXT4_IOC_GET_ES_CACHE", 0xc020662a},
	{"XFS_IOC_GETBMAP", 0xc0205826},
	{"XFS_IOC_GETBMAPA", 0xc020582c},
	{"XFS_IOC_GETBMAPX", 0xc0205838},
}

func blockmaps(files []string) error {
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		for _, io := range mapIoctls {
			// One buffer fits every argument: struct fiemap (32 bytes)
			// with 8 extents of 56, struct fsmap_head (192) with entries,
			// struct getbmap arrays, FIBMAP's int.
			buf := make([]byte, 4096)
			switch io.name {
			case "FS_IOC_FIEMAP", "EXT4_IOC_GET_ES_CACHE":
				binary.LittleEndian.PutUint64(buf[8:], ^uint64(0)) // fm_length: all
				binary.LittleEndian.PutUint32(buf[16:], 1)         // fm_flags: FIEMAP_FLAG_SYNC
				binary.LittleEndian.PutUint32(buf[24:], 8)         // fm_extent_count
			case "FS_IOC_GETFSMAP":
				binary.LittleEndian.PutUint32(buf[8:], 16) // fmh_count
				for i := 64 + 64; i < 192; i++ {           // fmh_keys[1]: the end of every range
					buf[i] = 0xff
				}
			case "XFS_IOC_GETBMAP", "XFS_IOC_GETBMAPA", "XFS_IOC_GETBMAPX":
				binary.LittleEndian.PutUint64(buf[16:], ^uint64(0)) // bmv_length: all
				binary.LittleEndian.PutUint32(buf[24:], 8)          // bmv_count
			}
			_, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), io.cmd, uintptr(unsafe.Pointer(&buf[0])))
			switch {
			case e != 0:
				fmt.Printf("%s %s %s\n", io.name, name, errnoName(e))
			case io.name == "FS_IOC_FIEMAP":
				n := binary.LittleEndian.Uint32(buf[20:])
				var phys uint64
				if n > 0 {
					phys = binary.LittleEndian.Uint64(buf[32+8:])
				}
				fmt.Printf("%s %s ok extents=%d physical=%#x\n", io.name, name, n, phys)
			default:
				fmt.Printf("%s %s ok\n", io.name, name)
			}
		}
		f.Close()
	}
	return nil
}

func errnoName(e syscall.Errno) string {
	for _, n := range []struct {
		e    syscall.Errno
		name string
	}{{syscall.EPERM, "EPERM"}, {syscall.ENOTTY, "ENOTTY"}, {syscall.EINVAL, "EINVAL"},
		{syscall.EOPNOTSUPP, "EOPNOTSUPP"}, {syscall.EACCES, "EACCES"}, {syscall.EBADF, "EBADF"}} {
		if e == n.e {
			return n.name
		}
	}
	return fmt.Sprintf("errno-%d", int(e))
}

// statx's mount-root attribute (Linux 5.8): set on the root of a mount.
const (
	sysStatx           = 332
	atSymlinkNofollow  = 0x100
	statxAttrMountRoot = 0x2000
)

// mountRoot reports whether path (not followed) is the root of a mount:
// its inode is the mounted file system's, not the directory entry's.
func mountRoot(path string) (bool, error) {
	var buf [256]byte // struct statx
	p, err := syscall.BytePtrFromString(path)
	if err != nil {
		return false, err
	}
	dirfd := -100 // AT_FDCWD
	_, _, e := syscall.Syscall6(sysStatx, uintptr(dirfd), uintptr(unsafe.Pointer(p)), atSymlinkNofollow, 0, uintptr(unsafe.Pointer(&buf[0])), 0)
	if e != 0 {
		return false, fmt.Errorf("statx %s: %w", path, e)
	}
	attrs := binary.LittleEndian.Uint64(buf[8:])
	mask := binary.LittleEndian.Uint64(buf[0x38:]) // stx_attributes_mask
	if mask&statxAttrMountRoot == 0 {
		return false, fmt.Errorf("statx %s: the kernel does not report mount roots", path)
	}
	return attrs&statxAttrMountRoot != 0, nil
}

func inodes(dirs []string) error {
	n := 0
	for _, dir := range dirs {
		var dst syscall.Stat_t
		if err := syscall.Stat(dir, &dst); err != nil {
			return fmt.Errorf("stat %s: %w", dir, err)
		}
		dirRoot, err := mountRoot(dir)
		if err != nil {
			return err
		}
		fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", dir, err)
		}
		buf := make([]byte, 32<<10)
		for {
			m, err := syscall.Getdents(fd, buf)
			if err != nil {
				return fmt.Errorf("getdents %s: %w", dir, err)
			}
			if m == 0 {
				break
			}
			for b := buf[:m]; len(b) > 0; {
				// struct linux_dirent64: d_ino, d_off, d_reclen, d_type, d_name.
				ino := binary.LittleEndian.Uint64(b)
				reclen := binary.LittleEndian.Uint16(b[16:])
				name := b[19:reclen]
				for i, c := range name {
					if c == 0 {
						name = name[:i]
						break
					}
				}
				b = b[reclen:]
				entry := string(name)
				if entry == ".." && dirRoot {
					// A mount root's parent is another file system's
					// directory (or, at "/", not there at all: readdir
					// gives the directory the file system's root was
					// taken from, as in any chroot).
					continue
				}
				path := filepath.Join(dir, entry)
				if entry != "." && entry != ".." {
					root, err := mountRoot(path)
					if err != nil {
						return err
					}
					if root {
						continue // its inode is the mounted file system's root
					}
				}
				var st syscall.Stat_t
				if err := syscall.Lstat(path, &st); err != nil {
					return fmt.Errorf("lstat %s: %w", path, err)
				}
				n++
				if st.Ino != ino {
					fmt.Printf("%s d_ino=%d st_ino=%d\n", path, ino, st.Ino)
				}
				if st.Dev != dst.Dev {
					fmt.Printf("%s st_dev=%d, its directory's %d\n", path, st.Dev, dst.Dev)
				}
			}
		}
		syscall.Close(fd)
	}
	fmt.Printf("checked %d\n", n)
	return nil
}
