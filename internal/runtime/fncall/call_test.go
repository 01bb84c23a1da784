package fncall_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
)

// program is one language's versions of the programs every language must
// handle, read from testdata/programs/<language>/: adding a language to
// the table takes a directory of programs there, no test code.
type program struct {
	hello, echo, broken, exit3 string
	// brokenErr is in the compiler's (or interpreter's) stderr for broken.
	brokenErr string
}

func loadProgram(t *testing.T, lang string) program {
	t.Helper()
	dir := filepath.Join("testdata", "programs", lang)
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("language %s needs test programs: %v", lang, err)
		}
		return string(b)
	}
	return program{hello: read("hello"), echo: read("echo"), broken: read("broken"),
		brokenErr: strings.TrimSpace(read("broken.err")), exit3: read("exit3")}
}

// call runs req in a fresh sandbox and checks the response's shape: the
// compile result is there exactly for compiled languages that got that far.
func call(t *testing.T, e *env, req fncall.Request) fncall.Response {
	t.Helper()
	if err := req.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	lang, err := fncall.Lookup(req.Language)
	if err != nil {
		t.Fatal(err)
	}
	resp := fncall.Call(context.Background(), e.sandbox(t), lang, req, rt.Resources{})
	if resp.Status == fncall.StatusSandboxError {
		t.Fatalf("SandboxError: %s", resp.Message)
	}
	if lang.Compiled() != (resp.Compile != nil) {
		t.Errorf("%s: compiled %v but Compile result %+v", lang.Name, lang.Compiled(), resp.Compile)
	}
	return resp
}

func describe(r fncall.Response) string {
	var b strings.Builder
	b.WriteString(r.Status)
	if r.Message != "" {
		b.WriteString(" (" + r.Message + ")")
	}
	for _, c := range []struct {
		name string
		r    *fncall.CommandResult
	}{{"compile", r.Compile}, {"run", r.Run}} {
		if c.r != nil {
			b.WriteString("; " + c.name + ": " + c.r.Status)
			b.WriteString(" rc=" + strconv.Itoa(c.r.ReturnCode) + " sig=" + strconv.Itoa(c.r.Signal))
			b.WriteString(" stdout=" + clip(c.r.Stdout) + " stderr=" + clip(c.r.Stderr))
		}
	}
	return b.String()
}

func clip(b []byte) string {
	if len(b) > 400 {
		b = append(b[:400:400], "..."...)
	}
	return strings.ReplaceAll(string(b), "\n", `\n`)
}

// TestLanguages runs, for every language of the table, a hello world, a
// program echoing its stdin (bytes as they are), one that does not compile
// (or parse), and one that exits 3, each in a fresh sandbox.
func TestLanguages(t *testing.T) {
	e := newEnv(t)
	for _, lang := range fncall.Languages() {
		t.Run(lang.Name, func(t *testing.T) {
			p := loadProgram(t, lang.Name)
			t.Run("hello", func(t *testing.T) {
				r := call(t, e, fncall.Request{Language: lang.Name, Code: p.hello})
				if r.Status != fncall.StatusSuccess || r.Run == nil || string(r.Run.Stdout) != "hello\n" {
					t.Fatalf("want Success printing hello, got %s", describe(r))
				}
				if r.Run.Status != fncall.CommandFinished || r.Run.ReturnCode != 0 || r.Run.ExecutionTime <= 0 {
					t.Errorf("run result %+v", *r.Run)
				}
			})
			t.Run("stdin", func(t *testing.T) {
				in := []byte("line one\nline two: ünïcode\n")
				r := call(t, e, fncall.Request{Language: lang.Name, Code: p.echo, Stdin: in})
				if r.Status != fncall.StatusSuccess || r.Run == nil || !bytes.Equal(r.Run.Stdout, in) {
					t.Fatalf("want Success echoing %q, got %s", in, describe(r))
				}
			})
			t.Run("broken", func(t *testing.T) {
				r := call(t, e, fncall.Request{Language: lang.Name, Code: p.broken})
				if r.Status != fncall.StatusFailed {
					t.Fatalf("want Failed, got %s", describe(r))
				}
				step := r.Run
				if lang.Compiled() {
					if r.Run != nil {
						t.Errorf("compile error, yet the program ran: %s", describe(r))
					}
					step = r.Compile
				}
				if step == nil || step.Status != fncall.CommandFinished || step.ReturnCode == 0 ||
					!strings.Contains(string(step.Stderr), p.brokenErr) {
					t.Fatalf("want a finished step with a non-zero exit and %q in stderr, got %s", p.brokenErr, describe(r))
				}
			})
			t.Run("exit3", func(t *testing.T) {
				r := call(t, e, fncall.Request{Language: lang.Name, Code: p.exit3})
				if r.Status != fncall.StatusFailed || r.Run == nil || r.Run.Status != fncall.CommandFinished || r.Run.ReturnCode != 3 {
					t.Fatalf("want Failed with return code 3, got %s", describe(r))
				}
				if lang.Compiled() && (r.Compile.Status != fncall.CommandFinished || r.Compile.ReturnCode != 0) {
					t.Errorf("compile result %+v", *r.Compile)
				}
			})
		})
	}
}

// TestRunTimeLimit: a program that outlives its run timeout is killed and
// the call fails with TimeLimitExceeded; so is a child it left running.
func TestRunTimeLimit(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	lang, _ := fncall.Lookup("bash")
	req := fncall.Request{Language: "bash", Code: "sleep 600 & sleep 600\n", RunTimeout: 300 * time.Millisecond}
	r := fncall.Call(context.Background(), sb, lang, req, rt.Resources{})
	if r.Status != fncall.StatusFailed || r.Run == nil || r.Run.Status != fncall.CommandTimeLimitExceeded {
		t.Fatalf("want Failed with TimeLimitExceeded, got %s", describe(r))
	}
	if !strings.Contains(r.Message, "time limit") {
		t.Errorf("message %q does not mention the time limit", r.Message)
	}
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Shell: "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true"}, nil)
	if err != nil || strings.TrimSpace(string(res.Stdout)) != "0" {
		t.Errorf("sleep processes left after the time limit: %v %q %q", err, res.Stdout, res.Stderr)
	}
}

// TestCompileTimeLimit: a compiler that outlives the compile timeout fails
// the call with TimeLimitExceeded, and nothing runs.
func TestCompileTimeLimit(t *testing.T) {
	e := newEnv(t)
	// Constant evaluation of ~4e10 steps: g++ gives up at its 2^33
	// operation limit, minutes from now; without a timeout this would
	// fail as a compile error instead, never as a time limit.
	code := `constexpr long f() {
  long s = 0;
  for (long i = 0; i < 200000; i++)
    for (long j = 0; j < 200000; j++) s += i ^ j;
  return s;
}
static_assert(f() != 1, "unreachable");
int main() {}
`
	r := call(t, e, fncall.Request{Language: "cpp", Code: code, CompileTimeout: time.Second})
	if r.Status != fncall.StatusFailed || r.Compile == nil || r.Compile.Status != fncall.CommandTimeLimitExceeded {
		t.Fatalf("want Failed with compile TimeLimitExceeded, got %s", describe(r))
	}
	if r.Run != nil {
		t.Errorf("the program ran after its compile timed out: %s", describe(r))
	}
}

// TestMemoryLimit: a program allocating past memory_limit_mb is killed and
// the call fails; a smaller one passes; the sandbox's own limit is back
// after each call.
func TestMemoryLimit(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	cg := memoryCgroup(t, e.backend, sb.ID())
	lang, _ := fncall.Lookup("python")
	alloc := func(mb int) fncall.Request {
		// str * n writes every byte, so the memory is really used.
		return fncall.Request{Language: "python", MemoryLimitMB: 64,
			Code: "s = 'x' * (" + strconv.Itoa(mb) + " << 20)\nprint(len(s) >> 20)\n"}
	}
	r := fncall.Call(context.Background(), sb, lang, alloc(8), rt.Resources{})
	if r.Status != fncall.StatusSuccess || string(r.Run.Stdout) != "8\n" {
		t.Fatalf("8 MB under a 64 MB limit: want Success, got %s", describe(r))
	}
	if got := readMemoryLimit(t, cg); got != 0 {
		t.Errorf("after the call the memory limit is %d, want none (the base)", got)
	}

	r = fncall.Call(context.Background(), sb, lang, alloc(512), rt.Resources{})
	if r.Status != fncall.StatusFailed || r.Run == nil || !r.Run.OOMKilled || r.Run.Signal != 9 {
		t.Fatalf("512 MB under a 64 MB limit: want Failed, OOM-killed, got %s (oom=%v)", describe(r), r.Run != nil && r.Run.OOMKilled)
	}
	if !strings.Contains(r.Message, "memory limit") {
		t.Errorf("message %q does not mention the memory limit", r.Message)
	}
	if got := readMemoryLimit(t, cg); got != 0 {
		t.Errorf("after the call the memory limit is %d, want none (the base)", got)
	}

	// A base limit is restored too, and the language default applies
	// when the request sets none.
	base := rt.Resources{MemoryBytes: 300 << 20}
	req := alloc(400)
	req.MemoryLimitMB = 0
	if lang.MemoryLimitMB <= 400 {
		t.Fatalf("python's default limit %d MB is too small for this test", lang.MemoryLimitMB)
	}
	r = fncall.Call(context.Background(), sb, lang, req, base)
	if r.Status != fncall.StatusSuccess {
		t.Fatalf("400 MB under python's default limit of %d MB: want Success, got %s", lang.MemoryLimitMB, describe(r))
	}
	if got := readMemoryLimit(t, cg); got != base.MemoryBytes {
		t.Errorf("after the call the memory limit is %d, want the base %d", got, base.MemoryBytes)
	}

	// A call whose limit is the base's runs under the limit in force
	// (Call does not set it again) and says so when it is hit.
	req = alloc(400)
	req.MemoryLimitMB = base.MemoryBytes >> 20
	r = fncall.Call(context.Background(), sb, lang, req, base)
	if r.Status != fncall.StatusFailed || r.Run == nil || !r.Run.OOMKilled {
		t.Fatalf("400 MB under a %d MB limit equal to the base: want Failed, OOM-killed, got %s", req.MemoryLimitMB, describe(r))
	}
	if want := fmt.Sprintf("memory limit of %d MB", req.MemoryLimitMB); !strings.Contains(r.Message, want) {
		t.Errorf("message %q does not say %q", r.Message, want)
	}
	if got := readMemoryLimit(t, cg); got != base.MemoryBytes {
		t.Errorf("after the call the memory limit is %d, want the base %d", got, base.MemoryBytes)
	}
}

// TestOutputLimit: output past MaxOutputBytes is cut and flagged, on both
// streams, and the call still succeeds.
func TestOutputLimit(t *testing.T) {
	e := newEnv(t)
	code := "import sys\nsys.stdout.write('o' * 100000)\nsys.stderr.write('e' * 100000)\n"
	r := call(t, e, fncall.Request{Language: "python", Code: code, MaxOutputBytes: 1000})
	if r.Status != fncall.StatusSuccess {
		t.Fatalf("want Success, got %s", describe(r))
	}
	if string(r.Run.Stdout) != strings.Repeat("o", 1000) || !r.Run.StdoutTruncated {
		t.Errorf("stdout: %d bytes, truncated %v; want 1000, true", len(r.Run.Stdout), r.Run.StdoutTruncated)
	}
	if string(r.Run.Stderr) != strings.Repeat("e", 1000) || !r.Run.StderrTruncated {
		t.Errorf("stderr: %d bytes, truncated %v; want 1000, true", len(r.Run.Stderr), r.Run.StderrTruncated)
	}
	// Without the bound, all of it comes back.
	r = call(t, e, fncall.Request{Language: "python", Code: code})
	if len(r.Run.Stdout) != 100000 || r.Run.StdoutTruncated {
		t.Errorf("unbounded stdout: %d bytes, truncated %v", len(r.Run.Stdout), r.Run.StdoutTruncated)
	}
}

// TestFiles: files are written (relative and absolute, in new
// directories) before the code runs, and fetch_files reads back what
// exists; a missing one is left out, an unreadable one is named.
func TestFiles(t *testing.T) {
	e := newEnv(t)
	code := `
import os
a = open("data/in.txt").read()
b = open("/opt/abs/in.txt").read()
open("out.txt", "w").write(a.upper())
os.makedirs("/var/tmp/res", exist_ok=True)
open("/var/tmp/res/out.txt", "w").write(b.upper())
print(os.getcwd())
`
	r := call(t, e, fncall.Request{
		Language: "python",
		Code:     code,
		Files: map[string][]byte{
			"data/in.txt":     []byte("relative"),
			"/opt/abs/in.txt": []byte("absolute"),
		},
		FetchFiles: []string{"out.txt", "/var/tmp/res/out.txt", "missing.txt", "data/in.txt", "data"},
	})
	if r.Status != fncall.StatusSuccess || string(r.Run.Stdout) != fncall.WorkDir+"\n" {
		t.Fatalf("want Success printing the working directory, got %s", describe(r))
	}
	want := map[string]string{"out.txt": "RELATIVE", "/var/tmp/res/out.txt": "ABSOLUTE", "data/in.txt": "relative"}
	for name, content := range want {
		if got, ok := r.Files[name]; !ok || string(got) != content {
			t.Errorf("fetched %s = %q (present %v), want %q", name, got, ok, content)
		}
	}
	if len(r.Files) != len(want) {
		t.Errorf("fetched %d files, want %d (missing.txt and the directory left out): %v", len(r.Files), len(want), keys(r.Files))
	}
	if !strings.Contains(r.Message, "fetch data") {
		t.Errorf("message %q does not name the directory that could not be fetched", r.Message)
	}
}

// TestFetchAfterFailure: files are fetched even when the program fails.
func TestFetchAfterFailure(t *testing.T) {
	e := newEnv(t)
	r := call(t, e, fncall.Request{Language: "bash", Code: "echo partial > log.txt; exit 1", FetchFiles: []string{"log.txt"}})
	if r.Status != fncall.StatusFailed || string(r.Files["log.txt"]) != "partial\n" {
		t.Fatalf("want Failed with log.txt fetched, got %s, files %v", describe(r), keys(r.Files))
	}
}

func keys(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestArgs: args reach the program as separate arguments, unsplit, for an
// interpreted and a compiled language.
func TestArgs(t *testing.T) {
	e := newEnv(t)
	args := []string{"a b", "--flag", "", "$HOME", "ü"}
	for _, tc := range []struct{ lang, code string }{
		{"python", "import sys\nfor a in sys.argv[1:]: print('[' + a + ']')\n"},
		{"c", "#include <stdio.h>\nint main(int c, char **v) { for (int i = 1; i < c; i++) printf(\"[%s]\\n\", v[i]); }\n"},
	} {
		t.Run(tc.lang, func(t *testing.T) {
			r := call(t, e, fncall.Request{Language: tc.lang, Code: tc.code, Args: args})
			want := "[a b]\n[--flag]\n[]\n[$HOME]\n[ü]\n"
			if r.Status != fncall.StatusSuccess || string(r.Run.Stdout) != want {
				t.Fatalf("want Success printing %q, got %s", want, describe(r))
			}
		})
	}
}

// TestSignal: a program killed by a signal fails, with the signal reported.
func TestSignal(t *testing.T) {
	e := newEnv(t)
	r := call(t, e, fncall.Request{Language: "c", Code: "#include <stdlib.h>\nint main(void) { abort(); }\n"})
	if r.Status != fncall.StatusFailed || r.Run.Signal != 6 || r.Run.OOMKilled {
		t.Fatalf("want Failed with signal 6, got %s", describe(r))
	}
}

// TestSandboxError: a sandbox that is gone is reported as SandboxError,
// naming the step that failed.
func TestSandboxError(t *testing.T) {
	e := newEnv(t)
	sb := e.sandbox(t)
	if err := sb.Destroy(context.Background()); err != nil {
		t.Fatal(err)
	}
	lang, _ := fncall.Lookup("python")
	r := fncall.Call(context.Background(), sb, lang, fncall.Request{Language: "python", Code: "print(1)"}, rt.Resources{})
	if r.Status != fncall.StatusSandboxError || !strings.Contains(r.Message, "write files") {
		t.Fatalf("want SandboxError naming the write, got %s", describe(r))
	}
	if r.Run != nil || r.Compile != nil {
		t.Errorf("results of steps that never ran: %s", describe(r))
	}
}

// TestCallInvalid: Call refuses a request Validate would have refused as
// a SandboxError (a caller bug), without touching the sandbox.
func TestCallInvalid(t *testing.T) {
	e := newEnv(t)
	lang, _ := fncall.Lookup("python")
	r := fncall.Call(context.Background(), e.sandbox(t), lang, fncall.Request{Language: "python"}, rt.Resources{})
	if r.Status != fncall.StatusSandboxError || !strings.Contains(r.Message, "code is empty") {
		t.Fatalf("want SandboxError naming the empty code, got %s", describe(r))
	}
}

// BenchmarkCallPython is fncall's figure of merit: python3 print(1)
// through Call on one warm sandbox (no reset between calls). Compare with
// BenchmarkHostPython (design target: within 1.5x).
func BenchmarkCallPython(b *testing.B) {
	e := newEnv(b)
	sb := e.sandbox(b)
	lang, _ := fncall.Lookup("python")
	req := fncall.Request{Language: "python", Code: "print(1)"}
	ctx := context.Background()
	for b.Loop() {
		r := fncall.Call(ctx, sb, lang, req, rt.Resources{})
		if r.Status != fncall.StatusSuccess || string(r.Run.Stdout) != "1\n" {
			b.Fatalf("got %s", describe(r))
		}
	}
}

// BenchmarkCallPythonReset is BenchmarkCallPython the way a pool serves
// calls: each call in a sandbox reset after the previous one (the reset
// itself is not timed), under the edge's base limits, so every call also
// sets python's memory limit and puts the base back.
func BenchmarkCallPythonReset(b *testing.B) {
	e := newEnv(b)
	sb := e.sandbox(b)
	lang, _ := fncall.Lookup("python")
	req := fncall.Request{Language: "python", Code: "print(1)"}
	base := rt.Resources{MemoryBytes: 2 << 30, Pids: 1024}
	ctx := context.Background()
	if err := sb.(rt.Updater).Update(ctx, base); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		b.StopTimer()
		if err := sb.(rt.Resetter).Reset(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		r := fncall.Call(ctx, sb, lang, req, base)
		if r.Status != fncall.StatusSuccess || string(r.Run.Stdout) != "1\n" {
			b.Fatalf("got %s", describe(r))
		}
	}
}

// BenchmarkHostPython runs the same program directly on the host.
func BenchmarkHostPython(b *testing.B) {
	for b.Loop() {
		out, err := exec.Command("/usr/bin/python3", "-c", "print(1)").Output()
		if err != nil || string(out) != "1\n" {
			b.Fatalf("%v %q", err, out)
		}
	}
}
