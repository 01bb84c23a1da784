// Command ipcprobe makes and counts IPC objects for the conformance suite's
// reset checks, which need what busybox cannot make: System V shared memory
// segments, semaphore sets and message queues, and POSIX message queues.
//
//	ipcprobe make    creates one of each in its IPC namespace
//	ipcprobe count   prints "shm N sem N msg N mqueue N" (mqueue: 0 or 1,
//	                 whether the queue "make" creates exists)
//
// It uses raw system calls only, so it builds as a small static binary
// that runs in any sandbox of the host's architecture.
package main

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"unsafe"
)

// mqName is the POSIX message queue "make" creates (the kernel's name has
// no leading slash; the C library strips it).
const mqName = "dsec-reset-probe"

const (
	ipcPrivate = 0
	ipcCreat   = 0o1000
)

func main() {
	if len(os.Args) != 2 {
		fail(fmt.Errorf("usage: ipcprobe make|count"))
	}
	switch os.Args[1] {
	case "make":
		fail(makeAll())
	case "count":
		fail(countAll())
	default:
		fail(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}

func makeAll() error {
	for _, c := range []struct {
		name string
		trap uintptr
		args [3]uintptr
	}{
		{"shmget", syscall.SYS_SHMGET, [3]uintptr{ipcPrivate, 1 << 16, ipcCreat | 0o600}},
		{"semget", syscall.SYS_SEMGET, [3]uintptr{ipcPrivate, 1, ipcCreat | 0o600}},
		{"msgget", syscall.SYS_MSGGET, [3]uintptr{ipcPrivate, ipcCreat | 0o600, 0}},
	} {
		if _, _, e := syscall.Syscall(c.trap, c.args[0], c.args[1], c.args[2]); e != 0 {
			return fmt.Errorf("%s: %w", c.name, e)
		}
	}
	fd, err := mqOpen(syscall.O_CREAT | syscall.O_RDWR)
	if err != nil {
		return fmt.Errorf("mq_open: %w", err)
	}
	syscall.Close(fd)
	fmt.Println("made")
	return nil
}

func countAll() error {
	var out []string
	for _, k := range []string{"shm", "sem", "msg"} {
		b, err := os.ReadFile("/proc/sysvipc/" + k)
		if err != nil {
			return err
		}
		n := 0
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n")[1:] {
			if strings.TrimSpace(line) != "" {
				n++
			}
		}
		out = append(out, fmt.Sprintf("%s %d", k, n))
	}
	mq := 1
	fd, err := mqOpen(syscall.O_RDONLY)
	switch {
	case err == syscall.ENOENT:
		mq = 0
	case err != nil:
		return fmt.Errorf("mq_open: %w", err)
	default:
		syscall.Close(fd)
	}
	fmt.Printf("%s mqueue %d\n", strings.Join(out, " "), mq)
	return nil
}

func mqOpen(flags int) (int, error) {
	name, err := syscall.BytePtrFromString(mqName)
	if err != nil {
		return -1, err
	}
	fd, _, e := syscall.Syscall6(syscall.SYS_MQ_OPEN, uintptr(unsafe.Pointer(name)), uintptr(flags|syscall.O_CLOEXEC), 0o600, 0, 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(fd), nil
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "ipcprobe:", err)
		os.Exit(1)
	}
}
