// Package rawfile reads small files (procfs, cgroupfs, /etc/passwd) with
// plain system calls: open, reads until end of file, close. os.ReadFile
// would also stat the file and register it with the runtime poller, which
// the hot paths that use this (the agent's exec, a sandbox's Reset) would
// pay on every file, and pulls in nothing the agent does not already link.
package rawfile

import (
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
	buf := make([]byte, 0, max(size, 1))
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
