// Package e2e runs DSec's real binaries as separate processes (dsec up,
// dsec server, dsec edge, the CLI) and checks what a user would see. The
// tests need root (sandboxes use namespaces, mounts and cgroups).
package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// binaries are the dsec and dsec-agent executables under test.
type binaries struct{ dsec, agent string }

func build(t *testing.T) binaries {
	t.Helper()
	testutil.RequireRoot(t)
	return binaries{
		dsec:  testutil.BuildBinary(t, "./cmd/dsec"),
		agent: testutil.BuildBinary(t, "./cmd/dsec-agent"),
	}
}

// freeAddr returns a loopback address nobody listens on right now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// daemon is one long-running dsec process.
type daemon struct {
	name string
	cmd  *exec.Cmd
	log  *syncBuffer
	done chan struct{}
	err  error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startDaemon starts dsec with args. At cleanup it is stopped with SIGTERM
// (a clean stop destroys its sandboxes) and killed if it does not exit.
func startDaemon(t *testing.T, name, bin string, args ...string) *daemon {
	t.Helper()
	d := &daemon{name: name, log: &syncBuffer{}, done: make(chan struct{})}
	d.cmd = exec.Command(bin, args...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		if d.stop(syscall.SIGTERM, time.Minute) != nil {
			t.Errorf("%s did not stop cleanly:\n%s", name, d.log.String())
		}
		if t.Failed() {
			t.Logf("%s log:\n%s", name, d.log.String())
		}
	})
	return d
}

// stop signals the daemon and waits up to grace for it to exit, then kills
// it. It returns an error if the daemon had to be killed.
func (d *daemon) stop(sig syscall.Signal, grace time.Duration) error {
	select {
	case <-d.done:
		return nil
	default:
	}
	d.cmd.Process.Signal(sig)
	select {
	case <-d.done:
		return nil
	case <-time.After(grace):
		d.cmd.Process.Kill()
		<-d.done
		return fmt.Errorf("%s killed after %v", d.name, grace)
	}
}

// waitHealthy polls base/healthz until it answers, the daemon exits, or the
// deadline passes.
func (d *daemon) waitHealthy(t *testing.T, base string) {
	t.Helper()
	poll(t, 30*time.Second, d.name+" healthy", func() (bool, error) {
		select {
		case <-d.done:
			return false, fmt.Errorf("%s exited (%v):\n%s", d.name, d.err, d.log.String())
		default:
		}
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
}

// poll calls cond until it reports true, fails, or timeout passes. It is
// how these tests wait for another process: never a fixed sleep.
func poll(t *testing.T, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for delay := 10 * time.Millisecond; ; delay = min(delay*2, 250*time.Millisecond) {
		ok, err := cond()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: not after %v", what, timeout)
		}
		time.Sleep(delay)
	}
}

// cli runs one dsec client command against endpoint with token.
type cli struct {
	bin, endpoint, token string
}

type result struct {
	stdout, stderr string
	code           int
}

func (c cli) run(t *testing.T, stdin io.Reader, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bin, args...)
	cmd.Env = append(os.Environ(), "DSEC_ENDPOINT="+c.endpoint, "DSEC_TOKEN="+c.token)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		t.Fatalf("dsec %s: %v", strings.Join(args, " "), err)
	}
	return r
}

// ok runs a command that must succeed and returns its trimmed stdout.
func (c cli) ok(t *testing.T, args ...string) string {
	t.Helper()
	r := c.run(t, nil, args...)
	if r.code != 0 {
		t.Fatalf("dsec %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return strings.TrimSpace(r.stdout)
}

func readToken(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// busyboxRootfs is a small root filesystem built from the host's busybox.
func busyboxRootfs(t *testing.T) string { return testsuite.BusyboxRootfs(t) }

// startUp runs `dsec up` on a fresh data dir and returns a CLI for it.
func startUp(t *testing.T, bins binaries) (cli, string) {
	t.Helper()
	data := t.TempDir()
	addr := freeAddr(t)
	d := startDaemon(t, "dsec up", bins.dsec, "up", "--data-dir", data, "--listen", addr,
		"--agent", bins.agent, "--node-id", "solo", "--log-level", "warn")
	endpoint := "http://" + addr
	d.waitHealthy(t, endpoint)
	return cli{bin: bins.dsec, endpoint: endpoint, token: readToken(t, filepath.Join(data, "admin.token"))}, data
}
