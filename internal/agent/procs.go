package agent

import (
	"os"
	"os/signal"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// procTable starts processes and delivers each one's exit status to the
// exec that started it.
//
// Two modes, because wait4 has exactly one owner per process:
//
//   - reapAll (the agent is PID 1, or a subreaper): one goroutine, woken by
//     SIGCHLD, calls wait4(-1, WNOHANG) until nothing is left and hands each
//     status to the waiter registered for that pid; orphans that were
//     re-parented to the agent are reaped and dropped. A status can never
//     be lost to the race between fork and registration: starts hold gate
//     for reading across fork+register, and the reaper takes gate for
//     writing before it looks a pid up.
//   - per-pid (the agent runs inside some other process, e.g. a test
//     binary): each start waits for its own pid only, so the host process's
//     other children are left alone.
type procTable struct {
	reapAll bool

	gate    sync.RWMutex // see above; held for reading across ForkExec
	mu      sync.Mutex   // guards waiters; taken after gate, never before
	waiters map[int]chan syscall.WaitStatus
}

var (
	reaperOnce sync.Once
	reaper     *procTable
)

// newProcTable returns the process-wide reaping table (started once, lives
// as long as the process) or a per-pid table.
func newProcTable(reapAll bool, log Logger) *procTable {
	if !reapAll {
		return &procTable{}
	}
	reaperOnce.Do(func() {
		reaper = &procTable{reapAll: true, waiters: make(map[int]chan syscall.WaitStatus)}
		if os.Getpid() != 1 {
			// Orphans of our execs come back to us instead of to the host's init.
			if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
				log.Warn("cannot become child subreaper", "err", err)
			}
		}
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGCHLD)
		go func() {
			reaper.reap() // children that exited before Notify
			for range sig {
				reaper.reap()
			}
		}()
	})
	return reaper
}

// reap collects every exited child. SIGCHLDs coalesce, so one signal means
// "one or more": loop until wait4 reports nothing more.
func (p *procTable) reap() {
	type exit struct {
		pid int
		ws  syscall.WaitStatus
	}
	var exits []exit
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			break
		}
		exits = append(exits, exit{pid, ws})
	}
	if len(exits) == 0 {
		return
	}
	// Wait out starts in flight so their pids are registered.
	p.gate.Lock()
	p.gate.Unlock() //nolint:staticcheck // an empty critical section is the point: it is a barrier
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, e := range exits {
		if ch, ok := p.waiters[e.pid]; ok {
			delete(p.waiters, e.pid)
			ch <- e.ws // buffered, never blocks
		}
	}
}

// start forks and execs argv0 and returns its pid and a channel that
// receives its exit status exactly once.
func (p *procTable) start(argv0 string, argv []string, attr *syscall.ProcAttr) (int, <-chan syscall.WaitStatus, error) {
	ch := make(chan syscall.WaitStatus, 1)
	if !p.reapAll {
		pid, err := syscall.ForkExec(argv0, argv, attr)
		if err != nil {
			return 0, nil, err
		}
		go func() {
			var ws syscall.WaitStatus
			for {
				_, err := syscall.Wait4(pid, &ws, 0, nil)
				if err != syscall.EINTR {
					break
				}
			}
			ch <- ws
		}()
		return pid, ch, nil
	}
	p.gate.RLock()
	defer p.gate.RUnlock()
	pid, err := syscall.ForkExec(argv0, argv, attr)
	if err != nil {
		return 0, nil, err
	}
	p.mu.Lock()
	p.waiters[pid] = ch
	p.mu.Unlock()
	return pid, ch, nil
}
