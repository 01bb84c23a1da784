package main

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// The daemon commands through the real binaries: the front dsec built from
// this tree and, next to it, dsecd and dsec-cli (testutil builds all
// three).

// runBin runs bin with args and env (nothing inherited but what env says)
// and returns its output and exit code.
func runBin(t *testing.T, env []string, bin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
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

// baseEnv is the test's environment without what steers the search for
// dsecd and dsec-cli, and with an empty PATH.
func baseEnv(t *testing.T, extra ...string) []string {
	t.Helper()
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, cli.DaemonEnv+"=") || strings.HasPrefix(kv, handoff.ClientEnv+"=") ||
			strings.HasPrefix(kv, "PATH=") || strings.HasPrefix(kv, "GODEBUG=") {
			continue
		}
		env = append(env, kv)
	}
	return append(append(env, "PATH="+t.TempDir()), extra...)
}

// loneDsec copies dsec into a directory of its own, with no dsecd or
// dsec-cli next to it.
func loneDsec(t *testing.T, dsec string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "dsec")
	in, err := os.Open(dsec)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDaemonCommandsReachDsecd(t *testing.T) {
	dsec := testutil.BuildBinary(t, "./cmd/dsec")
	for _, tc := range []struct {
		name string
		args []string
		want []string // in stdout
	}{
		{"up", []string{"up", "--help"}, []string{"dsecd up [flags]", "--auto-pool int", "--import", "--queue-size"}},
		{"server", []string{"server", "--help"}, []string{"dsecd server [flags]", "--node-timeout"}},
		{"edge", []string{"edge", "--help"}, []string{"dsecd edge --server", "--auto-pool int", "--advertise"}},
		// A client flag before the command: cobra routes it, and the flag
		// goes along (dsecd accepts dsec's client flags).
		{"flag first", []string{"--token-file", "/nonexistent", "up", "--help"}, []string{"dsecd up [flags]"}},
		{"help up", []string{"help", "up"}, []string{"dsecd up [flags]", "--data-dir"}},
		{"completion", []string{"__complete", "edge", "--auto"}, []string{"--auto-pool\t"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, errOut, code := runBin(t, baseEnv(t), dsec, tc.args...)
			if code != 0 {
				t.Fatalf("dsec %s: exit %d\n%s%s", strings.Join(tc.args, " "), code, out, errOut)
			}
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("dsec %s: stdout lacks %q:\n%s", strings.Join(tc.args, " "), w, out)
				}
			}
		})
	}

	// The arguments after the command, the exit code and the environment
	// all reach dsecd: it refuses the flag value it was given (exit 2,
	// before touching the data dir), and GODEBUG=inittrace=1 makes it
	// trace the initialisation of packages only dsecd links.
	data := filepath.Join(t.TempDir(), "data")
	_, errOut, code := runBin(t, baseEnv(t, "GODEBUG=inittrace=1"), dsec, "up", "--data-dir", data, "--auto-pool", "-1")
	if code != cli.ExitUsage || !strings.Contains(errOut, "dsecd: --auto-pool -1: must not be negative") {
		t.Errorf("dsec up --auto-pool -1: exit %d, stderr %q; want exit %d from dsecd", code, lastLines(errOut), cli.ExitUsage)
	}
	if !strings.Contains(errOut, "init github.com/prometheus/") {
		t.Errorf("dsec up under GODEBUG=inittrace=1 traced no prometheus package: dsecd did not get the environment")
	}
	if _, err := os.Stat(data); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused dsec up made its data dir (%v)", err)
	}
}

func TestDaemonSearchOrder(t *testing.T) {
	dsec := testutil.BuildBinary(t, "./cmd/dsec")
	dsecd := filepath.Join(filepath.Dir(dsec), cli.DaemonBinary)
	lone := loneDsec(t, dsec)

	// On $PATH only.
	pathDir := t.TempDir()
	if err := os.Symlink(dsecd, filepath.Join(pathDir, cli.DaemonBinary)); err != nil {
		t.Fatal(err)
	}
	env := append(baseEnv(t), "PATH="+pathDir) // the later PATH wins
	if out, errOut, code := runBin(t, env, lone, "up", "--help"); code != 0 || !strings.Contains(out, "dsecd up") {
		t.Errorf("dsecd on $PATH: exit %d, stdout %q, stderr %q", code, lastLines(out), errOut)
	}

	// $DSEC_DAEMON first, even when another dsecd is on $PATH.
	env = append(baseEnv(t), "PATH=/nonexistent", cli.DaemonEnv+"="+dsecd)
	if out, errOut, code := runBin(t, env, lone, "server", "--help"); code != 0 || !strings.Contains(out, "dsecd server") {
		t.Errorf("$DSEC_DAEMON: exit %d, stdout %q, stderr %q", code, lastLines(out), errOut)
	}
}

func TestMissingDaemon(t *testing.T) {
	dsec := testutil.BuildBinary(t, "./cmd/dsec")
	lone := loneDsec(t, dsec)
	for _, tc := range []struct {
		name string
		env  []string
		want []string // in stderr
	}{
		{"nowhere", nil, []string{"dsec: up: the daemon commands are in a separate binary, dsecd, and none was found", filepath.Join(filepath.Dir(lone), "dsecd"), "$PATH", "make build", "./cmd/dsecd", "$DSEC_DAEMON"}},
		{"bad DSEC_DAEMON", []string{cli.DaemonEnv + "=/nonexistent/dsecd"}, []string{"$DSEC_DAEMON=/nonexistent/dsecd", "no such file"}},
		{"DSEC_DAEMON is dsec", []string{cli.DaemonEnv + "=" + lone}, []string{"dsec itself"}},
		{"DSEC_DAEMON a directory", []string{cli.DaemonEnv + "=" + t.TempDir()}, []string{"not an executable file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, errOut, code := runBin(t, baseEnv(t, tc.env...), lone, "up", "--data-dir", t.TempDir())
			if code != cli.ExitError {
				t.Errorf("exit %d, want %d", code, cli.ExitError)
			}
			if out != "" {
				t.Errorf("stdout %q, want nothing", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q: %s", w, errOut)
				}
			}
		})
	}
}

// lastLines keeps test failures short.
func lastLines(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > 5 {
		lines = lines[len(lines)-5:]
	}
	return strings.Join(lines, "\n")
}

// TestMissingClient: without dsec-cli, the front serves nothing but the
// fast path of run, and says where it looked.
func TestMissingClient(t *testing.T) {
	dsec := testutil.BuildBinary(t, "./cmd/dsec")
	lone := loneDsec(t, dsec)
	for _, tc := range []struct {
		name string
		env  []string
		args []string
		want []string // in stderr
	}{
		{"nowhere", nil, []string{"sandbox", "ls"}, []string{"dsec: this command needs the full client, a separate binary, dsec-cli, and none was found",
			filepath.Join(filepath.Dir(lone), "dsec-cli"), "$PATH", "make build", "./cmd/dsec-cli", "$DSEC_CLI"}},
		// The fast path hands a run whose server is down to dsec-cli.
		{"run, server down", []string{"DSEC_ENDPOINT=127.0.0.1:1"}, []string{"run", "--image", "x:1", "--", "true"}, []string{"needs the full client"}},
		{"DSEC_CLI is dsec", []string{"DSEC_CLI=" + lone}, []string{"--help"}, []string{"$DSEC_CLI=" + lone, "dsec itself"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, errOut, code := runBin(t, baseEnv(t, tc.env...), lone, tc.args...)
			if code != cli.ExitError || out != "" {
				t.Errorf("exit %d, stdout %q; want exit %d and nothing", code, out, cli.ExitError)
			}
			for _, w := range tc.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q: %s", w, errOut)
				}
			}
		})
	}
}
