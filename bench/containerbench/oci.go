package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// ociRuntime drives an OCI runtime binary (crun or runc) the way a minimal
// engine would: one bundle per container whose root is a fresh overlay
// mounted on the host side from the shared busybox lower dir, then
// `RUNTIME run` (create, start, wait, delete in one process) for a cycle,
// and `RUNTIME run --detach` for idle containers.
type ociRuntime struct {
	bin    string // crun or runc
	rootfs string
	work   string
	state  string // the runtime's --root, private to this run
	cgroup string // cgroup parent (relative), one per runtime
	seq    atomic.Int64

	mu   sync.Mutex
	pids map[string]int // detached containers still alive: id -> init pid
}

func newOCI(bin string) System { return &ociRuntime{bin: bin} }

func (o *ociRuntime) Name() string { return o.bin }

func (o *ociRuntime) Setup(ctx context.Context, env Env) error {
	if _, err := exec.LookPath(o.bin); err != nil {
		return fmt.Errorf("%s not installed (apt-get install -y %s): %w", o.bin, o.bin, err)
	}
	o.rootfs = env.Rootfs
	o.work = env.WorkDir
	o.state = filepath.Join(env.WorkDir, "state")
	o.cgroup = cgroupName(o.bin)
	o.pids = map[string]int{}
	if err := os.MkdirAll(o.state, 0o700); err != nil {
		return fmt.Errorf("%s state dir: %w", o.bin, err)
	}
	// Detached containers are orphaned when `run --detach` returns; as
	// subreaper the harness inherits them and can reap them.
	return peer.BecomeSubreaper()
}

// bundle makes the bundle directory for container id: an overlay of the
// shared rootfs with a private upper dir, and its config.json.
func (o *ociRuntime) bundle(id, cgroup string, args []string) (string, error) {
	dir := filepath.Join(o.work, "b", id)
	upper, wk, merged := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "rootfs")
	for _, d := range []string{upper, wk, merged} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", fmt.Errorf("bundle %s: %w", id, err)
		}
	}
	opts := "lowerdir=" + o.rootfs + ",upperdir=" + upper + ",workdir=" + wk
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		_ = os.RemoveAll(dir)
		return "", fmt.Errorf("overlay for %s: %w", id, err)
	}
	cfg, err := json.Marshal(peer.OCISpec(id, args, specs.Root{Path: "rootfs"}, "/"+cgroup+"/"+id, ociResources(benchResources)))
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644)
	}
	if err != nil {
		_ = o.removeBundle(dir)
		return "", fmt.Errorf("config.json for %s: %w", id, err)
	}
	return dir, nil
}

func (o *ociRuntime) removeBundle(dir string) error {
	if err := unix.Unmount(filepath.Join(dir, "rootfs"), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmount bundle %s: %w", dir, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove bundle: %w", err)
	}
	return nil
}

func (o *ociRuntime) Cycle(ctx context.Context) error {
	id := fmt.Sprintf("cb%d", o.seq.Add(1))
	dir, err := o.bundle(id, o.cgroup, []string{"/bin/true"})
	if err != nil {
		return err
	}
	// run returns the container's exit status: a non-zero /bin/true
	// surfaces here as an error.
	runErr := run(ctx, o.bin, "--root", o.state, "run", "--bundle", dir, id)
	return errors.Join(runErr, o.removeBundle(dir))
}

func (o *ociRuntime) StartIdle(ctx context.Context, i int) (func(context.Context) error, error) {
	id := fmt.Sprintf("idle%d", i)
	dir, err := o.bundle(id, o.idleCgroup(), []string{"/bin/sleep", "1000000"})
	if err != nil {
		return nil, err
	}
	pid, err := peer.RunDetached(ctx, o.bin, o.state, dir, id)
	if err != nil {
		_ = run(context.WithoutCancel(ctx), o.bin, "--root", o.state, "delete", "--force", id)
		_ = o.removeBundle(dir)
		return nil, err
	}
	o.mu.Lock()
	o.pids[id] = pid
	o.mu.Unlock()
	return func(ctx context.Context) error { return o.stopIdle(ctx, id, dir, pid) }, nil
}

// stopIdle kills and reaps the container's init before asking the runtime
// to delete it: the harness is the init's parent (subreaper), and a runtime
// that waits for the process to vanish would wait forever on our zombie.
func (o *ociRuntime) stopIdle(ctx context.Context, id, dir string, pid int) error {
	var errs []error
	if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		errs = append(errs, fmt.Errorf("kill %s pid %d: %w", id, pid, err))
	}
	reap(pid)
	if err := run(ctx, o.bin, "--root", o.state, "delete", "--force", id); err != nil {
		errs = append(errs, err)
	}
	if err := o.removeBundle(dir); err != nil {
		errs = append(errs, err)
	}
	o.mu.Lock()
	delete(o.pids, id)
	o.mu.Unlock()
	return errors.Join(errs...)
}

// reap waits for pid if it is our child (ECHILD means it is not, and
// someone else reaps it).
func reap(pid int) {
	for {
		_, err := unix.Wait4(pid, nil, 0, nil)
		if !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

func (o *ociRuntime) Teardown(ctx context.Context) error {
	var errs []error
	o.mu.Lock()
	left := o.pids
	o.pids = map[string]int{}
	o.mu.Unlock()
	for _, pid := range left {
		_ = unix.Kill(pid, unix.SIGKILL)
		reap(pid)
	}
	// Whatever a cancelled or failed cycle left in the runtime's state.
	if out, err := output(ctx, o.bin, "--root", o.state, "list", "--quiet"); err == nil {
		for _, id := range strings.Fields(string(out)) {
			if id == "ID" || id == "NAME" {
				continue // crun prints a header even with --quiet in some versions
			}
			if err := run(ctx, o.bin, "--root", o.state, "delete", "--force", id); err != nil {
				errs = append(errs, err)
			}
		}
	} else if o.state != "" {
		errs = append(errs, err)
	}
	if o.work != "" {
		if err := unmountUnder(o.work); err != nil {
			errs = append(errs, err)
		}
	}
	if o.cgroup != "" {
		if err := removeCgroupTree(o.cgroup); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// idleCgroup is the parent of the idle containers' cgroups, apart from the
// cycles' parent: on cgroup v1 a removed child's charges (page cache) move
// to its parent and are reclaimed later, so a parent the cycles used can
// shrink while idle containers start, and the idle figure went negative.
func (o *ociRuntime) idleCgroup() string { return o.cgroup + "/idle" }

func (o *ociRuntime) CgroupMemory() (int64, error) { return cgroupMemoryUsage(o.idleCgroup()) }
