// Package qemu runs one QEMU virtual machine for the VM backends (microvm,
// fullvm): it builds qemu-system-x86_64's command line from a Config,
// starts QEMU in its own process group, and gives the caller the two
// channels a sandbox needs — QMP (pause, resume, quit, and whatever else
// the backend sends) and the agent channel, a virtio-serial port named
// "dsec.agent" that the guest's dsec-agent serves the agent protocol on.
//
// Both channels are Unix sockets in the VM's state directory. The agent
// channel's socket is this package's: it listens before QEMU starts and
// QEMU connects to it as a client while it sets up its character devices,
// after the QMP socket (QEMU's, a server) exists — so nothing polls for a
// socket QEMU has not made yet, and a QEMU that dies early is noticed at
// once (its exit closes the listener). Bytes the host
// writes to the agent channel before the guest opens the port wait in
// QEMU, so the caller may send its first request (the agent's Init) right
// away and simply wait for the answer: that wait is the boot.
//
// Every failure path kills QEMU's whole process group and reaps it; QEMU's
// stderr is kept (bounded) for error messages.
package qemu

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/digitalocean/go-qemu/qmp"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/fail"
)

// Binary is the QEMU system emulator the package runs by default.
const Binary = "qemu-system-x86_64"

// AgentPort is the name of the virtio-serial port the guest agent serves
// on (/sys/class/virtio-ports/*/name in the guest).
const AgentPort = "dsec.agent"

// stderrLimit bounds how much of QEMU's stderr is kept for errors.
const stderrLimit = 16 << 10

// Available reports whether the QEMU binary is on PATH.
func Available() bool {
	_, err := exec.LookPath(Binary)
	return err == nil
}

// Accel is the accelerator to use on this host: "kvm" when /dev/kvm exists
// and a hardware KVM module (kvm_intel or kvm_amd) is loaded, "tcg"
// otherwise. A /dev/kvm served by another module (kvm_pvm, found on some
// cloud VMs) hangs Debian's kernel, so its presence alone is not enough.
func Accel() string {
	if _, err := os.Stat("/dev/kvm"); err != nil {
		return "tcg"
	}
	for _, m := range []string{"kvm_intel", "kvm_amd"} {
		if _, err := os.Stat(filepath.Join("/sys/module", m)); err == nil {
			return "kvm"
		}
	}
	return "tcg"
}

// Drive is a disk handed to the guest.
type Drive struct {
	// File is the image on the host.
	File string
	// Format is "raw" (default) or "qcow2".
	Format string
	// ReadOnly hands the disk to the guest read-only.
	ReadOnly bool
	// Serial names the disk to the guest (/sys/block/vdX/serial); at most
	// 20 bytes.
	Serial string
	// Interface is the device model; default virtio-blk for the machine's
	// transport ("virtio-blk-device" on microvm, "virtio-blk-pci" else).
	Device string
}

// Config says how to run one VM.
type Config struct {
	// Binary defaults to Binary.
	Binary string
	// Dir is the VM's state directory (sockets, console log); it must
	// exist, and its path must be short (Unix socket paths are limited to
	// 108 bytes).
	Dir string
	// Machine is the -M value, e.g. "microvm,rtc=on" or "q35".
	Machine string
	// Accel is "kvm" or "tcg" (default Accel()). TBSizeMiB sets TCG's
	// translation cache size (tb-size); zero leaves QEMU's default, which
	// is large (up to 1 GiB reserved) and shows in host memory per guest.
	Accel     string
	TBSizeMiB int
	// CPU is the -cpu value (default "max" under TCG, "host" under KVM).
	CPU string
	// MemoryMiB and SMP size the guest.
	MemoryMiB int
	SMP       int
	// Slots and MaxMemMiB make room for device memory beside the RAM
	// (virtio-pmem): -m MemoryMiB,slots=Slots,maxmem=MaxMemMiB.
	Slots     int
	MaxMemMiB int
	// Kernel, Initrd and Append boot the guest directly (Kernel empty:
	// boot from Drives).
	Kernel, Initrd, Append string
	// Drives are the guest's disks, in order.
	Drives []Drive
	// Devices are extra -device values; Args are extra arguments, appended
	// last.
	Devices []string
	Args    []string
	// Console, if set, is a file that receives the guest's serial console.
	Console string
	// Env is QEMU's environment (default: the caller's).
	Env []string
	// ConnectTimeout bounds how long QEMU may take to connect its channels
	// (default 30 s; a loaded host under TCG can be slow to start QEMU).
	ConnectTimeout time.Duration
}

// Microvm reports whether cfg's machine is QEMU's microvm, whose virtio
// devices are virtio-mmio ("-device" models) rather than PCI.
func (cfg *Config) Microvm() bool {
	return strings.HasPrefix(cfg.Machine, "microvm")
}

// Virtio returns the device model of the virtio device kind ("blk",
// "serial", "balloon", "rng") for cfg's machine.
func (cfg *Config) Virtio(kind string) string {
	if cfg.Microvm() {
		return "virtio-" + kind + "-device"
	}
	return "virtio-" + kind + "-pci"
}

// Args returns QEMU's command line (without the binary) for cfg, with the
// QMP and agent channels at the given socket paths.
func (cfg *Config) args(qmpSock, agentSock string) []string {
	accel := cfg.Accel
	if accel == "" {
		accel = Accel()
	}
	cpu := cfg.CPU
	if cpu == "" {
		cpu = "max"
		if accel == "kvm" {
			cpu = "host"
		}
	}
	accelArg := accel
	if accel == "tcg" && cfg.TBSizeMiB > 0 {
		accelArg += ",tb-size=" + strconv.Itoa(cfg.TBSizeMiB)
	}
	mem, smp := cfg.MemoryMiB, cfg.SMP
	if mem <= 0 {
		mem = 256
	}
	if smp <= 0 {
		smp = 1
	}
	a := []string{
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-M", cfg.Machine, "-accel", accelArg, "-cpu", cpu,
		"-m", memArg(mem, cfg.Slots, cfg.MaxMemMiB), "-smp", strconv.Itoa(smp),
		// The QMP chardev comes first: by the time QEMU connects the agent
		// channel (next), the monitor's socket is connected too.
		"-chardev", "socket,id=qmp,server=on,wait=off,path=" + qmpSock,
		"-mon", "chardev=qmp,mode=control",
		"-chardev", "socket,id=agent,path=" + agentSock,
		"-device", cfg.Virtio("serial") + ",id=vser,max_ports=2",
		"-device", "virtserialport,bus=vser.0,chardev=agent,name=" + AgentPort,
	}
	if cfg.Console != "" {
		a = append(a, "-serial", "file:"+cfg.Console)
	} else {
		a = append(a, "-serial", "none")
	}
	if cfg.Kernel != "" {
		a = append(a, "-kernel", cfg.Kernel)
		if cfg.Initrd != "" {
			a = append(a, "-initrd", cfg.Initrd)
		}
		if cfg.Append != "" {
			a = append(a, "-append", cfg.Append)
		}
	}
	for i, d := range cfg.Drives {
		f := d.Format
		if f == "" {
			f = "raw"
		}
		id := "d" + strconv.Itoa(i)
		drive := "file=" + d.File + ",if=none,id=" + id + ",format=" + f
		if d.ReadOnly {
			drive += ",readonly=on"
		}
		dev := d.Device
		if dev == "" {
			dev = cfg.Virtio("blk")
		}
		dev += ",drive=" + id
		if d.Serial != "" {
			dev += ",serial=" + d.Serial
		}
		a = append(a, "-drive", drive, "-device", dev)
	}
	for _, d := range cfg.Devices {
		a = append(a, "-device", d)
	}
	return append(a, cfg.Args...)
}

func memArg(mem, slots, maxMem int) string {
	a := strconv.Itoa(mem) + "M"
	if slots > 0 && maxMem > mem {
		a += ",slots=" + strconv.Itoa(slots) + ",maxmem=" + strconv.Itoa(maxMem) + "M"
	}
	return a
}

// VM is a running QEMU.
type VM struct {
	cmd    *exec.Cmd
	dir    string
	stderr *boundedBuffer
	mon    *qmp.SocketMonitor
	client *agent.Client
	done   chan struct{}
	// waitErr is QEMU's exit status, set before done is closed.
	waitErr  error
	killOnce sync.Once
}

// Start runs QEMU with cfg and returns once QEMU has connected both
// channels and accepted QMP's handshake (the guest may still be booting).
// ctx bounds the start only. On error no QEMU process and no socket is
// left behind.
func Start(ctx context.Context, cfg Config) (_ *VM, err error) {
	if cfg.Dir == "" || cfg.Machine == "" {
		return nil, fail.Errorf(fail.InvalidArgument, "qemu: Config.Dir and Config.Machine are required")
	}
	bin := cfg.Binary
	if bin == "" {
		bin = Binary
	}
	qmpSock := filepath.Join(cfg.Dir, "qmp.sock")
	agentSock := filepath.Join(cfg.Dir, "agent.sock")
	os.Remove(qmpSock)
	defer os.Remove(qmpSock) // QEMU has it open from here on; the name is not needed
	agentL, err := listen(agentSock)
	if err != nil {
		return nil, err
	}
	defer func() { agentL.Close(); os.Remove(agentSock) }()

	cmd := exec.Command(bin, cfg.args(qmpSock, agentSock)...)
	cmd.Env = cfg.Env
	cmd.Dir = cfg.Dir
	// Its own process group, so that a kill reaches any helper it forks;
	// Pdeathsig, so that a crashed edge leaves no guest running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	vm := &VM{cmd: cmd, dir: cfg.Dir, stderr: &boundedBuffer{limit: stderrLimit}, done: make(chan struct{})}
	cmd.Stderr = vm.stderr
	if err := cmd.Start(); err != nil {
		return nil, fail.Errorf(fail.Internal, "qemu: start %s: %w", bin, err)
	}
	go func() {
		vm.waitErr = cmd.Wait()
		close(vm.done)
	}()
	defer func() {
		if err != nil {
			vm.Kill()
		}
	}()

	timeout := cfg.ConnectTimeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	// A QEMU that exits (a bad argument) or a cancelled ctx closes the
	// listeners, which ends the accepts below at once.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-vm.done:
		case <-ctx.Done():
		case <-stop:
			return
		}
		agentL.Close()
	}()
	agentConn, err := accept(agentL, deadline)
	if err != nil {
		return nil, vm.startErr(ctx, "connect the agent channel", err)
	}
	// QEMU made the QMP socket before it connected the agent channel.
	mon, err := qmp.NewSocketMonitor("unix", qmpSock, time.Until(deadline))
	if err != nil {
		agentConn.Close()
		return nil, vm.startErr(ctx, "connect QMP", err)
	}
	if err := mon.Connect(); err != nil {
		mon.Disconnect()
		agentConn.Close()
		return nil, vm.startErr(ctx, "QMP handshake", err)
	}
	vm.mon = mon
	vm.client = agent.NewClient(agentConn)
	return vm, nil
}

// startErr explains a failed start: QEMU's exit and stderr if it died,
// ctx's error if that ended it.
func (vm *VM) startErr(ctx context.Context, what string, err error) error {
	select {
	case <-vm.done:
		return fail.Errorf(fail.Internal, "qemu: %s: qemu exited (%v): %s", what, vm.waitErr, vm.Stderr())
	default:
	}
	if ctx.Err() != nil {
		return fail.New(ctxKind(ctx.Err()), fmt.Errorf("qemu: %s: %w", what, ctx.Err()))
	}
	return fail.Errorf(fail.Internal, "qemu: %s: %w (stderr: %s)", what, err, vm.Stderr())
}

func listen(path string) (*net.UnixListener, error) {
	os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "qemu: listen on %s: %w", path, err)
	}
	return l, nil
}

func accept(l *net.UnixListener, deadline time.Time) (net.Conn, error) {
	if err := l.SetDeadline(deadline); err != nil {
		return nil, err
	}
	return l.Accept()
}

// Agent is the agent protocol's client over the VM's agent channel. Its
// first request must be Init (see agent.AcceptInit).
func (vm *VM) Agent() *agent.Client { return vm.client }

// Pid is QEMU's process id (also its process group's).
func (vm *VM) Pid() int { return vm.cmd.Process.Pid }

// Done is closed once QEMU has exited and been reaped.
func (vm *VM) Done() <-chan struct{} { return vm.done }

// Stderr is what QEMU wrote to stderr (its last 16 KiB at most).
func (vm *VM) Stderr() string { return strings.TrimSpace(vm.stderr.String()) }

// Run sends one QMP command and returns its "return" value (raw JSON).
func (vm *VM) Run(ctx context.Context, command string, args any) (json.RawMessage, error) {
	cmd := qmp.Command{Execute: command, Args: nil}
	if args != nil {
		b, err := json.Marshal(args)
		if err != nil {
			return nil, err
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, err
		}
		cmd.Args = m
	}
	b, err := json.Marshal(cmd)
	if err != nil {
		return nil, err
	}
	type result struct {
		b   []byte
		err error
	}
	// SocketMonitor.Run has no context: a wedged QEMU is bounded by ctx,
	// and Kill (closing the socket) ends the call.
	ch := make(chan result, 1)
	go func() {
		out, err := vm.mon.Run(b)
		ch <- result{out, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-ctx.Done():
		return nil, fail.New(ctxKind(ctx.Err()), fmt.Errorf("qemu: %s: %w", command, ctx.Err()))
	case <-vm.done:
		return nil, fail.Errorf(fail.FailedPrecondition, "qemu: %s: qemu exited (%v)", command, vm.waitErr)
	}
	if r.err != nil {
		return nil, fail.Errorf(fail.Internal, "qemu: %s: %w", command, r.err)
	}
	var resp struct {
		Return json.RawMessage `json:"return"`
	}
	if err := json.Unmarshal(r.b, &resp); err != nil {
		return nil, fail.Errorf(fail.Internal, "qemu: %s: decode reply: %w", command, err)
	}
	return resp.Return, nil
}

// Stop pauses every vCPU (QMP stop); it returns once they are stopped.
func (vm *VM) Stop(ctx context.Context) error {
	_, err := vm.Run(ctx, "stop", nil)
	return err
}

// Cont resumes the vCPUs (QMP cont).
func (vm *VM) Cont(ctx context.Context) error {
	_, err := vm.Run(ctx, "cont", nil)
	return err
}

// Status is QMP query-status's status ("running", "paused", ...).
func (vm *VM) Status(ctx context.Context) (string, error) {
	raw, err := vm.Run(ctx, "query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return "", fail.Errorf(fail.Internal, "qemu: query-status: %w", err)
	}
	return st.Status, nil
}

// Quit asks QEMU to exit (QMP quit) and waits for it, killing it if ctx
// ends first. Either way QEMU is gone and reaped on return.
func (vm *VM) Quit(ctx context.Context) error {
	_, err := vm.Run(ctx, "quit", nil)
	if err == nil {
		select {
		case <-vm.done:
			vm.closeChannels()
			return nil
		case <-ctx.Done():
		}
	}
	vm.Kill()
	return nil
}

// Kill kills QEMU's process group, closes the channels and waits until
// QEMU is reaped. It is idempotent.
func (vm *VM) Kill() {
	vm.killOnce.Do(func() {
		// The group id is QEMU's pid (Setpgid); until Wait reaps QEMU the
		// pid cannot be reused, so the signal cannot reach a stranger.
		select {
		case <-vm.done:
		default:
			syscall.Kill(-vm.cmd.Process.Pid, syscall.SIGKILL)
		}
	})
	<-vm.done
	vm.closeChannels()
}

func (vm *VM) closeChannels() {
	if vm.mon != nil {
		vm.mon.Disconnect()
	}
	if vm.client != nil {
		vm.client.Close()
	}
}

// boundedBuffer keeps the last limit bytes written to it.
type boundedBuffer struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	limit int
}

func (b *boundedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	if over := b.buf.Len() - b.limit; over > 0 {
		b.buf.Next(over)
	}
	return len(p), nil
}

func (b *boundedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// ctxKind is the fail kind of a context's error.
func ctxKind(err error) fail.Kind {
	if errors.Is(err, context.DeadlineExceeded) {
		return fail.DeadlineExceeded
	}
	return fail.Canceled
}
