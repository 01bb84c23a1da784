package main

import (
	"golang.org/x/sys/unix"
)

// sealDescriptors leaves the agent holding nothing a sandbox process could
// inherit: every descriptor from 3 up, the control channel included, is
// marked close-on-exec, and the ones it inherited without that flag other
// than the channel (whatever started the runtime left open: a pipe, a
// terminal, a socket) are closed, since nothing in the agent uses them.
// Descriptors the Go runtime opened before main (the cgroup CPU quota
// files) are close-on-exec already and stay. Without this, every command
// held fd 3, the agent's channel to the edge, and could read later
// requests and answer them with forged results.
//
// Once, at start; /proc may not be mounted (a VM guest's /init): then
// everything is only marked close-on-exec, which is what keeps it from
// the sandbox's processes.
func sealDescriptors(control int) {
	if dir, err := unix.Open("/proc/self/fd", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
		closeInherited(dir, control)
		unix.Close(dir)
	}
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err == nil {
		return
	}
	// Before Linux 5.11: one fcntl per possible descriptor.
	var lim unix.Rlimit
	n := uint64(1 << 16)
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) == nil && lim.Cur < n {
		n = lim.Cur
	}
	for fd := 3; uint64(fd) < n; fd++ {
		unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC)
	}
}

// closeInherited closes the descriptors listed in the directory dir
// (/proc/self/fd) that are not close-on-exec, except 0-2, control and dir.
func closeInherited(dir, control int) {
	var fds []int
	buf := make([]byte, 4096)
	for {
		n, err := unix.Getdents(dir, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			break
		}
		var names []string
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
		for _, name := range names {
			fd := atoi(name)
			if fd > 2 && fd != control && fd != dir {
				fds = append(fds, fd)
			}
		}
	}
	// Closed after the listing, which must not see its own changes.
	for _, fd := range fds {
		if flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil && flags&unix.FD_CLOEXEC == 0 {
			unix.Close(fd)
		}
	}
}

// atoi parses a descriptor number; -1 if name is not one.
func atoi(name string) int {
	if name == "" || len(name) > 9 {
		return -1
	}
	n := 0
	for _, c := range []byte(name) {
		if c < '0' || c > '9' {
			return -1
		}
		n = n*10 + int(c-'0')
	}
	return n
}
