// Command fsprobe makes the changes Reset's tests need and busybox cannot
// make:
//
//	fsprobe touch-same PATH             sets PATH's atime and mtime to the
//	                                    values they have (only ctime moves)
//	fsprobe setxattr PATH NAME VALUE    sets an extended attribute
//	fsprobe getxattrs PATH...           prints each PATH's user.* attributes
//	fsprobe prlimit PID RES SOFT HARD   sets resource limit number RES of
//	                                    process PID (prlimit64)
//
// It uses raw system calls only, so it builds as a small static binary
// that runs in any sandbox of the host's architecture.
package main

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

func main() {
	if len(os.Args) < 2 {
		fail(fmt.Errorf("usage: fsprobe touch-same PATH | setxattr PATH NAME VALUE | getxattrs PATH... | prlimit PID RES SOFT HARD"))
	}
	switch args := os.Args[2:]; os.Args[1] {
	case "touch-same":
		if len(args) != 1 {
			fail(fmt.Errorf("usage: fsprobe touch-same PATH"))
		}
		fail(touchSame(args[0]))
	case "setxattr":
		if len(args) != 3 {
			fail(fmt.Errorf("usage: fsprobe setxattr PATH NAME VALUE"))
		}
		fail(syscall.Setxattr(args[0], args[1], []byte(args[2]), 0))
	case "getxattrs":
		for _, p := range args {
			fail(printXattrs(p))
		}
	case "prlimit":
		if len(args) != 4 {
			fail(fmt.Errorf("usage: fsprobe prlimit PID RES SOFT HARD"))
		}
		fail(prlimit(args))
	default:
		fail(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}

func touchSame(path string) error {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return err
	}
	ts := [2]syscall.Timespec{st.Atim, st.Mtim}
	p, err := syscall.BytePtrFromString(path)
	if err != nil {
		return err
	}
	const atFdcwd, atSymlinkNofollow = -100, 0x100
	fd := atFdcwd
	if _, _, e := syscall.Syscall6(syscall.SYS_UTIMENSAT, uintptr(fd), uintptr(unsafe.Pointer(p)),
		uintptr(unsafe.Pointer(&ts[0])), atSymlinkNofollow, 0, 0); e != 0 {
		return e
	}
	return nil
}

func printXattrs(path string) error {
	buf := make([]byte, 4096)
	n, err := syscall.Listxattr(path, buf)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	var out []string
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if !strings.HasPrefix(name, "user.") {
			continue
		}
		v := make([]byte, 4096)
		m, err := syscall.Getxattr(path, name, v)
		if err != nil {
			return fmt.Errorf("%s %s: %w", path, name, err)
		}
		out = append(out, name+"="+string(v[:m]))
	}
	sort.Strings(out)
	fmt.Printf("%s: %s\n", path, strings.Join(out, " "))
	return nil
}

// prlimit sets one resource limit of another process: PID, resource
// number, soft and hard limit.
func prlimit(args []string) error {
	var v [4]uint64
	for i, a := range args {
		n, err := strconv.ParseUint(a, 10, 64)
		if err != nil {
			return fmt.Errorf("prlimit: %q: %w", a, err)
		}
		v[i] = n
	}
	lim := [2]uint64{v[2], v[3]}
	if _, _, e := syscall.RawSyscall6(syscall.SYS_PRLIMIT64, uintptr(v[0]), uintptr(v[1]),
		uintptr(unsafe.Pointer(&lim[0])), 0, 0, 0); e != 0 {
		return fmt.Errorf("prlimit: %w", e)
	}
	return nil
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "fsprobe:", err)
		os.Exit(1)
	}
}
