package container

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// hostIPC is a descriptor of the host's IPC namespace (the process's),
// opened once for the whole process (New opens it), for inIPCNamespace to
// return to.
var hostIPC = sync.OnceValues(func() (int, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	fd, err := unix.Open("/proc/thread-self/ns/ipc", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open the host's IPC namespace: %w", err)
	}
	return fd, nil
})

// inIPCNamespace runs f on the calling OS thread while that thread is in
// the IPC namespace nsfd refers to (a pidfd or a namespace file), then
// returns the thread to the host's. Reset clears System V IPC objects and
// POSIX message queues there on every call. The goroutine is locked to
// its thread meanwhile, so no other goroutine runs in the sandbox's
// namespace. Only the IPC namespace is joined, which (unlike the mount
// namespace) needs no private file system context and can be left again:
// two setns calls, where handing the work to a thread kept for it cost two
// wake-ups (~50 us on these machines, far more under load) and a thread
// made and thrown away per call a clone. And it needs no descriptor of the
// sandbox's kept open: counting its objects there is as cheap as reading
// listings opened there once (which each sandbox kept: three descriptors).
//
// Should the thread fail to get back (setns of the host's namespace does
// not fail but for lack of memory), it stays locked to the calling
// goroutine, which the Go runtime then ends the thread with: no other
// goroutine ever runs there, and the caller's own code meanwhile does
// nothing that depends on the IPC namespace (System V IPC, POSIX message
// queues and /proc/sysvipc are used only here, always after joining a
// sandbox's namespace).
func inIPCNamespace(nsfd int, f func() error) error {
	host, err := hostIPC()
	if err != nil {
		return err
	}
	runtime.LockOSThread()
	if err := unix.Setns(nsfd, unix.CLONE_NEWIPC); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("join the sandbox's IPC namespace: %w", err)
	}
	err = f()
	if back := unix.Setns(host, unix.CLONE_NEWIPC); back != nil {
		return errors.Join(err, fmt.Errorf("rejoin the host's IPC namespace: %w", back))
	}
	runtime.UnlockOSThread()
	return err
}
