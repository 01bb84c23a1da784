// Package dsecup is what the benchmark harnesses under bench/ that measure
// a real `dsec up` (statebench, trajbench) share: building or copying the
// static dsec and dsec-agent binaries into a run's work dir, the busybox
// rootfs `make up` imports, starting and stopping the `dsec up` child
// process, finding and removing whatever a run left behind (mounts,
// processes, cgroups), and the report helpers (nearest-rank statistics,
// number formats, the host line). Test helpers are in dsecuptest.
package dsecup

// The `dsec up` child process.

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// stopGrace is how long a SIGTERMed dsec up may take to destroy its
// sandboxes before it is killed (its own shutdown deadline is 60 s).
const stopGrace = 90 * time.Second

// Options says how to start one `dsec up`.
type Options struct {
	Bins    Binaries
	DataDir string // made if missing
	// Rootfs is the busybox tree seeded as busybox:latest.
	Rootfs string
	// NodeID names the edge; sandbox IDs start with it.
	NodeID string
	// Args are appended to dsec up's command line.
	Args []string
	// LogAttrs are added to the "started dsec up" log line.
	LogAttrs []any
}

// Up is one running `dsec up`.
type Up struct {
	DataDir  string
	Endpoint string // http://127.0.0.1:PORT
	Token    string // the admin token

	cmd  *exec.Cmd
	log  *tailBuffer
	done chan struct{}
	err  error
}

// Start starts `dsec up` on o.DataDir with the busybox rootfs seeded as
// busybox:latest, and waits until it serves. A non-nil Up, even with an
// error, is a started process the caller must Stop and Reclaim.
func Start(ctx context.Context, o Options) (*Up, error) {
	if err := os.MkdirAll(o.DataDir, 0o755); err != nil {
		return nil, err
	}
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	args := []string{"up", "--data-dir", o.DataDir, "--listen", addr, "--agent", o.Bins.Agent,
		"--node-id", o.NodeID, "--log-level", "warn", "--import", "busybox:latest=" + o.Rootfs}
	args = append(args, o.Args...)
	u := &Up{DataDir: o.DataDir, Endpoint: "http://" + addr, log: &tailBuffer{max: 64 << 10}, done: make(chan struct{})}
	// dsecd directly: `dsec up` would only hand over to it.
	u.cmd = exec.Command(o.Bins.Dsecd, args...)
	u.cmd.Stdout, u.cmd.Stderr = u.log, u.log
	// Its own process group, so a Ctrl-C on the terminal reaches only the
	// harness, which then stops dsec up in order. If the harness dies
	// anyway, dsec up gets SIGTERM and destroys its sandboxes itself.
	u.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := u.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start dsec up: %w", err)
	}
	go func() { u.err = u.cmd.Wait(); close(u.done) }()
	slog.Info("started dsec up", append([]any{"pid", u.cmd.Process.Pid, "listen", addr}, o.LogAttrs...)...)

	deadline := time.Now().Add(60 * time.Second)
	for delay := 10 * time.Millisecond; ; delay = min(2*delay, 250*time.Millisecond) {
		select {
		case <-u.done:
			return u, fmt.Errorf("dsec up exited before serving (%v):\n%s", u.err, u.log.String())
		case <-ctx.Done():
			return u, ctx.Err()
		case <-time.After(delay):
		}
		if healthy(u.Endpoint) {
			break
		}
		if time.Now().After(deadline) {
			return u, fmt.Errorf("dsec up not serving on %s after 60s:\n%s", addr, u.log.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(o.DataDir, "admin.token"))
	if err != nil {
		return u, fmt.Errorf("admin token: %w", err)
	}
	u.Token = strings.TrimSpace(string(b))
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

// PID is the process id of dsec up.
func (u *Up) PID() int { return u.cmd.Process.Pid }

// Log is the tail (64 KiB) of what dsec up wrote to stdout and stderr.
func (u *Up) Log() string { return u.log.String() }

// Stop sends SIGTERM (a clean stop destroys every sandbox and unmounts the
// layers) and waits; after stopGrace it kills the process group. It
// returns an error if dsec up had to be killed or exited with an error.
func (u *Up) Stop() error {
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
		_ = syscall.Kill(-u.PID(), syscall.SIGKILL)
		<-u.done
		return fmt.Errorf("dsec up (pid %d) killed: no clean stop after %v", u.PID(), stopGrace)
	}
}

func (u *Up) exitErr() error {
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
