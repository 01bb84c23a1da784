// Package fullvm is the fullvm backend: a whole virtual machine per
// sandbox, QEMU's q35 machine booting a disk image (raw or qcow2, from
// `dsec image import --disk`; scripts/vm-disk-image.sh builds a Debian one)
// through its own BIOS and boot loader, any guest OS.
//
// The base disk is never written: each sandbox gets a qcow2 overlay in
// its own directory over it, and destroying the sandbox deletes the
// overlay. The sandbox takes no EROFS layers (its Spec.Layers is exactly
// the disk). Exec, files and archives go through dsec-agent where the
// guest runs it: the agent is not part of the image but handed to the
// guest at boot as a small read-only virtio disk (serial "dsec-agent", an
// EROFS file holding the static binary) that a unit in the image mounts
// and runs on the virtio-serial port dsec.agent. For guests without the
// agent, and for computer-use in any guest, the sandbox has a screen,
// keyboard and mouse (runtime.Display: QMP screendump and
// input-send-event, a VGA adapter and a USB tablet).
//
// Booting a Debian guest under TCG takes tens of seconds, so creates
// start from boot templates: the first create of a (base disk, vCPUs,
// memory) boots cold and, once the guest has opened the agent's port,
// saves the running machine's state to a file (QMP migrate) beside a
// frozen copy of its overlay; later creates start QEMU with -incoming from
// that file over a fresh overlay of the frozen one, which takes about a
// second. What must differ between two sandboxes restored from one
// template is set at restore: the clock and the hostname (by the agent),
// and the kernel's random state (a vmgenid device whose new generation ID
// makes Linux reseed its CRNG at once).
//
// Freeze and Thaw pause and resume the vCPUs (QMP stop/cont). A snapshot
// of a sandbox is a new standalone disk image (SnapshotDisk: the guest's
// file systems synced, the VM paused, its overlay and base converted into
// one qcow2): the host reads only image files, never a guest's file system.
package fullvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// Options configures the backend.
type Options struct {
	// StateDir holds the sandboxes' directories (overlays, sockets,
	// console logs), the boot templates and the agent disk. Its path must
	// be short: QEMU's sockets live under it (108-byte limit).
	StateDir string
	// AgentPath is the static dsec-agent binary (CGO_ENABLED=0) handed to
	// every guest.
	AgentPath string
	// QEMU and QEMUImg are the binaries (default qemu-system-x86_64 and
	// qemu-img on PATH).
	QEMU    string
	QEMUImg string
	// BootTimeout bounds a cold boot to the agent's answer (default 5
	// minutes: TCG on a loaded host is slow).
	BootTimeout time.Duration
	// DefaultMemoryBytes is a sandbox's guest memory when its spec sets
	// none (default 512 MiB); MaxVCPUs and MaxMemoryBytes bound what a
	// spec may ask (default the host's CPUs and 16 GiB).
	DefaultMemoryBytes int64
	MaxVCPUs           int
	MaxMemoryBytes     int64
	// ColdBoot boots every sandbox from its disk instead of restoring a
	// boot template.
	ColdBoot bool
	// Accel is "kvm" or "tcg"; default qemu.Accel().
	Accel string
}

// Backend creates fullvm sandboxes.
type Backend struct {
	opts      Options
	agentDisk string
	sbDir     string
	tmplDir   string

	mu    sync.Mutex
	live  map[string]bool // sandbox IDs in use
	seq   int             // names sandbox directories
	tmpls map[string]*template
}

// Sandbox directories are named by a counter, not by the sandbox ID: an
// ID may be long, and QEMU's socket paths under the directory may not.
const (
	sandboxesDir = "sandboxes"
	templatesDir = "templates"
)

// New checks opts and prepares the state directory and the agent disk.
func New(opts Options) (*Backend, error) {
	if opts.StateDir == "" {
		return nil, fail.Invalid("fullvm: Options.StateDir is required")
	}
	if opts.AgentPath == "" {
		return nil, fail.Invalid("fullvm: Options.AgentPath is required")
	}
	if opts.QEMU == "" {
		opts.QEMU = qemu.Binary
	}
	if opts.QEMUImg == "" {
		opts.QEMUImg = "qemu-img"
	}
	if opts.BootTimeout <= 0 {
		opts.BootTimeout = 5 * time.Minute
	}
	if opts.DefaultMemoryBytes <= 0 {
		opts.DefaultMemoryBytes = 512 << 20
	}
	if opts.MaxVCPUs <= 0 {
		opts.MaxVCPUs = goruntime.NumCPU()
	}
	if opts.MaxMemoryBytes <= 0 {
		opts.MaxMemoryBytes = 16 << 30
	}
	if opts.Accel == "" {
		opts.Accel = qemu.Accel()
	}
	for _, bin := range []string{opts.QEMU, opts.QEMUImg} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fail.Errorf(fail.FailedPrecondition, "fullvm: %s not found (scripts/deps.sh installs QEMU): %w", bin, err)
		}
	}
	b := &Backend{
		opts:    opts,
		sbDir:   filepath.Join(opts.StateDir, sandboxesDir),
		tmplDir: filepath.Join(opts.StateDir, templatesDir),
		live:    map[string]bool{},
		tmpls:   map[string]*template{},
	}
	for _, d := range []string{b.sbDir, b.tmplDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("fullvm: %w", err)
		}
	}
	// Leftovers of a previous run: no QEMU of it survives (Pdeathsig), so
	// its sandboxes and templates are garbage.
	for _, d := range []string{b.sbDir, b.tmplDir} {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			os.RemoveAll(filepath.Join(d, e.Name()))
		}
	}
	disk, err := buildAgentDisk(opts.StateDir, opts.AgentPath)
	if err != nil {
		return nil, err
	}
	b.agentDisk = disk
	return b, nil
}

// buildAgentDisk makes the read-only disk that carries dsec-agent into
// every guest: an EROFS file holding the binary, named by the binary's
// hash so that a new agent gets a new disk while sandboxes of the old one
// keep theirs. The guest's unit mounts it by its serial.
func buildAgentDisk(stateDir, agentPath string) (string, error) {
	f, err := os.Open(agentPath)
	if err != nil {
		return "", fail.Errorf(fail.FailedPrecondition, "fullvm: agent binary: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("fullvm: agent binary: %w", err)
	}
	disk := filepath.Join(stateDir, "agent-"+hex.EncodeToString(h.Sum(nil))[:16]+".erofs")
	if _, err := os.Stat(disk); err == nil {
		return disk, nil
	}
	tree, err := os.MkdirTemp(stateDir, "agent-tree-")
	if err != nil {
		return "", fmt.Errorf("fullvm: agent disk: %w", err)
	}
	defer os.RemoveAll(tree)
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	dst, err := os.OpenFile(filepath.Join(tree, "dsec-agent"), os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		return "", fmt.Errorf("fullvm: agent disk: %w", err)
	}
	_, err = io.Copy(dst, f)
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", fmt.Errorf("fullvm: agent disk: %w", err)
	}
	tmp := disk + ".tmp"
	if out, err := exec.Command("mkfs.erofs", "--quiet", "--all-root", tmp, tree).CombinedOutput(); err != nil {
		os.Remove(tmp)
		return "", fail.Errorf(fail.FailedPrecondition, "fullvm: agent disk: mkfs.erofs (scripts/deps.sh installs erofs-utils): %v: %s", err, out)
	}
	if err := os.Rename(tmp, disk); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("fullvm: agent disk: %w", err)
	}
	return disk, nil
}

// Kind is runtime.KindFullVM.
func (b *Backend) Kind() runtime.Kind { return runtime.KindFullVM }

// invalid is a refused spec: InvalidArgument, and runtime.ErrInvalidSpec.
func invalid(format string, args ...any) error {
	return fail.New(fail.InvalidArgument, fmt.Errorf("%w: "+format, append([]any{runtime.ErrInvalidSpec}, args...)...))
}

// machine is what a sandbox's QEMU is made of, as far as a boot template
// must match it.
type machine struct {
	base   string // the base disk's path
	format string // its format
	vcpus  int
	memMiB int
}

func (m machine) key() string {
	h := sha256.Sum256([]byte(fmt.Sprintf("%s\x00%s\x00%d\x00%d", m.base, m.format, m.vcpus, m.memMiB)))
	return hex.EncodeToString(h[:8])
}

// validate checks spec and returns the machine it asks for.
func (b *Backend) validate(spec runtime.Spec) (machine, error) {
	if err := checkID(spec.ID); err != nil {
		return machine{}, err
	}
	if len(spec.Layers) != 1 {
		return machine{}, invalid("spec.layers: a fullvm sandbox boots exactly one disk image, got %d layers", len(spec.Layers))
	}
	r := spec.Resources
	switch {
	case r.MilliCPU < 0:
		return machine{}, invalid("resources.milli_cpu %d is negative", r.MilliCPU)
	case r.MemoryBytes < 0:
		return machine{}, invalid("resources.memory_bytes %d is negative", r.MemoryBytes)
	case r.Pids < 0:
		return machine{}, invalid("resources.pids %d is negative", r.Pids)
	case r.DiskBytes < 0:
		return machine{}, invalid("resources.disk_bytes %d is negative", r.DiskBytes)
	case r.MemoryBytes > b.opts.MaxMemoryBytes:
		return machine{}, invalid("resources.memory_bytes %d is more than this node's fullvm maximum %d", r.MemoryBytes, b.opts.MaxMemoryBytes)
	case r.MemoryBytes > 0 && r.MemoryBytes < 128<<20:
		return machine{}, invalid("resources.memory_bytes %d is less than the 128 MiB a fullvm guest needs to boot", r.MemoryBytes)
	}
	m := machine{base: spec.Layers[0].Path, vcpus: 1, memMiB: int(b.opts.DefaultMemoryBytes >> 20)}
	if r.MilliCPU > 0 {
		m.vcpus = int((r.MilliCPU + 999) / 1000)
	}
	if m.vcpus > b.opts.MaxVCPUs {
		return machine{}, invalid("resources.milli_cpu %d asks for %d vCPUs, more than this node's %d", r.MilliCPU, m.vcpus, b.opts.MaxVCPUs)
	}
	if r.MemoryBytes > 0 {
		m.memMiB = int(r.MemoryBytes >> 20)
	}
	hostname := spec.Hostname
	if hostname == "" {
		hostname = runtime.HostnameFor(spec.ID)
	}
	if err := checkHostname(hostname); err != nil {
		return machine{}, err
	}
	return m, nil
}

// checkID refuses IDs that could not name a sandbox anywhere (the edge
// makes IDs; this guards the backend's own use of them).
func checkID(id string) error {
	if id == "" {
		return invalid("spec.id is empty")
	}
	if len(id) > 128 {
		return invalid("spec.id is %d bytes long, more than 128", len(id))
	}
	if id == "." || id == ".." {
		return invalid("spec.id %q is not a name", id)
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return invalid("spec.id %q: character %q is not a letter, digit, '-', '_' or '.'", id, c)
		}
	}
	return nil
}

// checkHostname accepts what sethostname(2) and a shell argument take
// safely: a DNS label-like name.
func checkHostname(h string) error {
	if len(h) > 64 {
		return invalid("spec.hostname is %d bytes long, more than 64", len(h))
	}
	for _, c := range h {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return invalid("spec.hostname %q: character %q is not a letter, digit, '-', '_' or '.'", h, c)
		}
	}
	return nil
}

// Create boots (or restores) a sandbox. On error no QEMU process, overlay
// or directory is left behind.
func (b *Backend) Create(ctx context.Context, spec runtime.Spec) (_ runtime.Sandbox, err error) {
	m, err := b.validate(spec)
	if err != nil {
		return nil, err
	}
	format, err := image.DetectDisk(m.base)
	if err != nil {
		if errors.Is(err, image.ErrBadDisk) {
			return nil, invalid("spec.layers[0]: %v", err)
		}
		return nil, fail.Errorf(fail.NotFound, "fullvm: disk image of sandbox %q: %w", spec.ID, err)
	}
	m.format = format

	b.mu.Lock()
	if b.live[spec.ID] {
		b.mu.Unlock()
		return nil, fail.Errorf(fail.AlreadyExists, "fullvm: sandbox %q exists", spec.ID)
	}
	b.live[spec.ID] = true
	b.seq++
	dir := filepath.Join(b.sbDir, strconv.Itoa(b.seq))
	b.mu.Unlock()
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
			b.release(spec.ID)
		}
	}()
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("fullvm: sandbox %q: %w", spec.ID, err)
	}
	if b.opts.ColdBoot {
		return b.boot(ctx, spec, m, dir, nil)
	}
	return b.fromTemplate(ctx, spec, m, dir)
}

func (b *Backend) release(id string) {
	b.mu.Lock()
	delete(b.live, id)
	b.mu.Unlock()
}

// overlay creates the sandbox's writable disk over backing.
func (b *Backend) overlay(ctx context.Context, path, backing, format string) error {
	out, err := exec.CommandContext(ctx, b.opts.QEMUImg, "create", "-q", "-f", "qcow2", "-F", format, "-b", backing, path).CombinedOutput()
	if err != nil {
		return fail.Errorf(fail.Internal, "fullvm: qemu-img create overlay: %v: %s", err, out)
	}
	return nil
}

// config is the QEMU configuration of a sandbox in dir over its overlay.
func (b *Backend) config(m machine, dir string) qemu.Config {
	return qemu.Config{
		Binary:    b.opts.QEMU,
		Dir:       dir,
		Machine:   "q35",
		Accel:     b.opts.Accel,
		MemoryMiB: m.memMiB,
		SMP:       m.vcpus,
		Drives: []qemu.Drive{
			{File: filepath.Join(dir, "disk.qcow2"), Format: "qcow2"},
			{File: b.agentDisk, Format: "raw", ReadOnly: true, Serial: "dsec-agent"},
		},
		Devices: []string{
			// The screen (a VGA adapter scanned out by QMP screendump)
			// and an absolute pointer, so a click lands where it is sent.
			"VGA",
			"qemu-xhci,id=xhci", "usb-tablet,bus=xhci.0",
			// A new generation ID per QEMU: a guest restored from a
			// template reseeds its CRNG instead of repeating its
			// siblings' random numbers.
			"vmgenid,guid=auto",
			"virtio-rng-pci",
		},
		Console: filepath.Join(dir, "console.log"),
		// The guest has no network (loopback only), as every sandbox.
		Args: []string{"-nic", "none"},
	}
}

// BootTimeout is how long a cold boot may take to reach the agent.
func (b *Backend) BootTimeout() time.Duration { return b.opts.BootTimeout }
