package main

import (
	"bytes"
	"errors"
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

	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// TestRunPathsAgree runs the same `run` invocations through the front's
// fast path (dsec) and through the full client (dsec-cli) against one
// real `dsec up`, and requires the same stdout, stderr and exit code. The
// fast-path runs get DSEC_CLI pointing nowhere, so a silent fallback to
// dsec-cli would fail them; the cases the fast path leaves to dsec-cli
// (server down, bad usage) run normally and must agree too.
func TestRunPathsAgree(t *testing.T) {
	testutil.RequireRoot(t)
	dsec := testutil.BuildBinary(t, "./cmd/dsec")
	cli := filepath.Join(filepath.Dir(dsec), handoff.ClientBinary)
	agent := testutil.BuildBinary(t, "./cmd/dsec-agent")
	endpoint, token := startUp(t, dsec, agent)

	// A port nobody listens on: the server is down.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := ln.Addr().String()
	ln.Close()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	img := []string{"run", "--image", "busybox:latest"}
	for _, tc := range []struct {
		name  string
		args  []string
		stdin string
		env   []string
		// fast: the front must serve it without dsec-cli.
		fast bool
		code int
	}{
		{name: "success", args: append(img, "--", "echo", "hello"), fast: true},
		{name: "exit code", args: append(img, "--", "sh", "-c", "exit 3"), fast: true, code: 3},
		{name: "stdout and stderr", args: append(img, "--", "sh", "-c", "echo out; echo err >&2; echo more; exit 1"), fast: true, code: 1},
		{name: "signal", args: append(img, "--", "sh", "-c", "kill -9 $$"), fast: true, code: 128 + 9},
		{name: "timeout", args: append(img, "--timeout", "200ms", "--", "sleep", "30"), fast: true, code: 124},
		// run sends no stdin (the command reads an empty one), on both paths.
		{name: "stdin", args: append(img, "--", "sh", "-c", "cat; echo done"), stdin: "ignored\n", fast: true},
		{name: "flags", args: append(img, "-e", "A=1", "--env=B=2", "-w", "/tmp", "--cpu", "0.5", "--memory", "64m",
			"--disk-size", "512m", "--label", "k=v", "--sandbox-env", "C=3", "--ttl", "1h", "--", "sh", "-c", "echo $A $B $C; pwd"), fast: true},
		{name: "network", args: append(img, "--net-allow", "pypi", "--net-deny=npm", "--", "sh", "-c", "echo $http_proxy"), fast: true},
		{name: "bad network rule", args: append(img, "--net-allow", "pipy", "--", "true"), fast: true, code: 125},
		{name: "token file", args: append([]string{"run", "--token-file", tokenFile, "--image", "busybox:latest"}, "--", "true"),
			env: []string{"DSEC_TOKEN="}, fast: true},
		{name: "missing image", args: []string{"run", "--image", "nope:latest", "--", "true"}, fast: true, code: 125},
		{name: "bad token", args: append(img, "--", "true"), env: []string{"DSEC_TOKEN=wrong"}, fast: true, code: 125},
		{name: "no token", args: append(img, "--", "true"), env: []string{"DSEC_TOKEN="}, fast: true, code: 125},
		{name: "token with a newline", args: append(img, "--", "true"), env: []string{"DSEC_TOKEN=a\nb"}, code: 125},
		{name: "bad spec", args: []string{"run", "--image", "busybox:latest", "--backend", "nope", "--", "true"}, fast: true, code: 125},
		{name: "server down", args: append(img, "--", "true"), env: []string{"DSEC_ENDPOINT=" + down}, code: 125},
		{name: "no command", args: img, code: 2},
		{name: "unknown flag", args: append(img, "--bogus", "--", "true"), code: 2},
		{name: "bad timeout", args: append(img, "--timeout", "-1s", "--", "true"), code: 2},
		{name: "bad disk size", args: append(img, "--disk-size", "-1g", "--", "true"), code: 2},
		{name: "missing token file", args: append([]string{"run", "--token-file", "/nonexistent"}, append(img[1:], "--", "true")...), code: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := append(os.Environ(), "DSEC_ENDPOINT="+endpoint, "DSEC_TOKEN="+token)
			env = append(env, tc.env...)
			fastEnv := env
			if tc.fast {
				fastEnv = append(env, handoff.ClientEnv+"=/nonexistent/dsec-cli")
			}
			fOut, fErr, fCode := runWith(t, fastEnv, tc.stdin, dsec, tc.args...)
			sOut, sErr, sCode := runWith(t, env, tc.stdin, cli, tc.args...)
			if fOut != sOut || fErr != sErr || fCode != sCode {
				t.Errorf("dsec %s:\nfast path: exit %d, stdout %q, stderr %q\ndsec-cli:  exit %d, stdout %q, stderr %q",
					strings.Join(tc.args, " "), fCode, fOut, fErr, sCode, sOut, sErr)
			}
			if sCode != tc.code {
				t.Errorf("dsec-cli %s: exit %d, want %d (stderr %q)", strings.Join(tc.args, " "), sCode, tc.code, sErr)
			}
		})
	}
}

// runWith runs bin with args, env and stdin and returns its output and
// exit code.
func runWith(t *testing.T, env []string, stdin, bin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatalf("%s %s: %v", bin, strings.Join(args, " "), err)
	}
	return out.String(), errOut.String(), code
}

// startUp runs `dsec up` (through the front, which hands it to dsecd) on
// a fresh data directory with busybox imported, and returns its endpoint
// and admin token. Cleanup stops it (SIGTERM destroys its sandboxes).
func startUp(t *testing.T, dsec, agent string) (endpoint, token string) {
	t.Helper()
	data := t.TempDir()
	rootfs := testsuite.BusyboxRootfs(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	var (
		logMu sync.Mutex
		log   bytes.Buffer
	)
	w := writerFunc(func(b []byte) (int, error) { logMu.Lock(); defer logMu.Unlock(); return log.Write(b) })
	cmd := exec.Command(dsec, "up", "--data-dir", data, "--listen", addr, "--agent", agent, "--node-id", "paths",
		"--log-level", "warn", "--import", "busybox:latest="+rootfs)
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(time.Minute):
			cmd.Process.Kill()
			<-done
			t.Error("dsec up did not stop in a minute")
		}
		if t.Failed() {
			logMu.Lock()
			t.Logf("dsec up log:\n%s", log.String())
			logMu.Unlock()
		}
	})
	endpoint = "http://" + addr
	deadline := time.Now().Add(60 * time.Second)
	for delay := 5 * time.Millisecond; ; delay = min(2*delay, 100*time.Millisecond) {
		select {
		case err := <-done:
			t.Fatalf("dsec up exited: %v\n%s", err, log.String())
		case <-time.After(delay):
		}
		if resp, err := http.Get(endpoint + "/healthz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("dsec up not serving after a minute:\n%s", log.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(data, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	return endpoint, strings.TrimSpace(string(b))
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
