package container

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// ipcThread runs functions inside sandboxes' IPC namespaces on one OS thread
// that the backend keeps for that: it joins the sandbox's namespace, runs
// the function, and joins the host's namespace again. Reset clears System V
// IPC objects and POSIX message queues there on every call, so a thread
// made and thrown away per Reset (a clone, a fresh stack and its page
// faults) would cost more than the clearing. Only the IPC namespace is
// joined: unlike the mount namespace it needs no private file system
// context and can be left again. The thread is never handed back to the Go
// scheduler, so no other goroutine runs in a sandbox's IPC namespace.
type ipcThread struct {
	mu     sync.Mutex
	w      *ipcWorker // nil before the first call and after a worker died
	closed bool
}

type ipcWorker struct {
	jobs chan ipcJob
	quit chan struct{} // closed by ipcThread.close
	dead chan struct{} // closed when the worker has stopped
}

type ipcJob struct {
	nsfd int // the sandbox's IPC namespace
	f    func() error
	done chan error
}

// do runs f in the IPC namespace nsfd refers to (a pidfd or a namespace
// file) and returns its error.
func (t *ipcThread) do(nsfd int, f func() error) error {
	t.mu.Lock()
	if t.closed {
		// A Reset after the backend's Close: a thread of its own.
		t.mu.Unlock()
		return onThrowawayThread(func() error {
			if err := unix.Setns(nsfd, unix.CLONE_NEWIPC); err != nil {
				return fmt.Errorf("join the sandbox's IPC namespace: %w", err)
			}
			return f()
		})
	}
	if t.w == nil {
		t.w = startIPCWorker()
	}
	w := t.w
	t.mu.Unlock()
	job := ipcJob{nsfd: nsfd, f: f, done: make(chan error, 1)}
	select {
	case w.jobs <- job:
		return <-job.done
	case <-w.dead:
		// It could not get back to the host's namespace after an earlier
		// job; the next call starts a new one.
		t.mu.Lock()
		if t.w == w {
			t.w = nil
		}
		t.mu.Unlock()
		return errors.New("IPC namespace thread stopped; try again")
	}
}

// close stops the worker (its thread ends with it).
func (t *ipcThread) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	if t.w != nil {
		close(t.w.quit)
		<-t.w.dead
		t.w = nil
	}
}

// startIPCWorker starts the worker on an OS thread other than the main
// one (which the runtime never ends, and whose namespaces /proc/self
// shows): a goroutine that lands on the main thread keeps it locked while
// a second one, which therefore cannot land there, becomes the worker.
func startIPCWorker() *ipcWorker {
	w := &ipcWorker{jobs: make(chan ipcJob), quit: make(chan struct{}), dead: make(chan struct{})}
	locked := make(chan struct{})
	var start func()
	start = func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			go start()
			<-locked // the worker has its own thread now
			runtime.UnlockOSThread()
			return
		}
		close(locked)
		// Never unlocked: the thread ends with the goroutine.
		defer close(w.dead)
		w.serve()
	}
	go start()
	<-locked
	return w
}

func (w *ipcWorker) serve() {
	for {
		select {
		case <-w.quit:
			return
		case j := <-w.jobs:
			if !w.run(j) {
				return // stuck in the sandbox's namespace: end the thread
			}
		}
	}
}

// run does one job and reports whether the thread is back in the host's
// IPC namespace. The way back is opened per job, so that no descriptor
// stays open between Resets.
func (w *ipcWorker) run(j ipcJob) bool {
	host, err := unix.Open("/proc/thread-self/ns/ipc", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		j.done <- fmt.Errorf("open the host's IPC namespace: %w", err)
		return true
	}
	defer unix.Close(host)
	if err := unix.Setns(j.nsfd, unix.CLONE_NEWIPC); err != nil {
		j.done <- fmt.Errorf("join the sandbox's IPC namespace: %w", err)
		return true
	}
	err = j.f()
	back := unix.Setns(host, unix.CLONE_NEWIPC)
	if back != nil && err == nil {
		err = fmt.Errorf("rejoin the host's IPC namespace: %w", back)
	}
	j.done <- err
	return back == nil
}
