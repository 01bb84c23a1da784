package guestinit

import (
	"fmt"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/audit/seccomp/filter"
)

// spawnReq is one process start handed to the spawner thread.
type spawnReq struct {
	attr  *syscall.SysProcAttr
	start func() error
	done  chan error
}

// startSpawner dedicates one locked OS thread to forking the workload's
// processes, and locks that thread down as a container's processes are:
// its bounding set keeps only keep (the container backend's capability
// set), no_new_privs is set, and the container's seccomp filter is
// installed on it alone. Its children inherit all three. The agent's
// other threads keep every capability: a guest's agent still reads the
// overlay's trusted.* attributes and the workload's files for a snapshot,
// which the container's agent leaves to the host. Without this, the
// workload (root in its guest) could trace or signal the agent, open its
// channel through /proc/1/fd and forge results.
func (g *Guest) startSpawner(keep uint64, prog []byte) error {
	var p filter.Program
	if len(prog) > 0 {
		if err := p.UnmarshalBinary(prog); err != nil {
			return fmt.Errorf("seccomp filter: %w", err)
		}
	}
	ready := make(chan error, 1)
	reqs := make(chan spawnReq)
	go func() {
		// Never unlocked: the thread is the spawner for the guest's life.
		runtime.LockOSThread()
		if err := lockThread(caps.Set(keep), p); err != nil {
			ready <- err
			return
		}
		ready <- nil
		for r := range reqs {
			r.attr.UseCgroupFD = true
			r.attr.CgroupFD = g.cgroup
			r.done <- r.start()
		}
	}()
	if err := <-ready; err != nil {
		return err
	}
	g.spawn = reqs
	return nil
}

// lockThread applies the lockdown to the calling thread only.
func lockThread(keep caps.Set, p filter.Program) error {
	if err := caps.DropBoundingThread(keep); err != nil {
		return err
	}
	// prctl acts on the calling thread: no_new_privs is per task.
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	if len(p) == 0 {
		return nil
	}
	// Without TSYNC: this thread (and what it forks) only.
	fprog := unix.SockFprog{Len: uint16(len(p)), Filter: &p[0]}
	_, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(p)
	if errno != 0 {
		return fmt.Errorf("seccomp: install filter: %w", errno)
	}
	return nil
}
