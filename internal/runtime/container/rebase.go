package container

import (
	"context"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

var _ rt.Rebaser = (*sandbox)(nil)

// Quiesce implements runtime.Rebaser: Reset's kill pass, attribute restore
// and IPC clearing, without touching the root file system. A quiesced
// sandbox waits, with no process of its user left, until Rebase gives it a
// new root (or Destroy ends it). The fork server goes too: it is an
// interpreter of the old spec's image.
func (s *sandbox) Quiesce(ctx context.Context) error {
	s.begin()
	defer s.end()
	s.resetMu.Lock()
	defer s.resetMu.Unlock()
	proc, err := s.quiesceLocked(ctx, "quiesce")
	if proc >= 0 {
		unix.Close(proc)
	}
	return err
}

// quiesceLocked quiesces the sandbox and returns the agent's /proc/PID
// directory (openProc) for the caller to use and close; -1 with an error.
func (s *sandbox) quiesceLocked(ctx context.Context, op string) (proc int, err error) {
	select {
	case <-s.done:
		return -1, fmt.Errorf("%w: %s: init has exited", rt.ErrSandboxGone, op)
	default:
	}
	if proc, err = s.openProc(); err != nil {
		return -1, s.gone(fmt.Errorf("%s: %w", op, err))
	}
	defer func() {
		if err != nil {
			unix.Close(proc)
			proc = -1
		}
	}()
	s.dropForkServer()
	if err := s.killUser(ctx); err != nil {
		return proc, s.gone(fmt.Errorf("%s: %w", op, err))
	}
	if err := s.attrs.restoreWith(s.cmd.Process.Pid, proc); err != nil {
		return proc, s.gone(fmt.Errorf("%s: %w", op, err))
	}
	if err := s.clearIPCNamespace(proc); err != nil {
		return proc, s.gone(fmt.Errorf("%s: %w", op, err))
	}
	return proc, nil
}

// Rebase implements runtime.Rebaser. It costs what a Reset that builds a
// new root costs (plus mounting layers no other sandbox holds), against a
// new agent process, namespaces, cgroup and directories for a create:
//
//  1. Quiesce (every user process killed and reaped, IPC cleared, the
//     fork server dropped).
//  2. The new spec's layers are acquired (mounted if no sandbox holds
//     them) and a detached overlay is built over them with fresh upper and
//     work directories, in the host's mount namespace, as Reset's new root.
//  3. On a throw-away thread in the sandbox's mount and UTS namespaces the
//     root is swapped exactly as Reset does (swapMounts: /proc and /sys
//     moved over, a fresh /dev, pivot_root, the old root detached with
//     whatever was under it) and the hostname set.
//  4. The cgroup takes the new resources, and the spec's exec defaults
//     (Env, Workdir, User) and layers become the sandbox's; in the
//     background the old overlay is unmounted, its directories removed and
//     the old layers released; the new pristine state is taken for the
//     next Reset.
//
// When the new spec has the sandbox's layers (specs that differ in env,
// resources or ID only) and the sandbox is still in its pristine state,
// steps 2 and 3 are skipped as a Reset that finds nothing changed skips
// them: the root is what a new overlay over those layers would be, so only
// the hostname (from a throw-away thread), limits and exec defaults change.
//
// Before step 3 a failure leaves the old root in place (the new layers are
// released again); from step 3 on it leaves the sandbox unusable. Either
// way the caller destroys it, and Destroy releases the layers the sandbox
// holds then.
func (s *sandbox) Rebase(ctx context.Context, spec rt.Spec) error {
	if spec.UserNamespace != s.spec.UserNamespace {
		return fmt.Errorf("%w: rebase: user_namespace %v, the sandbox's is %v", rt.ErrInvalidSpec, spec.UserNamespace, s.spec.UserNamespace)
	}
	if err := s.b.validate(&spec); err != nil {
		return fmt.Errorf("rebase: %w", err)
	}
	s.b.defaults(&spec)
	s.begin()
	defer s.end()
	s.resetMu.Lock()
	defer s.resetMu.Unlock()
	proc, err := s.quiesceLocked(ctx, "rebase")
	if err != nil {
		return err
	}
	defer unix.Close(proc)
	if sameLayers(s.spec.Layers, spec.Layers) && s.pristine != nil && s.unchanged(s.pristine, proc) == nil {
		// The root is what a new overlay over these layers would be (the
		// argument is Reset's for keeping it): only the hostname, limits
		// and exec defaults change.
		if err := onThrowawayThread(func() error { return s.setHostname(spec.Hostname) }); err != nil {
			return s.gone(fmt.Errorf("rebase: %w", err))
		}
		spec.ID = s.id
		s.spec = spec
		if err := s.Update(ctx, spec.Resources); err != nil {
			return fmt.Errorf("rebase: %w", err)
		}
		s.resetsKept.Add(1)
		return nil
	}
	s.dropPristine()

	lower := make([]string, len(spec.Layers))
	acquired := 0
	release := func() {
		for _, l := range spec.Layers[:acquired] {
			s.b.opts.Layers.Release(l.Digest)
		}
	}
	for i, l := range spec.Layers {
		d, err := s.b.opts.Layers.Acquire(ctx, l.Digest, l.Path)
		if err != nil {
			release()
			return fmt.Errorf("rebase: mount layer %s: %w", l.Digest, err)
		}
		acquired++
		lower[len(spec.Layers)-1-i] = d // overlay wants the top layer first
	}
	// From here on roots are built over the new layers; a root prepared
	// for the next Reset, or being prepared, is over the old ones
	// (prepareNext drops it when it sees the generation moved).
	s.fsMu.Lock()
	s.lower = lower
	s.lowerGen++
	stale := s.next
	s.next = nil
	s.fsMu.Unlock()
	if stale != nil {
		s.releaseRoot(stale.fd, stale.upper, stale.work, nil)
	}
	root, err := s.newRoot()
	if err != nil {
		release()
		return s.gone(fmt.Errorf("rebase: %w", err))
	}
	oldRoot, err := s.swapRootAndHost(root.fd, spec.Hostname)
	unix.Close(root.fd)
	if err != nil {
		// The sandbox may be half swapped: unusable. Destroy releases the
		// layers in s.spec, so the new ones go now.
		release()
		s.removeRootDirs(root.upper, root.work)
		return s.gone(fmt.Errorf("rebase: %w", err))
	}
	oldLayers := s.spec.Layers
	s.fsMu.Lock()
	oldUpper, oldWork := s.upper, s.work
	s.upper, s.work = root.upper, root.work
	s.fsMu.Unlock()
	if err := s.adoptRoot(root); err != nil {
		return s.gone(fmt.Errorf("rebase: %w", err))
	}
	spec.ID = s.id
	s.spec = spec
	// The old layers go once the old overlay over them is unmounted (a
	// layer nobody else holds is unmounted on its last release).
	s.releaseRoot(oldRoot, oldUpper, oldWork, func() {
		for _, l := range oldLayers {
			if err := s.b.opts.Layers.Release(l.Digest); err != nil {
				s.b.log.Warn("rebase: release old layer", "sandbox", s.id, "layer", l.Digest, "err", err)
			}
		}
	})
	if err := s.Update(ctx, spec.Resources); err != nil {
		return fmt.Errorf("rebase: %w", err)
	}
	s.resetsRebuilt.Add(1)
	// Taken on the create's path (~0.45 ms, a third of a Rebase): a
	// rebased sandbox whose spec is hot goes to an automatic pool, and
	// without it every Reset there would build a new root (2-3 ms and
	// four directory operations; measured: repeated runs of the --distinct
	// SDK loop, where every spec is hot, fell from 143 to 88 cycles/s).
	s.pristine = s.pristineOrNil(root.upper, root.work, proc)
	return nil
}

// releaseRoot closes a root's last reference and removes its directories,
// in the background, then runs then (if not nil); Destroy waits for it.
// Closing the reference unmounts the old overlay, here rather than on the
// caller's path; then its directories are the edge's again, and removing
// them costs as much as the user wrote.
func (s *sandbox) releaseRoot(fd int, upper, work string, then func()) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		unix.Close(fd)
		if err := s.removeRootDirs(upper, work); err != nil {
			s.b.log.Warn("remove old overlay directories", "sandbox", s.id, "upper", upper, "err", err)
		}
		if then != nil {
			then()
		}
	}()
}

// swapRootAndHost is swapRoot that also sets the hostname, from the same
// throw-away thread, which joins the sandbox's UTS namespace for it.
func (s *sandbox) swapRootAndHost(root int, hostname string) (int, error) {
	old := -1
	err := onThrowawayThread(func() error {
		var err error
		if old, err = s.swapRootLocked(root); err != nil {
			return err
		}
		return s.setHostname(hostname)
	})
	if err != nil && old >= 0 {
		unix.Close(old)
	}
	return old, err
}

// setHostname joins the sandbox's UTS namespace and sets its hostname. The
// calling thread stays there: it must be one that is thrown away.
func (s *sandbox) setHostname(hostname string) error {
	err := s.withNS("uts", func(fd int) error { return unix.Setns(fd, unix.CLONE_NEWUTS) })
	if err != nil {
		return fmt.Errorf("join the sandbox's uts namespace: %w", err)
	}
	if err := unix.Sethostname([]byte(hostname)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	return nil
}

// sameLayers reports whether a and b are the same layers in the same order.
func sameLayers(a, b []rt.Layer) bool {
	return slices.EqualFunc(a, b, func(x, y rt.Layer) bool { return x.Digest == y.Digest })
}
