package seccomp_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/audit/seccomp"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// The test binary re-executes itself in a child mode to install the filter
// in a real process (a filter cannot be removed, so never in the test
// process). The parent compiles the program and hands it over as bytes on
// stdin, as the edge hands it to the agent.
const (
	childEnv = "DSEC_SECCOMP_TEST_CHILD"
	dirEnv   = "DSEC_SECCOMP_TEST_DIR"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(child(mode))
	}
	os.Exit(m.Run())
}

// runChild starts the test binary in mode with the default program on
// stdin and returns its stdout.
func runChild(t testing.TB, mode, dir string) []byte {
	t.Helper()
	p, err := seccomp.Default()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := p.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+mode, dirEnv+"="+dir)
	cmd.Stdin = bytes.NewReader(raw)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child %s: %v\nstdout:\n%s\nstderr:\n%s", mode, err, out, stderr.Bytes())
	}
	return out
}

func TestInstall(t *testing.T) {
	testutil.RequireRoot(t)
	common := []string{
		"install", "unshare", "mount", "keyctl", "clone3", "personality-query", "personality-set",
		"socket-inet", "socket-alg", "files", "exec", "cp", "chown", "ioctl-allowed", "threads",
		"ioctl/FICLONE", "ioctl/FICLONE-high-bits", "ioctl/FICLONERANGE", "ioctl/FIDEDUPERANGE",
		"ioctl/EXT4_IOC_MOVE_EXT", "ioctl/XFS_IOC_SWAPEXT", "ioctl/XFS_IOC_EXCHANGE_RANGE",
		"ioctl/XFS_IOC_COMMIT_RANGE", "ioctl/F2FS_IOC_MOVE_RANGE",
	}
	for _, tc := range []struct {
		mode string
		want []string
	}{
		// The filter alone, installed by full root (the CAP_SYS_ADMIN path):
		// every denial here is the filter's doing, not a missing capability.
		{"filter", common},
		// The sandbox: capabilities restricted, then the filter.
		{"sandbox", append([]string{"restrict", "mknod"}, common...)},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			dir := prepareDir(t)
			// Unfiltered, FICLONE on these files fails (or works) for reasons
			// of the file system, never with EPERM: so the child's EPERM can
			// only come from the filter.
			if err := ficlone(dir, 0); errors.Is(err, unix.EPERM) {
				t.Fatalf("FICLONE without a filter already fails with EPERM; the test would prove nothing")
			}
			checkReport(t, runChild(t, tc.mode, dir), tc.want)
		})
	}
}

func prepareDir(t testing.TB) string {
	dir := t.TempDir()
	for _, name := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(dir, name), bytes.Repeat([]byte(name), 8192), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func ficlone(dir string, high uint64) error {
	src, err := os.Open(filepath.Join(dir, "a"))
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(filepath.Join(dir, "b"), os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer dst.Close()
	_, _, e := unix.Syscall(unix.SYS_IOCTL, dst.Fd(), uintptr(high|unix.FICLONE), src.Fd())
	if e != 0 {
		return e
	}
	return nil
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

func wantErrno(err error, want unix.Errno) error {
	if !errors.Is(err, want) {
		return fmt.Errorf("got %v, want %v", err, want)
	}
	return nil
}

func errnoErr(e unix.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func readProgram() (seccomp.Program, error) {
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		return nil, err
	}
	var p seccomp.Program
	return p, p.UnmarshalBinary(raw)
}

func child(mode string) int {
	switch mode {
	case "bench-install":
		return benchInstallChild()
	case "bench-syscall", "bench-syscall-filtered":
		return benchSyscallChild(mode == "bench-syscall-filtered")
	case "tsync":
		return tsyncChild()
	}
	dir := os.Getenv(dirEnv)
	r := &reporter{}
	p, err := readProgram()
	if err != nil {
		r.check("install", err)
		return 1
	}
	if mode == "sandbox" {
		if err := caps.Restrict(caps.DockerDefault()); err != nil {
			if errors.Is(err, caps.ErrCgo) {
				fmt.Printf("SKIP %v\n", err) // a -race or cgo build of the test binary
				return 0
			}
			r.check("restrict", err)
			return 1
		}
		r.check("restrict", nil)
	}
	if err := seccomp.Install(p); err != nil {
		r.check("install", err)
		return 1
	}
	r.check("install", nil)

	// Denied by the filter.
	r.check("unshare", wantErrno(unix.Unshare(unix.CLONE_NEWNS), unix.EPERM))
	r.check("mount", wantErrno(unix.Mount("none", dir, "tmpfs", 0, ""), unix.EPERM))
	_, err = unix.KeyctlInt(unix.KEYCTL_GET_KEYRING_ID, unix.KEY_SPEC_SESSION_KEYRING, 0, 0, 0)
	r.check("keyctl", wantErrno(err, unix.EPERM))
	_, _, e := unix.Syscall(unix.SYS_CLONE3, 0, 0, 0)
	r.check("clone3", wantErrno(errnoErr(e), unix.ENOSYS))
	_, _, e = unix.Syscall(unix.SYS_PERSONALITY, 0xffffffff, 0, 0)
	r.check("personality-query", errnoErr(e))
	_, _, e = unix.Syscall(unix.SYS_PERSONALITY, 0x0040000 /* ADDR_NO_RANDOMIZE */, 0, 0)
	r.check("personality-set", wantErrno(errnoErr(e), unix.EPERM))
	_, err = unix.Socket(unix.AF_ALG, unix.SOCK_SEQPACKET, 0)
	r.check("socket-alg", wantErrno(err, unix.EPERM))
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
	if err == nil {
		unix.Close(fd)
	}
	r.check("socket-inet", err)

	checkIoctls(r, dir)

	// Ordinary work goes on.
	f := filepath.Join(dir, "c")
	err = os.WriteFile(f, []byte("hello"), 0o600)
	if err == nil {
		var b []byte
		b, err = os.ReadFile(f)
		if err == nil && string(b) != "hello" {
			err = fmt.Errorf("read back %q", b)
		}
	}
	r.check("files", err)
	r.check("exec", exec.Command("/bin/true").Run())
	err = exec.Command("/bin/cp", filepath.Join(dir, "a"), filepath.Join(dir, "copy")).Run()
	if err == nil {
		var a, c []byte
		a, _ = os.ReadFile(filepath.Join(dir, "a"))
		c, err = os.ReadFile(filepath.Join(dir, "copy"))
		if err == nil && !bytes.Equal(a, c) {
			err = errors.New("copy differs from the original")
		}
	}
	r.check("cp", err)
	r.check("chown", os.Chown(f, 1234, 1234))

	if mode == "sandbox" {
		err = unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))
		r.check("mknod", wantErrno(err, unix.EPERM))
	}

	// Threads started after Install inherit the filter; threads that existed
	// got it through TSYNC. Both must show it.
	release := make(chan struct{})
	ready := make(chan struct{})
	for range 4 {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			ready <- struct{}{}
			<-release
		}()
	}
	for range 4 {
		<-ready
	}
	r.check("threads", checkThreads(mode == "sandbox"))
	close(release)

	if r.failed {
		return 1
	}
	return 0
}

func checkIoctls(r *reporter, dir string) {
	r.check("ioctl/FICLONE", wantErrno(ficlone(dir, 0), unix.EPERM))
	r.check("ioctl/FICLONE-high-bits", wantErrno(ficlone(dir, 1<<32), unix.EPERM))

	dst, err := os.OpenFile(filepath.Join(dir, "b"), os.O_RDWR, 0)
	if err != nil {
		r.check("ioctl-open", err)
		return
	}
	defer dst.Close()
	var n int32
	_, _, e := unix.Syscall(unix.SYS_IOCTL, dst.Fd(), unix.TIOCINQ /* FIONREAD */, uintptr(unsafe.Pointer(&n)))
	r.check("ioctl-allowed", errnoErr(e))

	// A zeroed argument block: with the filter the kernel never reads it.
	// EXT4_IOC_SWAP_BOOT is left out: if the filter were broken it would
	// swap blocks with the host file system's boot loader inode.
	var arg [256]byte
	for _, io := range seccomp.DeniedIoctls {
		if io.Name == "FICLONE" || io.Name == "EXT4_IOC_SWAP_BOOT" {
			continue
		}
		_, _, e := unix.Syscall(unix.SYS_IOCTL, dst.Fd(), uintptr(io.Cmd), uintptr(unsafe.Pointer(&arg)))
		r.check("ioctl/"+io.Name, wantErrno(errnoErr(e), unix.EPERM))
	}
}

// checkThreads reads the status of every thread of this process: each must
// be under exactly one filter and, in a sandbox, hold exactly the kept
// capabilities with no_new_privs set.
func checkThreads(sandbox bool) error {
	files, err := filepath.Glob("/proc/self/task/*/status")
	if err != nil {
		return err
	}
	if len(files) < 5 {
		return fmt.Errorf("only %d threads, want at least 5", len(files))
	}
	keep := fmt.Sprintf("%016x", uint64(caps.DockerDefault()))
	var errs error
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			errs = errors.Join(errs, err)
			continue
		}
		want := map[string]string{"Seccomp": "2", "Seccomp_filters": "1"}
		if sandbox {
			want["NoNewPrivs"] = "1"
			want["CapBnd"] = keep
			want["CapEff"] = keep
			want["CapAmb"] = "0000000000000000"
		}
		for _, line := range strings.Split(string(b), "\n") {
			k, v, _ := strings.Cut(line, ":")
			if w, ok := want[k]; ok {
				if v = strings.TrimSpace(v); v != w {
					errs = errors.Join(errs, fmt.Errorf("%s: %s = %s, want %s", f, k, v, w))
				}
				delete(want, k)
			}
		}
		for k := range want {
			errs = errors.Join(errs, fmt.Errorf("%s: no %s line", f, k))
		}
	}
	return errs
}

// TestInstallReportsThreadSync gives one thread a filter of its own, which
// TSYNC cannot reconcile, and checks that Install names the failure.
func TestInstallReportsThreadSync(t *testing.T) {
	testutil.RequireRoot(t)
	checkReport(t, runChild(t, "tsync", ""), []string{"tsync"})
}

func tsyncChild() int {
	r := &reporter{}
	p, err := readProgram()
	if err != nil {
		r.check("tsync", err)
		return 1
	}
	runtime.LockOSThread()
	installed := make(chan error)
	release := make(chan struct{})
	go func() {
		// A locked goroutine runs on a thread of its own, not the main one.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		allow := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW}}
		fprog := unix.SockFprog{Len: 1, Filter: &allow[0]}
		_, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fprog)))
		installed <- errnoErr(e)
		<-release
	}()
	if err := <-installed; err != nil {
		r.check("tsync", fmt.Errorf("per-thread filter: %w", err))
		return 1
	}
	err = seccomp.Install(p)
	close(release)
	if !errors.Is(err, seccomp.ErrThreadSync) {
		r.check("tsync", fmt.Errorf("Install returned %v, want ErrThreadSync", err))
		return 1
	}
	r.check("tsync", nil)
	return 0
}

// BenchmarkInstall measures seccomp.Install of the default program in a
// fresh process per iteration (filters stack and cannot be removed, so one
// process cannot install many). ns/install is the install alone; ns/op
// includes starting the process.
func BenchmarkInstall(b *testing.B) {
	testutil.RequireRoot(b)
	var total time.Duration
	for i := 0; i < b.N; i++ {
		out := runChild(b, "bench-install", "")
		ns, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
		if err != nil {
			b.Fatalf("child said %q", out)
		}
		total += time.Duration(ns)
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "ns/install")
}

func benchInstallChild() int {
	p, err := readProgram()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
	start := time.Now()
	err = seccomp.Install(p)
	d := time.Since(start)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(d.Nanoseconds())
	return 0
}

// BenchmarkSyscallOverhead measures what the filter adds to a cheap syscall
// (getppid), with and without the default filter, in child processes that
// each time a million calls; ns/syscall is the figure to read.
func BenchmarkSyscallOverhead(b *testing.B) {
	testutil.RequireRoot(b)
	for _, mode := range []string{"bench-syscall", "bench-syscall-filtered"} {
		b.Run(mode, func(b *testing.B) {
			var sum float64
			for i := 0; i < b.N; i++ {
				out := runChild(b, mode, "")
				ns, err := strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
				if err != nil {
					b.Fatalf("child said %q", out)
				}
				sum += ns
			}
			b.ReportMetric(sum/float64(b.N), "ns/syscall")
		})
	}
}

func benchSyscallChild(filtered bool) int {
	p, err := readProgram()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if filtered {
		unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
		if err := seccomp.Install(p); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	const n = 1_000_000
	start := time.Now()
	for range n {
		unix.RawSyscall(unix.SYS_GETPPID, 0, 0, 0)
	}
	fmt.Println(float64(time.Since(start).Nanoseconds()) / n)
	return 0
}
