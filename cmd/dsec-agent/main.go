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
	"os/signal"
	"runtime"
	"runtime/debug"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/audit/seccomp/filter"
	"github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit"
	"github.com/dsec-dev/dsec/internal/runtime/microvm/guestinit"
)

// idleRelease is how long the agent must be idle before it returns free
// memory to the kernel (a forced GC, then every free page unmapped). Long
// enough that a sandbox in use does not pay for it between requests: a
// pooled sandbox comes back every second or two under an RL loop, and each
// release made its next exec fault its heap back in (~30 us a page on
// virtual machines; the SDK loop ran 16-25 % faster with 10 s than with 1 s).
// Short against an idle sandbox's life. A fresh agent's memory is the same
// either way (measured: 1.26 MiB cgroup charge per idle sandbox); what a
// release returns is what a large output left behind.
const idleRelease = 10 * time.Second

func main() {
	runtime.GOMAXPROCS(1)
	debug.SetGCPercent(20)

	// A microVM guest's /init has no fd 3: its channel is a virtio-serial
	// port it finds itself.
	if guestinit.IsGuest() {
		guestMain()
		return
	}

	// fd 3 must be the channel the runtime passed (a socket, or a
	// virtio-serial port). Without one, fd 3 can be a file the Go runtime
	// itself opened at start-up (the cgroup CPU quota).
	if err := checkControl(3); err != nil {
		fatal(2, "control channel fd 3 is unusable", err)
	}
	sealDescriptors(3)
	// The runtime poller needs a non-blocking fd to give reads deadlines and
	// to close the channel under a blocked reader.
	if err := unix.SetNonblock(3, true); err != nil {
		fatal(2, "control channel fd 3 is unusable", err)
	}
	conn := os.NewFile(3, "control")
	if os.Getpid() == 1 {
		absorbSignals()
	}

	opts := agent.Options{
		ReapAll: os.Getpid() == 1,
		OnIdle:  releaseWhenIdle(),
	}
	if len(os.Args) > 1 && os.Args[1] == "container-init" {
		// A pre-started agent waits here for its sandbox; map its own code
		// now, so setting the sandbox up later does not take a page fault
		// per code page (each costs tens of microseconds on virtual
		// machines; hundreds of them add up to milliseconds).
		prefaultText()
		fork, init, err := sandboxinit.Run(conn, lockdown)
		if err != nil {
			// The edge has the reason on the channel; nothing else to do.
			os.Exit(3)
		}
		opts.Fork = fork
		opts.Env, opts.Workdir, opts.User = init.Env, init.Workdir, init.User
	}

	err := agent.Serve(context.Background(), conn, opts)
	if err != nil {
		fatal(1, "agent stopped", err)
	}
}

// absorbSignals keeps PID 1 alive when a sandbox process signals it. The
// kernel drops signals to a namespace's init only where init has the
// default action, and the Go runtime installs a handler for every signal,
// exiting on SIGTERM, SIGHUP, SIGINT, and crashing on SIGQUIT or a SIGSEGV
// sent with kill(2); any user of the sandbox could end it. Notified
// signals are only delivered to the channel (real faults still crash), and
// processes the agent starts get default dispositions back at exec.
func absorbSignals() {
	ch := make(chan os.Signal, 16)
	signal.Notify(ch, unix.SIGHUP, unix.SIGINT, unix.SIGQUIT, unix.SIGILL, unix.SIGTRAP, unix.SIGABRT,
		unix.SIGBUS, unix.SIGFPE, unix.SIGSEGV, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE, unix.SIGALRM,
		unix.SIGTERM, unix.SIGSTKFLT, unix.SIGXCPU, unix.SIGXFSZ, unix.SIGVTALRM, unix.SIGIO, unix.SIGPWR,
		unix.SIGSYS)
	go func() {
		for range ch {
		}
	}()
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

// lockdown restricts the agent and every command it forks: the spawner
// thread's bounding set (thread), then capabilities, no_new_privs and the
// seccomp filter on every thread (process); no_new_privs, set by
// caps.RestrictProcess, is what allows installing the filter without
// CAP_SYS_ADMIN.
var lockdown = sandboxinit.Lockdown{
	Thread: func(keep uint64) error { return caps.DropBoundingThread(caps.Set(keep)) },
	Process: func(keep uint64, prog []byte) error {
		if err := caps.RestrictProcess(caps.Set(keep)); err != nil {
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
	},
}

// prefaultText populates the page tables of the agent's executable
// mappings (code and read-only data) with one madvise per mapping. The pages
// are the page cache's, shared by every agent: this costs page-table entries,
// not memory. Best effort: MADV_POPULATE_READ needs Linux 5.14.
func prefaultText() {
	exe, err := os.Readlink("/proc/self/exe")
	if err != nil {
		return
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return
	}
	for len(maps) > 0 {
		line := maps
		if i := bytesIndexByte(maps, '\n'); i >= 0 {
			line, maps = maps[:i], maps[i+1:]
		} else {
			maps = nil
		}
		var start, end uintptr
		var perms [4]byte
		n, path := parseMapsLine(line, &start, &end, &perms)
		if n && path == exe && perms[0] == 'r' {
			unix.Syscall(unix.SYS_MADVISE, start, end-start, unix.MADV_POPULATE_READ)
		}
	}
}

func bytesIndexByte(b []byte, c byte) int {
	for i, x := range b {
		if x == c {
			return i
		}
	}
	return -1
}

// parseMapsLine reads "start-end perms offset dev inode path" from a
// /proc/self/maps line.
func parseMapsLine(line []byte, start, end *uintptr, perms *[4]byte) (bool, string) {
	field := 0
	var cur uintptr
	i := 0
	for ; i < len(line) && field < 2; i++ {
		c := line[i]
		switch {
		case c >= '0' && c <= '9':
			cur = cur<<4 | uintptr(c-'0')
		case c >= 'a' && c <= 'f':
			cur = cur<<4 | uintptr(c-'a'+10)
		case c == '-' && field == 0:
			*start, cur, field = cur, 0, 1
		case c == ' ' && field == 1:
			*end, field = cur, 2
		default:
			return false, ""
		}
	}
	if i+4 > len(line) {
		return false, ""
	}
	copy(perms[:], line[i:i+4])
	// The path is the last field; mappings without one end in spaces.
	j := len(line)
	for j > 0 && line[j-1] != ' ' {
		j--
	}
	return true, string(line[j:])
}
