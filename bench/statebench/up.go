package main

// The `dsec up` child process, and everything needed to make sure the run
// leaves nothing behind: dsec up's layer mounts and sandbox cgroups, the
// harness's own peer cgroups, and any process started from this run's
// binaries.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// nodeID names the edge; sandbox IDs start with it.
const nodeID = "statebench"

// stopGrace is how long a SIGTERMed dsec up may take to destroy its
// sandboxes before it is killed (its own shutdown deadline is 60 s).
const stopGrace = 90 * time.Second

// upProc is one running `dsec up`.
type upProc struct {
	cmd      *exec.Cmd
	dataDir  string
	endpoint string
	token    string
	log      *tailBuffer
	done     chan struct{}
	err      error
}

// startUp starts `dsec up` on dataDir with the busybox rootfs seeded as
// busybox:latest, and waits until it serves.
func startUp(ctx context.Context, bins binaries, dataDir, rootfs string) (*upProc, error) {
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, err
	}
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	args := []string{"up", "--data-dir", dataDir, "--listen", addr, "--agent", bins.agent,
		"--node-id", nodeID, "--log-level", "warn", "--import", "busybox:latest=" + rootfs}
	u := &upProc{dataDir: dataDir, endpoint: "http://" + addr, log: &tailBuffer{max: 64 << 10}, done: make(chan struct{})}
	u.cmd = exec.Command(bins.dsec, args...)
	u.cmd.Stdout, u.cmd.Stderr = u.log, u.log
	// Its own process group, so a Ctrl-C on the terminal reaches only this
	// harness, which then stops dsec up in order. If the harness dies
	// anyway, dsec up gets SIGTERM and destroys its sandboxes itself.
	u.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := u.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start dsec up: %w", err)
	}
	go func() { u.err = u.cmd.Wait(); close(u.done) }()
	slog.Info("started dsec up", "pid", u.cmd.Process.Pid, "listen", addr)

	deadline := time.Now().Add(60 * time.Second)
	for delay := 10 * time.Millisecond; ; delay = min(2*delay, 250*time.Millisecond) {
		select {
		case <-u.done:
			return u, fmt.Errorf("dsec up exited before serving (%v):\n%s", u.err, u.log.String())
		case <-ctx.Done():
			return u, ctx.Err()
		case <-time.After(delay):
		}
		if healthy(u.endpoint) {
			break
		}
		if time.Now().After(deadline) {
			return u, fmt.Errorf("dsec up not serving on %s after 60s:\n%s", addr, u.log.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(dataDir, "admin.token"))
	if err != nil {
		return u, fmt.Errorf("admin token: %w", err)
	}
	u.token = strings.TrimSpace(string(b))
	return u, nil
}

func healthy(endpoint string) bool {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(endpoint + "/healthz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// freeAddr returns a loopback address nobody listens on right now.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func (u *upProc) pid() int { return u.cmd.Process.Pid }

// stop sends SIGTERM (a clean stop destroys every sandbox and unmounts the
// layers) and waits; after stopGrace it kills the process group. It
// returns an error if dsec up had to be killed or exited with an error.
func (u *upProc) stop() error {
	select {
	case <-u.done:
		return u.exitErr()
	default:
	}
	_ = u.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-u.done:
		return u.exitErr()
	case <-time.After(stopGrace):
		_ = syscall.Kill(-u.pid(), syscall.SIGKILL)
		<-u.done
		return fmt.Errorf("dsec up (pid %d) killed: no clean stop after %v", u.pid(), stopGrace)
	}
}

func (u *upProc) exitErr() error {
	if u.err != nil {
		return fmt.Errorf("dsec up exited: %w:\n%s", u.err, u.log.String())
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	b   []byte
	max int
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// Leaks is what the run left behind, found (and removed) at its end. All
// empty after a clean run.
type Leaks struct {
	Mounts    []string `json:"mounts,omitempty"`
	Cgroups   []string `json:"cgroups,omitempty"`
	Processes []string `json:"processes,omitempty"`
}

func (l Leaks) empty() bool { return len(l.Mounts)+len(l.Cgroups)+len(l.Processes) == 0 }

func (l Leaks) String() string {
	var parts []string
	if len(l.Mounts) > 0 {
		parts = append(parts, fmt.Sprintf("mounts %v", l.Mounts))
	}
	if len(l.Cgroups) > 0 {
		parts = append(parts, fmt.Sprintf("cgroups %v", l.Cgroups))
	}
	if len(l.Processes) > 0 {
		parts = append(parts, fmt.Sprintf("processes %v", l.Processes))
	}
	return strings.Join(parts, ", ")
}

// reclaim finds what dsec up (pid upPID, already exited) left behind and
// removes it: processes started from this run's binaries (killed), its
// sandboxes' cgroups (tasks killed, directories removed) and mounts under
// dataDir (detached, deepest first).
func reclaim(bins binaries, upPID int, dataDir string) (Leaks, error) {
	var (
		leaks Leaks
		errs  []error
	)
	procs, err := processesFrom(bins.dir)
	if err != nil {
		errs = append(errs, err)
	}
	for _, p := range procs {
		leaks.Processes = append(leaks.Processes, fmt.Sprintf("%d %s", p.pid, p.exe))
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
	}
	cgs, err := sandboxCgroups(upPID)
	if err != nil {
		errs = append(errs, err)
	}
	leaks.Cgroups = cgs
	if err := removeCgroups(cgs); err != nil {
		errs = append(errs, err)
	}
	mps, err := mountsUnder(dataDir)
	if err != nil {
		errs = append(errs, err)
	}
	leaks.Mounts = mps
	if err := unmountAll(mps); err != nil {
		errs = append(errs, err)
	}
	return leaks, errors.Join(errs...)
}

// reclaimHarness finds what the harness's own peers left: their cgroups
// (statebench-*-PID, with whatever runs in them) and any mount under the
// work dir; it removes them.
func reclaimHarness(work string) (Leaks, error) {
	var (
		leaks Leaks
		errs  []error
	)
	cgs, err := harnessCgroups(os.Getpid())
	if err != nil {
		errs = append(errs, err)
	}
	leaks.Cgroups = cgs
	if err := removeCgroups(cgs); err != nil {
		errs = append(errs, err)
	}
	mps, err := mountsUnder(work)
	if err != nil {
		errs = append(errs, err)
	}
	leaks.Mounts = mps
	if err := unmountAll(mps); err != nil {
		errs = append(errs, err)
	}
	return leaks, errors.Join(errs...)
}

type proc struct {
	pid int
	exe string
}

// processesFrom lists live processes whose executable is in dir.
func processesFrom(dir string) ([]proc, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []proc
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		if err != nil {
			continue
		}
		exe = strings.TrimSuffix(exe, " (deleted)")
		if filepath.Dir(exe) == dir {
			out = append(out, proc{pid, exe})
		}
	}
	return out, nil
}

// sandboxCgroups lists the cgroups the container backend of dsec up (pid)
// made: "s<pid>-<n>" under its parent "dsec" in every hierarchy.
func sandboxCgroups(pid int) ([]string, error) {
	return globCgroups(fmt.Sprintf("dsec/s%d-*", pid))
}

// harnessCgroups lists the peer cgroups of the harness with pid: the
// freezer floor's and the OCI runtime's parents, in every hierarchy.
func harnessCgroups(pid int) ([]string, error) {
	return globCgroups(fmt.Sprintf("%s*-%d", cgroupPrefix, pid))
}

// globCgroups expands the pattern rel (relative to a hierarchy root) in
// every mounted cgroup hierarchy, v1 or v2. Only real cgroup file systems
// count.
func globCgroups(rel string) ([]string, error) {
	var out []string
	for _, pat := range []string{filepath.Join(cgroupRoot, "*", rel), filepath.Join(cgroupRoot, rel)} {
		m, err := filepath.Glob(pat)
		if err != nil {
			return nil, err
		}
		for _, p := range m {
			if isCgroupFS(filepath.Dir(p)) {
				out = append(out, p)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}

func isCgroupFS(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	return st.Type == unix.CGROUP_SUPER_MAGIC || st.Type == unix.CGROUP2_SUPER_MAGIC
}

// removeCgroups removes each cgroup tree in dirs: thaws it (a frozen task
// cannot die), kills its tasks, removes the directories deepest first,
// retrying while killed tasks are still exiting.
func removeCgroups(dirs []string) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		var errs []error
		for _, d := range dirs {
			var sub []string
			err := filepath.WalkDir(d, func(p string, e fs.DirEntry, err error) error {
				if err != nil {
					if errors.Is(err, fs.ErrNotExist) {
						return nil
					}
					return err
				}
				if e.IsDir() {
					sub = append(sub, p)
				}
				return nil
			})
			if err != nil {
				errs = append(errs, fmt.Errorf("walk cgroup %s: %w", d, err))
				continue
			}
			sort.Slice(sub, func(i, j int) bool { return len(sub[i]) > len(sub[j]) })
			var killed []int
			for _, s := range sub {
				_ = os.WriteFile(filepath.Join(s, "freezer.state"), []byte("THAWED"), 0o644)
				_ = os.WriteFile(filepath.Join(s, "cgroup.freeze"), []byte("0"), 0o644)
				if b, err := os.ReadFile(filepath.Join(s, "cgroup.procs")); err == nil {
					for _, f := range strings.Fields(string(b)) {
						if pid, err := strconv.Atoi(f); err == nil && syscall.Kill(pid, syscall.SIGKILL) == nil {
							killed = append(killed, pid)
						}
					}
				}
			}
			time.Sleep(10 * time.Millisecond)
			reap(killed)
			for _, s := range sub {
				if err := unix.Rmdir(s); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("remove cgroup %s: %w", s, err))
				}
			}
		}
		if len(errs) == 0 || time.Now().After(deadline) {
			return errors.Join(errs...)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// reap collects the exit status of those of pids that are this process's
// exited children (an unreaped zombie can keep its cgroup busy), without
// blocking on live ones; it never waits for any other child, so it cannot
// steal an exit status that some Cmd.Wait is waiting for.
func reap(pids []int) {
	for _, pid := range pids {
		for {
			_, err := unix.Wait4(pid, nil, unix.WNOHANG, nil)
			if !errors.Is(err, unix.EINTR) {
				break
			}
		}
	}
}

// mountsUnder lists the host mount points at or below dir, deepest first.
func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	dir = filepath.Clean(dir)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

func unmountAll(mps []string) error {
	var errs []error
	for _, m := range mps {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space...).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// removeDir removes dir unless something is still mounted below it:
// RemoveAll would then delete inside the mounted file system.
func removeDir(dir string) error {
	mps, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if err := unmountAll(mps); err != nil {
		return fmt.Errorf("not removing %s: %w", dir, err)
	}
	if left, err := mountsUnder(dir); err != nil || len(left) > 0 {
		return fmt.Errorf("not removing %s: still mounted %v (%v)", dir, left, err)
	}
	return os.RemoveAll(dir)
}
