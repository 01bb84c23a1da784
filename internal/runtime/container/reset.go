package container

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/containerd/cgroups/v3"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/rawfile"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit"
)

// killTimeout bounds how long Reset waits for the user's processes to die
// and be reaped after SIGKILL (a process in uninterruptible sleep cannot
// die before the kernel lets it); past it the reset fails and the caller
// destroys the sandbox.
const killTimeout = 10 * time.Second

var (
	_ rt.Resetter = (*sandbox)(nil)
	_ rt.Updater  = (*sandbox)(nil)
)

// Reset implements runtime.Resetter: the sandbox keeps its agent, its
// namespaces and its cgroup, and gets back the state Create left it in.
// Its cost is what the previous user changed: a user who wrote nothing
// costs a kill pass and a comparison, not a new root file system.
//
//  1. Every process in the user cgroup (where every process the agent
//     starts is born, and which nothing inside can leave) is SIGKILLed
//     until the cgroup holds none, and Reset waits until the agent, PID 1,
//     has reaped them all (one read of the cgroup's pids count says when
//     there is nobody: killUser). What the previous user may have changed
//     about the agent (rlimits, nice, scheduling policy, CPU affinity and
//     I/O priority, which every process it forks inherits, and its OOM
//     score: a process of the same user may change them) is put back as it
//     was after Create (restoreWith).
//  2. System V IPC objects and POSIX message queues of the sandbox's IPC
//     namespace are removed, from the calling thread while it joins that
//     namespace (inIPCNamespace), if counting them there finds any.
//  3. If the sandbox is still in its pristine state (see pristine), that
//     is all. Otherwise, on a throw-away OS thread of the edge that joins
//     the sandbox's mount namespace, a new overlay with a fresh upper and
//     work directory is stacked on the old root, the existing /proc and
//     /sys are moved over (they belong to the sandbox's PID and network
//     namespaces), a fresh /dev is mounted as the agent's set-up does, the
//     thread pivots into the new root (which moves the root and working
//     directory of the agent with it) and detaches the old root with
//     everything the previous user left mounted under it. The overlay is
//     built detached, in the host's mount namespace where the layer paths
//     resolve (new mount API), usually ahead of time (step 4). Then the new
//     pristine state is taken.
//  4. In the background, after a new root: the old overlay is released,
//     its upper and work directories are removed, and the next Reset's
//     overlay is built (after a Reset that kept the root, only the latter,
//     once). Destroy waits for that.
//
// The old overlay is never modified while mounted (overlayfs does not
// allow changing its upper directory underneath it), and the host's mount
// table is never touched.
//
// Why keeping the root when the fingerprint is unchanged is exact, not a
// guess. Everything a sandbox process can write is in the fingerprint's
// trees: the overlay's upper directory (every write to the root file
// system, /tmp included, lands there: a new or changed file is created or
// copied up into it, a deletion leaves a whiteout, an attribute change
// copies the entry up; the lower layers are read-only), its work
// directory (where copy-ups are staged), and the tmpfs mounts under /dev.
// /proc and /sys are kept by both paths alike; the mount table, which a
// sandbox cannot change without CAP_SYS_ADMIN, is compared byte for byte
// anyway, so an unexpected mount (or a layer mount propagated from the
// host) also takes the full path. Those trees hold only directories,
// device nodes, symbolic links and empty files when the pristine state is
// taken (a tree holding data gets no pristine state), and the content of
// each of those is wholly in what is compared: a directory's content is
// its entries, listed recursively; a device node has none; a symbolic
// link's target cannot change without making a new inode; an empty file's
// is its size, 0. So a change
// must show in an entry's existence, inode number, type, mode, owner,
// link count, size, mtime or extended attributes (user.* xattrs, or the
// opaque/whiteout markers overlayfs writes), each compared as it is, and
// every one of those changes also moves the ctime, which is compared too:
// a user can put mtime back with utimensat (a same-value touch changes
// nothing else), but not ctime, which the kernel sets to the current time
// and which only a clock change (CAP_SYS_TIME, not granted) could set
// back. That is also why a comparison may skip reading the attributes and
// names of an entry that has not changed for a second, on the file
// systems known to move its times with them: its ctime would tell (see
// pristine.recent). Hard links cannot point out of a tree: a link to a
// lower file copies it up first (a new entry), and a link's target and
// the link count are in the fingerprint. Nothing can change a tree after
// the check either: every user process is dead and reaped, so no
// descriptor, mapping, lock or pending write of theirs is left (files are
// closed before a task becomes a zombie), and the agent writes only while
// serving a request, which the caller has no longer in flight when it
// resets (as with the full path, whose new root a racing request would
// write into too). The free blocks and inodes of the /dev tmpfs mounts are
// compared as a check that nothing unlisted (an unlinked file still held
// open) remains. Not compared are access times: reading a directory moves
// its atime (once, under relatime), which tells the next user at most that
// a directory was listed, no more than a fresh root's times tell anyway.
func (s *sandbox) Reset(ctx context.Context) error {
	s.begin() // the agent reaps at the sandbox's weight
	defer s.end()
	s.resetMu.Lock()
	defer s.resetMu.Unlock()
	select {
	case <-s.done:
		return fmt.Errorf("%w: reset: init has exited", rt.ErrSandboxGone)
	default:
	}
	proc, err := s.openProc()
	if err != nil {
		return s.gone(fmt.Errorf("reset: %w", err))
	}
	defer unix.Close(proc)
	if err := s.killUser(ctx); err != nil {
		return s.gone(fmt.Errorf("reset: %w", err))
	}
	if err := s.attrs.restoreWith(s.cmd.Process.Pid, proc); err != nil {
		return s.gone(fmt.Errorf("reset: %w", err))
	}
	s.checkForkServer()
	if err := s.clearIPCNamespace(proc); err != nil {
		return s.gone(fmt.Errorf("reset: %w", err))
	}
	if s.pristine != nil {
		err := s.unchanged(s.pristine, proc)
		if err == nil {
			s.resetsKept.Add(1)
			// A sandbox that is reset is a pooled one: its next user may
			// write, so the root a full Reset would need is prepared once
			// (it waits until one does).
			s.fsMu.Lock()
			prepared := s.next != nil
			s.fsMu.Unlock()
			if !prepared {
				s.bg.Add(1)
				go func() {
					defer s.bg.Done()
					s.prepareNext()
				}()
			}
			return nil
		}
		s.b.log.Debug("reset: new root", "sandbox", s.id, "why", err)
	}
	s.dropPristine()
	root := s.takeNext()
	if root == nil {
		if root, err = s.newRoot(); err != nil {
			return s.gone(fmt.Errorf("reset: %w", err))
		}
	}
	oldRoot, err := s.swapRoot(root.fd)
	unix.Close(root.fd)
	if err != nil {
		// The sandbox is unusable; Destroy removes the directories with the
		// rest of the sandbox's directory.
		return s.gone(fmt.Errorf("reset: %w", err))
	}
	s.fsMu.Lock()
	oldUpper, oldWork := s.upper, s.work
	s.upper, s.work = root.upper, root.work
	s.fsMu.Unlock()
	if err := s.adoptRoot(root); err != nil {
		return s.gone(fmt.Errorf("reset: %w", err))
	}
	s.resetsRebuilt.Add(1)
	s.pristine = s.pristineOrNil(root.upper, root.work, proc)

	s.releaseRoot(oldRoot, oldUpper, oldWork, s.prepareNext)
	return nil
}

// pristineOrNil takes the sandbox's pristine state, reading the agent's
// files through proc (openProc); without one (a tree that cannot have one,
// or an error), the next Reset takes the full path.
func (s *sandbox) pristineOrNil(upper, work string, proc int) *pristine {
	p, err := s.takePristine(upper, work, proc)
	if err != nil {
		s.b.log.Debug("no pristine state: every reset builds a new root", "sandbox", s.id, "err", err)
		return nil
	}
	return p
}

// clearIPCNamespace removes the IPC objects of the sandbox's IPC
// namespace: its System V objects from the calling thread, which joins the
// namespace for it (clearSysV), and its POSIX message queues through the
// agent's mqueue mount (clearAgentMqueues; proc is the agent's /proc/PID
// directory, openProc) or, for an agent without one, the edge's own
// (clearMqueues). Most users make none: then it costs three system calls
// in the namespace, two to get there and back, and a stat.
func (s *sandbox) clearIPCNamespace(proc int) error {
	err := s.withNS("ipc", func(fd int) error {
		return inIPCNamespace(fd, func() error {
			if err := clearSysV(); err != nil {
				return err
			}
			if s.agentMqueue > 0 {
				return nil
			}
			return s.clearMqueues()
		})
	})
	if err != nil || s.agentMqueue <= 0 {
		return err
	}
	return s.clearAgentMqueues(proc)
}

// openProc opens the agent's /proc/PID directory, which a Reset reads the
// agent's attributes, mount table and /dev through. Such a descriptor
// names the process, not the number: what is looked up through it fails
// once the process is gone, rather than finding another that got the PID.
// And it is the agent's: the agent is the edge's child, so its PID names
// it until the edge reaps it, and alive, asked after the open, fails once
// it is reaped. Opened for each call and closed after it, like every
// descriptor a Reset reads through: a sandbox keeps none in the edge
// between calls (the edge's open-file limit bounds how many sandboxes a
// node holds; see internal/edge).
func (p *agentProc) openProc() (int, error) {
	fd, err := unix.Open("/proc/"+strconv.Itoa(p.cmd.Process.Pid), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open the agent's /proc directory: %w", err)
	}
	if err := p.alive(); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("agent: %w", err)
	}
	return fd, nil
}

// overlayRoot is a detached overlay mount over its own fresh upper and
// work directories.
type overlayRoot struct {
	fd          int
	upper, work string
	// vol is the volume upper and work are in and disk its limit, when
	// they have one of their own (makeRootDirs).
	vol  uint64
	disk int64
	// lowerGen is the sandbox's lowerGen when the root was built over
	// its layers.
	lowerGen int
}

// newRoot makes a new generation of upper and work directories and a
// detached overlay over them and the sandbox's layers.
func (s *sandbox) newRoot() (*overlayRoot, error) {
	s.fsMu.Lock()
	if s.destroyed {
		s.fsMu.Unlock()
		return nil, errors.New("sandbox destroyed")
	}
	s.gen++
	gen := strconv.Itoa(s.gen)
	lower, lowerGen := s.lower, s.lowerGen
	s.fsMu.Unlock()
	r := &overlayRoot{lowerGen: lowerGen}
	if err := s.makeRootDirs(r, gen); err != nil {
		return nil, err
	}
	fd, err := newOverlay(lower, r.upper, r.work)
	if err != nil {
		s.removeRootDirs(r.upper, r.work)
		return nil, err
	}
	r.fd = fd
	return r, nil
}

// prepareNext builds the next Reset's root ahead of time (most of a
// Reset's cost on file systems where creating inodes is slow). Only
// sandboxes that were reset once do: they are the pooled ones.
func (s *sandbox) prepareNext() {
	s.fsMu.Lock()
	busy := s.next != nil || s.destroyed
	s.fsMu.Unlock()
	if busy {
		return
	}
	r, err := s.newRoot()
	if err != nil {
		// The next Reset builds its own and reports the error if it recurs.
		s.b.log.Debug("prepare next root", "sandbox", s.id, "err", err)
		return
	}
	s.fsMu.Lock()
	if s.next == nil && !s.destroyed && r.lowerGen == s.lowerGen {
		s.next, r = r, nil
	}
	s.fsMu.Unlock()
	if r != nil { // raced with another preparation, a Rebase or Destroy
		unix.Close(r.fd)
		s.removeRootDirs(r.upper, r.work)
	}
}

// takeNext returns the prepared root, or nil.
func (s *sandbox) takeNext() *overlayRoot {
	s.fsMu.Lock()
	defer s.fsMu.Unlock()
	r := s.next
	s.next = nil
	return r
}

// dropNext releases a prepared root that will not be used (Destroy).
func (s *sandbox) dropNext() {
	s.fsMu.Lock()
	s.destroyed = true
	r := s.next
	s.next = nil
	s.fsMu.Unlock()
	if r != nil {
		unix.Close(r.fd)
	}
}

// killUser SIGKILLs every process of the user cgroup but the agent (on
// cgroup v1 the agent's spawner thread lives there) and returns once they
// are all gone and reaped. SIGKILL works on stopped processes; processes
// of a frozen sandbox are signalled first and then thawed, so they die
// without running another instruction. Killing repeats until a pass finds
// nobody: a process forked between two passes is caught by the next, and a
// killed process cannot fork any more. Reaped is when the cgroup's pids
// count (which holds a task until its parent, the agent by then, waits for
// it) equals the agent's own threads there.
//
// PIDs read from cgroup.procs are signalled by number. The kernel hands
// PIDs out cyclically, so one freed between the read and the kill would
// have to be reused by the time the whole PID range wrapped around, within
// microseconds: not a practical risk (pidfds would close it at a cost per
// process).
//
// Most users leave nothing running, and then one read of the cgroup's pids
// count settles it (onlyAgent) instead of the listing and the reaping
// check (three files).
func (s *sandbox) killUser(ctx context.Context) error {
	// The fork server is spared (see forkserver.go); whether it was
	// left as it should be is checkForkServer's business.
	spare := s.forkServerPid()
	if spare == 0 && !s.frozen.Load() && s.onlyAgent() {
		return nil
	}
	dir := s.cg.userDir()
	agentPid := s.cmd.Process.Pid
	threadsFile := "tasks"
	if cgroupMode() == cgroups.Unified {
		threadsFile = "cgroup.threads"
		// v2 kills the whole cgroup in one write (Linux 5.14+); the loop
		// below still waits for the reaping, and kills by hand if the file
		// does not exist, or when a fork server is to be spared.
		if spare == 0 {
			if err := os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("kill user cgroup: %w", err)
			}
		}
	}
	kill := func() (int, error) {
		b, err := rawfile.Read(filepath.Join(dir, "cgroup.procs"), 512)
		if err != nil {
			return 0, fmt.Errorf("list user processes: %w", err)
		}
		n := 0
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil || pid == agentPid {
				continue
			}
			if pid == spare {
				continue
			}
			n++
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
				return 0, fmt.Errorf("kill %d: %w", pid, err)
			}
		}
		return n, nil
	}
	// Signal first, thaw second: a frozen process keeps the SIGKILL pending
	// and dies as soon as it is thawed. A sandbox not known to be frozen is
	// thawed too if its processes do not die at once.
	thawed := false
	thaw := func() error {
		if err := s.cg.thaw(); err != nil {
			return fmt.Errorf("thaw: %w", err)
		}
		thawed = true
		s.frozen.Store(false)
		return nil
	}
	n, err := kill()
	if err != nil {
		return err
	}
	if s.frozen.Load() {
		if err := thaw(); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(killTimeout)
	wait := 20 * time.Microsecond
	for {
		if n == 0 {
			tasks, reaped, err := allReaped(dir, threadsFile)
			if err != nil {
				return err
			}
			if reaped {
				if spare == 0 {
					// Only the agent's own threads are left: what
					// onlyAgent compares with next time.
					s.rf.agentTasks, s.rf.agentTasksKnown = tasks, true
				}
				return nil
			}
		}
		select {
		case <-s.done:
			return errors.New("init exited while its processes were being killed")
		case <-ctx.Done():
			return fmt.Errorf("killing the user's processes: %w", ctx.Err())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("user processes survive SIGKILL for %v (%d still running)", killTimeout, n)
		}
		// Dying and reaping take from microseconds to a few milliseconds;
		// the cgroup gives no notification on v1, so poll with a backoff.
		time.Sleep(wait)
		wait = min(2*wait, 5*time.Millisecond)
		if n, err = kill(); err != nil {
			return err
		}
		if n > 0 && !thawed {
			if err := thaw(); err != nil {
				return err
			}
		}
	}
}

// allReaped reports whether the user cgroup's pids count (tasks, zombies
// included until reaped) is down to the threads listed in it (the agent's
// spawner thread on v1, none on v2; a spared fork server's), and returns
// the count.
func allReaped(dir, threadsFile string) (tasks int, reaped bool, err error) {
	cur, err := rawfile.Read(filepath.Join(dir, "pids.current"), 32)
	if err != nil {
		return 0, false, fmt.Errorf("read user pids count: %w", err)
	}
	n, err := strconv.Atoi(string(bytes.TrimSpace(cur)))
	if err != nil {
		return 0, false, fmt.Errorf("user pids count %q: %w", cur, err)
	}
	threads, err := rawfile.Read(filepath.Join(dir, threadsFile), 128)
	if err != nil {
		return 0, false, fmt.Errorf("list user threads: %w", err)
	}
	return n, n == len(strings.Fields(string(threads))), nil
}

// swapRoot makes the detached overlay root the sandbox's root (see Reset)
// and returns an O_PATH descriptor of the old, detached root: the last
// reference to it, so that closing it releases the old overlay. It runs on
// an OS thread that joins the sandbox's namespaces and is never handed back
// to the Go scheduler.
func (s *sandbox) swapRoot(root int) (int, error) {
	var old int
	err := onThrowawayThread(func() error {
		var err error
		old, err = s.swapRootLocked(root)
		return err
	})
	return old, err
}

// onThrowawayThread runs f on an OS thread that f may leave in other
// namespaces or with other file system context: the goroutine stays locked
// to it and exits, so the Go runtime ends the thread instead of running
// other goroutines on it. (Threads the runtime needs meanwhile are cloned
// by its template thread, not by this one.) The main thread is the
// exception: the runtime never ends it, only parks it, and /proc/self
// reads the main thread's namespaces. So f never runs there: landing on it,
// the goroutine keeps it locked, and so out of the scheduler's hands,
// while a second goroutine, which cannot land there, runs f.
func onThrowawayThread(f func() error) error {
	ch := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			ch <- onThrowawayThread(f)
			runtime.UnlockOSThread()
			return
		}
		ch <- f()
	}()
	return <-ch
}

func (s *sandbox) swapRootLocked(root int) (int, error) {
	// setns into a mount namespace refuses a thread that shares its
	// fs_struct (root, cwd) with others, as every Go thread does.
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return -1, fmt.Errorf("unshare fs: %w", err)
	}
	err := s.withNS("mnt", func(fd int) error { return unix.Setns(fd, unix.CLONE_NEWNS) })
	if err != nil {
		return -1, fmt.Errorf("join the sandbox's mnt namespace: %w", err)
	}
	// The thread's root and working directory are now the sandbox's root.
	old, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open old root: %w", err)
	}
	if err := swapMounts(root); err != nil {
		unix.Close(old)
		return -1, err
	}
	return old, nil
}

// swapMounts runs in the sandbox's mount namespace, with the old root as
// the calling thread's root and working directory.
func swapMounts(root int) error {
	// The new overlay goes on top of the old root: processes keep seeing the
	// old root (a root is not crossed into a mount stacked on it) until
	// pivot_root moves them, and no directory of the user's is used as a
	// mount point.
	if err := unix.MoveMount(root, "", unix.AT_FDCWD, "/", unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach new root: %w", err)
	}
	if err := unix.Fchdir(root); err != nil {
		return fmt.Errorf("enter new root: %w", err)
	}
	if err := sandboxinit.PrepareRoot("."); err != nil {
		return err
	}
	for _, m := range []struct {
		dir   string
		magic int64
	}{{"proc", unix.PROC_SUPER_MAGIC}, {"sys", unix.SYSFS_MAGIC}} {
		if err := moveMount("/"+m.dir, m.dir, m.magic); err != nil {
			return err
		}
	}
	if err := sandboxinit.MountDev("dev", false); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	// The old root now sits on top of the new one; detaching it drops the
	// old /dev, /dev/pts and /dev/shm, and the old overlay once its last
	// reference is closed.
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	return nil
}

// moveMount moves the mount at from (in the old root) onto to (relative to
// the working directory, the new root), after checking it is the file
// system it should be: the only mounts Reset keeps are /proc and /sys.
func moveMount(from, to string, magic int64) error {
	fd, err := unix.Open(from, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", from, err)
	}
	defer unix.Close(fd)
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", from, err)
	}
	if st.Type != magic {
		return fmt.Errorf("%s is not the sandbox's own mount (file system type %#x)", from, st.Type)
	}
	// move_mount refuses anything but the root of a mount, so this moves
	// the whole /proc or /sys tree, masks included.
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, to, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("move %s to the new root: %w", from, err)
	}
	return nil
}

// newOverlay builds the sandbox's overlay as a detached mount (new mount
// API) and returns its file descriptor: mounted nowhere, so the host's
// mount table never sees it, yet resolved in the host's namespace.
func newOverlay(lower []string, upper, work string) (int, error) {
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fsfd)
	fail := func(what string, err error) (int, error) {
		return -1, fmt.Errorf("new overlay (%d layers): %s: %w%s", len(lower), what, err, fsMessages(fsfd))
	}
	if err := unix.FsconfigSetString(fsfd, "source", "overlay"); err != nil {
		return fail("source", err)
	}
	// The sandbox reads the names the overlay is given in its mountinfo:
	// descriptors' names, not host paths (see sandboxinit.OverlayDirs).
	dirs, err := sandboxinit.OpenOverlayDirs(lower, upper, work)
	if err != nil {
		return -1, fmt.Errorf("new overlay: %w", err)
	}
	defer dirs.Close()
	// fsconfig takes string values of at most 256 bytes, and a lowerdir
	// list of many layers passes that: layers go one at a time
	// ("lowerdir+", Linux 6.8 and later, top first as in the list) where
	// the kernel has it, as a list otherwise.
	for i, l := range dirs.Lower {
		if err := unix.FsconfigSetString(fsfd, "lowerdir+", l); err != nil {
			if i == 0 && errors.Is(err, unix.EINVAL) {
				if err := unix.FsconfigSetString(fsfd, "lowerdir", strings.Join(dirs.Lower, ":")); err != nil {
					return fail("lowerdir", err)
				}
				break
			}
			return fail("lowerdir+ (layer "+strconv.Itoa(i)+")", err)
		}
	}
	for _, kv := range [][2]string{{"upperdir", dirs.Upper}, {"workdir", dirs.Work}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return fail(kv[0], err)
		}
	}
	for _, o := range sandboxinit.OverlayOptions {
		var err error
		if o[1] == "" {
			err = unix.FsconfigSetFlag(fsfd, o[0])
		} else {
			err = unix.FsconfigSetString(fsfd, o[0], o[1])
		}
		if err != nil {
			return fail(o[0], err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fail("create", err)
	}
	// nodev as the agent's own overlay mount has: device nodes only in /dev.
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fail("fsmount", err)
	}
	return mfd, nil
}

// fsMessages reads the kernel's explanation of a failed fsconfig from the
// file system context ("e overlayfs: ..."), for the error message.
func fsMessages(fsfd int) string {
	var msgs []string
	buf := make([]byte, 1024)
	for range 8 {
		n, err := unix.Read(fsfd, buf)
		if err != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	if len(msgs) == 0 {
		return ""
	}
	return " (" + strings.Join(msgs, "; ") + ")"
}

// IPC_INFO-family commands of shmctl, semctl and msgctl: they report how
// many objects of the kind exist in the caller's IPC namespace.
const (
	shmInfo = 14 // SHM_INFO: struct shm_info, used_ids first
	semInfo = 19 // SEM_INFO: struct seminfo, semusz (sets in use) 8th
	msgInfo = 12 // MSG_INFO: struct msginfo, msgpool (queues in use) first
)

// clearSysV removes every System V shared memory segment, semaphore set
// and message queue of the calling thread's IPC namespace (the sandbox's:
// see inIPCNamespace). Every user process is dead by now, so removed
// segments are freed at once.
func clearSysV() error {
	for _, k := range []struct {
		file  string
		count func() (int, error)
		rm    func(id int) error
	}{
		{"shm", func() (int, error) { return ipcCount(unix.SYS_SHMCTL, 0, shmInfo, 0, 0) },
			func(id int) error { return ipcCall(unix.SYS_SHMCTL, uintptr(id), unix.IPC_RMID, 0) }},
		{"sem", func() (int, error) { return ipcCount(unix.SYS_SEMCTL, 0, 0, semInfo, 7) },
			func(id int) error { return ipcCall(unix.SYS_SEMCTL, uintptr(id), 0, unix.IPC_RMID) }},
		{"msg", func() (int, error) { return ipcCount(unix.SYS_MSGCTL, 0, msgInfo, 0, 0) },
			func(id int) error { return ipcCall(unix.SYS_MSGCTL, uintptr(id), unix.IPC_RMID, 0) }},
	} {
		// One system call tells whether there is anything to remove; the
		// listing, which names the objects, costs a /proc read.
		n, err := k.count()
		if err != nil {
			return fmt.Errorf("count System V %s: %w", k.file, err)
		}
		if n == 0 {
			continue
		}
		// The files list the reader's IPC namespace; the host's /proc is
		// still this thread's /proc.
		b, err := os.ReadFile("/proc/sysvipc/" + k.file)
		if err != nil {
			return fmt.Errorf("list System V IPC: %w", err)
		}
		lines := strings.Split(string(b), "\n")
		for _, line := range lines[1:] { // header first
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			id, err := strconv.Atoi(f[1])
			if err != nil {
				return fmt.Errorf("System V IPC listing: bad line %q", line)
			}
			if err := k.rm(id); err != nil && err != unix.EINVAL && err != unix.EIDRM {
				return fmt.Errorf("remove System V %s %d: %w", k.file, id, err)
			}
		}
	}
	return nil
}

// ipcCount calls an *_INFO command (the buffer is the last argument, after
// a1 and a2) and returns the int32 at index idx of the struct it fills.
func ipcCount(trap, a0, a1, a2 uintptr, idx int) (int, error) {
	var buf [32]int32 // larger than shm_info, seminfo and msginfo
	p := uintptr(unsafe.Pointer(&buf[0]))
	var e syscall.Errno
	if trap == unix.SYS_SEMCTL {
		_, _, e = unix.Syscall6(trap, a0, a1, a2, p, 0, 0)
	} else {
		_, _, e = unix.Syscall(trap, a0, a1, p)
	}
	if e != 0 {
		return 0, e
	}
	return int(buf[idx]), nil
}

func ipcCall(trap, a0, a1, a2 uintptr) error {
	if _, _, e := unix.Syscall(trap, a0, a1, a2); e != 0 {
		return e
	}
	return nil
}

// mqueueMagic is the mqueue file system's type (statfs).
const mqueueMagic = 0x19800202

// clearAgentMqueues unlinks every POSIX message queue of the sandbox's IPC
// namespace through the detached mqueue mount the agent made at its start
// in that namespace and keeps open (agent.ContainerInitResult.MqueueFD), reached
// through the agent's /proc/PID/fd (proc: openProc) instead of a
// descriptor the edge would keep per sandbox. The mqueue root directory's
// size grows by a fixed amount with each queue made in it and shrinks with
// each removed (it has no other way in), so its size when empty, learnt on
// the first call, says there is none to list: one stat.
//
// Why the descriptor found there is the sandbox's mqueue root. Only the
// agent changes its descriptor table, and nothing in the sandbox can reach
// it (the agent is not dumpable, so no process there may ptrace it, read
// /proc/1/fd or use pidfd_getfd on it); the agent never closes it, so no
// later file of its gets its number. Were the agent subverted anyway, it
// could put there only what it can reach, and the only mqueue directory it
// can reach is its own namespace's root: it cannot mount (no
// CAP_SYS_ADMIN after it locked itself down), the host's mqueue mounts are
// not in its mount tree, and no other namespace's is in the sandbox. So the
// first call checks that it is a directory of an mqueue file system, and
// later ones that it is the same inode; anything else fails the Reset (the
// sandbox is destroyed).
func (s *sandbox) clearAgentMqueues(proc int) error {
	name := "fd/" + strconv.Itoa(s.agentMqueue)
	f := &s.rf
	var st unix.Stat_t
	if err := unix.Fstatat(proc, name, &st, 0); err != nil {
		return fmt.Errorf("stat the sandbox's mqueue root: %w", err)
	}
	if f.mqueueKnown {
		if st.Dev != f.mqueueDev || st.Ino != f.mqueueIno {
			return errors.New("the agent's mqueue descriptor names another file")
		}
		if st.Size == f.mqueueEmpty {
			return nil
		}
	}
	dfd, err := unix.Openat(proc, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the sandbox's mqueue root: %w", err)
	}
	d := os.NewFile(uintptr(dfd), "mqueue")
	defer d.Close()
	var sfs unix.Statfs_t
	if err := errors.Join(unix.Fstatfs(dfd, &sfs), unix.Fstat(dfd, &st)); err != nil {
		return fmt.Errorf("stat the sandbox's mqueue root: %w", err)
	}
	if sfs.Type != mqueueMagic || st.Mode&unix.S_IFMT != unix.S_IFDIR ||
		f.mqueueKnown && (st.Dev != f.mqueueDev || st.Ino != f.mqueueIno) {
		return fmt.Errorf("the agent's mqueue descriptor is not an mqueue root (file system %#x, mode %#o)", sfs.Type, st.Mode)
	}
	names, err := d.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("list message queues: %w", err)
	}
	for _, n := range names {
		if err := unix.Unlinkat(dfd, n, 0); err != nil && err != unix.ENOENT {
			return fmt.Errorf("remove message queue %q: %w", n, err)
		}
	}
	// The directory is empty now (no process is left to make a queue):
	// its size is what the next call compares with.
	if err := unix.Fstat(dfd, &st); err != nil {
		return fmt.Errorf("stat mqueue: %w", err)
	}
	f.mqueueEmpty, f.mqueueDev, f.mqueueIno, f.mqueueKnown = st.Size, st.Dev, st.Ino, true
	return nil
}

// clearMqueues is clearAgentMqueues for an agent without an mqueue mount
// (an older agent): it goes through a detached mount of the sandbox's
// mqueue file system that the edge makes on the first Reset, from a thread
// in the sandbox's IPC namespace (a mqueue mount shows the IPC namespace of
// whoever created it), and keeps until Destroy: one descriptor more per
// sandbox.
func (s *sandbox) clearMqueues() error {
	if s.mqueue >= 0 && s.rf.mqueueKnown {
		var st unix.Stat_t
		if err := unix.Fstat(s.mqueue, &st); err == nil && st.Size == s.rf.mqueueEmpty {
			return nil
		}
	}
	if s.mqueue < 0 {
		fsfd, err := unix.Fsopen("mqueue", unix.FSOPEN_CLOEXEC)
		if err != nil {
			return fmt.Errorf("fsopen mqueue: %w", err)
		}
		defer unix.Close(fsfd)
		if err := unix.FsconfigCreate(fsfd); err != nil {
			return fmt.Errorf("mqueue: %w%s", err, fsMessages(fsfd))
		}
		if s.mqueue, err = unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, 0); err != nil {
			return fmt.Errorf("mount mqueue: %w", err)
		}
	}
	dfd, err := unix.Openat(s.mqueue, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open mqueue: %w", err)
	}
	d := os.NewFile(uintptr(dfd), "mqueue")
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("list message queues: %w", err)
	}
	for _, n := range names {
		if err := unix.Unlinkat(s.mqueue, n, 0); err != nil && err != unix.ENOENT {
			return fmt.Errorf("remove message queue %q: %w", n, err)
		}
	}
	// The directory is empty now (no process is left to make a queue):
	// its size is what the next call compares with.
	var st unix.Stat_t
	if err := unix.Fstat(s.mqueue, &st); err != nil {
		return fmt.Errorf("stat mqueue: %w", err)
	}
	s.rf.mqueueEmpty, s.rf.mqueueKnown = st.Size, true
	return nil
}

// Update implements runtime.Updater: the sandbox's CPU, memory and pids
// limits change in place. A zero field means no limit (Pids: the backend's
// default), as at Create. Lowering the memory limit below what the sandbox
// uses makes the kernel reclaim, and fails if it cannot.
//
// Only the limits that differ from those in force are written, and an
// Update to the limits in force writes nothing: fncall sets one memory
// limit for each call and puts the sandbox's back after it, and every
// cgroup file written costs.
func (s *sandbox) Update(ctx context.Context, r rt.Resources) error {
	if r.MilliCPU < 0 || r.MemoryBytes < 0 || r.Pids < 0 {
		return fmt.Errorf("%w: resources must not be negative", rt.ErrInvalidSpec)
	}
	if r.MemoryBytes != 0 && r.MemoryBytes < minMemory {
		return fmt.Errorf("%w: resources.memory %d bytes is below the %d MiB minimum", rt.ErrInvalidSpec, r.MemoryBytes, minMemory>>20)
	}
	if r.Pids == 0 {
		r.Pids = s.b.opts.DefaultPids
	}
	if err := validDisk(r.DiskBytes); err != nil {
		return err
	}
	if r.DiskBytes == 0 {
		r.DiskBytes = s.b.opts.DefaultDiskBytes
	}
	select {
	case <-s.done:
		return fmt.Errorf("%w: update: init has exited", rt.ErrSandboxGone)
	default:
	}
	s.updateMu.Lock()
	defer s.updateMu.Unlock()
	if s.resKnown && r == s.res {
		return nil
	}
	var from *rt.Resources
	if s.resKnown {
		from = &s.res
	}
	if err := s.cg.set(from, r); err != nil {
		// Some limits may have been written: the next Update writes all.
		s.resKnown = false
		return s.gone(fmt.Errorf("update resources: %w", err))
	}
	if err := s.b.setDisk(s.agentProc, r.DiskBytes); err != nil {
		s.resKnown = false
		return s.gone(fmt.Errorf("update resources: %w", err))
	}
	s.res, s.resKnown = r, true
	return nil
}

// agentAttrs are the agent's attributes that a process running as the same
// user (root in the sandbox, without CAP_SYS_ADMIN) can still change: its
// resource limits (prlimit), and per thread its nice value and scheduling
// policy, CPU affinity and I/O priority, which every process it starts
// inherits (the agent's spawner thread forks them all), and its OOM score
// (a previous user could make the agent the OOM killer's first choice).
type agentAttrs struct {
	rlimits [unix.RLIMIT_RTTIME + 1]unix.Rlimit
	// limits is /proc/PID/limits as it read then: the same limits, as
	// text, for restoreWith to compare with.
	limits   []byte
	sched    unix.SchedAttr
	affinity unix.CPUSet
	ioprio   int
	oomScore []byte
	// autogroup is /proc/PID/autogroup ("/autogroup-N nice K"; nil where
	// the kernel has none): the nice value of the agent's session's
	// scheduling group, which a process of the same user may set (one
	// tenant's "echo 19 > /proc/1/autogroup" was still there for the
	// next). coredumpFilter is /proc/PID/coredump_filter, which every
	// process the agent forks inherits.
	autogroup      []byte
	autogroupNice  []byte
	coredumpFilter []byte
	// coredumpValue is coredumpFilter as it is written back: the file
	// prints hex digits with leading zeros, and takes them as octal
	// without a 0x.
	coredumpValue []byte
}

// ioprioWhoProcess is IOPRIO_WHO_PROCESS: ioprio_get/set of one thread.
const ioprioWhoProcess = 1

// captureAgent records the attributes of the agent's main thread.
func captureAgent(pid int) (*agentAttrs, error) {
	a := &agentAttrs{}
	for r := range a.rlimits {
		if err := unix.Prlimit(pid, r, nil, &a.rlimits[r]); err != nil {
			return nil, fmt.Errorf("read agent rlimit %d: %w", r, err)
		}
	}
	var err error
	if a.limits, err = rawfile.Read("/proc/"+strconv.Itoa(pid)+"/limits", 2048); err != nil {
		return nil, fmt.Errorf("read agent limits: %w", err)
	}
	sa, err := unix.SchedGetAttr(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("read agent scheduling: %w", err)
	}
	a.sched = unix.SchedAttr{Policy: sa.Policy, Nice: sa.Nice, Priority: sa.Priority}
	if err := unix.SchedGetaffinity(pid, &a.affinity); err != nil {
		return nil, fmt.Errorf("read agent CPU affinity: %w", err)
	}
	prio, _, e := unix.Syscall(unix.SYS_IOPRIO_GET, ioprioWhoProcess, uintptr(pid), 0)
	if e != 0 {
		return nil, fmt.Errorf("read agent I/O priority: %w", e)
	}
	a.ioprio = int(prio)
	if a.oomScore, err = os.ReadFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid)); err != nil {
		return nil, fmt.Errorf("read agent OOM score: %w", err)
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/autogroup", pid)); err == nil {
		if f := strings.Fields(string(b)); len(f) == 3 && f[1] == "nice" {
			a.autogroup, a.autogroupNice = b, []byte(f[2])
		}
	}
	if a.coredumpFilter, err = os.ReadFile(fmt.Sprintf("/proc/%d/coredump_filter", pid)); err != nil {
		return nil, fmt.Errorf("read agent coredump filter: %w", err)
	}
	a.coredumpValue = []byte("0x" + strings.TrimSpace(string(a.coredumpFilter)))
	return a, nil
}

// restore puts the recorded attributes back on process pid and on each of
// its threads, reading its /proc files by path.
func (a *agentAttrs) restore(pid int) error { return a.restoreWith(pid, -1) }

// restoreWith puts the recorded attributes back on process pid and on each
// of its threads, reading and writing its /proc files through proc, its
// /proc/PID directory (openProc), or by path when proc is -1. Threads
// that exit meanwhile are skipped.
//
// The resource limits and the OOM score are process-wide and can be read
// back exactly, in one read each: /proc/PID/limits prints all sixteen soft
// and hard limits in full ("unlimited" or the number), so equal text means
// equal limits; they are written only when they differ, which a user must
// have gone out of their way to cause. The per-thread attributes cannot be
// read back more cheaply than they are set (three system calls per thread
// either way, and a thread that joined since would need them too), so they
// are set on every thread every time.
func (a *agentAttrs) restoreWith(pid, proc int) error {
	at := procFiles{dir: proc}
	if proc < 0 {
		at = procFiles{dir: unix.AT_FDCWD, prefix: "/proc/" + strconv.Itoa(pid) + "/"}
	}
	var buf [4096]byte
	limits, ok := []byte(nil), false
	if fd, err := at.open("limits", unix.O_RDONLY); err == nil {
		limits, ok, _ = preadSmall(fd, buf[:])
		unix.Close(fd)
	}
	// Unreadable or different: set them all (and fail if that fails).
	if !ok || !bytes.Equal(limits, a.limits) {
		for r := range a.rlimits {
			if err := unix.Prlimit(pid, r, &a.rlimits[r], nil); err != nil {
				return fmt.Errorf("restore agent rlimit %d: %w", r, err)
			}
		}
	}
	// The file takes a whole number per write, wherever it is written.
	if err := at.restore("oom_score_adj", a.oomScore, a.oomScore, buf[:]); err != nil {
		return fmt.Errorf("restore agent OOM score: %w", err)
	}
	if a.autogroup != nil {
		if err := at.restore("autogroup", a.autogroup, a.autogroupNice, buf[:]); err != nil {
			return fmt.Errorf("restore agent autogroup nice: %w", err)
		}
	}
	if err := at.restore("coredump_filter", a.coredumpFilter, a.coredumpValue, buf[:]); err != nil {
		return fmt.Errorf("restore agent coredump filter: %w", err)
	}
	tids, err := at.threads(buf[:])
	if err != nil {
		return fmt.Errorf("list agent threads: %w", err)
	}
	for _, t := range tids {
		tid, err := strconv.Atoi(t)
		if err != nil {
			continue
		}
		sched := a.sched
		err = unix.SchedSetAttr(tid, &sched, 0)
		if err == nil {
			err = unix.SchedSetaffinity(tid, &a.affinity)
		}
		if err == nil {
			if _, _, e := unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(tid), uintptr(a.ioprio)); e != 0 {
				err = e
			}
		}
		if err != nil && err != unix.ESRCH {
			return fmt.Errorf("restore agent thread %d scheduling: %w", tid, err)
		}
	}
	return nil
}

// procFiles names a process's /proc files: relative to dir, its
// /proc/PID directory, or (dir AT_FDCWD) by prefix, "/proc/PID/".
type procFiles struct {
	dir    int
	prefix string
}

// open opens the file name with plain system calls: os.Open would stat it
// and try to register it with the runtime poller, on every Reset.
func (at procFiles) open(name string, flags int) (int, error) {
	return unix.Openat(at.dir, at.prefix+name, flags|unix.O_CLOEXEC, 0)
}

// restore reads the file name and, unless it reads want, writes value
// into it. One read from offset 0 of a new descriptor (these files take
// no pread: autogroup answers ESPIPE).
func (at procFiles) restore(name string, want, value, buf []byte) error {
	fd, err := at.open(name, unix.O_RDWR)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if n, err := unix.Read(fd, buf); err == nil && n < len(buf) && bytes.Equal(buf[:n], want) {
		return nil
	}
	if _, err := unix.Seek(fd, 0, io.SeekStart); err != nil {
		return err
	}
	_, err = unix.Write(fd, value)
	return err
}

// threads lists the thread IDs of the process.
func (at procFiles) threads(buf []byte) ([]string, error) {
	fd, err := at.open("task", unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var tids []string
	for {
		n, err := unix.ReadDirent(fd, buf)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return tids, nil
		}
		_, _, tids = unix.ParseDirent(buf[:n], -1, tids)
	}
}

// resetFiles is what Reset learnt about the sandbox, kept from one call to
// the next. It holds no descriptor: the files Reset reads are opened for
// each call (openProc) and closed after it.
type resetFiles struct {
	// agentTasks is the pids count of the user cgroup when it held
	// nothing but the agent's own threads (known once a kill pass saw
	// it).
	agentTasks      int
	agentTasksKnown bool

	// mqueueEmpty is the size of the sandbox's mqueue root directory with
	// no queue in it, and mqueueDev and mqueueIno its device and inode
	// numbers (clearAgentMqueues).
	mqueueEmpty          int64
	mqueueDev, mqueueIno uint64
	mqueueKnown          bool
}

// onlyAgent reports whether the user cgroup holds nothing but the agent's
// own threads, known to be rf.agentTasks: its pids count says so (one
// read of pids.current, borrowed from the agent: openUserFile).
//
// Exact because the pids count charges every task of the cgroup (and of
// any cgroup below it) from its fork until its parent reaps it, so a
// process still running, a zombie, a fork under way are all counted; and
// the agent's threads there never leave: on v1 that is the spawner thread
// alone, locked to its goroutine for the agent's life (the Go runtime never
// clones a new thread from a locked one; it asks its template thread), on
// v2 there are none. Nothing inside the sandbox can move a task between
// cgroups. So a count equal to agentTasks means no other task; any other
// count, or an unreadable one, makes the caller do the full pass (which
// learns agentTasks again).
func (s *sandbox) onlyAgent() bool {
	if !s.rf.agentTasksKnown {
		return false
	}
	fd, err := s.openUserFile(filePidsCurrent)
	if err != nil {
		return false
	}
	var buf [32]byte
	b, ok, err := preadSmall(fd, buf[:])
	unix.Close(fd)
	if err != nil || !ok {
		return false
	}
	n, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	return err == nil && n == s.rf.agentTasks
}

// closeResetFiles closes what Reset keeps open (Destroy, with resetMu
// held, once init is gone).
func (s *sandbox) closeResetFiles() {
	s.dropPristine()
	if s.mqueue >= 0 {
		unix.Close(s.mqueue)
		s.mqueue = -1
	}
	s.rf = resetFiles{}
}
