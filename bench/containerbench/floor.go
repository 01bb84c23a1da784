package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// The floor rows are not sandboxes: they bound from below what any sandbox
// create->run->destroy can cost on this host, so the other rows can be
// read as overhead on top of process spawn.

// floorCgroup gives a floor row's idle processes a memory cgroup, so
// they get the same precise figure the runtimes' cgroups give.
type floorCgroup struct{ cg *memCgroup }

func (f *floorCgroup) setup(name string) error {
	cg, err := newMemCgroup(cgroupName(name))
	if err != nil {
		return err
	}
	f.cg = &cg
	return nil
}

func (f *floorCgroup) Teardown(ctx context.Context) error {
	if f.cg == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return errors.Join(f.cg.drain(ctx), f.cg.remove())
}

func (f *floorCgroup) CgroupMemory() (int64, error) { return f.cg.usage() }

// startIdle starts cmd and moves it into the cgroup. A single sleep forks
// nothing, so moving it after start (charges move with it) is exact.
func (f *floorCgroup) startIdle(cmd *exec.Cmd) (func(context.Context) error, error) {
	stop, err := startIdleProcess(cmd)
	if err != nil {
		return nil, err
	}
	if err := f.cg.add(cmd.Process.Pid); err != nil {
		return nil, errors.Join(err, stop(context.Background()))
	}
	return stop, nil
}

// hostExec is a bare os/exec of /bin/true on the host.
type hostExec struct{ floorCgroup }

func newHostExec() System { return &hostExec{} }

func (h *hostExec) Name() string                     { return "host-exec" }
func (h *hostExec) Setup(context.Context, Env) error { return h.setup(h.Name()) }
func (h *hostExec) Cycle(ctx context.Context) error {
	return exec.CommandContext(ctx, "/bin/true").Run()
}
func (h *hostExec) StartIdle(context.Context, int) (func(context.Context) error, error) {
	return h.startIdle(exec.Command("/bin/sleep", "1000000"))
}

// nsSpawn is a bare Go spawn into fresh mount, pid, ipc, uts and network
// namespaces, chrooted into the busybox rootfs: the kernel work every
// container runtime must do, with none of the runtime around it.
type nsSpawn struct {
	floorCgroup
	rootfs string
}

func newNSSpawn() System { return &nsSpawn{} }

func (s *nsSpawn) Name() string { return "ns-spawn" }

func (s *nsSpawn) Setup(_ context.Context, env Env) error {
	s.rootfs = env.Rootfs
	return s.setup(s.Name())
}

func (s *nsSpawn) command(ctx context.Context, argv ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Chroot: s.rootfs,
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWIPC |
			syscall.CLONE_NEWUTS | syscall.CLONE_NEWNET,
	}
	return cmd
}

func (s *nsSpawn) Cycle(ctx context.Context) error {
	return s.command(ctx, "/bin/true").Run()
}

func (s *nsSpawn) StartIdle(_ context.Context, _ int) (func(context.Context) error, error) {
	// Not CommandContext: the idle process must outlive the call that
	// started it.
	return s.startIdle(s.command(context.Background(), "/bin/sleep", "1000000"))
}

// startIdleProcess starts cmd and returns a stop that kills and reaps it.
func startIdleProcess(cmd *exec.Cmd) (func(context.Context) error, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	// Idle processes must not outlive a harness that dies without tearing
	// down.
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start idle %s: %w", cmd.Path, err)
	}
	return func(context.Context) error {
		if err := cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("kill idle pid %d: %w", cmd.Process.Pid, err)
		}
		_ = cmd.Wait() // killed on purpose: the exit status is noise
		return nil
	}, nil
}
