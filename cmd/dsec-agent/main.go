// Command dsec-agent is the init process of every DSec sandbox: PID 1 in a
// container, /init in a VM guest. It serves the agent protocol on the
// control channel inherited as fd 3 (a socket or a virtio-serial port) and
// reaps orphaned processes.
//
// Its memory is paid once per idle sandbox, so it stays lean: one P, an
// eager GC, and free heap handed back to the kernel soon after the last
// request finishes.
package main

import (
	"context"
	"errors"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/audit/seccomp/filter"
	"github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit"
)

// idleRelease is how long the agent must be idle before it returns free
// memory to the kernel. Long enough that a busy sandbox (one exec after
// another) does not pay a forced GC per request.
const idleRelease = time.Second

func main() {
	runtime.GOMAXPROCS(1)
	debug.SetGCPercent(20)

	// fd 3 must be the channel the runtime passed (a socket, or a
	// virtio-serial port). Without one, fd 3 can be a file the Go runtime
	// itself opened at start-up (the cgroup CPU quota).
	if err := checkControl(3); err != nil {
		fatal(2, "control channel fd 3 is unusable", err)
	}
	// The runtime poller needs a non-blocking fd to give reads deadlines and
	// to close the channel under a blocked reader.
	if err := unix.SetNonblock(3, true); err != nil {
		fatal(2, "control channel fd 3 is unusable", err)
	}
	conn := os.NewFile(3, "control")

	var fork sandboxinit.Fork
	if len(os.Args) > 1 && os.Args[1] == "container-init" {
		var err error
		// The edge waits for the outcome on the socket; nothing else to do.
		if fork, err = sandboxinit.Run(conn, lockdown); err != nil {
			os.Exit(3)
		}
	}

	err := agent.Serve(context.Background(), conn, agent.Options{
		ReapAll: os.Getpid() == 1,
		OnIdle:  releaseWhenIdle(),
		Fork:    fork,
	})
	if err != nil {
		fatal(1, "agent stopped", err)
	}
}

// checkControl rejects an fd that cannot be a control channel: closed, or
// a regular file or directory.
func checkControl(fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if t := st.Mode & unix.S_IFMT; t == unix.S_IFREG || t == unix.S_IFDIR {
		return errors.New("not a socket or device")
	}
	return nil
}

// fatal reports why the agent cannot go on, then exits with code. A plain
// stderr write keeps log/slog (and its package init) out of the binary.
func fatal(code int, msg string, err error) {
	os.Stderr.WriteString("dsec-agent: " + msg + ": " + err.Error() + "\n")
	os.Exit(code)
}

// releaseWhenIdle returns an OnIdle hook that frees memory once no request
// has finished for idleRelease (a timer reset on every call).
func releaseWhenIdle() func() {
	var mu sync.Mutex
	var t *time.Timer
	return func() {
		mu.Lock()
		defer mu.Unlock()
		if t == nil {
			t = time.AfterFunc(idleRelease, debug.FreeOSMemory)
			return
		}
		t.Reset(idleRelease)
	}
}

// lockdown restricts the agent, and so every command it will fork, to the
// sandbox's capability set, then installs the seccomp filter (no_new_privs,
// set by caps.Restrict, is what allows that without CAP_SYS_ADMIN).
func lockdown(keep []int, prog []byte) error {
	if err := caps.Restrict(caps.Of(keep...)); err != nil {
		return err
	}
	if len(prog) == 0 {
		return nil
	}
	var p filter.Program
	if err := p.UnmarshalBinary(prog); err != nil {
		return err
	}
	return filter.Install(p)
}
