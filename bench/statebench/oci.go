package main

// The pause/resume peer: P detached busybox containers run by crun (or
// runc), paused and resumed one after another, as a user of the runtime
// pauses N containers. The runtime runs in a worker process (this binary
// re-executed with ociWorkerArg) in a private mount namespace: crun 1.8
// refuses the hybrid cgroup layout of this host, so the worker replaces
// the cgroup2 mount with an empty tmpfs there, as bench/containerbench
// does, without touching the host's mounts or dsec up's view. The worker
// keeps its containers for the whole phase and answers "pause" and
// "resume" lines on stdin with one JSON line each, so the harness can
// interleave the peer's passes with DSec's.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// ociWorkerArg, as the first argument, makes this binary the OCI worker.
const ociWorkerArg = "-oci-worker"

// workerMsg is one line the worker prints.
type workerMsg struct {
	Op    string `json:"op"`
	N     int    `json:"n,omitempty"`
	Nanos int64  `json:"ns,omitempty"`
	Error string `json:"error,omitempty"`
}

// ociPeer is the harness's side of a running worker.
type ociPeer struct {
	rt    string
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan workerMsg
	done  chan struct{}
	n     int
}

// ociCgroup is the cgroup parent of the worker's containers; the
// harness's pid in it lets the leak check find it.
func ociCgroup(rt string) string {
	return fmt.Sprintf("%s%s-%d", cgroupPrefix, rt, os.Getpid())
}

// startOCI starts the worker and waits until its n containers run.
func startOCI(ctx context.Context, rt, workDir, rootfs string, n int) (*ociPeer, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(workDir, 0o700); err != nil {
		return nil, err
	}
	o := &ociPeer{rt: rt, lines: make(chan workerMsg, 4), done: make(chan struct{}), n: n}
	o.cmd = exec.Command(self, ociWorkerArg, "-runtime", rt, "-workdir", workDir, "-rootfs", rootfs,
		"-n", strconv.Itoa(n), "-cgroup", ociCgroup(rt))
	o.cmd.Stderr = os.Stderr
	// Go makes / recursively private in the child when it unshares the
	// mount namespace, so nothing the worker mounts reaches the host. Its
	// own process group keeps a terminal's Ctrl-C for the harness, which
	// then stops the worker in order; if the harness dies, the worker
	// gets SIGTERM and tears down by itself.
	o.cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if o.in, err = o.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := o.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := o.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s worker: %w", rt, err)
	}
	go func() {
		defer close(o.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var m workerMsg
			if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
				m = workerMsg{Op: "?", Error: fmt.Sprintf("bad worker line %q", sc.Text())}
			}
			o.lines <- m
		}
	}()
	go func() { _ = o.cmd.Wait(); close(o.done) }()
	slog.Info("started OCI worker", "runtime", rt, "pid", o.cmd.Process.Pid, "containers", n)
	m, err := o.reply(ctx, "ready", 10*time.Minute)
	if err != nil {
		return o, err
	}
	if m.N != n {
		return o, fmt.Errorf("%s worker runs %d containers, want %d", rt, m.N, n)
	}
	return o, nil
}

// reply waits for the worker's answer to op.
func (o *ociPeer) reply(ctx context.Context, op string, timeout time.Duration) (workerMsg, error) {
	select {
	case m, ok := <-o.lines:
		switch {
		case !ok:
			return m, fmt.Errorf("%s worker exited before answering %s", o.rt, op)
		case m.Error != "":
			return m, fmt.Errorf("%s worker: %s: %s", o.rt, m.Op, m.Error)
		case m.Op != op:
			return m, fmt.Errorf("%s worker answered %q to %q", o.rt, m.Op, op)
		}
		return m, nil
	case <-ctx.Done():
		return workerMsg{}, ctx.Err()
	case <-time.After(timeout):
		return workerMsg{}, fmt.Errorf("%s worker: no answer to %s after %v", o.rt, op, timeout)
	}
}

// pass pauses ("pause") or resumes ("resume") every container, one after
// another, and returns the wall time of the pass.
func (o *ociPeer) pass(ctx context.Context, op string) (time.Duration, error) {
	if _, err := io.WriteString(o.in, op+"\n"); err != nil {
		return 0, fmt.Errorf("%s worker: %w", o.rt, err)
	}
	m, err := o.reply(ctx, op, 5*time.Minute)
	if err != nil {
		return 0, err
	}
	return time.Duration(m.Nanos), nil
}

// close ends the worker: EOF on its stdin makes it delete its containers,
// their cgroups and its state, and exit. A worker that does not is
// killed (its mounts die with its namespace; the leak check finds the
// rest).
func (o *ociPeer) close() error {
	o.in.Close()
	var errs []error
	timeout := time.After(3 * time.Minute)
drain:
	for {
		select {
		case m, ok := <-o.lines:
			if !ok {
				break drain
			}
			if m.Error != "" {
				errs = append(errs, fmt.Errorf("%s worker: %s: %s", o.rt, m.Op, m.Error))
			}
		case <-timeout:
			_ = syscall.Kill(-o.cmd.Process.Pid, syscall.SIGKILL)
			errs = append(errs, fmt.Errorf("%s worker killed: no teardown after 3m", o.rt))
			break drain
		}
	}
	<-o.done
	if st := o.cmd.ProcessState; st != nil && !st.Success() && len(errs) == 0 {
		errs = append(errs, fmt.Errorf("%s worker: %s", o.rt, st))
	}
	return errors.Join(errs...)
}

// ociWorker is the worker process's state.
type ociWorker struct {
	rt, work, rootfs, state, cgroup string

	mu   sync.Mutex
	ids  []string
	pids map[string]int
}

func ociWorkerMain(args []string) error {
	fs := flag.NewFlagSet("oci-worker", flag.ContinueOnError)
	var (
		rt     = fs.String("runtime", "crun", "")
		work   = fs.String("workdir", "", "")
		rootfs = fs.String("rootfs", "", "")
		n      = fs.Int("n", 1, "")
		cg     = fs.String("cgroup", "", "")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	enc := json.NewEncoder(os.Stdout)
	say := func(m workerMsg) { _ = enc.Encode(m) }

	w := &ociWorker{rt: *rt, work: *work, rootfs: *rootfs, state: filepath.Join(*work, "state"), cgroup: *cg, pids: map[string]int{}}
	err := w.setup(ctx, *n)
	if err == nil {
		say(workerMsg{Op: "ready", N: len(w.ids)})
		lines := make(chan string)
		go func() {
			defer close(lines)
			sc := bufio.NewScanner(os.Stdin)
			for sc.Scan() {
				lines <- strings.TrimSpace(sc.Text())
			}
		}()
	loop:
		for {
			select {
			case <-ctx.Done():
				break loop
			case op, ok := <-lines:
				if !ok {
					break loop
				}
				switch op {
				case "pause", "resume":
					d, err := w.pass(ctx, op)
					m := workerMsg{Op: op, Nanos: int64(d)}
					if err != nil {
						m.Error = err.Error()
					}
					say(m)
				default:
					say(workerMsg{Op: op, Error: "unknown op"})
				}
			}
		}
	} else {
		say(workerMsg{Op: "ready", Error: err.Error()})
	}
	terr := w.teardown()
	if terr != nil {
		say(workerMsg{Op: "teardown", Error: terr.Error()})
	}
	return errors.Join(err, terr)
}

// setup starts n detached containers running `sleep`.
func (w *ociWorker) setup(ctx context.Context, n int) error {
	if hybridCgroups() && w.rt == "crun" {
		if err := peer.HideUnifiedCgroup("statebench-no-cgroup2"); err != nil {
			return err
		}
	}
	// Detached containers are orphaned when `run --detach` returns; as
	// subreaper the worker inherits them and can reap them.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("become subreaper: %w", err)
	}
	if err := os.MkdirAll(w.state, 0o700); err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := w.start(ctx, fmt.Sprintf("c%d", i)); err != nil {
			return err
		}
	}
	return nil
}

// start runs container id detached: a bundle whose root is the shared
// busybox tree, read-only (pausing does not touch the file system, so no
// per-container overlay is needed), and whose process is `sleep`.
func (w *ociWorker) start(ctx context.Context, id string) error {
	dir := filepath.Join(w.work, "b", id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	cfg, err := json.Marshal(ociSpec(id, w.rootfs, "/"+w.cgroup+"/"+id))
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644); err != nil {
		return err
	}
	w.mu.Lock()
	w.ids = append(w.ids, id) // teardown deletes it even if run fails half-way
	w.mu.Unlock()
	pid, err := peer.RunDetached(ctx, w.rt, w.state, dir, id)
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.pids[id] = pid
	w.mu.Unlock()
	return nil
}

// pass runs `RUNTIME pause|resume ID` for every container, one after
// another, and returns the wall time; then (untimed) checks that every
// container's freezer says what was asked.
func (w *ociWorker) pass(ctx context.Context, op string) (time.Duration, error) {
	t0 := time.Now()
	for _, id := range w.ids {
		if err := run(ctx, w.rt, "--root", w.state, op, id); err != nil {
			return 0, err
		}
	}
	d := time.Since(t0)
	for _, id := range w.ids {
		frozen, err := cgroupFrozen(w.cgroup + "/" + id)
		if err != nil {
			return 0, err
		}
		if frozen != (op == "pause") {
			return 0, fmt.Errorf("after %s, container %s has frozen=%v", op, id, frozen)
		}
	}
	return d, nil
}

// teardown kills and reaps every container's init, deletes the containers
// from the runtime's state and removes their cgroups.
func (w *ociWorker) teardown() error {
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// A paused container's processes cannot die: thaw first (the cgroup
	// removal below thaws too, but delete --force comes before it).
	for _, id := range w.ids {
		if frozen, err := cgroupFrozen(w.cgroup + "/" + id); err == nil && frozen {
			_ = run(ctx, w.rt, "--root", w.state, "resume", id)
		}
	}
	var pids []int
	for _, pid := range w.pids {
		if unix.Kill(pid, unix.SIGKILL) == nil {
			pids = append(pids, pid)
		}
	}
	for _, pid := range pids {
		for {
			if _, err := unix.Wait4(pid, nil, 0, nil); !errors.Is(err, unix.EINTR) {
				break
			}
		}
	}
	if _, err := os.Stat(w.state); err == nil {
		out, err := output(ctx, w.rt, "--root", w.state, "list", "--quiet")
		if err != nil {
			errs = append(errs, err)
		}
		for _, id := range strings.Fields(string(out)) {
			if id == "ID" || id == "NAME" {
				continue // a header, in some versions even with --quiet
			}
			if err := run(ctx, w.rt, "--root", w.state, "delete", "--force", id); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if w.cgroup != "" {
		cgs, err := dsecup.GlobCgroups(w.cgroup)
		if err != nil {
			errs = append(errs, err)
		}
		if err := dsecup.RemoveCgroups(cgs); err != nil {
			errs = append(errs, err)
		}
	}
	if err := dsecup.RemoveDir(w.work); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// run executes a runtime command and returns its error with the tail of
// its stderr. Its own process group keeps signals for the worker.
func run(ctx context.Context, name string, args ...string) error {
	_, err := output(ctx, name, args...)
	return err
}

func output(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if len(msg) > 400 {
			msg = "..." + msg[len(msg)-400:]
		}
		return []byte(stdout.String()), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
	}
	return []byte(stdout.String()), nil
}

// ociSpec is the config `runc spec` generates, changed where the peer
// needs it: no terminal, `sleep` as the process, the shared busybox tree
// as a read-only root, the namespaces DSec uses (plus cgroup), and a
// cgroup path the harness can find and remove.
func ociSpec(id, rootfs, cgroupsPath string) *specs.Spec {
	sp := peer.OCISpec(id, []string{"/bin/sleep", "1000000"}, specs.Root{Path: rootfs, Readonly: true}, cgroupsPath, nil)
	// Its peers have never had the cgroup file system mounted: pausing
	// does not need it, and the figures stay comparable with earlier runs.
	sp.Mounts = slices.DeleteFunc(sp.Mounts, func(m specs.Mount) bool { return m.Destination == "/sys/fs/cgroup" })
	return sp
}
