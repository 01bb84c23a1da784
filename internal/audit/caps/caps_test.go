package caps_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// The test binary re-executes itself in child mode to restrict a real
// process: Restrict is irreversible, so it must not run in the test process.
const (
	childEnv = "DSEC_CAPS_TEST_CHILD"
	dirEnv   = "DSEC_CAPS_TEST_DIR"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(child(mode))
	}
	os.Exit(m.Run())
}

func TestDockerDefault(t *testing.T) {
	s := caps.DockerDefault()
	if s.Has(unix.CAP_MKNOD) {
		t.Error("DockerDefault keeps CAP_MKNOD; sandboxes must not create device nodes")
	}
	for _, c := range []int{unix.CAP_CHOWN, unix.CAP_SETPCAP, unix.CAP_NET_BIND_SERVICE, unix.CAP_AUDIT_WRITE} {
		if !s.Has(c) {
			t.Errorf("DockerDefault lacks %s", caps.Name(c))
		}
	}
	for _, c := range []int{unix.CAP_SYS_ADMIN, unix.CAP_SYS_PTRACE, unix.CAP_NET_ADMIN, unix.CAP_DAC_READ_SEARCH} {
		if s.Has(c) {
			t.Errorf("DockerDefault keeps %s", caps.Name(c))
		}
	}
	if n := len(s.Caps()); n != 13 {
		t.Errorf("DockerDefault has %d capabilities, want Docker's 14 minus CAP_MKNOD = 13", n)
	}
}

func TestNamesRoundTrip(t *testing.T) {
	s := caps.DockerDefault()
	got, err := caps.Parse(s.Names())
	if err != nil {
		t.Fatal(err)
	}
	if got != s {
		t.Errorf("Parse(Names()) = %v, want %v", got, s)
	}
	got, err = caps.Parse([]string{"chown", "cap_kill", " CAP_SETUID "})
	if err != nil {
		t.Fatal(err)
	}
	if want := caps.Of(unix.CAP_CHOWN, unix.CAP_KILL, unix.CAP_SETUID); got != want {
		t.Errorf("Parse = %v, want %v", got, want)
	}
	if _, err := caps.Parse([]string{"CAP_FLY"}); err == nil {
		t.Error("Parse accepted CAP_FLY")
	}
	if n := caps.Name(unix.CAP_CHECKPOINT_RESTORE); n != "CAP_CHECKPOINT_RESTORE" {
		t.Errorf("Name(40) = %q", n)
	}
	if s := caps.Of(unix.CAP_CHOWN, unix.CAP_KILL).String(); s != "CAP_CHOWN,CAP_KILL" {
		t.Errorf("String = %q", s)
	}
	if s := caps.Of(63).Without(63); s != 0 {
		t.Errorf("Without left %v", s)
	}
}

func TestRestrict(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		mode string
		keep caps.Set
	}{
		{"docker", caps.DockerDefault()},
		{"none", 0},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"="+tc.mode, dirEnv+"="+dir)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("child: %v\n%s\n%s", err, out, stderr.Bytes())
			}
			checkReport(t, out, []string{"restrict", "threads", "status", "exec-status", "chown", "mknod", "restrict-again"})
		})
	}
}

// checkReport fails the test for every FAIL line and every expected check
// the child did not report.
func checkReport(t *testing.T, out []byte, want []string) {
	t.Helper()
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "SKIP "):
			t.Skip(strings.TrimPrefix(line, "SKIP "))
		case strings.HasPrefix(line, "ok "):
			seen[strings.TrimPrefix(line, "ok ")] = true
		case strings.HasPrefix(line, "FAIL "):
			name, _, _ := strings.Cut(strings.TrimPrefix(line, "FAIL "), ":")
			seen[name] = true
			t.Error(line)
		}
	}
	for _, w := range want {
		if !seen[w] {
			t.Errorf("child did not report check %q; output:\n%s", w, out)
		}
	}
}

type reporter struct{ failed bool }

func (r *reporter) check(name string, err error) {
	if err != nil {
		r.failed = true
		fmt.Printf("FAIL %s: %v\n", name, err)
		return
	}
	fmt.Printf("ok %s\n", name)
}

func child(mode string) int {
	keep := caps.DockerDefault()
	if mode == "none" {
		keep = 0
	}
	dir := os.Getenv(dirEnv)
	r := &reporter{}

	// Park a few goroutines on threads of their own so that the process has
	// several threads before Restrict: all of them must end up restricted.
	release := make(chan struct{})
	ready := make(chan struct{})
	for range 3 {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			ready <- struct{}{}
			<-release
		}()
	}
	for range 3 {
		<-ready
	}
	defer close(release)

	if err := caps.Restrict(keep); err != nil {
		if errors.Is(err, caps.ErrCgo) {
			fmt.Printf("SKIP %v\n", err) // a -race or cgo build of the test binary
			return 0
		}
		r.check("restrict", err)
		return 1
	}
	r.check("restrict", nil)

	tasks, err := filepath.Glob("/proc/self/task/*/status")
	if err == nil && len(tasks) < 4 {
		err = fmt.Errorf("only %d threads, want at least 4", len(tasks))
	}
	r.check("threads", err)

	var statusErr error
	for _, p := range tasks {
		b, err := os.ReadFile(p)
		if err == nil {
			err = checkStatus(b, keep)
		}
		if err != nil {
			statusErr = errors.Join(statusErr, fmt.Errorf("%s: %w", p, err))
		}
	}
	r.check("status", statusErr)

	// A command run as root after exec gets its permitted set from the
	// bounding set: it must come out exactly as restricted.
	out, err := exec.Command("/bin/cat", "/proc/self/status").Output()
	if err == nil {
		err = checkStatus(out, keep)
	}
	r.check("exec-status", err)

	f := filepath.Join(dir, "f")
	err = os.Chown(f, 1234, 1234)
	if keep.Has(unix.CAP_CHOWN) {
		r.check("chown", err)
	} else {
		r.check("chown", wantErrno(err, unix.EPERM))
	}

	err = unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))
	r.check("mknod", wantErrno(err, unix.EPERM))

	r.check("restrict-again", caps.Restrict(keep))

	if r.failed {
		return 1
	}
	return 0
}

func wantErrno(err error, want unix.Errno) error {
	if !errors.Is(err, want) {
		return fmt.Errorf("got %v, want %v", err, want)
	}
	return nil
}

// checkStatus compares the capability lines of a /proc status file.
func checkStatus(status []byte, keep caps.Set) error {
	fields := map[string]string{}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok {
			fields[k] = strings.TrimSpace(v)
		}
	}
	want := map[string]uint64{
		"CapBnd": uint64(keep), "CapPrm": uint64(keep), "CapEff": uint64(keep),
		"CapInh": uint64(keep), "CapAmb": 0, "NoNewPrivs": 1,
	}
	var errs error
	for k, w := range want {
		base := 16
		if k == "NoNewPrivs" {
			base = 10
		}
		got, err := strconv.ParseUint(fields[k], base, 64)
		if err != nil {
			errs = errors.Join(errs, fmt.Errorf("%s: %w", k, err))
			continue
		}
		if got != w {
			errs = errors.Join(errs, fmt.Errorf("%s = %#x, want %#x", k, got, w))
		}
	}
	return errs
}
