// Package microvm is the microVM backend: each sandbox is a QEMU guest
// (-M microvm; KVM where the host has it, TCG otherwise) booted directly
// from a Debian cloud kernel and an initramfs whose /init is dsec-agent
// (see vmimage and guestinit). The sandbox's EROFS layers are handed to
// the guest read-only as virtio-blk disks (or, on -M q35, as virtio-pmem
// with DAX, so that guests share the host's page cache), composed by
// overlayfs inside the guest over a sparse per-sandbox ext4 disk whose size
// is the sandbox's disk limit. The agent protocol runs over a
// virtio-serial port; its first request, Init, carries the layout and the
// limits, exactly as for a container's agent. Memory is the guest's RAM
// (plus a cgroup inside the guest, so that a workload's OOM kill or fork
// bomb never reaches the agent), CPUs are vCPUs, and a balloon with
// free-page reporting hands what an idle guest frees back to the host.
//
// The host never mounts the guest's writable disk: a snapshot is a tar
// stream the guest agent writes (DiffArchiver).
package microvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/audit/seccomp"
	"github.com/dsec-dev/dsec/internal/fail"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/agentconv"
	"github.com/dsec-dev/dsec/internal/runtime/microvm/guestinit"
	"github.com/dsec-dev/dsec/internal/runtime/microvm/vmimage"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// Defaults of Options.
const (
	DefaultMemoryBytes = 256 << 20
	DefaultPids        = 1024
	DefaultDiskBytes   = 1 << 30
	DefaultBootTimeout = 90 * time.Second
	// DefaultTBSizeMiB keeps TCG's translation cache small: QEMU's default
	// reserves far more, and it shows in host memory per idle guest.
	DefaultTBSizeMiB = 32
	// guestOverheadBytes is added to the sandbox's memory limit to size
	// the guest's RAM: the kernel, the agent and the page cache of the
	// layers live there, outside the workload's cgroup.
	guestOverheadBytes = 64 << 20
)

// Options configures the backend.
type Options struct {
	// StateDir holds one directory per sandbox (sockets, the writable
	// disk). Keep its path short: Unix socket paths have 108 bytes.
	StateDir string
	// CacheDir, KernelPackage and AgentPath say where and from what the
	// guest image is built (vmimage.Options).
	CacheDir, KernelPackage, AgentPath string
	// QEMU is the emulator binary (default qemu.Binary); Accel "kvm" or
	// "tcg" (default qemu.Accel()).
	QEMU, Accel string
	// Machine is "microvm" (default) or "q35"; DAX (q35 only) hands the
	// layers over as virtio-pmem with DAX, so that guests map the host's
	// page cache instead of copying layer data into their own RAM (QEMU
	// 7.2's microvm has no device-memory region for virtio-pmem).
	Machine string
	DAX     bool
	// Defaults for Resources left at zero.
	DefaultPids, DefaultMemoryBytes, DefaultDiskBytes int64
	// BootTimeout bounds a guest's boot to agent ready.
	BootTimeout time.Duration
	// TBSizeMiB is TCG's translation cache size.
	TBSizeMiB int
	// Console keeps each guest's serial console in its state directory
	// (console.log; kernel messages and the agent's last words).
	Console bool
	Logger  *slog.Logger
}

// Backend creates microVM sandboxes.
type Backend struct {
	opts  Options
	img   *vmimage.Image
	accel string
	khz   int
	mkfs  string
	// caps and seccomp are the container backend's lockdown, which the
	// guest applies to the workload (not to its agent).
	caps    uint64
	seccomp []byte
}

// New prepares the guest image (fetching the kernel on first use) and
// returns the backend.
func New(ctx context.Context, o Options) (*Backend, error) {
	if o.StateDir == "" || o.AgentPath == "" {
		return nil, fail.Invalid("microvm: Options.StateDir and Options.AgentPath are required")
	}
	if o.Machine == "" {
		o.Machine = "microvm"
	}
	if o.Machine != "microvm" && o.Machine != "q35" {
		return nil, fail.Invalid("microvm: Options.Machine %q: want microvm or q35", o.Machine)
	}
	if o.DAX && o.Machine != "q35" {
		return nil, fail.Invalid("microvm: Options.DAX: virtio-pmem needs Machine q35 (QEMU's microvm has no device-memory region)")
	}
	if o.DefaultPids <= 0 {
		o.DefaultPids = DefaultPids
	}
	if o.DefaultMemoryBytes <= 0 {
		o.DefaultMemoryBytes = DefaultMemoryBytes
	}
	if o.DefaultDiskBytes <= 0 {
		o.DefaultDiskBytes = DefaultDiskBytes
	}
	if o.BootTimeout <= 0 {
		o.BootTimeout = DefaultBootTimeout
	}
	if o.TBSizeMiB <= 0 {
		o.TBSizeMiB = DefaultTBSizeMiB
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	b := &Backend{opts: o, accel: o.Accel}
	if b.accel == "" {
		b.accel = qemu.Accel()
	}
	if o.QEMU == "" {
		o.QEMU = qemu.Binary
		b.opts.QEMU = o.QEMU
	}
	if _, err := exec.LookPath(o.QEMU); err != nil {
		return nil, fail.Errorf(fail.Unavailable, "microvm: %s: %w (scripts/deps.sh installs qemu-system-x86)", o.QEMU, err)
	}
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return nil, fail.Errorf(fail.Unavailable, "microvm: mkfs.ext4: %w", err)
	}
	b.mkfs = mkfs
	if err := os.MkdirAll(o.StateDir, 0o700); err != nil {
		return nil, fail.Errorf(fail.Internal, "microvm: %w", err)
	}
	img, err := vmimage.Ensure(ctx, vmimage.Options{CacheDir: o.CacheDir, KernelPackage: o.KernelPackage, AgentPath: o.AgentPath})
	if err != nil {
		return nil, err
	}
	b.img = img
	b.khz = hostKHz()
	// The container's policy, with clone3 allowed: the guest's spawner
	// thread forks every workload process with clone3 (CLONE_INTO_CGROUP)
	// under the filter it installs on itself. seccomp cannot read clone3's
	// flags, which is why Docker refuses it; what a workload could do with
	// them (namespaces of its own) happens in its own guest kernel, behind
	// the VM boundary.
	pol, err := seccomp.DefaultPolicy()
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "microvm: seccomp policy: %w", err)
	}
	pol.Rules = append([]seccomp.Rule{{Syscall: "clone3", Action: seccomp.Allow}}, pol.Rules...)
	prog, err := seccomp.Compile(pol)
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "microvm: compile seccomp profile: %w", err)
	}
	if b.seccomp, err = prog.MarshalBinary(); err != nil {
		return nil, fail.Errorf(fail.Internal, "microvm: %w", err)
	}
	b.caps = uint64(caps.DockerDefault())
	return b, nil
}

// Kind is rt.KindMicroVM.
func (b *Backend) Kind() rt.Kind { return rt.KindMicroVM }

// StateDir is where the sandboxes' directories are.
func (b *Backend) StateDir() string { return b.opts.StateDir }

// Image is the guest image the backend boots.
func (b *Backend) Image() vmimage.Image { return *b.img }

// hostKHz is the host's TSC frequency as /proc/cpuinfo states it: a
// microvm guest under TCG hangs calibrating its timers without
// tsc_early_khz (DESIGN §4).
func hostKHz() int {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "cpu MHz" {
			mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int(mhz * 1000)
			}
		}
	}
	return 0
}

func invalid(format string, args ...any) error {
	return fail.New(fail.InvalidArgument, fmt.Errorf("%w: "+format, append([]any{rt.ErrInvalidSpec}, args...)...))
}

// validate checks spec on the host, naming the field at fault.
func validate(spec *rt.Spec) error {
	switch {
	case spec.ID == "" || spec.ID == "." || spec.ID == ".." || strings.ContainsAny(spec.ID, "/\x00"):
		return invalid("spec.id %q: must be a non-empty file name", spec.ID)
	case len(spec.ID) > 64:
		return invalid("spec.id: longer than 64 bytes")
	case len(spec.Layers) == 0:
		return invalid("spec.layers: none")
	case spec.Resources.MemoryBytes < 0:
		return invalid("spec.resources.memory_bytes: negative")
	case spec.Resources.MilliCPU < 0:
		return invalid("spec.resources.milli_cpu: negative")
	case spec.Resources.Pids < 0:
		return invalid("spec.resources.pids: negative")
	case spec.Resources.DiskBytes < 0:
		return invalid("spec.resources.disk_bytes: negative")
	}
	return nil
}

// Create boots a guest for spec and sets the sandbox up in it.
func (b *Backend) Create(ctx context.Context, spec rt.Spec) (_ rt.Sandbox, err error) {
	if err := validate(&spec); err != nil {
		return nil, err
	}
	for i, l := range spec.Layers {
		fi, err := os.Stat(l.Path)
		if err != nil {
			return nil, fail.Errorf(fail.NotFound, "microvm: spec.layers[%d]: %w", i, err)
		}
		if !fi.Mode().IsRegular() {
			return nil, invalid("spec.layers[%d]: %s is not an EROFS file", i, l.Path)
		}
	}
	r := spec.Resources
	if r.MemoryBytes == 0 {
		r.MemoryBytes = b.opts.DefaultMemoryBytes
	}
	if r.Pids == 0 {
		r.Pids = b.opts.DefaultPids
	}
	if r.DiskBytes == 0 {
		r.DiskBytes = b.opts.DefaultDiskBytes
	}
	if r.DiskBytes < 8<<20 {
		return nil, invalid("spec.resources.disk_bytes: %d is below the 8 MiB a guest's writable disk needs", r.DiskBytes)
	}
	hostname := spec.Hostname
	if hostname == "" {
		hostname = rt.HostnameFor(spec.ID)
	}

	dir := filepath.Join(b.opts.StateDir, spec.ID)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil, fail.Errorf(fail.AlreadyExists, "microvm: sandbox %s exists", spec.ID)
		}
		return nil, fail.Errorf(fail.Internal, "microvm: %w", err)
	}
	var vm *qemu.VM
	defer func() {
		if err != nil {
			if vm != nil {
				vm.Kill()
			}
			os.RemoveAll(dir)
		}
	}()
	disk := filepath.Join(dir, "rw.img")
	if err := b.makeDisk(ctx, disk, r.DiskBytes); err != nil {
		return nil, err
	}

	var pmem map[int]string
	if b.opts.DAX {
		if pmem, err = b.pmemFiles(spec.Layers); err != nil {
			return nil, err
		}
	}
	cfg := b.config(dir, spec, r, disk, pmem)
	vm, err = qemu.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	in := &agent.Init{
		Hostname:  hostname,
		Env:       spec.Env,
		Workdir:   spec.Workdir,
		User:      spec.User,
		Resources: &agent.Resources{MilliCPU: r.MilliCPU, MemoryBytes: r.MemoryBytes, Pids: r.Pids, DiskBytes: r.DiskBytes},
		// Only the lockdown of the container's part applies in a guest:
		// the workload gets a container's capabilities and seccomp filter,
		// so it can neither reach the agent nor read what a container
		// could not.
		Container: &agent.ContainerInit{Caps: b.caps, Seccomp: b.seccomp},
		Writable: &agent.Writable{
			Source: &agent.Source{Block: &agent.BlockDevice{Serial: "rw"}, FSType: "ext4"},
			Upper:  "upper", Work: "work",
		},
	}
	// Top first (overlay order).
	for i := len(spec.Layers) - 1; i >= 0; i-- {
		src := agent.Source{FSType: "erofs"}
		if b.opts.DAX {
			src.Pmem = &agent.PmemDevice{Index: uint32(i), DAX: true}
		} else {
			src.Block = &agent.BlockDevice{Serial: "l" + strconv.Itoa(i)}
		}
		in.Layers = append(in.Layers, src)
	}
	bootCtx, cancel := context.WithTimeout(ctx, b.opts.BootTimeout)
	defer cancel()
	if _, err := vm.Agent().Init(bootCtx, in); err != nil {
		return nil, b.bootErr(ctx, bootCtx, vm, dir, err)
	}
	s := &sandbox{b: b, id: spec.ID, dir: dir, vm: vm, client: vm.Agent(), done: make(chan struct{})}
	go func() {
		<-vm.Done()
		close(s.done)
	}()
	return s, nil
}

// bootErr explains a failed boot: the guest's own refusal (a layer that
// is no EROFS file), a timeout, or QEMU's death.
func (b *Backend) bootErr(ctx, bootCtx context.Context, vm *qemu.VM, dir string, err error) error {
	var ae *agent.Error
	console := ""
	if b.opts.Console {
		if c, rerr := os.ReadFile(filepath.Join(dir, "console.log")); rerr == nil {
			if len(c) > 2048 {
				c = c[len(c)-2048:]
			}
			console = "; console: " + strings.TrimSpace(string(c))
		}
	}
	switch {
	case errors.As(err, &ae) && ae.Code == agent.CodeInvalidArgument:
		return fail.New(fail.InvalidArgument, fmt.Errorf("%w: microvm: guest refused the sandbox: %v", rt.ErrInvalidSpec, err))
	case errors.As(err, &ae):
		return fail.Errorf(fail.FailedPrecondition, "microvm: guest could not set the sandbox up: %w%s", err, console)
	case ctx.Err() != nil:
		return fail.Errorf(fail.Canceled, "microvm: boot: %w", ctx.Err())
	case bootCtx.Err() != nil:
		return fail.RetryAfter(fail.ResourceExhausted, fmt.Errorf("%w: microvm: the guest did not boot within %v%s", rt.ErrBusy, b.opts.BootTimeout, console), 0)
	}
	return fail.Errorf(fail.Internal, "microvm: boot: %w (qemu: %s)%s", err, vm.Stderr(), console)
}

// config is QEMU's configuration for one sandbox.
func (b *Backend) config(dir string, spec rt.Spec, r rt.Resources, disk string, pmem map[int]string) qemu.Config {
	memMiB := int((r.MemoryBytes + guestOverheadBytes + (1<<20 - 1)) >> 20)
	smp := 1
	if r.MilliCPU > 1000 {
		smp = int((r.MilliCPU + 999) / 1000)
	}
	machine := "microvm,rtc=on"
	transport := "mmio"
	if b.opts.Machine == "q35" {
		machine, transport = "q35", "pci"
	}
	cmdline := []string{
		"quiet", "loglevel=3", "panic=-1", guestinit.Marker + "=" + transport,
		// The guest's devices are known: no legacy probing.
		"i8042.noaux", "i8042.nomux", "i8042.dumbkbd", "i8042.nopnp", "noresume",
		// The guest is one sandbox: side-channel mitigations inside it
		// protect the sandbox from itself, at a cost TCG makes large.
		"mitigations=off", "random.trust_cpu=on",
		// Boot-time work the guest does not need, measured under TCG at
		// about a second of its boot: the guest's own LSMs, audit, IMA/EVM
		// and crypto self-tests (the workload's lockdown is its
		// capabilities and seccomp filter, and the VM boundary). TSC is
		// reliable enough for a guest: else the clocksource watchdog moves
		// it to jiffies, whose 4 ms ticks every sleep in the guest pays.
		"apparmor=0", "audit=0", "ima_appraise=off", "evm=off", "cryptomgr.notests", "tsc=reliable",
	}
	if b.khz > 0 {
		cmdline = append(cmdline, "tsc_early_khz="+strconv.Itoa(b.khz))
	}
	cfg := qemu.Config{
		Binary:    b.opts.QEMU,
		Dir:       dir,
		Machine:   machine,
		Accel:     b.accel,
		TBSizeMiB: b.opts.TBSizeMiB,
		MemoryMiB: memMiB,
		SMP:       smp,
		Kernel:    b.img.Kernel,
		Initrd:    b.img.Initrd,
	}
	if b.opts.Console {
		cfg.Console = filepath.Join(dir, "console.log")
		cmdline = append(cmdline, "console=ttyS0")
	}
	cfg.Append = strings.Join(cmdline, " ")
	if b.opts.DAX {
		// Each layer is a virtio-pmem device backed by the EROFS file,
		// mapped shared and read-only: every guest maps the same host page
		// cache pages.
		var slots int64
		for i, l := range spec.Layers {
			path, size := l.Path, int64(0)
			if p, ok := pmem[i]; ok {
				path = p
			}
			if fi, err := os.Stat(path); err == nil {
				size = fi.Size()
			}
			slots += size
			id := "pm" + strconv.Itoa(i)
			cfg.Args = append(cfg.Args, "-object",
				fmt.Sprintf("memory-backend-file,id=%s,share=on,readonly=on,mem-path=%s,size=%d", id, path, size))
			cfg.Devices = append(cfg.Devices, fmt.Sprintf("virtio-pmem-pci,memdev=%s,id=pmem%d", id, i))
		}
		cfg.Slots = len(spec.Layers) + 1
		cfg.MaxMemMiB = memMiB + int(slots>>20) + 2*len(spec.Layers)
	} else {
		for i, l := range spec.Layers {
			cfg.Drives = append(cfg.Drives, qemu.Drive{File: l.Path, ReadOnly: true, Serial: "l" + strconv.Itoa(i)})
		}
	}
	cfg.Drives = append(cfg.Drives, qemu.Drive{File: disk, Serial: "rw"})
	cfg.Devices = append(cfg.Devices, cfg.Virtio("balloon")+",free-page-reporting=on")
	return cfg
}

// pmemAlign is the size a virtio-pmem region must be a multiple of for
// the guest's nvdimm driver to take it.
const pmemAlign = 2 << 20

// pmemFiles returns, for each layer whose file is not a multiple of
// pmemAlign, a copy padded with zeros to one (EROFS ignores what follows
// its last block), kept by digest under the cache directory for every
// later sandbox: the layer file itself is read-only and shared.
func (b *Backend) pmemFiles(layers []rt.Layer) (map[int]string, error) {
	out := map[int]string{}
	dir := filepath.Join(filepath.Dir(b.img.Initrd), "pmem")
	for i, l := range layers {
		fi, err := os.Stat(l.Path)
		if err != nil {
			return nil, fail.Errorf(fail.NotFound, "microvm: spec.layers[%d]: %w", i, err)
		}
		if fi.Size()%pmemAlign == 0 {
			continue
		}
		name := strings.TrimPrefix(l.Digest, "sha256:")
		if name == "" || strings.ContainsAny(name, "/.") {
			return nil, invalid("spec.layers[%d].digest %q: not a sha256 digest", i, l.Digest)
		}
		p := filepath.Join(dir, name+".pmem")
		if _, err := os.Stat(p); err == nil {
			out[i] = p
			continue
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fail.Errorf(fail.Internal, "microvm: %w", err)
		}
		if err := padCopy(l.Path, p, (fi.Size()+pmemAlign-1)/pmemAlign*pmemAlign); err != nil {
			return nil, fail.Errorf(fail.Internal, "microvm: pmem copy of layer %d: %w", i, err)
		}
		out[i] = p
	}
	return out, nil
}

// padCopy copies src to dst (through a temporary name) and extends it to
// size.
func padCopy(src, dst string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".pmem-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Truncate(size); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o444); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// makeDisk makes the sandbox's writable disk: a sparse file of size bytes
// with an empty ext4 file system, made by mkfs.ext4 on the file itself
// (the host never mounts it). No journal (the disk dies with the
// sandbox, and a journal costs space the limit is counted in) and no
// blocks reserved for root (every writer in the guest is root).
func (b *Backend) makeDisk(ctx context.Context, path string, size int64) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fail.Errorf(fail.Internal, "microvm: writable disk: %w", err)
	}
	err = f.Truncate(size)
	f.Close()
	if err != nil {
		return fail.Errorf(fail.Internal, "microvm: writable disk: %w", err)
	}
	cmd := exec.CommandContext(ctx, b.mkfs, "-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode",
		"-E", "lazy_itable_init=1,nodiscard", path)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fail.Errorf(fail.Internal, "microvm: mkfs.ext4: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

var _ rt.DiffArchiver = (*sandbox)(nil)

// sandbox is one microVM.
type sandbox struct {
	b      *Backend
	id     string
	dir    string
	vm     *qemu.VM
	client *agent.Client
	done   chan struct{}

	mu        sync.Mutex
	destroyed bool
	frozen    bool
}

func (s *sandbox) ID() string { return s.id }

func (s *sandbox) Done() <-chan struct{} { return s.done }

func (s *sandbox) Exec(ctx context.Context, req rt.ExecRequest, out rt.OutputFunc) (rt.ExecResult, error) {
	res, err := s.client.Exec(ctx, agentconv.ExecRequest(req), agentconv.Output(out))
	return agentconv.ExecResult(res), agentconv.Err(err)
}

func (s *sandbox) WriteFile(ctx context.Context, path string, data []byte, mode uint32) error {
	return agentconv.Err(s.client.WriteFile(ctx, path, data, mode))
}

func (s *sandbox) ReadFile(ctx context.Context, path string, maxBytes int64) ([]byte, error) {
	b, err := s.client.ReadFile(ctx, path, maxBytes)
	return b, agentconv.Err(err)
}

func (s *sandbox) PutArchive(ctx context.Context, dir string, r io.Reader) error {
	return agentconv.Err(s.client.PutArchive(ctx, dir, r))
}

func (s *sandbox) GetArchive(ctx context.Context, dir string, w io.Writer) error {
	return agentconv.Err(s.client.GetArchive(ctx, dir, w))
}

// Freeze pauses the guest's vCPUs (QMP stop): every process in it stops,
// and the agent with them, so other calls wait until Thaw.
func (s *sandbox) Freeze(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("microvm %s: %w", s.id, rt.ErrSandboxGone))
	}
	if s.frozen {
		return nil
	}
	if err := s.vm.Stop(ctx); err != nil {
		return s.gone(err)
	}
	s.frozen = true
	return nil
}

// Thaw resumes the guest (QMP cont).
func (s *sandbox) Thaw(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("microvm %s: %w", s.id, rt.ErrSandboxGone))
	}
	if !s.frozen {
		return nil
	}
	if err := s.vm.Cont(ctx); err != nil {
		return s.gone(err)
	}
	s.frozen = false
	return nil
}

// gone marks err as the sandbox's loss when QEMU has exited.
func (s *sandbox) gone(err error) error {
	select {
	case <-s.vm.Done():
		return fail.New(fail.FailedPrecondition, fmt.Errorf("microvm %s: %w: %v", s.id, rt.ErrSandboxGone, err))
	default:
		return err
	}
}

// WriteDiff writes what the sandbox changed over its layers as a tar
// stream with OCI whiteouts (runtime.DiffArchiver): the guest agent walks
// its overlay's upper directory with the workload's cgroup frozen. A
// frozen (paused) guest is resumed for the walk — its workload stays
// frozen by the cgroup — and paused again after.
func (s *sandbox) WriteDiff(ctx context.Context, w io.Writer) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("microvm %s: %w", s.id, rt.ErrSandboxGone))
	}
	if s.frozen {
		if err := s.vm.Cont(ctx); err != nil {
			return s.gone(err)
		}
		defer func() {
			if err := s.vm.Stop(context.WithoutCancel(ctx)); err != nil {
				s.b.opts.Logger.Warn("microvm: pause after diff", "sandbox", s.id, "err", err)
			}
		}()
	}
	return agentconv.Err(s.client.Diff(ctx, w))
}

// Destroy kills QEMU and removes the sandbox's directory (its writable
// disk and sockets). It is idempotent.
func (s *sandbox) Destroy(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil
	}
	s.destroyed = true
	s.vm.Kill()
	if err := os.RemoveAll(s.dir); err != nil {
		return fail.Errorf(fail.Internal, "microvm %s: remove state: %w", s.id, err)
	}
	return nil
}
