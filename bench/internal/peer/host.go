// Package peer holds what the benchmarks need to run their peers (crun,
// runc, a private dockerd) on a DSec node and leave nothing behind: one
// copy for containerbench, statebench and densitybench.
package peer

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// HideUnifiedCgroup makes this process's private mount namespace look
// cgroup v1-only, which crun 1.8 needs on a hybrid host ("cgroups in hybrid
// mode not supported"). The unified mount is replaced by an empty tmpfs
// (named source) rather than just removed: crun still writes a
// cgroup.procs file per container under that path, and without the tmpfs
// those writes would land in the host's /sys/fs/cgroup tmpfs, hidden under
// the host's unified mount and never cleaned up. A host without that mount
// is left as it is.
func HideUnifiedCgroup(source string) error {
	const unified = "/sys/fs/cgroup/unified"
	if _, err := os.Stat(unified); errors.Is(err, os.ErrNotExist) {
		return nil // not hybrid
	}
	if err := unix.Unmount(unified, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("unmount %s in private namespace: %w", unified, err)
	}
	if err := unix.Mount(source, unified, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=755,size=16m"); err != nil {
		return fmt.Errorf("mount scratch tmpfs on %s: %w", unified, err)
	}
	return nil
}

// BecomeSubreaper makes orphaned descendants (detached containers, bwrap's
// sandbox init, containerd's shims) re-parent to this process rather than
// to the host's PID 1, which may be slow to reap them or never do.
func BecomeSubreaper() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("become subreaper: %w", err)
	}
	return nil
}

// ReapOrphans reaps every exited child (what this process inherited as
// subreaper) without blocking on live ones. Callers run it only when no
// os/exec command of theirs is in flight, so it cannot steal an exit status
// that Cmd.Wait is waiting for.
func ReapOrphans() {
	for {
		pid, err := unix.Wait4(-1, nil, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
	}
}
