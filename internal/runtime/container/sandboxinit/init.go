// Package sandboxinit is the part of the container backend that runs inside
// the sandbox: dsec-agent calls Run as PID 1 of fresh namespaces, before it
// starts serving requests. It mounts the overlay root filesystem and the
// minimal /dev, /proc and /sys inside the sandbox's own mount namespace (so the
// host mount table never sees them), pivots into it, brings loopback up, sets
// the hostname and finally locks the process down (capabilities, no_new_privs,
// seccomp), so that every command the agent forks inherits the restrictions.
//
// The container backend's Reset, which builds a sandbox's root file system
// again from the edge, uses the same pieces (OverlayOptions, PrepareRoot,
// MountDev), so that a reset sandbox looks exactly like a new one.
//
// The package is linked into dsec-agent: keep its imports small, because the
// agent's memory is paid once per sandbox.
package sandboxinit

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
)

// config is the container's part of the sandbox's agent.Init, resolved:
// the overlay's directories as host paths, and the files the agent opens
// before it pivots.
//
// User processes are born in a child cgroup whose pids limit excludes the
// agent's own threads, so a fork bomb cannot starve the agent (a Go program
// dies when it cannot create a thread). All of them are forked from one
// spawner thread: on cgroup v1 that thread lives in UserTasks (v1 places
// single threads); on v2 it forks with CLONE_INTO_CGROUP into
// UserCgroupDir. The files are opened before pivot_root, while the host
// cgroup file system is still visible.
//
// UserMoreTasks are, on cgroup v1, the tasks files of the user cgroups in
// the other hierarchies with one (memory, cpu), which the spawner thread
// joins too. A process is born in its forking thread's cgroups, and a v1
// memory cgroup charges a process's memory to the cgroup of the process,
// not of the thread: so user processes are held to the user's memory limit
// and are the only candidates of its OOM killer, while the agent's memory
// stays in the sandbox's cgroup; and a fork storm competes for the
// sandbox's CPU quota as one group beside the agent, which keeps its share
// however many processes the storm has.
//
// CgroupFiles are files of the user cgroup that the agent opens read-only
// before pivot_root and keeps open, unused, for the edge to read through
// (ContainerInitResult.CgroupFDs): an exec and a Reset read them, and the
// edge, which keeps no descriptor per sandbox, borrows the agent's
// (pidfd_getfd) rather than open a cgroup file each time.
type config struct {
	// lower are the read-only layer directories, top first (overlay order).
	lower []string
	// upper and work are the sandbox's private overlay directories.
	upper, work string
	hostname    string
	agent.ContainerInit

	userTasks     *os.File   // opened UserTasks
	userMoreTasks []*os.File // opened UserMoreTasks
	userDirFD     int        // opened UserCgroupDir
	cgroupFDs     []int32    // opened CgroupFiles
}

// configFrom checks in for what the container backend needs, naming the
// field at fault: every layer and the writable layer are directories (a
// Source's path), and the container part is there.
func configFrom(in *agent.Init) (*config, error) {
	if err := in.Validate(); err != nil {
		return nil, err
	}
	if in.Container == nil {
		return nil, errors.New("init: container: none (the container backend's init needs it)")
	}
	if in.Container.Rootfs == "" {
		return nil, errors.New("init: container.rootfs: empty")
	}
	cfg := &config{hostname: in.Hostname, ContainerInit: *in.Container, lower: make([]string, len(in.Layers))}
	for i, l := range in.Layers {
		if l.Path == "" {
			return nil, fmt.Errorf("init: layers[%d]: not a directory (path): the container backend takes no devices", i)
		}
		cfg.lower[i] = l.Path
	}
	w := in.Writable
	if w == nil {
		return nil, errors.New("init: writable: none")
	}
	if w.Source.Path == "" {
		return nil, errors.New("init: writable.source: not a directory (path): the container backend takes no devices")
	}
	cfg.upper, cfg.work = filepath.Join(w.Source.Path, w.Upper), filepath.Join(w.Source.Path, w.Work)
	return cfg, nil
}

// Lockdown restricts the agent, and so every process it forks. It is
// provided by the agent (which links the audit packages) so that this
// package stays free of them.
type Lockdown struct {
	// Thread drops the bounding set of the calling OS thread to caps (bit
	// c: capability c is kept): the spawner thread every sandbox process is
	// forked from.
	Thread func(caps uint64) error
	// Process applies caps, no_new_privs and the seccomp program to every
	// thread.
	Process func(caps uint64, seccomp []byte) error
}

// Fork wraps a process start so that the process is forked from the
// sandbox's spawner thread; it matches agent.Options.Fork.
type Fork func(attr *syscall.SysProcAttr, start func() error) error

// Run reads the sandbox's agent.Init from conn (the first request on it),
// builds the sandbox and answers. It returns an error (already reported to
// the edge) if the sandbox could not be built; the caller must then exit.
// The returned Fork must wrap every process the agent starts; the Init is
// returned for what the agent itself applies (the exec defaults).
func Run(conn io.ReadWriter, lock Lockdown) (Fork, *agent.Init, error) {
	// While a pre-started agent waits for its sandbox.
	mq := openMqueue()
	var fork Fork
	var init *agent.Init
	err := agent.AcceptInit(conn, func(in *agent.Init) (*agent.InitResult, error) {
		init = in
		cfg, err := configFrom(in)
		if err != nil {
			return nil, err
		}
		fork, err = setup(cfg, lock)
		if err != nil {
			return nil, err
		}
		return &agent.InitResult{Container: &agent.ContainerInitResult{MqueueFD: int32(mq), CgroupFDs: cfg.cgroupFDs}}, nil
	})
	return fork, init, err
}

// openMqueue mounts the POSIX message queue file system of the agent's IPC
// namespace, the sandbox's, detached (mounted nowhere: the sandbox's mount
// table does not show it) and returns its descriptor, or 0 where it cannot
// (a kernel without POSIX message queues). The agent keeps it open for its
// life and never uses it: the edge looks at the sandbox's queues through
// it (/proc/PID/fd/N) when it resets the sandbox, so that it need not
// keep a descriptor of its own per sandbox. Nothing in the sandbox can
// reach it (the agent is not dumpable) or put something else in its
// place, and the edge checks what it finds there.
func openMqueue() int {
	fsfd, err := unix.Fsopen("mqueue", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return 0
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return 0
	}
	fd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil || fd <= 0 {
		return 0
	}
	return fd
}

func setup(cfg *config, lock Lockdown) (Fork, error) {
	if err := setupRoot(cfg); err != nil {
		return nil, err
	}
	fork, err := startSpawner(cfg, lock)
	if err != nil {
		return nil, err
	}
	if cfg.NoLockdown || lock.Process == nil {
		return fork, nil
	}
	if err := lock.Process(cfg.Caps, cfg.Seccomp); err != nil {
		return nil, fmt.Errorf("lock down: %w", err)
	}
	return fork, nil
}

type spawnReq struct {
	attr  *syscall.SysProcAttr
	start func() error
	done  chan error
}

// startSpawner dedicates one OS thread to forking the sandbox's processes.
// That thread alone carries what must be inherited by them and is costly or
// impossible to apply to a whole Go process: the reduced bounding set, and
// on cgroup v1 membership of the user cgroup (v1 places single threads), so
// every process is born there (openUserCgroup opened its files before the
// pivot).
func startSpawner(cfg *config, lock Lockdown) (Fork, error) {
	ready := make(chan error, 1)
	reqs := make(chan spawnReq)
	go func() {
		// Never unlocked: the thread is the spawner for the sandbox's life
		// (if setup fails, the runtime ends the thread with the goroutine).
		runtime.LockOSThread()
		for _, f := range append([]*os.File{cfg.userTasks}, cfg.userMoreTasks...) {
			if f == nil {
				continue
			}
			if _, err := f.Write([]byte(strconv.Itoa(unix.Gettid()))); err != nil {
				ready <- fmt.Errorf("enter user cgroup %s: %w", f.Name(), err)
				return
			}
			f.Close()
		}
		if !cfg.NoLockdown && lock.Thread != nil {
			if err := lock.Thread(cfg.Caps); err != nil {
				ready <- fmt.Errorf("lock down spawner: %w", err)
				return
			}
		}
		ready <- nil
		for r := range reqs {
			if cfg.userDirFD > 0 {
				r.attr.UseCgroupFD = true
				r.attr.CgroupFD = cfg.userDirFD
			}
			r.done <- r.start()
		}
	}()
	if err := <-ready; err != nil {
		return nil, err
	}
	return func(attr *syscall.SysProcAttr, start func() error) error {
		done := make(chan error, 1)
		reqs <- spawnReq{attr: attr, start: start, done: done}
		return <-done
	}, nil
}

// openUserCgroup opens the user cgroup's files while the host's cgroup file
// system is still in view (before pivot_root).
func openUserCgroup(cfg *config) error {
	for _, name := range cfg.CgroupFiles {
		fd, err := unix.Open(name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			fd = 0 // the edge opens it itself
		}
		cfg.cgroupFDs = append(cfg.cgroupFDs, int32(fd))
	}
	switch {
	case cfg.UserCgroupDir != "":
		fd, err := unix.Open(cfg.UserCgroupDir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open user cgroup: %w", err)
		}
		cfg.userDirFD = fd
	case cfg.UserTasks != "":
		f, err := os.OpenFile(cfg.UserTasks, os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("open user cgroup: %w", err)
		}
		cfg.userTasks = f
		for _, name := range cfg.UserMoreTasks {
			f, err := os.OpenFile(name, os.O_WRONLY, 0)
			if err != nil {
				return fmt.Errorf("open user cgroup: %w", err)
			}
			cfg.userMoreTasks = append(cfg.userMoreTasks, f)
		}
	}
	return nil
}

func setupRoot(cfg *config) error {
	if err := openUserCgroup(cfg); err != nil {
		return err
	}
	// Mount events must never propagate back to the host; the host's layer
	// mounts must still reach an agent started ahead of demand (the layer
	// cache's root is shared), so the copy of the tree becomes a slave.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		return fmt.Errorf("make mounts slave: %w", err)
	}
	if err := mountRootfs(cfg); err != nil {
		return err
	}
	if err := pivot(cfg.Rootfs); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	if cfg.hostname != "" {
		if err := unix.Sethostname([]byte(cfg.hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	// The OOM killer must pick the user's processes, never the agent: losing
	// PID 1 would tear the whole sandbox down. The agent resets the score of
	// each child it starts. Lowering the score needs CAP_SYS_RESOURCE, which
	// some hosts (nested or restricted VMs) do not grant even to root; the
	// sandbox still works there, only with a less protected agent.
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte("-1000"), 0); err != nil &&
		!errors.Is(err, os.ErrPermission) {
		return fmt.Errorf("oom_score_adj: %w", err)
	}
	// The agent runs as root like the user's processes, so without this any
	// of them could ptrace it, write its memory through /proc/1/mem or take
	// its control socket with pidfd_getfd: forge results, and, since a
	// reset sandbox keeps its agent, own the next user's sandbox too. A
	// non-dumpable process needs CAP_SYS_PTRACE for all of that, which
	// sandboxes never have. Processes it starts are dumpable again after
	// execve.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("set non-dumpable: %w", err)
	}
	return nil
}

type mnt struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

// OverlayOptions are the overlay mount options besides the directories, as
// key and value ("" for a flag). index=off, redirect_dir=off and
// metacopy=off keep the upper directory self-contained, so pack_diff can
// turn it into a layer on its own. volatile skips syncfs of the upper: a
// sandbox's writable layer does not outlive a host crash anyway, and agents
// calling sync must not stall the node's disk. The container backend's
// Reset mounts its fresh overlays with the same options.
//
// xino=on makes inode numbers consistent. The layers sit on several file
// systems (one per EROFS layer, the upper on the host's), and without xino
// readdir gives a directory's or copied-up file's inode number in the layer
// it comes from while stat gives overlay's own, and st_dev differs between
// files, so find -inum, du, rsync and hard-link detection go wrong. With
// it overlay puts the layer's index in the high bits of every inode number
// (0x4000…, 0x8000… for lower layers; the upper's are the host file
// system's), the same in readdir and stat, with one st_dev. "on", not
// "auto": every layer has the same file system UUID (layer.Build pins it
// so that builds are reproducible), and "auto" falls back to xino=off over
// two such layers ("conflicting uuid detected in lower fs"). It needs the
// upper file system's inode numbers to leave the high bits free (ext4's
// are 32-bit; overlay warns "inode number too big" and numbers that inode
// on its own otherwise).
var OverlayOptions = [][2]string{{"index", "off"}, {"redirect_dir", "off"}, {"metacopy", "off"}, {"xino", "on"}, {"volatile", ""}}

// OverlayDirs are an overlay's directories named so that the mount shows
// nothing of the host: overlay keeps the directory names it is given and
// shows them to the sandbox in /proc/mounts and mountinfo, and the host
// paths name the node's state and data directories and the edge's PID (in
// the slot name). Each directory is opened (O_PATH) and named by its
// descriptor as /proc/self/fd/N, which the kernel resolves when the mount
// is made in the process that holds the descriptors. (Passing the
// descriptors themselves, fsconfig's FSCONFIG_SET_FD, does not help:
// overlay then shows the directory's full path, d_path.) The names are
// resolved once, at mount time; the directories keep their host paths for
// everything else (pack_diff reads the upper directory by its path).
type OverlayDirs struct {
	// Lower are the layer directories, top first; Upper and Work may be
	// empty (a read-only overlay).
	Lower       []string
	Upper, Work string
	fds         []int
}

// OpenOverlayDirs opens lower, upper and work and names them; the caller
// closes them with Close once the overlay is mounted.
func OpenOverlayDirs(lower []string, upper, work string) (*OverlayDirs, error) {
	d := &OverlayDirs{fds: make([]int, 0, len(lower)+2)}
	// Errors name the directory's role, not its path: Reset's reach the
	// edge's callers.
	name := func(dir, role string) (string, error) {
		fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return "", fmt.Errorf("open overlay %s directory: %w", role, err)
		}
		d.fds = append(d.fds, fd)
		return "/proc/self/fd/" + strconv.Itoa(fd), nil
	}
	d.Lower = make([]string, len(lower))
	for i, l := range lower {
		n, err := name(l, "layer "+strconv.Itoa(i))
		if err != nil {
			d.Close()
			return nil, err
		}
		d.Lower[i] = n
	}
	for _, p := range []struct {
		dst       *string
		dir, role string
	}{{&d.Upper, upper, "upper"}, {&d.Work, work, "work"}} {
		if p.dir == "" {
			continue
		}
		n, err := name(p.dir, p.role)
		if err != nil {
			d.Close()
			return nil, err
		}
		*p.dst = n
	}
	return d, nil
}

// Close closes the directories' descriptors.
func (d *OverlayDirs) Close() {
	for _, fd := range d.fds {
		unix.Close(fd)
	}
	d.fds = nil
}

// overlayData is the overlay's mount(2) data: the directories and
// OverlayOptions.
func overlayData(d *OverlayDirs) string {
	var b strings.Builder
	b.WriteString("lowerdir=" + strings.Join(d.Lower, ":") + ",upperdir=" + d.Upper + ",workdir=" + d.Work)
	for _, o := range OverlayOptions {
		b.WriteString("," + o[0])
		if o[1] != "" {
			b.WriteString("=" + o[1])
		}
	}
	return b.String()
}

func mountRootfs(cfg *config) error {
	r := cfg.Rootfs
	dirs, err := OpenOverlayDirs(cfg.lower, cfg.upper, cfg.work)
	if err != nil {
		return err
	}
	err = unix.Mount("overlay", r, "overlay", unix.MS_NODEV, overlayData(dirs))
	dirs.Close()
	if err != nil {
		return fmt.Errorf("mount overlay (%d layers): %w", len(cfg.lower), err)
	}
	if err := PrepareRoot(r); err != nil {
		return err
	}
	const nsd = unix.MS_NOSUID | unix.MS_NODEV
	mounts := []mnt{
		{"proc", "proc", "proc", nsd | unix.MS_NOEXEC, ""},
		{"sysfs", "sys", "sysfs", nsd | unix.MS_NOEXEC | unix.MS_RDONLY, ""},
	}
	for _, m := range mounts {
		if err := unix.Mount(m.source, filepath.Join(r, m.target), m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount /%s: %w", m.target, err)
		}
	}
	if err := MountDev(filepath.Join(r, "dev"), cfg.UserNS); err != nil {
		return err
	}
	return maskPaths(r)
}

// PrepareRoot makes the mount points the sandbox needs in a freshly mounted
// root file system and fixes /tmp's mode. It is shared by the first set-up
// and by the container backend's Reset, which mounts a new overlay: both
// must leave the same upper directory behind.
func PrepareRoot(root string) error {
	for _, d := range []string{"proc", "dev", "sys", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return fmt.Errorf("mkdir /%s: %w", d, err)
		}
	}
	// Only touch /tmp's mode when the image got it wrong: a chmod copies the
	// directory up into the sandbox's upper layer.
	if fi, err := os.Stat(filepath.Join(root, "tmp")); err == nil && fi.Mode()&(os.ModePerm|os.ModeSticky) != 0o777|os.ModeSticky {
		if err := os.Chmod(filepath.Join(root, "tmp"), 0o777|os.ModeSticky); err != nil {
			return fmt.Errorf("chmod /tmp: %w", err)
		}
	}
	return nil
}

// MountDev mounts the sandbox's /dev at dev: a small tmpfs with the usual
// device nodes, a new devpts instance and a /dev/shm tmpfs. The container
// backend's Reset calls it too, for a /dev with nothing of the previous
// user's left in it.
func MountDev(dev string, userNS bool) error {
	if err := unix.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_STRICTATIME, "mode=755,size=65536k"); err != nil {
		return fmt.Errorf("mount /dev: %w", err)
	}
	return populateDev(dev, userNS)
}

var devices = []struct {
	name         string
	major, minor uint32
}{
	{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7},
	{"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0},
}

func populateDev(dev string, userNS bool) error {
	for _, d := range devices {
		p := filepath.Join(dev, d.name)
		if userNS {
			// mknod is not allowed in a user namespace: bind the host's node.
			f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o666)
			if err != nil {
				return fmt.Errorf("create /dev/%s: %w", d.name, err)
			}
			f.Close()
			if err := unix.Mount("/dev/"+d.name, p, "", unix.MS_BIND, ""); err != nil {
				return fmt.Errorf("bind /dev/%s: %w", d.name, err)
			}
			continue
		}
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("mknod /dev/%s: %w", d.name, err)
		}
		// mknod honours the umask; devices must be usable by every user.
		if err := unix.Chmod(p, 0o666); err != nil {
			return fmt.Errorf("chmod /dev/%s: %w", d.name, err)
		}
	}
	for _, d := range []string{"pts", "shm"} {
		if err := os.Mkdir(filepath.Join(dev, d), 0o755); err != nil {
			return fmt.Errorf("mkdir /dev/%s: %w", d, err)
		}
	}
	if err := unix.Mount("devpts", filepath.Join(dev, "pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC,
		"newinstance,ptmxmode=0666,mode=0620"); err != nil {
		return fmt.Errorf("mount /dev/pts: %w", err)
	}
	if err := unix.Mount("shm", filepath.Join(dev, "shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC,
		"mode=1777,size=65536k"); err != nil {
		return fmt.Errorf("mount /dev/shm: %w", err)
	}
	links := [][2]string{
		{"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"},
		{"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
	}
	for _, l := range links {
		if err := os.Symlink(l[0], filepath.Join(dev, l[1])); err != nil {
			return fmt.Errorf("symlink /dev/%s: %w", l[1], err)
		}
	}
	return nil
}

// What maskPaths hides, relative to the root: at least what Docker hides
// (moby's oci.DefaultSpec: masked /proc/acpi, asound, interrupts, kcore,
// keys, latency_stats, timer_list, timer_stats, sched_debug, scsi,
// /sys/firmware, /sys/devices/virtual/powercap; read-only /proc/bus, fs,
// irq, sys, sysrq-trigger), and what else shows the host to a sandbox's
// root: its kernel command line (which names the host's own services),
// kernel memory layout and physical addresses (slabinfo, vmallocinfo,
// vmcoreinfo, the kpage* files of every physical page), and the firmware's
// boot parameters (e820 memory map), and the host's btrfs file systems
// (the scratch file system's qgroups: every sandbox's disk use). Paths
// this kernel lacks are skipped.
var (
	// maskedFiles are covered by the host's /dev/null: they read empty.
	maskedFiles = []string{
		"proc/interrupts", "proc/kcore", "proc/keys", "proc/latency_stats",
		"proc/timer_list", "proc/timer_stats", "proc/sched_debug",
		"proc/cmdline", "proc/slabinfo", "proc/vmallocinfo",
		"proc/kpagecount", "proc/kpageflags", "proc/kpagecgroup",
		"sys/kernel/vmcoreinfo",
	}
	// maskedDirs are covered by an empty read-only tmpfs.
	maskedDirs = []string{
		"proc/acpi", "proc/asound", "proc/scsi",
		"sys/firmware", "sys/devices/virtual/powercap", "sys/kernel/boot_params",
		// Every btrfs file system of the host, the sandboxes' scratch
		// file system among them: its qgroups show every other
		// sandbox's disk use and limit.
		"sys/fs/btrfs",
	}
	// readOnlyPaths become read-only (/sys is read-only as a whole).
	readOnlyPaths = []string{"proc/bus", "proc/fs", "proc/irq", "proc/sys", "proc/sysrq-trigger"}
)

// MaskPaths applies the masks a sandbox's /proc and /sys get under root
// (see maskPaths); the microVM guest's init shares them.
func MaskPaths(root string) error { return maskPaths(root) }

// maskPaths applies the masks under root, whose /proc and /sys are
// mounted. Each is one mount (two for a read-only bind) and no stat: a
// path this kernel lacks fails the mount with ENOENT. The masks are
// mounts on the sandbox's /proc and /sys, so Reset, which moves those
// into the new root whole, keeps them.
func maskPaths(root string) error {
	for _, p := range maskedFiles {
		err := unix.Mount("/dev/null", filepath.Join(root, p), "", unix.MS_BIND, "")
		if err != nil && err != unix.ENOENT {
			return fmt.Errorf("mask /%s: %w", p, err)
		}
	}
	// One empty tmpfs, bound onto the other directories: a bind costs
	// less than a new superblock (its flags are the first mount's).
	empty := ""
	for _, p := range maskedDirs {
		t := filepath.Join(root, p)
		var err error
		if empty == "" {
			err = unix.Mount("tmpfs", t, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0,mode=555")
			if err == nil {
				empty = t
			}
		} else {
			err = unix.Mount(empty, t, "", unix.MS_BIND, "")
		}
		if err != nil && err != unix.ENOENT {
			return fmt.Errorf("mask /%s: %w", p, err)
		}
	}
	for _, p := range readOnlyPaths {
		t := filepath.Join(root, p)
		if err := unix.Mount(t, t, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return fmt.Errorf("bind /%s: %w", p, err)
		}
		if err := unix.Mount("", t, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("read-only /%s: %w", p, err)
		}
	}
	return nil
}

// pivot makes rootfs the root of the mount namespace and drops the host's
// mounts from it (pivot_root(".", ".") stacks the old root on the new one,
// so it can be detached without a temporary directory).
func pivot(rootfs string) error {
	if err := unix.Chdir(rootfs); err != nil {
		return fmt.Errorf("chdir rootfs: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	return unix.Chdir("/")
}

// loopbackUp sets IFF_UP on "lo" in the sandbox's fresh network namespace
// with one ioctl: cheaper than netlink and enough for the only interface.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket for lo: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}
