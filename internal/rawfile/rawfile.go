// Package rawfile reads small files (procfs, cgroupfs, /etc/passwd) with
// plain system calls: open, reads until end of file, close. os.ReadFile
// would also stat the file and register it with the runtime poller, which
// the hot paths that use this (the agent's exec, a sandbox's Reset) would
// pay on every file, and pulls in nothing the agent does not already link.
//
// ReadRegular is for files a sandbox's workload controls: it cannot block
// and cannot make its reader allocate more than its limit.
package rawfile

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Read returns the whole file at path; size is the first buffer's size
// (the buffer grows if the file is larger).
func Read(path string, size int) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	return readAll(fd, path, size, -1)
}

var (
	// ErrNotRegular: ReadRegular found something else than a regular file
	// (a FIFO, a device such as /dev/zero, a socket, a directory).
	ErrNotRegular = errors.New("not a regular file")
	// ErrTooLarge: ReadRegular's file holds more than its limit.
	ErrTooLarge = errors.New("file too large")
)

// ReadRegular returns the regular file at path if it holds at most limit
// bytes. It is opened so that opening cannot block or take a terminal
// (O_NONBLOCK: a FIFO does not wait for a writer; O_NOCTTY), refused unless
// fstat says it is a regular file (a symbolic link to /dev/zero is
// followed, and refused), and refused once more than limit bytes were
// read, whatever its size said: the first buffer is the size fstat
// reported, at most limit+1, so a file that lies about its size or grows
// meanwhile costs its reader at most about twice the limit. One fstat more
// than Read.
func ReadRegular(path string, limit int) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, &os.PathError{Op: "open", Path: path, Err: fmt.Errorf("%w (%s)", ErrNotRegular, TypeName(st.Mode))}
	}
	if st.Size > int64(limit) {
		return nil, &os.PathError{Op: "read", Path: path, Err: fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, st.Size, limit)}
	}
	return readAll(fd, path, int(st.Size)+1, limit)
}

// readAll reads fd to its end into a buffer of first size size; limit >= 0
// bounds what it may read.
func readAll(fd int, path string, size, limit int) ([]byte, error) {
	if limit >= 0 {
		size = min(size, limit+1)
	}
	buf := make([]byte, 0, max(size, 1))
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		room := buf[len(buf):cap(buf)]
		if limit >= 0 {
			room = room[:min(len(room), limit+1-len(buf))]
		}
		n, err := unix.Read(fd, room)
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
		if limit >= 0 && len(buf) > limit {
			return nil, &os.PathError{Op: "read", Path: path, Err: fmt.Errorf("%w: more than %d bytes", ErrTooLarge, limit)}
		}
	}
}

// TypeName names a file type from a stat mode, for error messages.
func TypeName(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return "regular file"
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFIFO:
		return "FIFO"
	case unix.S_IFCHR:
		return "character device"
	case unix.S_IFBLK:
		return "block device"
	case unix.S_IFSOCK:
		return "socket"
	case unix.S_IFLNK:
		return "symbolic link"
	}
	return fmt.Sprintf("file type %#o", mode&unix.S_IFMT)
}
