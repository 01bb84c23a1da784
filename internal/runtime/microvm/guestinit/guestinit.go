// Package guestinit is dsec-agent's work as /init of a microVM guest,
// before it serves the agent protocol: mount the kernel's file systems,
// load the modules the initramfs carries, find the agent's virtio-serial
// port, take the sandbox's configuration from the first request on it (the
// agent protocol's Init, like a container's agent: no configuration rides
// on the kernel command line), then build the sandbox's root — each EROFS
// layer mounted read-only from its virtio-blk (or virtio-pmem) device, an
// overlay over them whose upper directory lives on the sandbox's writable
// ext4 disk — and switch into it, with the same /proc and /sys masks as a
// container, the hostname, and a cgroup that bounds the memory and tasks
// of everything the agent starts.
//
// The kernel runs /init with nothing mounted and no stdio; this package
// links nothing that spawns a process, as nothing else exists in the
// initramfs.
package guestinit

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit"
)

// Marker is the kernel command line parameter that tells dsec-agent it is
// a microVM guest's init; its value is the virtio transport, "mmio"
// (-M microvm) or "pci" (q35).
const Marker = "dsec.transport"

// AgentPort is the virtio-serial port name (qemu.AgentPort; not imported,
// to keep QEMU's client out of the agent).
const AgentPort = "dsec.agent"

// UserCgroup is the cgroup (under the guest's cgroup2 root) every process
// the agent starts is born in; its memory.max and pids.max are the
// sandbox's limits.
const UserCgroup = "/sys/fs/cgroup/sandbox"

const (
	modDir  = "/lib/modules"
	newRoot = "/newroot"
	// How long devices may take to appear after their driver loads.
	deviceWait = 20 * time.Second
)

// IsGuest reports whether this process is a microVM guest's init: PID 1
// run as /init (a container's agent is PID 1 too, but is started under its
// own path with its control channel as fd 3).
func IsGuest() bool {
	return os.Getpid() == 1 && len(os.Args) > 0 && os.Args[0] == "/init"
}

// Guest is a set-up guest, ready to serve.
type Guest struct {
	// Conn is the agent channel.
	Conn *os.File
	// Options are Serve's: exec defaults from Init, processes born in
	// UserCgroup, and the verdict on failed commands.
	Options agent.Options

	cgroup   int // UserCgroup, opened before the switch of root
	writable int // the writable disk's root, for statfs
	upper    int // the overlay's upper directory, for diff
	spawn    chan spawnReq
	mu       sync.Mutex
	oomKills uint64
	pidsMax  uint64
}

// Start mounts the basics, loads the channel's drivers, opens the agent's
// port and answers its Init. On error the guest cannot serve: the caller
// reports and powers off.
func Start() (*Guest, error) {
	for _, m := range []struct{ src, dst, fs string }{
		{"devtmpfs", "/dev", "devtmpfs"}, {"proc", "/proc", "proc"}, {"sysfs", "/sys", "sysfs"},
	} {
		if err := unix.Mount(m.src, m.dst, m.fs, unix.MS_NOSUID, ""); err != nil && err != unix.EBUSY {
			return nil, fmt.Errorf("mount %s: %w", m.dst, err)
		}
	}
	// The kernel gave /init no stdio; the serial console (when the host
	// keeps one) gets our messages.
	if fd, err := unix.Open("/dev/console", unix.O_RDWR|unix.O_NOCTTY, 0); err == nil {
		unix.Dup2(fd, 1)
		unix.Dup2(fd, 2)
		if fd > 2 {
			unix.Close(fd)
		}
	}
	cmdline, _ := os.ReadFile("/proc/cmdline")
	transport := "mmio"
	for _, f := range strings.Fields(string(cmdline)) {
		if v, ok := strings.CutPrefix(f, Marker+"="); ok {
			transport = v
		}
	}
	mods, err := readModulesDep()
	if err != nil {
		return nil, err
	}
	g := &Guest{cgroup: -1, writable: -1, upper: -1}
	driver := "virtio_mmio"
	if transport == "pci" {
		driver = "virtio_pci"
	}
	for _, m := range []string{driver, "virtio_console"} {
		if err := mods.load(m); err != nil {
			return nil, err
		}
	}
	port, err := findPort()
	if err != nil {
		return nil, err
	}
	conn, err := os.OpenFile(port, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open the agent port: %w", err)
	}
	if err := waitForHost(conn); err != nil {
		conn.Close()
		return nil, err
	}
	var in *agent.Init
	err = agent.AcceptInit(conn, func(i *agent.Init) (*agent.InitResult, error) {
		in = i
		if err := i.Validate(); err != nil {
			return nil, err
		}
		if err := g.setup(i, mods); err != nil {
			return nil, &agent.Error{Code: agent.CodeUnavailable, Message: "guest init: " + err.Error()}
		}
		return &agent.InitResult{}, nil
	})
	if err != nil {
		conn.Close()
		return nil, err
	}
	g.Conn = conn
	g.Options = agent.Options{
		ReapAll: true,
		Env:     in.Env,
		Workdir: in.Workdir,
		User:    in.User,
		Fork:    g.fork,
		Verdict: g.verdict,
		Diff:    g.diff,
	}
	return g, nil
}

// setup builds the sandbox's root from in and switches into it.
func (g *Guest) setup(in *agent.Init, mods modules) error {
	need := []string{"virtio_blk", "erofs", "overlay"}
	for _, l := range in.Layers {
		if l.Pmem != nil {
			need = append(need, "virtio_pmem", "nd_pmem")
			break
		}
	}
	for _, m := range need {
		if err := mods.load(m); err != nil {
			return err
		}
	}
	// Free-page reporting hands pages the guest frees back to the host;
	// a guest without the balloon still works.
	mods.load("virtio_balloon")

	var lower []string
	for i, l := range in.Layers {
		dir := fmt.Sprintf("/layers/%d", i)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := mountSource(&l, dir, unix.MS_RDONLY); err != nil {
			return fmt.Errorf("layers[%d]: %w", i, err)
		}
		lower = append(lower, dir)
	}
	if in.Writable == nil {
		return errors.New("writable: none (a guest needs a writable disk)")
	}
	if err := os.MkdirAll("/rw", 0o755); err != nil {
		return err
	}
	if err := mountSource(in.Writable.Source, "/rw", unix.MS_NOATIME); err != nil {
		return fmt.Errorf("writable: %w", err)
	}
	upper := filepath.Join("/rw", in.Writable.Upper)
	work := filepath.Join("/rw", in.Writable.Work)
	for _, d := range []string{upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("writable: %w", err)
		}
	}
	fd, err := unix.Open("/rw", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	g.writable = fd
	if g.upper, err = unix.Open(upper, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return err
	}
	// The container's overlay options: xino=on keeps inode numbers
	// consistent across the layers' file systems (readdir and stat agree),
	// index, redirect_dir and metacopy off, volatile (the disk dies with
	// the sandbox: no syncs).
	data := "lowerdir=" + strings.Join(lower, ":") + ",upperdir=" + upper + ",workdir=" + work
	for _, o := range sandboxinit.OverlayOptions {
		data += "," + o[0]
		if o[1] != "" {
			data += "=" + o[1]
		}
	}
	if err := unix.Mount("overlay", newRoot, "overlay", unix.MS_NODEV, data); err != nil {
		return fmt.Errorf("mount overlay (%d layers): %w", len(lower), err)
	}
	if err := sandboxinit.PrepareRoot(newRoot); err != nil {
		return err
	}
	const nsd = unix.MS_NOSUID | unix.MS_NODEV
	for _, m := range []struct {
		src, dst, fs string
		flags        uintptr
	}{
		{"proc", "proc", "proc", nsd | unix.MS_NOEXEC},
		{"sysfs", "sys", "sysfs", nsd | unix.MS_NOEXEC | unix.MS_RDONLY},
		{"cgroup2", "sys/fs/cgroup", "cgroup2", nsd | unix.MS_NOEXEC},
	} {
		if err := unix.Mount(m.src, filepath.Join(newRoot, m.dst), m.fs, m.flags, ""); err != nil {
			return fmt.Errorf("mount /%s: %w", m.dst, err)
		}
	}
	if err := sandboxinit.MountDev(filepath.Join(newRoot, "dev"), false); err != nil {
		return err
	}
	if err := g.limits(in.Resources); err != nil {
		return err
	}
	// The kernel's log is the guest's, but a container cannot read its
	// kernel's either (dmesg needs CAP_SYSLOG, which the workload lacks).
	for _, kv := range [][2]string{{"kernel/dmesg_restrict", "1"}, {"kernel/kptr_restrict", "2"}} {
		if err := os.WriteFile("/proc/sys/"+kv[0], []byte(kv[1]), 0); err != nil {
			return fmt.Errorf("sysctl %s: %w", kv[0], err)
		}
	}
	if c := in.Container; c != nil && !c.NoLockdown {
		if err := g.startSpawner(c.Caps, c.Seccomp); err != nil {
			return err
		}
	} else if err := g.startSpawner(^uint64(0), nil); err != nil {
		return err
	}
	if err := sandboxinit.MaskPaths(newRoot); err != nil {
		return err
	}
	if in.Hostname != "" {
		if err := unix.Sethostname([]byte(in.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	// The initramfs's files are in guest RAM; nothing needs them now (a
	// running /init keeps its own pages).
	os.RemoveAll(modDir)
	os.Remove("/init")
	// switch_root: the overlay becomes /, and the initramfs's own mounts
	// stay behind underneath it, unreachable.
	for _, d := range []string{"/proc", "/sys"} {
		unix.Unmount(d, unix.MNT_DETACH)
	}
	if err := unix.Chdir(newRoot); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	return unix.Chdir("/")
}

// limits makes UserCgroup with the sandbox's memory and pids limits.
// The guest's RAM bounds the guest as a whole; the cgroup keeps the
// agent out of reach of a workload's OOM kill or fork bomb.
func (g *Guest) limits(r *agent.Resources) error {
	root := filepath.Join(newRoot, "sys/fs/cgroup")
	if err := os.WriteFile(filepath.Join(root, "cgroup.subtree_control"), []byte("+memory +pids"), 0); err != nil {
		return fmt.Errorf("cgroup controllers: %w", err)
	}
	dir := filepath.Join(root, "sandbox")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return fmt.Errorf("cgroup: %w", err)
	}
	if r != nil && r.MemoryBytes > 0 {
		if err := os.WriteFile(filepath.Join(dir, "memory.max"), []byte(strconv.FormatInt(r.MemoryBytes, 10)), 0); err != nil {
			return fmt.Errorf("memory.max: %w", err)
		}
	}
	if r != nil && r.Pids > 0 {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.FormatInt(r.Pids, 10)), 0); err != nil {
			return fmt.Errorf("pids.max: %w", err)
		}
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	g.cgroup = fd
	return nil
}

// fork has every process the agent starts forked by the locked-down
// spawner thread and born in UserCgroup.
func (g *Guest) fork(attr *syscall.SysProcAttr, start func() error) error {
	done := make(chan error, 1)
	g.spawn <- spawnReq{attr: attr, start: start, done: done}
	return <-done
}

// verdict tells a failed command's result what the guest's kernel saw:
// OOM kills and refused forks in UserCgroup since the last verdict, and a
// full writable disk.
func (g *Guest) verdict() agent.Verdict {
	g.mu.Lock()
	defer g.mu.Unlock()
	var v agent.Verdict
	if n := g.counter("memory.events", "oom_kill"); n > g.oomKills {
		v.OOMKilled, g.oomKills = true, n
	}
	if n := g.counter("pids.events", "max"); n > g.pidsMax {
		v.PidsExhausted, g.pidsMax = true, n
	}
	var st unix.Statfs_t
	if g.writable >= 0 && unix.Fstatfs(g.writable, &st) == nil {
		// Full: less than 256 KiB a non-root writer could still get (ext4
		// keeps none for root: the disk is made with -m 0), or no inode.
		v.DiskFull = st.Bavail*uint64(st.Bsize) < 256<<10 || st.Ffree == 0
	}
	return v
}

// counter reads "key N" from a flat keyed file of UserCgroup.
func (g *Guest) counter(file, key string) uint64 {
	fd, err := unix.Openat(g.cgroup, file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	f := os.NewFile(uintptr(fd), file)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok && k == key {
			n, _ := strconv.ParseUint(v, 10, 64)
			return n
		}
	}
	return 0
}

// mountSource mounts a layer or the writable disk at dir.
func mountSource(s *agent.Source, dir string, flags uintptr) error {
	var dev, data string
	switch {
	case s.Block != nil:
		d, err := blockBySerial(s.Block.Serial)
		if err != nil {
			return err
		}
		dev = d
	case s.Pmem != nil:
		dev = fmt.Sprintf("/dev/pmem%d", s.Pmem.Index)
		if err := waitFor(dev); err != nil {
			return err
		}
		if s.Pmem.DAX {
			data = "dax=always"
		}
	default:
		return fmt.Errorf("a guest takes devices, not the path %q", s.Path)
	}
	if err := unix.Mount(dev, dir, s.FSType, flags, data); err != nil {
		return fmt.Errorf("mount %s (%s) on %s: %w", dev, s.FSType, dir, err)
	}
	return nil
}

// blockBySerial finds the virtio-blk disk whose serial is serial, waiting
// for the driver to probe it.
func blockBySerial(serial string) (string, error) {
	deadline := time.Now().Add(deviceWait)
	for {
		names, _ := filepath.Glob("/sys/block/vd*")
		for _, n := range names {
			b, err := os.ReadFile(filepath.Join(n, "serial"))
			if err == nil && strings.TrimSpace(string(b)) == serial {
				return "/dev/" + filepath.Base(n), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no disk with serial %q appeared", serial)
		}
		time.Sleep(time.Millisecond)
	}
}

func waitFor(path string) error {
	deadline := time.Now().Add(deviceWait)
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not appear", path)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitForHost waits until the host's first request is readable on the
// port. Until QEMU's "port open" message reaches the guest's driver, a
// read of the port returns end of file (and poll says POLLHUP), though
// the host is connected and has written: the guest opens the port that
// early at every boot, so it polls past it (POLLHUP set).
func waitForHost(conn *os.File) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	for {
		var ready bool
		var perr error
		err := rc.Control(func(fd uintptr) {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			_, perr = unix.Poll(fds, 100)
			// The driver says POLLIN|POLLHUP while the host is not
			// connected (a read would not block: it returns EOF).
			ready = fds[0].Revents&(unix.POLLIN|unix.POLLHUP) == unix.POLLIN
		})
		switch {
		case err != nil:
			return err
		case perr != nil && perr != unix.EINTR:
			return fmt.Errorf("poll the agent port: %w", perr)
		case ready:
			return nil
		}
		time.Sleep(time.Millisecond)
	}
}

// findPort returns the device of the virtio-serial port named AgentPort.
func findPort() (string, error) {
	deadline := time.Now().Add(deviceWait)
	for {
		names, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
		for _, n := range names {
			b, err := os.ReadFile(n)
			if err == nil && strings.TrimSpace(string(b)) == AgentPort {
				return "/dev/" + filepath.Base(filepath.Dir(n)), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %s appeared", AgentPort)
		}
		time.Sleep(time.Millisecond)
	}
}

// modules knows each module's dependencies (the initramfs's modules.dep,
// written by vmimage) and which are loaded.
type modules struct {
	deps   map[string][]string
	loaded map[string]bool
}

func readModulesDep() (modules, error) {
	b, err := os.ReadFile(filepath.Join(modDir, "modules.dep"))
	if err != nil {
		return modules{}, fmt.Errorf("modules.dep: %w", err)
	}
	m := modules{deps: map[string][]string{}, loaded: map[string]bool{}}
	for _, line := range bytes.Split(b, []byte("\n")) {
		name, rest, ok := strings.Cut(string(line), ":")
		if ok {
			m.deps[name] = strings.Fields(rest)
		}
	}
	return m, nil
}

// load loads name after what it depends on.
func (m modules) load(name string) error {
	if m.loaded[name] {
		return nil
	}
	deps, ok := m.deps[name]
	if !ok {
		return fmt.Errorf("module %s is not in the initramfs", name)
	}
	for _, d := range deps {
		if err := m.load(d); err != nil {
			return err
		}
	}
	f, err := os.Open(filepath.Join(modDir, name+".ko"))
	if err != nil {
		return fmt.Errorf("module %s: %w", name, err)
	}
	defer f.Close()
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && err != unix.EEXIST {
		return fmt.Errorf("load module %s: %w", name, err)
	}
	m.loaded[name] = true
	return nil
}

// loopbackUp sets IFF_UP on "lo".
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

// PowerOff ends the guest (QEMU then exits: the backend runs it with
// -no-reboot), after a last message on the console.
func PowerOff(msg string) {
	if msg != "" {
		os.Stderr.WriteString("dsec-agent (guest): " + msg + "\n")
	}
	unix.Sync()
	unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	os.Exit(1)
}
