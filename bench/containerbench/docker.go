package main

import (
	"archive/tar"
	"context"
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
	"strings"
	"syscall"
	"time"
)

// dockerImage is the busybox rootfs imported into the private dockerd.
const dockerImage = "dsecbench-busybox:latest"

// docker runs a private dockerd (own data-root, exec-root, socket and
// cgroup parent) for the duration of one measurement and drives it with the
// docker CLI, as a user of Docker would. dockerd's iptables, ip-forward and
// masquerade handling is off: it installs no per-container rules for
// unpublished containers anyway, and leaving the host firewall untouched is
// worth more than those few start-up rules. The bridge variant still
// creates a veth pair and a network namespace per container.
type docker struct {
	bridge bool
	name   string
	cli    string
	work   string
	sock   string
	cgroup string

	dockerd *exec.Cmd
	exited  chan struct{} // closed when dockerd exits
	// Host state that existed before dockerd ran, so Teardown removes only
	// what this run created.
	hadDocker0  bool
	newPaths    []string
	iptablesPre string
}

func newDocker(bridge bool) System {
	name := "docker-nonet"
	if bridge {
		name = "docker"
	}
	return &docker{bridge: bridge, name: name}
}

func (d *docker) Name() string { return d.name }

func (d *docker) Setup(ctx context.Context, env Env) error {
	if _, err := exec.LookPath("dockerd"); err != nil {
		return fmt.Errorf("dockerd not installed (apt-get install -y docker.io): %w", err)
	}
	// Prefer the CLI that ships with the daemon: another docker client
	// earlier on PATH may speak a newer API than this dockerd.
	d.cli = "/usr/bin/docker"
	if _, err := os.Stat(d.cli); err != nil {
		if d.cli, err = exec.LookPath("docker"); err != nil {
			return fmt.Errorf("docker CLI not found: %w", err)
		}
	}
	d.work = env.WorkDir
	d.sock = filepath.Join(env.WorkDir, "docker.sock")
	d.cgroup = cgroupName(d.name)
	if _, err := net.InterfaceByName("docker0"); err == nil {
		d.hadDocker0 = true
	}
	for _, p := range []string{"/etc/docker/key.json", "/run/docker", "/run/containerd"} {
		if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
			d.newPaths = append(d.newPaths, p)
		}
	}
	if out, err := output(ctx, "iptables-save"); err == nil {
		d.iptablesPre = string(out)
	}
	// containerd's shims daemonise and would be orphaned to the host's
	// PID 1, which may never reap what they leave; as subreaper the
	// worker inherits them and reaps them in Teardown.
	if err := becomeSubreaper(); err != nil {
		return err
	}

	logf, err := os.Create(filepath.Join(env.WorkDir, "dockerd.log"))
	if err != nil {
		return fmt.Errorf("dockerd log: %w", err)
	}
	defer logf.Close()
	// Not CommandContext: dockerd must be stopped gracefully by Teardown,
	// never SIGKILLed by a cancelled context.
	args := []string{
		"--data-root", filepath.Join(env.WorkDir, "data"),
		"--exec-root", filepath.Join(env.WorkDir, "exec"),
		"--pidfile", filepath.Join(env.WorkDir, "dockerd.pid"),
		"--host", "unix://" + d.sock,
		"--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
		"--cgroup-parent", "/" + d.cgroup,
		"--exec-opt", "native.cgroupdriver=cgroupfs",
	}
	if !d.bridge {
		// No docker0 at all when no container will use it.
		args = append(args, "--bridge", "none")
	}
	d.dockerd = exec.Command("dockerd", args...)
	d.dockerd.Stdout, d.dockerd.Stderr = logf, logf
	d.dockerd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	start := time.Now()
	if err := d.dockerd.Start(); err != nil {
		return fmt.Errorf("start dockerd: %w", err)
	}
	d.exited = make(chan struct{})
	go func() { _ = d.dockerd.Wait(); close(d.exited) }()
	if err := d.waitReady(ctx); err != nil {
		return err
	}
	slog.Info("dockerd ready", "system", d.name, "after", time.Since(start).Round(time.Millisecond))

	tarPath := filepath.Join(env.WorkDir, "rootfs.tar")
	if err := tarDir(env.Rootfs, tarPath); err != nil {
		return err
	}
	if err := run(ctx, d.cli, "-H", "unix://"+d.sock, "import", tarPath, dockerImage); err != nil {
		return fmt.Errorf("import busybox rootfs: %w", err)
	}
	return nil
}

// waitReady polls dockerd's /_ping until it answers, dockerd exits, or ctx
// ends. Polling is the only readiness signal dockerd offers.
func (d *docker) waitReady(ctx context.Context) error {
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, "unix", d.sock)
		},
	}}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://docker/_ping", nil)
		if err != nil {
			return fmt.Errorf("dockerd ping request: %w", err)
		}
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-d.exited:
			return fmt.Errorf("dockerd exited during start-up; see %s", filepath.Join(d.work, "dockerd.log"))
		case <-ctx.Done():
			return fmt.Errorf("dockerd not ready: %w", ctx.Err())
		case <-tick.C:
		}
	}
}

func (d *docker) runArgs(detach bool, argv ...string) []string {
	args := []string{"-H", "unix://" + d.sock, "run"}
	if detach {
		args = append(args, "--detach")
	} else {
		args = append(args, "--rm")
	}
	if !d.bridge {
		args = append(args, "--network", "none")
	}
	return append(append(args, dockerImage), argv...)
}

func (d *docker) Cycle(ctx context.Context) error {
	return run(ctx, d.cli, d.runArgs(false, "/bin/true")...)
}

func (d *docker) StartIdle(ctx context.Context, _ int) (func(context.Context) error, error) {
	out, err := output(ctx, d.cli, d.runArgs(true, "/bin/sleep", "1000000")...)
	if err != nil {
		return nil, err
	}
	id := strings.TrimSpace(string(out))
	return func(ctx context.Context) error {
		return run(ctx, d.cli, "-H", "unix://"+d.sock, "rm", "--force", id)
	}, nil
}

func (d *docker) CgroupMemory() (int64, error) { return cgroupMemoryUsage(d.cgroup) }

func (d *docker) Teardown(ctx context.Context) error {
	var errs []error
	if d.dockerd != nil && d.dockerd.Process != nil {
		select {
		case <-d.exited:
		default:
			if out, err := output(ctx, d.cli, "-H", "unix://"+d.sock, "ps", "--all", "--quiet"); err == nil {
				if ids := strings.Fields(string(out)); len(ids) > 0 {
					args := append([]string{"-H", "unix://" + d.sock, "rm", "--force"}, ids...)
					if err := run(ctx, d.cli, args...); err != nil {
						errs = append(errs, err)
					}
				}
			}
			_ = d.dockerd.Process.Signal(syscall.SIGTERM)
			select {
			case <-d.exited:
			case <-ctx.Done():
				_ = d.dockerd.Process.Kill()
				<-d.exited
				errs = append(errs, fmt.Errorf("dockerd did not stop in time; killed: %w", ctx.Err()))
			}
		}
	}
	reapOrphans()
	if !d.hadDocker0 {
		if _, err := net.InterfaceByName("docker0"); err == nil {
			if err := run(ctx, "ip", "link", "delete", "docker0"); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if d.cgroup != "" {
		if err := removeCgroupTree(d.cgroup); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range d.newPaths {
		if err := removeEmptyTree(p); err != nil {
			errs = append(errs, err)
		}
	}
	if d.iptablesPre != "" || d.dockerd != nil {
		if out, err := output(ctx, "iptables-save"); err == nil && stripComments(string(out)) != stripComments(d.iptablesPre) {
			errs = append(errs, errors.New("iptables rules changed while dockerd ran; inspect with iptables-save"))
		}
	}
	return errors.Join(errs...)
}

// removeEmptyTree removes p if it is a file dockerd created (key.json) or a
// directory tree holding only empty directories (/run/docker/plugins ...);
// anything with content is left alone and reported.
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
		if err := os.Remove(dirs[i]); err != nil {
			return fmt.Errorf("remove %s: %w", dirs[i], err)
		}
	}
	return nil
}

// stripComments drops iptables-save's timestamp comments so two dumps of
// the same rules compare equal.
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
// symlinks as symlinks (the applets are links to busybox).
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
