package peer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/opencontainers/runtime-spec/specs-go"
)

// OCISpec is the config `runc spec` generates, changed where the
// benchmarks' peers need it: no terminal, args as the process, the
// namespaces DSec uses (plus cgroup), root as given, a cgroup path the
// harness can measure and remove, and res as the limits (nil: devices
// denied, nothing else limited).
func OCISpec(id string, args []string, root specs.Root, cgroupsPath string, res *specs.LinuxResources) *specs.Spec {
	caps := []string{"CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"}
	if res == nil {
		res = &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}}}
	}
	return &specs.Spec{
		Version: "1.0.2",
		Process: &specs.Process{
			User: specs.User{UID: 0, GID: 0},
			Args: args,
			Env:  []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			Cwd:  "/",
			Capabilities: &specs.LinuxCapabilities{
				Bounding: caps, Effective: caps, Permitted: caps,
			},
			Rlimits:         []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 1024, Soft: 1024}},
			NoNewPrivileges: true,
		},
		Root:     &root,
		Hostname: id,
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "ro"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: cgroupsPath,
			Resources:   res,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
				{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.CgroupNamespace},
			},
			MaskedPaths: []string{
				"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
				"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi",
			},
			ReadonlyPaths: []string{
				"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
			},
		},
	}
}

// RunDetached runs `BIN --root STATE run --detach` of the bundle dir as
// id and returns the container's init PID (from its pid file). On error
// the caller deletes what may have been made.
func RunDetached(ctx context.Context, bin, state, dir, id string) (int, error) {
	pidFile := filepath.Join(dir, "pid")
	// The detached container inherits the runtime's stdio; a pipe would
	// keep Wait from returning while it lives, so use a file.
	logf, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		return 0, fmt.Errorf("log of %s: %w", id, err)
	}
	cmd := exec.CommandContext(ctx, bin, "--root", state, "run", "--detach", "--pid-file", pidFile, "--bundle", dir, id)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Run()
	logf.Close()
	if err != nil {
		msg, _ := os.ReadFile(logf.Name())
		return 0, fmt.Errorf("%s run --detach %s: %w: %s", bin, id, err, strings.TrimSpace(string(msg)))
	}
	b, err := os.ReadFile(pidFile)
	pid, perr := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || perr != nil || pid <= 0 {
		return 0, fmt.Errorf("%s pid file of %s: %w", bin, id, errors.Join(err, perr))
	}
	return pid, nil
}
