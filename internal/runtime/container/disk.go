package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// The writable-layer limit (Resources.DiskBytes). With Options.Scratch a
// sandbox's directory is a volume of the scratch file system (package
// scratchfs: a btrfs subvolume) without a limit, holding the rootfs mount
// point and one volume per generation of its root, g.<N>, with the
// overlay's upper and work directories and the sandbox's limit (a qgroup
// limit): g.0 is made with the agent's directory when it is spawned, the
// next by Reset and Rebase (ahead of time, as their roots are). The
// limit is set at Create only when it differs from the default a warm
// agent was made with, and by Update (Rebase): one ioctl. The current
// generation's volume is what the limit and DiskFull apply to; an old
// one is deleted (one ioctl) once its overlay is unmounted, and the whole
// tree with the sandbox.

// DefaultDiskBytes is the writable-layer limit of a sandbox whose spec
// sets none (Options.DefaultDiskBytes).
const DefaultDiskBytes = 10 << 30

// minDisk is the smallest writable-layer limit: the overlay's own
// directories and the file system's metadata for them need some.
const minDisk = 4 << 20

// validDisk checks Resources.DiskBytes (Create, Rebase, Update).
func validDisk(n int64) error {
	if n < 0 {
		return fmt.Errorf("%w: resources.disk_bytes must not be negative", rt.ErrInvalidSpec)
	}
	if n != 0 && n < minDisk {
		return fmt.Errorf("%w: resources.disk_bytes %d bytes is below the %d MiB minimum", rt.ErrInvalidSpec, n, minDisk>>20)
	}
	return nil
}

// makeSlotDir makes an agent's directory and sets the paths of its first
// overlay's upper and work directories (made by the caller): on the
// scratch file system, a volume with, inside, the volume of the first
// root, g.0, limited to disk bytes; else plain directories.
func (b *Backend) makeSlotDir(p *agentProc, disk int64) error {
	if b.opts.Scratch == nil {
		if err := os.Mkdir(p.dir, 0o700); err != nil {
			return fmt.Errorf("sandbox dir: %w", err)
		}
		p.upper, p.work = filepath.Join(p.dir, "upper"), filepath.Join(p.dir, "work")
		return nil
	}
	// Unlimited, so that the edge can always make the next root's volume
	// in it: a volume's entry is charged to the volume that holds it.
	if _, err := b.opts.Scratch.NewVolume(p.dir, 0); err != nil {
		return fmt.Errorf("sandbox dir: %w", err)
	}
	v, err := b.opts.Scratch.NewVolume(filepath.Join(p.dir, "g.0"), disk)
	if err != nil {
		b.opts.Scratch.DeleteVolume(p.dir)
		return fmt.Errorf("sandbox dir: %w", err)
	}
	p.vol, p.disk = v.ID, disk
	p.upper, p.work = filepath.Join(v.Path, "upper"), filepath.Join(v.Path, "work")
	return nil
}

// removeSlotDir removes an agent's directory with everything in it (a
// volume: one ioctl, its space freed in the background).
func (b *Backend) removeSlotDir(dir string) error {
	if b.opts.Scratch != nil {
		return b.opts.Scratch.DeleteVolume(dir)
	}
	return os.RemoveAll(dir)
}

// setDisk makes disk bytes the agent's writable-layer limit, when it has
// a volume and the limit differs.
func (b *Backend) setDisk(p *agentProc, disk int64) error {
	if p.vol == 0 || disk == p.disk {
		return nil
	}
	if err := b.opts.Scratch.SetLimit(p.vol, disk); err != nil {
		return fmt.Errorf("writable-layer limit: %w", err)
	}
	p.disk = disk
	return nil
}

// noteDiskFull sets res.DiskFull when a command failed and the sandbox's
// writable layer is (nearly) at its limit, or the scratch file system
// itself is full: the command most likely failed for lack of space. Read
// only for failed commands (a qgroup's usage from sysfs and one statfs),
// so a successful exec costs nothing more. A command that filled the
// layer and deleted what it wrote before failing is not caught.
func (s *sandbox) noteDiskFull(res *rt.ExecResult) {
	if s.vol == 0 || res.ExitCode == 0 && res.Signal == 0 {
		return
	}
	res.DiskFull = s.b.opts.Scratch.Full(s.vol)
}

// makeRootDirs makes the upper and work directories of root generation
// gen (Reset's and Rebase's new roots). On the scratch file system they
// are in a volume of their own, <dir>/g.<gen>, with the sandbox's limit:
// the old root's files, removed in the background after the swap, then
// neither count against the new root nor keep the edge from making it
// when the user filled the old one (a full sandbox's Reset would fail and
// the sandbox be destroyed: a workload could force a cold create).
func (s *sandbox) makeRootDirs(r *overlayRoot, gen string) error {
	if s.b.opts.Scratch == nil {
		r.upper, r.work = filepath.Join(s.dir, "upper."+gen), filepath.Join(s.dir, "work."+gen)
	} else {
		s.updateMu.Lock()
		disk := s.disk
		s.updateMu.Unlock()
		v, err := s.b.opts.Scratch.NewVolume(filepath.Join(s.dir, "g."+gen), disk)
		if err != nil {
			return err
		}
		r.vol, r.disk = v.ID, disk
		r.upper, r.work = filepath.Join(v.Path, "upper"), filepath.Join(v.Path, "work")
	}
	// Mkdir, not MkdirAll: after Destroy removed the sandbox directory,
	// nothing may be created under it again.
	if err := os.Mkdir(r.upper, 0o755); err != nil {
		s.removeRootDirs(r.upper, r.work)
		return err
	}
	if err := os.Mkdir(r.work, 0o755); err != nil {
		s.removeRootDirs(r.upper, r.work)
		return err
	}
	return nil
}

// removeRootDirs removes a root's upper and work directories: their
// volume when they have one of their own (one ioctl however much the user
// wrote), else the two trees.
func (s *sandbox) removeRootDirs(upper, work string) error {
	if vdir := filepath.Dir(upper); s.b.opts.Scratch != nil && vdir != s.dir && filepath.Dir(vdir) == s.dir {
		return s.b.opts.Scratch.DeleteVolume(vdir)
	}
	return errors.Join(os.RemoveAll(upper), os.RemoveAll(work))
}

// adoptRoot makes root's volume the sandbox's (the one its limit and
// DiskFull apply to) once root is the sandbox's root, and gives it the
// limit in force if that changed since root was made.
func (s *sandbox) adoptRoot(r *overlayRoot) error {
	if r.vol == 0 {
		return nil
	}
	s.updateMu.Lock()
	defer s.updateMu.Unlock()
	disk := s.disk
	s.vol, s.disk = r.vol, r.disk
	return s.b.setDisk(s.agentProc, disk)
}
