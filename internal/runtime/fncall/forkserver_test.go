package fncall_test

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path"
	"strconv"
	"strings"
	"testing"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
)

// pyCall runs code through fncall.Call (the fork server, for python) and
// fails the test on a SandboxError.
func pyCall(t *testing.T, sb rt.Sandbox, code string, stdin string, args ...string) fncall.Response {
	t.Helper()
	lang, _ := fncall.Lookup("python")
	r := fncall.Call(context.Background(), sb, lang, fncall.Request{Language: "python", Code: code, Stdin: []byte(stdin), Args: args}, rt.Resources{})
	if r.Status == fncall.StatusSandboxError || r.Run == nil {
		t.Fatalf("SandboxError: %s", describe(r))
	}
	return r
}

func reset(t *testing.T, sb rt.Sandbox) {
	t.Helper()
	if err := sb.(rt.Resetter).Reset(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestForkServerKeptAcrossResets: python calls are forks of one
// pre-started interpreter (their parent is not the agent, PID 1), which
// the sandbox keeps across Resets: consecutive calls share the parent.
func TestForkServerKeptAcrossResets(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	var parents []string
	for i := range 3 {
		if i > 0 {
			reset(t, sb)
		}
		r := pyCall(t, sb, "import os; print(os.getppid())", "")
		parents = append(parents, strings.TrimSpace(string(r.Run.Stdout)))
	}
	if parents[0] == "1" || parents[0] == "" {
		t.Fatalf("the call's parent is %q: not run by a fork server", parents[0])
	}
	if parents[1] != parents[0] || parents[2] != parents[0] {
		t.Errorf("parents %v: the fork server was not kept across resets", parents)
	}
}

// TestForkServerSameAsInterpreter: what a program sees and produces through
// the fork server is what it sees and produces run by a fresh interpreter
// (`python3 main.py ARGS` by the agent) in the same sandbox: output, exit
// code, signal, tracebacks, argv, module state and environment.
func TestForkServerSameAsInterpreter(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	lang, _ := fncall.Lookup("python")
	programs := []struct {
		name, code, stdin string
		args              []string
	}{
		{"hello", "print(1)", "", nil},
		{"stdin", "import sys\nprint(sys.stdin.read().upper(), end='')", "hello\nworld\n", nil},
		{"argv", "import sys, os\nprint(sys.argv, __name__, __file__, sys.path[0], os.getcwd(), sys.orig_argv[1:])", "", []string{"a", "b c"}},
		{"main-module", "import sys\nprint(sorted(k for k in globals()), __spec__, __package__, __cached__, type(__loader__).__name__)\nprint(sys.modules['__main__'] is sys.modules[__name__])", "", nil},
		{"modules", "import sys\nprint(sorted(sys.modules))", "", nil},
		{"environment", "import os\nprint(sorted(os.environ.items()))", "", nil},
		{"traceback", "def f():\n    return 1/0\n\nf()\n", "", nil},
		{"syntax-error", "print(\n", "", nil},
		{"exit-code", "import sys\nprint('before')\nsys.exit(3)", "", nil},
		{"exit-message", "import sys\nsys.exit('bye')", "", nil},
		{"signal", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", "", nil},
		{"atexit-and-threads", "import atexit, threading, time\natexit.register(lambda: print('atexit'))\nthreading.Thread(target=lambda: (time.sleep(0.1), print('thread'))).start()\nprint('main')", "", nil},
		{"unflushed-stderr", "import sys\nsys.stdout.write('out')\nsys.stderr.write('err')", "", nil},
		{"keyboard-interrupt", "raise KeyboardInterrupt", "", nil},
		{"session", "import os\nprint(os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())", "", nil},
	}
	for _, p := range programs {
		t.Run(p.name, func(t *testing.T) {
			reset(t, sb)
			fork := pyCall(t, sb, p.code, p.stdin, p.args...)
			reset(t, sb)
			// The same program, run the ordinary way.
			if err := sb.PutArchive(context.Background(), "/", archiveOf(t, fncall.WorkDir+"/main.py", p.code)); err != nil {
				t.Fatal(err)
			}
			res, err := sb.Exec(context.Background(), rt.ExecRequest{
				Argv: append([]string{"python3", fncall.WorkDir + "/main.py"}, p.args...), Env: lang.Env,
				Cwd: fncall.WorkDir, Stdin: []byte(p.stdin), Timeout: 10 * time.Second}, nil)
			if err != nil {
				t.Fatal(err)
			}
			got, want := fork.Run, res
			if string(got.Stdout) != string(want.Stdout) || string(got.Stderr) != string(want.Stderr) ||
				got.ReturnCode != want.ExitCode || got.Signal != want.Signal {
				t.Errorf("through the fork server:\n  rc=%d sig=%d stdout=%q\n  stderr=%q\nby a fresh interpreter:\n  rc=%d sig=%d stdout=%q\n  stderr=%q",
					got.ReturnCode, got.Signal, got.Stdout, got.Stderr, want.ExitCode, want.Signal, want.Stdout, want.Stderr)
			}
		})
	}
}

// TestForkServerIsolation: a call cannot reach into the fork server that
// the next call is forked from: its memory and descriptors are closed to
// it, what it may change (a resource limit) is put back by the Reset, and
// a server it stopped or killed is replaced, so the next call runs as
// usual.
func TestForkServerIsolation(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	r := pyCall(t, sb, `import os, resource
ppid = os.getppid()
for path in ("/proc/%d/mem" % ppid, "/proc/%d/fd/0" % ppid, "/proc/%d/environ" % ppid):
    try:
        open(path, "rb").close()
        print("opened", path)
    except OSError as e:
        print("refused", type(e).__name__)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
try:
    resource.prlimit(ppid, resource.RLIMIT_NOFILE, (64, 64))
    print("set limit")
except OSError as e:
    print("refused", type(e).__name__)
open("/tmp/left-behind", "w").write("x")
`, "")
	out := strings.Fields(string(r.Run.Stdout))
	if r.Status != fncall.StatusSuccess || len(out) != 9 || strings.Contains(string(r.Run.Stdout), "opened") {
		t.Fatalf("the call could open the fork server's memory, descriptors or environment, or failed: %s", describe(r))
	}
	// The sandbox's seccomp filter refuses setting another process's
	// limits (see seccomp.pid1Rules); Reset would put them back anyway.
	if out[7] != "refused" {
		t.Errorf("the call could set the fork server's resource limit: %s", describe(r))
	}
	limit := out[6]
	reset(t, sb)
	r = pyCall(t, sb, `import os, resource
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.path.exists("/tmp/left-behind"), os.getppid())
`, "")
	out = strings.Fields(string(r.Run.Stdout))
	if len(out) != 3 || out[0] != limit || out[1] != "False" {
		t.Fatalf("after the reset: %s; want the limit %s back and no file", describe(r), limit)
	}
	server := out[2]

	// Stopped: the program that did it is killed (its own failure, not
	// the sandbox's: a SandboxError would let a program have its sample
	// masked at will), and the server is replaced.
	// (Found at its time limit, when it cannot be killed normally.)
	lang, _ := fncall.Lookup("python")
	r = fncall.Call(context.Background(), sb, lang, fncall.Request{Language: "python", RunTimeout: time.Second,
		Code: "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nprint('stopped', flush=True)\nimport time\ntime.sleep(600)"}, rt.Resources{})
	if r.Status != fncall.StatusFailed || r.Run == nil || r.Run.Signal != 9 || string(r.Run.Stdout) != "stopped\n" {
		t.Fatalf("stopping the server: %s; want Failed, killed by signal 9, its output kept", describe(r))
	}
	reset(t, sb)
	r = pyCall(t, sb, "import os\nprint(os.getppid())", "")
	if r.Status != fncall.StatusSuccess || strings.TrimSpace(string(r.Run.Stdout)) == server {
		t.Fatalf("after stopping the server: %s; want a call served by a new server", describe(r))
	}
	// Killed: the call's result is still right, and so is the next call's.
	server = strings.TrimSpace(string(r.Run.Stdout))
	reset(t, sb)
	r = pyCall(t, sb, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('killed')", "")
	if r.Status != fncall.StatusFailed {
		t.Fatalf("killing the server: %s; want Failed", describe(r))
	}
	reset(t, sb)
	r = pyCall(t, sb, "import os\nprint(os.getppid())", "")
	if r.Status != fncall.StatusSuccess || strings.TrimSpace(string(r.Run.Stdout)) == server || strings.TrimSpace(string(r.Run.Stdout)) == "1" {
		t.Fatalf("after killing the server: %s; want a call served by a new server", describe(r))
	}
}

// TestForkServerTimeLimit: a forked call that outlives its time limit is
// killed with what it started, and the server serves the next call.
func TestForkServerTimeLimit(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	lang, _ := fncall.Lookup("python")
	code := "import subprocess, time\nsubprocess.Popen(['sleep', '600'])\ntime.sleep(600)\n"
	r := fncall.Call(context.Background(), sb, lang, fncall.Request{Language: "python", Code: code, RunTimeout: 500 * time.Millisecond}, rt.Resources{})
	if r.Status != fncall.StatusFailed || r.Run == nil || r.Run.Status != fncall.CommandTimeLimitExceeded {
		t.Fatalf("want Failed with TimeLimitExceeded, got %s", describe(r))
	}
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Shell: "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true"}, nil)
	if err != nil || strings.TrimSpace(string(res.Stdout)) != "0" {
		t.Errorf("sleep left after the time limit: %v %q %q", err, res.Stdout, res.Stderr)
	}
	reset(t, sb)
	r = pyCall(t, sb, "print(6*7)", "")
	if r.Status != fncall.StatusSuccess || strings.TrimSpace(string(r.Run.Stdout)) != strconv.Itoa(42) {
		t.Fatalf("next call: %s", describe(r))
	}
}

// archiveOf is a tar stream of one file (its directories included).
func archiveOf(t *testing.T, name, content string) io.Reader {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	rel := strings.TrimPrefix(name, "/")
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: path.Dir(rel) + "/", Mode: 0o777}); err != nil {
		t.Fatal(err)
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: rel, Mode: 0o644, Size: int64(len(content))}); err != nil {
		t.Fatal(err)
	}
	tw.Write([]byte(content))
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return &buf
}

// TestForkServerDescriptors: a sandbox keeping a python fork server
// across its Resets holds at most 4 descriptors in this process while it
// waits for its next call (its agent's socket and pidfd, the next Reset's
// prepared root, the server's connection): the edge's open-file limit
// bounds a node's sandboxes at that many each (internal/edge).
func TestForkServerDescriptors(t *testing.T) {
	e := newEnv(t)
	count := func() int {
		d, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(d)
	}
	use := func(sb rt.Sandbox) {
		pyCall(t, sb, "print(1)", "")
		reset(t, sb)
		if r := pyCall(t, sb, "print(2)", ""); strings.TrimSpace(string(r.Run.Stdout)) != "2" {
			t.Fatalf("second call: %s", describe(r))
		}
		reset(t, sb)
	}
	// What is opened once for all is open before the count.
	first := e.sandbox(t)
	use(first)
	if err := first.Destroy(context.Background()); err != nil {
		t.Fatal(err)
	}
	const n, perSandbox, shared = 4, 4, 2
	before := count()
	for range n {
		use(e.sandbox(t))
	}
	// A Reset prepares the next one's root in the background, with a
	// few descriptors open while it does: what counts is what is left.
	grew := 0
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if grew = count() - before; grew <= n*perSandbox+shared || time.Now().After(deadline) {
			break
		}
	}
	if grew > n*perSandbox+shared {
		t.Errorf("%d sandboxes with a fork server hold %d descriptors more, want at most %d each", n, grew, perSandbox)
	}
	t.Logf("%d sandboxes with a fork server: %d descriptors more", n, grew)
}
