package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// bubblewrap does less than the other peers, and the table should be read
// with that in mind: no cgroup, no per-sandbox writable layer (it bind
// mounts the shared rootfs read-only; it has no overlay support), no
// runtime state on disk. It is the "just namespaces and mounts" reference
// with a real tool.
type bwrap struct {
	rootfs, bin, self string
	// cg holds the idle sandboxes; bwrap makes no cgroup of its own.
	cg *memCgroup
}

func newBwrap() System { return &bwrap{} }

func (b *bwrap) Name() string { return "bwrap" }

func (b *bwrap) Setup(_ context.Context, env Env) error {
	bin, err := exec.LookPath("bwrap")
	if err != nil {
		return fmt.Errorf("bwrap not installed (apt-get install -y bubblewrap): %w", err)
	}
	b.bin, b.rootfs, b.self = bin, env.Rootfs, env.SelfExe
	cg, err := newMemCgroup(cgroupName("bwrap"))
	if err != nil {
		return err
	}
	b.cg = &cg
	// Killing a sandbox's pid-namespace init orphans its other processes.
	return peer.BecomeSubreaper()
}

func (b *bwrap) Teardown(ctx context.Context) error {
	if b.cg == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return errors.Join(b.cg.drain(ctx), b.cg.remove())
}

func (b *bwrap) CgroupMemory() (int64, error) { return b.cg.usage() }

func (b *bwrap) args(argv ...string) []string {
	return append([]string{"--unshare-all", "--die-with-parent",
		"--ro-bind", b.rootfs, "/", "--proc", "/proc", "--dev", "/dev"}, argv...)
}

func (b *bwrap) Cycle(ctx context.Context) error {
	return run(ctx, "bwrap", b.args("/bin/true")...)
}

func (b *bwrap) StartIdle(_ context.Context, _ int) (func(context.Context) error, error) {
	// bwrap's --die-with-parent is set by the inner process after clone,
	// so killing the outer bwrap right after start can orphan the sandbox.
	// --info-fd tells us the inner pid: stop kills that (the sandbox's pid
	// namespace init, which takes the whole namespace with it) as well.
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("bwrap info pipe: %w", err)
	}
	defer r.Close()
	argv := append([]string{cgexecFlag, b.cg.dir(), b.bin, "--info-fd", "3"}, b.args("/bin/sleep", "1000000")...)
	cmd := exec.Command(b.self, argv...)
	cmd.ExtraFiles = []*os.File{w}
	stopOuter, err := startIdleProcess(cmd)
	w.Close()
	if err != nil {
		return nil, err
	}
	var info struct {
		ChildPid int `json:"child-pid"`
	}
	if err := json.NewDecoder(r).Decode(&info); err != nil || info.ChildPid <= 0 {
		return nil, errors.Join(fmt.Errorf("bwrap --info-fd gave no child pid: %w", err), stopOuter(context.Background()))
	}
	return func(ctx context.Context) error {
		if err := unix.Kill(info.ChildPid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("kill bwrap sandbox pid %d: %w", info.ChildPid, err)
		}
		return stopOuter(ctx)
	}, nil
}
