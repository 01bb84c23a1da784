package main

import (
	"context"
	"strings"

	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// dockerImage is the busybox rootfs imported into the private dockerd.
const dockerImage = "dsecbench-busybox:latest"

// docker runs a private dockerd (peer.Dockerd: own data-root, exec-root,
// socket and cgroup parent, the host's firewall untouched) for the
// duration of one measurement and drives it with the docker CLI, as a
// user of Docker would. The bridge variant creates a veth pair and a
// network namespace per container.
type docker struct {
	bridge bool
	name   string
	cgroup string
	d      *peer.Dockerd
}

func newDocker(bridge bool) System {
	name := "docker-nonet"
	if bridge {
		name = "docker"
	}
	return &docker{bridge: bridge, name: name}
}

func (d *docker) Name() string { return d.name }

func (d *docker) Setup(ctx context.Context, env Env) error {
	// containerd's shims daemonise and would be orphaned to the host's
	// PID 1, which may never reap what they leave; as subreaper the
	// worker inherits them and reaps them in Teardown.
	if err := peer.BecomeSubreaper(); err != nil {
		return err
	}
	d.cgroup = cgroupName(d.name)
	var err error
	d.d, err = peer.StartDockerd(ctx, peer.DockerdConfig{
		Dir: env.WorkDir, Rootfs: env.Rootfs, Image: dockerImage, Cgroup: d.cgroup, Bridge: d.bridge,
	})
	return err
}

func (d *docker) runArgs(detach bool, argv ...string) []string {
	args := d.d.Args("run")
	if detach {
		args = append(args, "--detach")
	} else {
		args = append(args, "--rm")
	}
	if !d.bridge {
		args = append(args, "--network", "none")
	}
	return append(append(args, dockerImage), argv...)
}

func (d *docker) Cycle(ctx context.Context) error {
	return run(ctx, peer.DockerCLI, d.runArgs(false, "/bin/true")...)
}

func (d *docker) StartIdle(ctx context.Context, _ int) (func(context.Context) error, error) {
	out, err := output(ctx, peer.DockerCLI, d.runArgs(true, "/bin/sleep", "1000000")...)
	if err != nil {
		return nil, err
	}
	id := strings.TrimSpace(string(out))
	return func(ctx context.Context) error {
		return run(ctx, peer.DockerCLI, d.d.Args("rm", "--force", id)...)
	}, nil
}

func (d *docker) CgroupMemory() (int64, error) { return cgroupMemoryUsage(d.cgroup) }

func (d *docker) Teardown(ctx context.Context) error {
	if d.d == nil {
		return nil
	}
	err := d.d.Stop(ctx)
	peer.ReapOrphans()
	return err
}
