package fullvm_test

import (
	"bufio"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime/fullvm"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// BenchmarkBoot measures a cold boot of the Debian disk to agent ready
// (Create with ColdBoot: BIOS, extlinux, kernel, systemd to the end of
// the boot, when the agent's unit opens the port, then the agent's answer
// and the sandbox's hostname and clock), to be read beside its floor
// (BenchmarkBootFloor), and with a create that restores the boot
// template. Run with -benchtime=1x or a few: a cold boot takes tens of
// seconds under TCG.
func BenchmarkBoot(b *testing.B) {
	backend(b)
	cold, err := fullvm.New(fullvm.Options{
		StateDir:  filepath.Join(stateRoot, "bench-cold"),
		AgentPath: filepath.Join(stateRoot, "dsec-agent"),
		ColdBoot:  true,
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("cold-to-agent", func(b *testing.B) {
		for b.Loop() {
			sb, err := cold.Create(context.Background(), newSpec(b))
			if err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			sb.Destroy(context.Background())
			b.StartTimer()
		}
	})
	warm, _ := backend(b)
	// The first create makes the template; restores are measured.
	sb, err := warm.Create(context.Background(), newSpec(b))
	if err != nil {
		b.Fatal(err)
	}
	sb.Destroy(context.Background())
	b.Run("restore-to-agent", func(b *testing.B) {
		for b.Loop() {
			sb, err := warm.Create(context.Background(), newSpec(b))
			if err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			sb.Destroy(context.Background())
			b.StartTimer()
		}
	})
}

// BenchmarkBootFloor is BenchmarkBoot's floor: the same QEMU booting the
// same disk, without the agent's disk, to the login prompt on the serial
// console (getty starts with multi-user.target, about when systemd
// reports the boot over and the agent's port opens). Run it in the same run as BenchmarkBoot, with -benchtime=1x or
// a few.
func BenchmarkBootFloor(b *testing.B) {
	_, disk := backend(b)
	for i := 0; i < b.N; i++ {
		bootToLogin(b, disk)
	}
}

// bootToLogin boots disk (under a throwaway overlay) with the machine a
// fullvm sandbox has, less the agent's disk, and returns when the serial
// console shows the login prompt.
func bootToLogin(b *testing.B, disk string) {
	b.StopTimer()
	dir := b.TempDir()
	overlay := filepath.Join(dir, "disk.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", disk, overlay).CombinedOutput(); err != nil {
		b.Fatalf("qemu-img: %v: %s", err, out)
	}
	cmd := exec.Command(qemu.Binary, "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-M", "q35", "-accel", qemu.Accel(), "-cpu", "max", "-m", "512M", "-smp", "1",
		"-drive", "file="+overlay+",if=none,id=d0,format=qcow2", "-device", "virtio-blk-pci,drive=d0",
		"-device", "VGA", "-nic", "none", "-serial", "stdio")
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	b.StartTimer()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	found := make(chan bool, 1)
	go func() {
		r := bufio.NewReader(out)
		var tail string
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			tail += string(buf[:n])
			if strings.Contains(tail, "login: ") {
				found <- true
				return
			}
			if len(tail) > 64 {
				tail = tail[len(tail)-64:]
			}
			if err != nil {
				found <- false
				return
			}
		}
	}()
	select {
	case ok := <-found:
		if !ok {
			b.Fatal("QEMU ended before the login prompt")
		}
	case <-time.After(10 * time.Minute):
		b.Fatal("no login prompt within 10 minutes")
	}
	b.StopTimer()
	b.StartTimer()
}

// BenchmarkScreenshot is one screenshot's round trip: QMP screendump to
// a PNG file and reading it back.
func BenchmarkScreenshot(b *testing.B) {
	bk, _ := backend(b)
	sb, err := bk.Create(context.Background(), newSpec(b))
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Destroy(context.Background())
	d := sb.(*fullvm.Sandbox)
	for b.Loop() {
		if _, err := d.Screenshot(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
}
