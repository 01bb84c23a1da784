package peer

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// DockerCLI is the CLI that ships with Debian's dockerd: another client
// earlier on PATH may speak a newer API than this daemon.
const DockerCLI = "/usr/bin/docker"

// DockerMissing says why Docker cannot run here, "" when it can.
func DockerMissing() string {
	if _, err := exec.LookPath("dockerd"); err != nil {
		return "dockerd not installed (apt-get install -y docker.io)"
	}
	if _, err := os.Stat(DockerCLI); err != nil {
		return DockerCLI + " missing (it comes with docker.io)"
	}
	return ""
}

// DockerdConfig says how to run a private dockerd.
type DockerdConfig struct {
	// Dir holds its data-root, exec-root, pidfile, socket and log.
	Dir string
	// Rootfs is imported as Image once it is ready.
	Rootfs, Image string
	// Cgroup is its containers' cgroup parent, relative to a hierarchy's
	// root; removed with everything under it by Stop.
	Cgroup string
	// Bridge keeps docker0 for containers that use the network; without
	// it dockerd runs with --bridge none.
	Bridge bool
	// PrivateMounts runs dockerd in a mount namespace of its own, so its
	// containers' mounts never enter the host's table.
	PrivateMounts bool
}

// Dockerd is a private dockerd, run as a user of Docker would run one but
// with its own data-root, exec-root, pidfile, socket and cgroup parent,
// and iptables, ip-forward and masquerading off: it installs no
// per-container rules for unpublished containers anyway, and leaving the
// host firewall and sysctls untouched is worth more than those few
// start-up rules. Stop removes every container, stops dockerd, kills what
// of this run survives it (containerd, shims), and removes what dockerd
// made outside Dir if it was not there before (docker0, /etc/docker/key.json,
// /run/docker, /run/containerd, /var/lib/docker, /var/lib/containerd).
type Dockerd struct {
	cfg DockerdConfig
	// Sock is the daemon's unix socket.
	Sock   string
	cmd    *exec.Cmd
	exited chan struct{} // closed when dockerd exits

	// Host state that existed before dockerd ran, so Stop removes only
	// what this run created.
	hadDocker0  bool
	newPaths    []string
	iptablesPre string
}

// StartDockerd starts dockerd and imports cfg.Rootfs as cfg.Image. A
// non-nil *Dockerd, even with an error, must be stopped.
func StartDockerd(ctx context.Context, cfg DockerdConfig) (*Dockerd, error) {
	if why := DockerMissing(); why != "" {
		return nil, errors.New(why)
	}
	d := &Dockerd{cfg: cfg, Sock: filepath.Join(cfg.Dir, "docker.sock")}
	if _, err := net.InterfaceByName("docker0"); err == nil {
		d.hadDocker0 = true
	}
	for _, p := range []string{"/etc/docker/key.json", "/run/docker", "/run/containerd", "/var/lib/docker", "/var/lib/containerd"} {
		if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
			d.newPaths = append(d.newPaths, p)
		}
	}
	if out, err := exec.CommandContext(ctx, "iptables-save").Output(); err == nil {
		d.iptablesPre = stripComments(string(out))
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(cfg.Dir, "dockerd.log"))
	if err != nil {
		return nil, fmt.Errorf("dockerd log: %w", err)
	}
	defer logf.Close()
	args := []string{
		"--data-root", filepath.Join(cfg.Dir, "data"),
		"--exec-root", filepath.Join(cfg.Dir, "exec"),
		"--pidfile", filepath.Join(cfg.Dir, "dockerd.pid"),
		"--host", "unix://" + d.Sock,
		"--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
		"--cgroup-parent", "/" + cfg.Cgroup,
		"--exec-opt", "native.cgroupdriver=cgroupfs",
	}
	if !cfg.Bridge {
		// No docker0 at all when no container will use it.
		args = append(args, "--bridge", "none")
	}
	// Not CommandContext: dockerd must be stopped in order by Stop, never
	// SIGKILLed by a cancelled context.
	d.cmd = exec.Command("dockerd", args...)
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if cfg.PrivateMounts {
		d.cmd.SysProcAttr.Unshareflags = syscall.CLONE_NEWNS
	}
	t0 := time.Now()
	if err := d.cmd.Start(); err != nil {
		d.cmd = nil
		return nil, fmt.Errorf("start dockerd: %w", err)
	}
	d.exited = make(chan struct{})
	go func() { _ = d.cmd.Wait(); close(d.exited) }()
	if err := d.waitReady(ctx); err != nil {
		return d, err
	}
	slog.Info("dockerd ready", "dir", cfg.Dir, "after", time.Since(t0).Round(time.Millisecond))
	tarPath := filepath.Join(cfg.Dir, "rootfs.tar")
	if err := tarDir(cfg.Rootfs, tarPath); err != nil {
		return d, err
	}
	if out, err := d.CLI(ctx, "import", tarPath, cfg.Image); err != nil {
		return d, fmt.Errorf("docker import of the busybox rootfs: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return d, nil
}

// Args prefixes args with the option that points the CLI at this daemon.
func (d *Dockerd) Args(args ...string) []string {
	return append([]string{"-H", "unix://" + d.Sock}, args...)
}

// CLI runs the docker CLI against this daemon and returns its output
// (combined with stderr when it fails).
func (d *Dockerd) CLI(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, DockerCLI, d.Args(args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return append(out, stderr.String()...), fmt.Errorf("docker %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// waitReady polls /_ping until dockerd answers, exits, or ctx ends:
// polling is the only readiness signal dockerd offers.
func (d *Dockerd) waitReady(ctx context.Context) error {
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, "unix", d.Sock)
		},
	}}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://docker/_ping", nil)
		if err != nil {
			return fmt.Errorf("dockerd ping: %w", err)
		}
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-d.exited:
			b, _ := os.ReadFile(filepath.Join(d.cfg.Dir, "dockerd.log"))
			return fmt.Errorf("dockerd exited during start-up:\n%s", tail(string(b), 2000))
		case <-ctx.Done():
			return fmt.Errorf("dockerd not ready: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stop removes every container, stops dockerd and everything of this run,
// and reports what it could not undo.
func (d *Dockerd) Stop(ctx context.Context) error {
	var errs []error
	if d.cmd != nil {
		select {
		case <-d.exited:
		default:
			if out, err := d.CLI(ctx, "ps", "--all", "--quiet"); err != nil {
				errs = append(errs, err)
			} else if ids := strings.Fields(string(out)); len(ids) > 0 {
				slog.Info("removing docker containers", "n", len(ids))
				for start := 0; start < len(ids); start += 100 {
					if _, err := d.CLI(ctx, append([]string{"rm", "--force"}, ids[start:min(start+100, len(ids))]...)...); err != nil {
						errs = append(errs, err)
					}
				}
			}
			_ = d.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-d.exited:
			case <-time.After(60 * time.Second):
				_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
				<-d.exited
				errs = append(errs, errors.New("dockerd did not stop in 60 s; killed"))
			}
		}
	}
	// containerd and shims outlive a dockerd that died or was killed.
	for i := 0; i < 50; i++ {
		pids := PidsNaming(d.cfg.Dir + "/")
		if len(pids) == 0 {
			break
		}
		if i == 0 {
			slog.Warn("killing processes of this run that outlived dockerd", "pids", pids)
		}
		for _, p := range pids {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if pids := PidsNaming(d.cfg.Dir + "/"); len(pids) > 0 {
		errs = append(errs, fmt.Errorf("processes of the docker run survive: %v", pids))
	}
	if d.cfg.Cgroup != "" {
		if cgs, err := dsecup.GlobCgroups(d.cfg.Cgroup); err != nil {
			errs = append(errs, err)
		} else if err := dsecup.RemoveCgroups(cgs); err != nil {
			errs = append(errs, err)
		}
	}
	if !d.hadDocker0 {
		if _, err := net.InterfaceByName("docker0"); err == nil {
			if out, err := exec.CommandContext(ctx, "ip", "link", "delete", "docker0").CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("ip link delete docker0: %w: %s", err, out))
			}
		}
	}
	// Shims killed above leave their sockets in /run/containerd/s: named
	// sha256(<containerd address>/moby/<id>) by containerd 1.6.
	if ents, err := os.ReadDir(filepath.Join(d.cfg.Dir, "data", "containers")); err == nil {
		for _, e := range ents {
			h := sha256.Sum256([]byte(filepath.Join(d.cfg.Dir, "exec", "containerd", "containerd.sock") + "/moby/" + e.Name()))
			_ = os.Remove(filepath.Join("/run/containerd/s", hex.EncodeToString(h[:])))
		}
	}
	for _, p := range d.newPaths {
		if err := removeEmptyTree(p); err != nil {
			errs = append(errs, err)
		}
	}
	if d.iptablesPre != "" {
		if out, err := exec.CommandContext(ctx, "iptables-save").Output(); err == nil && stripComments(string(out)) != d.iptablesPre {
			errs = append(errs, errors.New("iptables rules changed while dockerd ran; inspect with iptables-save"))
		}
	}
	return errors.Join(errs...)
}

// PidsNaming lists live processes, other than this one, whose command line
// contains s.
func PidsNaming(s string) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(b) == 0 {
			continue // a zombie has an empty command line
		}
		if strings.Contains(strings.ReplaceAll(string(b), "\x00", " "), s) {
			out = append(out, pid)
		}
	}
	return out
}

// removeEmptyTree removes p if it is a file dockerd created (key.json) or a
// tree of empty directories (/run/docker/plugins ...); anything with
// content is reported and left.
func removeEmptyTree(p string) error {
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat %s: %w", p, err)
	}
	if !fi.IsDir() {
		return os.Remove(p)
	}
	var dirs []string
	err = filepath.WalkDir(p, func(q string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !de.IsDir() {
			return fmt.Errorf("%s is not empty (%s); left in place", p, q)
		}
		dirs = append(dirs, q)
		return nil
	})
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := unix.Rmdir(dirs[i]); err != nil {
			return fmt.Errorf("remove %s: %w", dirs[i], err)
		}
	}
	return nil
}

// stripComments drops iptables-save's timestamp comments.
func stripComments(s string) string {
	var b strings.Builder
	for _, l := range strings.Split(s, "\n") {
		if !strings.HasPrefix(l, "#") {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// tarDir writes dir as an uncompressed tar for `docker import`, keeping
// symlinks as symlinks.
func tarDir(dir, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return fmt.Errorf("create rootfs tar: %w", err)
	}
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := de.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = rel
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "root", "root"
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			src, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, src)
			src.Close()
			return err
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("tar rootfs %s: %w", dir, err)
	}
	return nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
