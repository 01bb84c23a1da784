package main

// The wave's peer runs on a private dockerd (bench/internal/peer), as
// containerbench's and bench/sdkbench/docker_cycle.sh's do: its own
// data-root, socket and cgroup parent, no bridge, in a private mount
// namespace so container mounts never enter the host's table.

import (
	"context"
	"fmt"
	"os"

	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// dockerImage is the busybox rootfs imported into the private dockerd.
const dockerImage = "densitybench-busybox:latest"

// startDockerd starts dockerd in dir and imports rootfs as dockerImage. A
// non-nil *peer.Dockerd, even with an error, must be stopped.
func startDockerd(ctx context.Context, dir, rootfs string) (*peer.Dockerd, error) {
	return peer.StartDockerd(ctx, peer.DockerdConfig{
		Dir: dir, Rootfs: rootfs, Image: dockerImage,
		Cgroup:        fmt.Sprintf("%sdocker-%d", cgroupPrefix, os.Getpid()),
		PrivateMounts: true,
	})
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
