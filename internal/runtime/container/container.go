// Package container is DSec's native container backend: Linux namespaces,
// cgroups and seccomp over an overlay of read-only EROFS layers, written in
// Go with no runc or containerd on the create path.
//
// A create costs one process spawn. The edge forks dsec-agent directly into
// new mount, PID, IPC, UTS, network and cgroup namespaces, born inside the
// sandbox's cgroup, with one end of a socketpair as fd 3. The agent (PID 1)
// receives its configuration over that socket, mounts the overlay and the
// minimal /dev, /proc and /sys inside its own mount namespace (package
// sandboxinit), pivots into it, locks itself down and then serves exec and
// file requests over the same socket for the sandbox's whole life.
//
// Layers are mounted once per node by a shared, reference-counted cache
// (layer.Mounts); the host mount table holds one mount per layer, never one
// per sandbox.
//
// Reset (runtime.Resetter) recycles a sandbox for its next user in place,
// for a fraction of a destroy and a create, because the agent's start-up
// is most of a create. It is done from the edge, not by the agent: the
// agent has given up the right to mount and must not be trusted after a
// hostile user anyway. The user's processes are killed through the user
// cgroup. A root file system nobody wrote to (its fingerprint, taken when
// the sandbox was fresh, is unchanged) is kept; otherwise it is replaced,
// not cleaned: the overlay's upper directory must not change while it is
// mounted, so a new overlay over a fresh upper directory is built detached
// (new mount API) in the host's namespace, where the layer paths resolve,
// then moved into the sandbox's mount namespace, with the sandbox's own
// /proc and /sys and a fresh /dev, and made its root with pivot_root,
// which moves the agent along. The old overlay goes with the old root; its
// directories are removed in the background.
//
// A node holds far more sandboxes than its limits add up to (qos.go): a
// sandbox's memory limit covers RAM and swap together, idle sandboxes
// (no request in flight) get the least CPU weight and are the first whose
// memory goes to swap when the node runs short.
package container

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/audit/seccomp"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/agentconv"
	"github.com/dsec-dev/dsec/internal/runtime/container/scratchfs"
	"github.com/dsec-dev/dsec/internal/swap"
)

// LayerMounts is the node's shared cache of read-only layer mounts
// (satisfied by *layer.Mounts).
type LayerMounts interface {
	// Acquire mounts the EROFS file (once per node) and returns its
	// directory; a directory layer is returned as is.
	Acquire(ctx context.Context, digest, file string) (string, error)
	// Release drops one reference; the last one unmounts.
	Release(digest string) error
}

// Options configure the backend. Zero values get defaults.
type Options struct {
	// StateDir holds one directory per sandbox (overlay upper, work, rootfs
	// mount point). Default /var/lib/dsec/sandboxes.
	StateDir string
	// AgentPath is the dsec-agent binary. Default: next to the running
	// executable.
	AgentPath string
	// Layers mounts the sandboxes' layers. Required.
	Layers LayerMounts
	// CgroupParent is the cgroup under which sandboxes live. Default "dsec".
	CgroupParent string
	// DefaultPids bounds tasks per sandbox when the spec sets none.
	DefaultPids int64
	// Scratch is the file system sandboxes' writable layers live on, each
	// in a volume with its own limit (Resources.DiskBytes, see disk.go);
	// StateDir is its Dir. Nil: writable layers are plain directories in
	// StateDir and DiskBytes is not enforced.
	Scratch *scratchfs.FS
	// DefaultDiskBytes is the writable-layer limit when the spec sets
	// none. Default DefaultDiskBytes.
	DefaultDiskBytes int64
	// Seccomp is the compiled filter every sandbox installs. Default:
	// Docker's default profile plus DSec's denials (package seccomp).
	Seccomp []byte
	// Caps is the capability set sandboxes keep. Default: Docker's set
	// without CAP_MKNOD (package caps).
	Caps []int
	// Unconfined skips capabilities, no_new_privs and seccomp. Only for
	// debugging a profile problem; never for agents' code.
	Unconfined bool
	// Warm is how many agents to keep started ahead of demand (0: none).
	// Each idle one costs about a sandbox's idle memory.
	Warm int
	// InitTimeout bounds how long a sandbox may take to come up.
	InitTimeout time.Duration
	// MemoryBytes bounds the RAM of all sandboxes together (the edge's
	// --memory): CgroupParent's memory limit. 0: no bound of DSec's (the
	// host's RAM). Swap is not counted in it (see setNodeMemory).
	MemoryBytes int64
	// IdleAfter is how long a sandbox has had no request in flight before
	// it counts as idle: its CPU weight is lowered, what its execs left
	// running gets SCHED_IDLE, and its memory is taken back first when the
	// node runs short (qos.go). Default DefaultIdleAfter.
	IdleAfter time.Duration
	// Logger, default slog.Default().
	Logger *slog.Logger
}

// Backend creates container sandboxes.
type Backend struct {
	opts Options
	log  *slog.Logger

	mu    sync.Mutex
	live  map[string]*sandbox
	slots atomic.Int64

	// Warm pool of pre-started agents (Options.Warm).
	warm       chan *agentProc
	refillCh   chan struct{}
	stop       chan struct{}
	fillerDone chan struct{}
	closeOnce  sync.Once

	// qosDone is closed when the QoS loop (qos.go) has stopped.
	qosDone  chan struct{}
	qosStats qosCounters
}

var _ rt.Backend = (*Backend)(nil)

// minMemory is the smallest memory limit a sandbox may have: its agent
// alone needs a few MiB.
const minMemory = 8 << 20

// validID keeps IDs safe as path and cgroup components: 1-128 of
// [A-Za-z0-9_.-], starting with a letter or digit (so never "." or "..").
func validID(id string) bool {
	if len(id) == 0 || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '_' && c != '.' && c != '-') {
			return false
		}
	}
	return true
}

// New returns a container backend. It removes what a previous process with
// the same state directory left behind (sandboxes do not survive their edge).
func New(opts Options) (*Backend, error) {
	if opts.Layers == nil {
		return nil, errors.New("container backend: Options.Layers is required")
	}
	if opts.StateDir == "" && opts.Scratch != nil {
		opts.StateDir = opts.Scratch.Dir()
	}
	if opts.StateDir == "" {
		opts.StateDir = "/var/lib/dsec/sandboxes"
	}
	if opts.Scratch != nil && filepath.Clean(opts.StateDir) != filepath.Clean(opts.Scratch.Dir()) {
		return nil, fmt.Errorf("container backend: StateDir %s is not the scratch file system's %s", opts.StateDir, opts.Scratch.Dir())
	}
	opts.StateDir = filepath.Clean(opts.StateDir)
	if opts.DefaultDiskBytes == 0 {
		opts.DefaultDiskBytes = DefaultDiskBytes
	}
	if err := validDisk(opts.DefaultDiskBytes); err != nil {
		return nil, fmt.Errorf("container backend: DefaultDiskBytes: %w", err)
	}
	if opts.CgroupParent == "" {
		opts.CgroupParent = "dsec"
	}
	if opts.DefaultPids == 0 {
		opts.DefaultPids = 2048
	}
	if opts.InitTimeout == 0 {
		opts.InitTimeout = 30 * time.Second
	}
	if opts.IdleAfter == 0 {
		opts.IdleAfter = DefaultIdleAfter
	}
	if opts.MemoryBytes < 0 || opts.IdleAfter < 0 {
		return nil, errors.New("container backend: MemoryBytes and IdleAfter must not be negative")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.AgentPath == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("locate dsec-agent: %w", err)
		}
		opts.AgentPath = filepath.Join(filepath.Dir(exe), "dsec-agent")
	}
	if !opts.Unconfined {
		if opts.Seccomp == nil {
			prog, err := seccomp.Default()
			if err != nil {
				return nil, fmt.Errorf("compile seccomp profile: %w", err)
			}
			if opts.Seccomp, err = prog.MarshalBinary(); err != nil {
				return nil, err
			}
		}
		if opts.Caps == nil {
			opts.Caps = caps.DockerDefault().Caps()
		}
	}
	if _, err := os.Stat(opts.AgentPath); err != nil {
		return nil, fmt.Errorf("dsec-agent binary: %w", err)
	}
	if err := checkAgentBinary(opts.AgentPath); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(opts.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	// Before any thread joins a sandbox's IPC namespace (Reset).
	if _, err := hostIPC(); err != nil {
		return nil, err
	}
	b := &Backend{opts: opts, log: opts.Logger, live: map[string]*sandbox{},
		warm: make(chan *agentProc, opts.Warm), refillCh: make(chan struct{}, 1), stop: make(chan struct{}),
		qosDone: make(chan struct{})}
	b.cleanStale()
	if err := setNodeMemory(opts.CgroupParent, opts.MemoryBytes); err != nil {
		return nil, fmt.Errorf("container backend: bound the sandboxes' memory at %d bytes (cgroup %s): %w", opts.MemoryBytes, opts.CgroupParent, err)
	}
	if total, _, err := swap.Total(); err == nil {
		hostSwap.Store(total > 0)
	}
	go b.qosLoop()
	if opts.Warm > 0 {
		b.fillerDone = make(chan struct{})
		go b.fillWarm()
	}
	return b, nil
}

// Kind implements runtime.Backend.
func (b *Backend) Kind() rt.Kind { return rt.KindContainer }

// StateDir is where sandboxes' directories live (leak checks use it).
func (b *Backend) StateDir() string { return b.opts.StateDir }

// AgentPID returns the host PID of sandbox id's agent (its PID 1), for
// operators (nsenter) and tests.
func (b *Backend) AgentPID(id string) (int, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	sb := b.live[id]
	if sb == nil {
		return 0, false
	}
	return sb.cmd.Process.Pid, true
}

// CgroupDirs lists the directories under which sandbox cgroups are created.
func (b *Backend) CgroupDirs() []string {
	if cgroupMode() == cgroups.Unified {
		return []string{filepath.Join(cgroupRoot, b.opts.CgroupParent)}
	}
	var d []string
	for _, c := range v1Controllers {
		d = append(d, filepath.Join(cgroupRoot, string(c), b.opts.CgroupParent))
	}
	return d
}

func (b *Backend) validate(spec *rt.Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("%w: id %q must be 1-128 characters of [A-Za-z0-9_.-]", rt.ErrInvalidSpec, spec.ID)
	}
	if len(spec.Layers) == 0 {
		return fmt.Errorf("%w: layers: at least one layer is required", rt.ErrInvalidSpec)
	}
	for i, l := range spec.Layers {
		if l.Digest == "" || l.Path == "" {
			return fmt.Errorf("%w: layers[%d]: digest and path are required", rt.ErrInvalidSpec, i)
		}
		if _, err := os.Stat(l.Path); err != nil {
			return fmt.Errorf("%w: layers[%d] (%s): %v", rt.ErrInvalidSpec, i, l.Digest, err)
		}
	}
	r := spec.Resources
	if r.MilliCPU < 0 || r.MemoryBytes < 0 || r.Pids < 0 {
		return fmt.Errorf("%w: resources must not be negative", rt.ErrInvalidSpec)
	}
	if r.MemoryBytes != 0 && r.MemoryBytes < minMemory {
		return fmt.Errorf("%w: resources.memory %d bytes is below the %d MiB minimum", rt.ErrInvalidSpec, r.MemoryBytes, minMemory>>20)
	}
	if err := validDisk(r.DiskBytes); err != nil {
		return err
	}
	if spec.UserNamespace {
		return fmt.Errorf("%w: user_namespace is not supported by the container backend yet", rt.ErrInvalidSpec)
	}
	return nil
}

// defaults fills in what a valid spec may leave out (Create, Rebase).
func (b *Backend) defaults(spec *rt.Spec) {
	if spec.Hostname == "" {
		spec.Hostname = rt.HostnameFor(spec.ID)
	}
	if spec.Resources.Pids == 0 {
		spec.Resources.Pids = b.opts.DefaultPids
	}
	if spec.Resources.DiskBytes == 0 {
		spec.Resources.DiskBytes = b.opts.DefaultDiskBytes
	}
}

// Create implements runtime.Backend. Every step registers its undo; a
// failure runs them in reverse so nothing is left behind.
func (b *Backend) Create(ctx context.Context, spec rt.Spec) (_ rt.Sandbox, err error) {
	if err := b.validate(&spec); err != nil {
		return nil, err
	}
	b.defaults(&spec)
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	b.mu.Lock()
	if _, dup := b.live[spec.ID]; dup {
		b.mu.Unlock()
		return nil, fmt.Errorf("%w: id %q is already in use", rt.ErrInvalidSpec, spec.ID)
	}
	b.live[spec.ID] = nil // reserve
	b.mu.Unlock()
	undo = append(undo, func() { b.mu.Lock(); delete(b.live, spec.ID); b.mu.Unlock() })

	p := b.takeWarm()
	if p != nil {
		undo = append(undo, p.kill)
		if err := p.cg.update(spec.Resources); err != nil {
			return nil, fmt.Errorf("set resources: %w", err)
		}
		if err := b.setDisk(p, spec.Resources.DiskBytes); err != nil {
			return nil, err
		}
	} else {
		if p, err = b.spawn(spec.Resources); err != nil {
			return nil, err
		}
		undo = append(undo, p.kill)
	}

	// Overlay wants the top layer first.
	lower := make([]string, len(spec.Layers))
	for i, l := range spec.Layers {
		d, err := b.opts.Layers.Acquire(ctx, l.Digest, l.Path)
		if err != nil {
			return nil, fmt.Errorf("mount layer %s: %w", l.Digest, err)
		}
		digest := l.Digest
		undo = append(undo, func() { b.opts.Layers.Release(digest) })
		lower[len(spec.Layers)-1-i] = d
	}

	in, err := b.initFor(p, spec, lower)
	if err != nil {
		return nil, err
	}
	client := agent.NewClient(p.conn)
	undo = append(undo, func() { client.Close() })
	res, err := b.initSandbox(ctx, client, in, p.done)
	if err != nil {
		return nil, err
	}
	attrs, err := captureAgent(p.cmd.Process.Pid)
	if err != nil {
		return nil, err
	}
	proc, err := p.openProc()
	if err != nil {
		return nil, err
	}
	defer unix.Close(proc)
	sb := &sandbox{b: b, id: spec.ID, spec: spec, agentProc: p, client: client,
		lower: lower, upper: p.upper, work: p.work, attrs: attrs, mqueue: -1,
		agentMqueue: int(res.MqueueFD), agentFiles: fds(res.CgroupFDs), res: spec.Resources, resKnown: true}
	// Taken before anyone can use the sandbox: what a Reset that finds
	// nothing changed keeps.
	sb.pristine = sb.pristineOrNil(p.upper, p.work, proc)
	sb.qos.lastEnd.Store(time.Now().UnixNano())
	sb.qos.cpuMark = -1
	b.mu.Lock()
	b.live[spec.ID] = sb
	b.mu.Unlock()
	return sb, nil
}

// agentProc is a dsec-agent started in fresh namespaces and its cgroup,
// waiting for its sandbox's Init. Its directory and cgroup are named by a
// slot name of the backend's own, not by the sandbox ID, so that agents can
// be started before anyone asks for a sandbox.
type agentProc struct {
	b    *Backend
	slot string
	dir  string
	cg   cgroup
	// upper and work are the first overlay's directories (makeSlotDir).
	upper, work string
	// vol is the ID of the volume on the scratch file system the current
	// overlay's directories are in (0: none), and disk its limit (under
	// the sandbox's updateMu once it has one).
	vol  uint64
	disk int64
	// cmd is the agent's process. Its os.Process holds a pidfd (where
	// the kernel has them) that Reset joins the agent's namespaces
	// through (withNS), immune to PID reuse; it is the only descriptor of
	// the agent's process the edge keeps.
	cmd     *exec.Cmd
	conn    net.Conn
	done    chan struct{}
	waitErr error
}

// kill ends the agent (and with it every process of its PID namespace) and
// removes its cgroup and directory.
func (p *agentProc) kill() {
	p.cmd.Process.Kill()
	<-p.done
	p.conn.Close()
	p.cg.delete()
	p.b.removeSlotDir(p.dir)
}

// withNS calls f with a descriptor that names the agent's namespace name
// ("mnt", "ipc", ...) for setns: the pidfd its os.Process holds, which
// names the agent for sure and stays open until f returns, or, where the
// kernel has no pidfds, the namespace's file opened by PID (the agent is
// our child: its PID names it until Wait reaps it).
func (p *agentProc) withNS(name string, f func(fd int) error) error {
	var ferr error
	err := p.cmd.Process.WithHandle(func(h uintptr) { ferr = f(int(h)) })
	switch {
	case err == nil:
		return ferr
	case errors.Is(err, os.ErrProcessDone):
		return errors.New("init has exited")
	case !errors.Is(err, os.ErrNoHandle):
		return err
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/%s", p.cmd.Process.Pid, name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s namespace: %w", name, err)
	}
	defer unix.Close(fd)
	return f(fd)
}

// borrow returns a duplicate of the agent's descriptor n (pidfd_getfd,
// close-on-exec).
func (p *agentProc) borrow(n int) (int, error) {
	fd, gerr := -1, error(nil)
	err := p.cmd.Process.WithHandle(func(h uintptr) { fd, gerr = unix.PidfdGetfd(int(h), n, 0) })
	if err != nil {
		return -1, err
	}
	return fd, gerr
}

// openUserFile opens file i of the user cgroup's files (userFiles) for
// reading: a duplicate of the agent's descriptor of it (borrow), which
// costs a fraction of opening a cgroup file (kernfs), checked to be that
// very file (its device and inode numbers, from a stat when the cgroup was
// made: the agent cannot pass anything else off as it); else, when that
// fails (an agent without it, a kernel or security module that refuses
// pidfd_getfd, or the check), by its path on the host's cgroup file
// system, which nothing in a sandbox can change.
func (s *sandbox) openUserFile(i int) (int, error) {
	f := s.cg.files()
	if i < len(s.agentFiles) && s.agentFiles[i] > 0 {
		if fd, err := s.borrow(s.agentFiles[i]); err == nil {
			var st unix.Stat_t
			if unix.Fstat(fd, &st) == nil && (fileID{st.Dev, st.Ino}) == f.id[i] {
				return fd, nil
			}
			unix.Close(fd)
		}
	}
	fd, err := unix.Open(f.path[i], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", f.path[i], err)
	}
	return fd, nil
}

// alive reports whether the agent has not been reaped yet (a zombie
// counts): through the pidfd where there is one, so a nil answer after
// something was opened by the agent's PID (/proc/PID/...) means the PID
// named the agent when it was opened.
func (p *agentProc) alive() error {
	return p.cmd.Process.Signal(syscall.Signal(0))
}

// spawn starts an agent with resources r. One process spawn: the agent is
// born in its cgroup and namespaces and does the rest itself.
func (b *Backend) spawn(r rt.Resources) (_ *agentProc, err error) {
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()
	slot := fmt.Sprintf("s%d-%d", os.Getpid(), b.slots.Add(1))
	dir := filepath.Join(b.opts.StateDir, slot)
	p := &agentProc{b: b, slot: slot, dir: dir}
	if err := b.makeSlotDir(p, r.DiskBytes); err != nil {
		return nil, err
	}
	undo = append(undo, func() { b.removeSlotDir(dir) })
	for _, d := range []string{p.upper, p.work, filepath.Join(dir, "rootfs")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, fmt.Errorf("sandbox dir: %w", err)
		}
	}
	cg, err := newCgroup(b.opts.CgroupParent, slot, r)
	if err != nil {
		return nil, err
	}
	undo = append(undo, func() { cg.delete() })

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	parentFile := os.NewFile(uintptr(fds[0]), "agent-control")
	childFile := os.NewFile(uintptr(fds[1]), "agent-control")
	conn, err := net.FileConn(parentFile)
	parentFile.Close()
	if err != nil {
		childFile.Close()
		return nil, fmt.Errorf("control socket: %w", err)
	}
	undo = append(undo, func() { conn.Close() })

	cmd := &exec.Cmd{
		Path:       b.opts.AgentPath,
		Args:       []string{"dsec-agent", "container-init"},
		Env:        []string{"GOMAXPROCS=1"},
		ExtraFiles: []*os.File{childFile},
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWIPC |
				syscall.CLONE_NEWUTS | syscall.CLONE_NEWNET | syscall.CLONE_NEWCGROUP,
			// No PidFD: os.Process then opens the pidfd it keeps itself
			// (with one of ours, it would keep a duplicate of it).
			Setsid: true,
		},
	}
	err = cg.spawn(cmd.SysProcAttr, cmd.Start)
	childFile.Close()
	if err != nil {
		return nil, fmt.Errorf("start dsec-agent: %w", err)
	}
	p.cg, p.cmd, p.conn, p.done = cg, cmd, conn, make(chan struct{})
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// takeWarm returns a pre-started agent, or nil when none is ready.
func (b *Backend) takeWarm() *agentProc {
	for {
		select {
		case p := <-b.warm:
			b.refill()
			select {
			case <-p.done: // died while waiting: discard
				p.kill()
				continue
			default:
			}
			return p
		default:
			return nil
		}
	}
}

// refill asks the background filler to top the warm pool up.
func (b *Backend) refill() {
	select {
	case b.refillCh <- struct{}{}:
	default:
	}
}

// fillWarm keeps Options.Warm agents started ahead of demand, so a create
// costs mounts and a round trip instead of a process start (the bulk of
// it: a Go process takes ~10 ms from exec to main on these machines).
func (b *Backend) fillWarm() {
	defer close(b.fillerDone)
	for {
		for len(b.warm) < cap(b.warm) {
			select {
			case <-b.stop:
				return
			default:
			}
			p, err := b.spawn(rt.Resources{Pids: b.opts.DefaultPids, DiskBytes: b.opts.DefaultDiskBytes})
			if err != nil {
				b.log.Warn("start warm agent", "err", err)
				break
			}
			b.warm <- p
		}
		select {
		case <-b.stop:
			return
		case <-b.refillCh:
		case <-time.After(time.Second):
		}
	}
}

// Close stops the warm pool and removes its agents. Live sandboxes are
// the caller's to destroy (a Reset after Close still works).
func (b *Backend) Close() error {
	b.closeOnce.Do(func() {
		close(b.stop)
		if b.fillerDone != nil {
			<-b.fillerDone
		}
		<-b.qosDone
		for {
			select {
			case p := <-b.warm:
				p.kill()
				continue
			default:
			}
			break
		}
	})
	return nil
}

// initFor is the Init that sets p up as spec's sandbox over the layer
// directories lower (top first). The exec defaults stay out of it: a
// rebase changes them under a running agent, so each exec carries the
// spec's (sandbox.exec).
func (b *Backend) initFor(p *agentProc, spec rt.Spec, lower []string) (*agent.Init, error) {
	// The overlay's directories are named relative to one writable
	// directory, as a VM guest's are relative to its disk.
	wdir := filepath.Dir(p.upper)
	if filepath.Dir(p.work) != wdir {
		return nil, fmt.Errorf("overlay upper %s and work %s are not in one directory", p.upper, p.work)
	}
	in := &agent.Init{
		Hostname: spec.Hostname,
		Resources: &agent.Resources{MilliCPU: spec.Resources.MilliCPU, MemoryBytes: spec.Resources.MemoryBytes,
			Pids: spec.Resources.Pids, DiskBytes: spec.Resources.DiskBytes},
		Layers: make([]agent.Source, len(lower)),
		Writable: &agent.Writable{Source: &agent.Source{Path: wdir},
			Upper: filepath.Base(p.upper), Work: filepath.Base(p.work)},
		Container: &agent.ContainerInit{
			Rootfs:      filepath.Join(p.dir, "rootfs"),
			Seccomp:     b.opts.Seccomp,
			Caps:        uint64(caps.Of(b.opts.Caps...)),
			NoLockdown:  b.opts.Unconfined,
			CgroupFiles: p.cg.files().path[:],
		},
	}
	for i, l := range lower {
		in.Layers[i].Path = l
	}
	p.cg.user(in.Container)
	return in, nil
}

// fds converts the agent's descriptor numbers.
func fds(in []int32) []int {
	out := make([]int, len(in))
	for i, fd := range in {
		out[i] = int(fd)
	}
	return out
}

// initSandbox sends the sandbox's Init and waits for the agent's answer,
// bounded by the context, the init timeout and the agent's death. It
// returns the container part of the answer.
func (b *Backend) initSandbox(ctx context.Context, client *agent.Client, in *agent.Init, done <-chan struct{}) (*agent.ContainerInitResult, error) {
	ictx, cancel := context.WithTimeout(ctx, b.opts.InitTimeout)
	defer cancel()
	res, err := client.Init(ictx, in)
	if err != nil {
		var ae *agent.Error
		if errors.As(err, &ae) {
			return nil, fmt.Errorf("sandbox setup: %s", ae.Message)
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		select {
		case <-done:
			return nil, fmt.Errorf("dsec-agent exited during sandbox setup: %w", err)
		default:
		}
		if ictx.Err() != nil {
			return nil, fmt.Errorf("%w: sandbox setup took longer than %v: %v", rt.ErrBusy, b.opts.InitTimeout, err)
		}
		return nil, fmt.Errorf("sandbox setup: %w", err)
	}
	if res.Container == nil {
		return nil, errors.New("sandbox setup: the agent's answer has no container part")
	}
	return res.Container, nil
}

// cleanStale removes sandboxes a previous process left behind: their
// processes are killed (via their cgroups), their directories removed.
func (b *Backend) cleanStale() {
	entries, err := os.ReadDir(b.opts.StateDir)
	if err != nil {
		return
	}
	for _, e := range entries {
		id := e.Name()
		cg := existingCgroup(b.opts.CgroupParent, id)
		if cg != nil {
			killCgroup(cg)
			if err := cg.delete(); err != nil {
				b.log.Warn("stale sandbox cgroup", "id", id, "err", err)
			}
		}
		dir := filepath.Join(b.opts.StateDir, id)
		// The rootfs was mounted in the sandbox's own mount namespace, which
		// died with its processes; detach in case an older layout mounted it
		// on the host.
		unix.Unmount(filepath.Join(dir, "rootfs"), unix.MNT_DETACH)
		if err := b.removeSlotDir(dir); err != nil {
			b.log.Warn("stale sandbox dir", "id", id, "err", err)
		}
		b.log.Info("removed stale sandbox", "id", id)
	}
}

type sandbox struct {
	*agentProc
	b      *Backend
	id     string
	spec   rt.Spec
	client *agent.Client

	// attrs are the agent's inheritable attributes after Create.
	attrs *agentAttrs
	// resetMu serialises Reset with itself and with the end of Destroy,
	// and guards pristine.
	resetMu sync.Mutex
	// pristine is the sandbox's state as Create or the last full Reset left
	// it (nil: none could be taken; every Reset builds a new root).
	pristine *pristine
	// resetsKept and resetsRebuilt count Resets that found nothing changed
	// and kept the root, and those that built a new one.
	resetsKept, resetsRebuilt atomic.Int64
	// fsMu guards the current overlay's directories, which Reset replaces
	// (generation gen; 0 is Create's "upper" and "work"), the root prepared
	// for the next Reset, and destroyed.
	fsMu        sync.Mutex
	upper, work string
	gen         int
	// lower are the overlay's layer directories, top first, and lowerGen
	// counts their changes (Rebase).
	lower     []string
	lowerGen  int
	next      *overlayRoot
	destroyed bool
	// bg counts Reset's background work in flight (releasing the old root,
	// preparing the next); Destroy waits for it.
	bg sync.WaitGroup
	// agentMqueue is the agent's descriptor of a detached mount of the
	// sandbox's mqueue file system (agent.ContainerInitResult.MqueueFD), which
	// Reset looks through (clearAgentMqueues); 0 if it has none. Then
	// mqueue is the edge's own such mount (-1 until the first Reset makes
	// it); only Reset uses them.
	agentMqueue int
	mqueue      int
	// agentFiles are the agent's descriptors of the user cgroup's files
	// (userFiles, agent.ContainerInitResult.CgroupFDs), which openUserFile
	// borrows.
	agentFiles []int
	// rf is what Reset learnt about the sandbox (under resetMu).
	rf resetFiles
	// updateMu serialises Update and guards res: the limits in force
	// (Pids defaulted), when resKnown (a failed Update leaves them unknown).
	updateMu sync.Mutex
	res      rt.Resources
	resKnown bool
	// frozen is set from Freeze until a Thaw succeeds: Reset skips the
	// thaw of a sandbox that was not frozen.
	frozen atomic.Bool
	// qos is the sandbox's activity and CPU weight (qos.go).
	qos activity
	// forkMu serialises ForkExec (one exec through the fork server at a
	// time); forkSrvMu guards forkSrv, the running fork server or nil.
	forkMu    sync.Mutex
	forkSrvMu sync.Mutex
	forkSrv   *forkServer

	destroyOnce sync.Once
	destroyErr  error
}

var _ rt.Sandbox = (*sandbox)(nil)

func (s *sandbox) ID() string { return s.id }

func (s *sandbox) Done() <-chan struct{} { return s.done }

// gone turns a failed call on a dead sandbox into ErrSandboxGone.
func (s *sandbox) gone(err error) error {
	if err == nil || errors.Is(err, rt.ErrSandboxGone) {
		return err
	}
	select {
	case <-s.done:
		return fmt.Errorf("%w: %v", rt.ErrSandboxGone, err)
	default:
		return err
	}
}

func (s *sandbox) Exec(ctx context.Context, req rt.ExecRequest, out rt.OutputFunc) (rt.ExecResult, error) {
	return s.exec(ctx, req, true, out)
}

// exec runs req; events says whether its result reports what the limits
// did to it (noteEvents).
func (s *sandbox) exec(ctx context.Context, req rt.ExecRequest, events bool, out rt.OutputFunc) (rt.ExecResult, error) {
	// The agent resolves duplicates (later K=V wins) and adds PATH and HOME
	// when missing.
	req.Env = append(append(make([]string, 0, len(s.spec.Env)+len(req.Env)), s.spec.Env...), req.Env...)
	if req.Cwd == "" {
		req.Cwd = s.spec.Workdir
	}
	if req.User == "" {
		req.User = s.spec.User
	}
	s.begin()
	defer s.end()
	var before userEvents
	var evErr error
	if events {
		before, evErr = s.cg.files().execStart(s.openUserFile)
	}
	ares, err := s.client.Exec(ctx, agentconv.ExecRequest(req), agentconv.Output(out))
	res := agentconv.ExecResult(ares)
	err = agentconv.Err(err)
	if events {
		after, afterErr := s.cg.files().execEnd(s.openUserFile, err == nil && evErr == nil)
		if err == nil && evErr == nil && afterErr == nil {
			noteEvents(&res, before, after)
		}
	}
	if err != nil {
		return res, s.gone(err)
	}
	s.noteDiskFull(&res)
	return res, nil
}

// noteEvents reports what the sandbox's limits did to the exec, from the
// user cgroup's counters read before it (before) and after it (after):
// OOMKilled if the kernel OOM-killed one of the sandbox's processes
// meanwhile, PidsExhausted if the pids limit refused a fork. Either is the
// workload's own trouble, reported as its command's result; the sandbox
// stays usable (its agent is not in the user cgroup). The kernel does not
// say which process a kill or a refusal hit, so execs running at the same
// time each see the other's; one after another, each sees its own. Two
// preads a side, whatever the exec did, and the two files opened and
// closed around them unless another exec in flight holds them open
// (userFiles.execStart).
func noteEvents(res *rt.ExecResult, before, after userEvents) {
	if after.oomKills > before.oomKills {
		res.OOMKilled = true
	}
	if after.pidsMax > before.pidsMax {
		res.PidsExhausted = true
	}
}

// Freeze stops the sandbox with the cgroup freezer, its agent included:
// the kernel keeps every process and its memory as they are.
func (s *sandbox) Freeze(ctx context.Context) error {
	select {
	case <-s.done:
		return fmt.Errorf("%w: freeze: init has exited", rt.ErrSandboxGone)
	default:
	}
	s.frozen.Store(true)
	if err := s.cg.freeze(); err != nil {
		return s.gone(fmt.Errorf("freeze: %w", err))
	}
	return nil
}

// Thaw resumes a frozen sandbox.
func (s *sandbox) Thaw(ctx context.Context) error {
	if err := s.cg.thaw(); err != nil {
		return s.gone(fmt.Errorf("thaw: %w", err))
	}
	s.frozen.Store(false)
	return nil
}

// UpperDir implements runtime.Differ. The overlay is mounted without
// redirect_dir, metacopy or index, so the upper directory is self-contained:
// whiteouts, opaque directories and full copies of changed files.
// After a Reset it is the new overlay's.
func (s *sandbox) UpperDir() string {
	s.fsMu.Lock()
	defer s.fsMu.Unlock()
	return s.upper
}

func (s *sandbox) WriteFile(ctx context.Context, path string, data []byte, mode uint32) error {
	s.begin()
	defer s.end()
	return s.gone(agentconv.Err(s.client.WriteFile(ctx, path, data, mode)))
}

func (s *sandbox) ReadFile(ctx context.Context, path string, maxBytes int64) ([]byte, error) {
	s.begin()
	defer s.end()
	b, err := s.client.ReadFile(ctx, path, maxBytes)
	return b, s.gone(agentconv.Err(err))
}

func (s *sandbox) PutArchive(ctx context.Context, dir string, tar io.Reader) error {
	s.begin()
	defer s.end()
	return s.gone(agentconv.Err(s.client.PutArchive(ctx, dir, tar)))
}

func (s *sandbox) GetArchive(ctx context.Context, dir string, w io.Writer) error {
	s.begin()
	defer s.end()
	return s.gone(agentconv.Err(s.client.GetArchive(ctx, dir, w)))
}

// Destroy kills PID 1, which makes the kernel kill every other process of
// the PID namespace; the mount namespace (and with it the overlay) goes with
// the last process. Then the cgroup, the layers and the directory go.
func (s *sandbox) Destroy(ctx context.Context) error {
	s.destroyOnce.Do(func() {
		// SIGKILL cannot be ignored: the wait is short and not cancellable,
		// so a cancelled caller never leaves a half-destroyed sandbox. A
		// frozen sandbox is thawed first: its processes could not die.
		s.cmd.Process.Signal(syscall.SIGKILL)
		s.cg.thaw()
		// The kernel kills the PID namespace's processes when its init
		// dies, and init's exit waits for them: no user code runs again,
		// so their teardown need not wait for the sandbox's quota.
		s.cg.unthrottle()
		<-s.done
		s.client.Close()
		s.conn.Close()
		s.dropForkServer()
		// A Reset in flight fails quickly now that init is gone; after it,
		// no new directory can appear, and the removals it started finish.
		s.resetMu.Lock()
		s.dropNext() // and no new one is prepared
		s.bg.Wait()
		s.closeResetFiles()
		s.resetMu.Unlock()
		var errs []error
		if err := s.cg.delete(); err != nil {
			errs = append(errs, fmt.Errorf("delete cgroup: %w", err))
		}
		for _, l := range s.spec.Layers {
			if err := s.b.opts.Layers.Release(l.Digest); err != nil {
				errs = append(errs, fmt.Errorf("release layer %s: %w", l.Digest, err))
			}
		}
		if err := s.b.removeSlotDir(s.dir); err != nil {
			errs = append(errs, fmt.Errorf("remove sandbox dir: %w", err))
		}
		s.b.mu.Lock()
		delete(s.b.live, s.id)
		s.b.mu.Unlock()
		s.destroyErr = errors.Join(errs...)
	})
	return s.destroyErr
}

// AcceptEgress relays the next connection to the sandbox's egress proxy
// listener (runtime.Egress). Not a request of the workload's: it waits
// without counting as activity.
func (s *sandbox) AcceptEgress(ctx context.Context, listen string) (rt.EgressConn, error) {
	c, err := s.client.AcceptEgress(ctx, listen)
	if err != nil {
		return nil, s.gone(agentconv.Err(err))
	}
	return c, nil
}
