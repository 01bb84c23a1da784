package qemu_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

func requireQEMU(t *testing.T) {
	t.Helper()
	if !qemu.Available() {
		t.Skip("qemu-system-x86_64 is not installed (scripts/deps.sh installs it)")
	}
}

// alive reports whether a process with pid exists (and is not a zombie).
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	f := strings.Fields(string(b))
	return len(f) > 2 && f[2] != "Z"
}

// TestLifecycle boots a machine with no guest kernel (the firmware finds
// nothing to boot and idles): enough to check the QMP side — pause,
// resume, status, quit — and that nothing is left behind.
func TestLifecycle(t *testing.T) {
	requireQEMU(t)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vm, err := qemu.Start(ctx, qemu.Config{Dir: dir, Machine: "microvm", MemoryMiB: 64, TBSizeMiB: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Kill()
	pid := vm.Pid()
	if !alive(pid) {
		t.Fatal("qemu is not running after Start")
	}
	if vm.Agent() == nil {
		t.Fatal("no agent client")
	}
	st, err := vm.Status(ctx)
	if err != nil || st != "running" {
		t.Fatalf("status after start: %q, %v; want running", st, err)
	}
	if err := vm.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if st, err := vm.Status(ctx); err != nil || st != "paused" {
		t.Fatalf("status after Stop: %q, %v; want paused", st, err)
	}
	if err := vm.Cont(ctx); err != nil {
		t.Fatal(err)
	}
	if st, err := vm.Status(ctx); err != nil || st != "running" {
		t.Fatalf("status after Cont: %q, %v; want running", st, err)
	}
	if _, err := vm.Run(ctx, "no-such-command", nil); err == nil {
		t.Error("an unknown QMP command succeeded")
	}
	if err := vm.Quit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-vm.Done():
	default:
		t.Fatal("Done is not closed after Quit")
	}
	if alive(pid) {
		t.Errorf("qemu (pid %d) still runs after Quit", pid)
	}
	if _, err := vm.Status(ctx); err == nil {
		t.Error("Status after Quit succeeded")
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		t.Errorf("left behind in the state directory: %s", e.Name())
	}
}

// TestKillReaps checks that Kill ends QEMU's whole process group.
func TestKillReaps(t *testing.T) {
	requireQEMU(t)
	ctx := context.Background()
	vm, err := qemu.Start(ctx, qemu.Config{Dir: t.TempDir(), Machine: "microvm", MemoryMiB: 64, TBSizeMiB: 16})
	if err != nil {
		t.Fatal(err)
	}
	pid := vm.Pid()
	vm.Kill()
	vm.Kill() // idempotent
	if alive(pid) {
		t.Fatalf("qemu (pid %d) survives Kill", pid)
	}
	if err := syscall.Kill(-pid, 0); err != syscall.ESRCH {
		t.Errorf("process group %d still exists after Kill: %v", pid, err)
	}
}

// TestStartFailure: a command line QEMU refuses fails Start with QEMU's own
// message, and leaves no process and no socket behind.
func TestStartFailure(t *testing.T) {
	requireQEMU(t)
	dir := t.TempDir()
	_, err := qemu.Start(context.Background(), qemu.Config{Dir: dir, Machine: "microvm", Devices: []string{"no-such-device"}})
	if err == nil {
		t.Fatal("Start with an unknown device succeeded")
	}
	if !strings.Contains(err.Error(), "no-such-device") {
		t.Errorf("error does not carry QEMU's reason: %v", err)
	}
	if fail.KindOf(err) != fail.Internal {
		t.Errorf("error kind %v, want internal", fail.KindOf(err))
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		t.Errorf("left behind in the state directory: %s", e.Name())
	}
}

// TestStartCancelled: a context that ends during the start kills QEMU.
func TestStartCancelled(t *testing.T) {
	requireQEMU(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := qemu.Start(ctx, qemu.Config{Dir: t.TempDir(), Machine: "microvm", MemoryMiB: 64})
	if err == nil {
		t.Fatal("Start with a cancelled context succeeded")
	}
	if fail.KindOf(err) != fail.Canceled {
		t.Errorf("error kind %v, want canceled: %v", fail.KindOf(err), err)
	}
}

func TestAccelRule(t *testing.T) {
	a := qemu.Accel()
	_, devErr := os.Stat("/dev/kvm")
	_, intel := os.Stat("/sys/module/kvm_intel")
	_, amd := os.Stat("/sys/module/kvm_amd")
	want := "tcg"
	if devErr == nil && (intel == nil || amd == nil) {
		want = "kvm"
	}
	if a != want {
		t.Errorf("Accel() = %q, want %q", a, want)
	}
}
