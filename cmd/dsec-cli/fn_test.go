package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/cmd/dsec/cli"
)

// The fn and pool commands against a scripted server (Connect handlers on
// httptest): what they send, print and exit with. Running them against a
// real `dsec up` is part of the Python SDK's live tests
// (sdk/python/tests/test_fncall.py, test_pools.py).

// fakeFn answers RunCode by the code's first word and records requests.
type fakeFn struct {
	dsecv1connect.UnimplementedFnServiceHandler
	mu   sync.Mutex
	reqs []*dsecv1.RunCodeRequest
}

func finished(code int32, stdout, stderr string) *dsecv1.CommandResult {
	return &dsecv1.CommandResult{Status: "Finished", ReturnCode: code, Stdout: []byte(stdout), Stderr: []byte(stderr)}
}

func (f *fakeFn) RunCode(_ context.Context, r *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	f.mu.Lock()
	f.reqs = append(f.reqs, r.Msg)
	f.mu.Unlock()
	word, _, _ := strings.Cut(r.Msg.GetCode(), " ")
	var resp *dsecv1.RunCodeResponse
	switch word {
	case "ok":
		resp = &dsecv1.RunCodeResponse{Status: "Success", RunResult: finished(0, "out:"+string(r.Msg.GetStdin()), "warn\n")}
	case "exit3":
		resp = &dsecv1.RunCodeResponse{Status: "Failed", RunResult: finished(3, "partial\n", "boom\n")}
	case "tle":
		resp = &dsecv1.RunCodeResponse{Status: "Failed", RunResult: &dsecv1.CommandResult{Status: "TimeLimitExceeded", ReturnCode: -1, Signal: 9}}
	case "killed":
		resp = &dsecv1.RunCodeResponse{Status: "Failed", RunResult: &dsecv1.CommandResult{Status: "Finished", Signal: 9, OomKilled: true}}
	case "badc":
		resp = &dsecv1.RunCodeResponse{Status: "Failed", CompileResult: finished(1, "", "main.c:1: error: expected ';'\n")}
	case "slowc":
		resp = &dsecv1.RunCodeResponse{Status: "Failed", CompileResult: &dsecv1.CommandResult{Status: "TimeLimitExceeded"}}
	case "compiled":
		resp = &dsecv1.RunCodeResponse{Status: "Success", CompileResult: finished(0, "", "note: ok\n"), RunResult: finished(0, "ran\n", "")}
	case "broken":
		resp = &dsecv1.RunCodeResponse{Status: "SandboxError", Message: "the sandbox's node failed"}
	case "busy":
		err := connect.NewError(connect.CodeUnavailable, errors.New("no capacity: the admission queue is full"))
		err.Meta().Set("Retry-After", "3")
		return nil, err
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("language %q: unknown", r.Msg.GetLanguage()))
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeFn) last() *dsecv1.RunCodeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reqs[len(f.reqs)-1]
}

// fakePools keeps pools in memory.
type fakePools struct {
	dsecv1connect.UnimplementedPoolServiceHandler
	mu    sync.Mutex
	pools []*dsecv1.Pool
	last  *dsecv1.CreatePoolRequest
}

func (f *fakePools) Create(_ context.Context, r *connect.Request[dsecv1.CreatePoolRequest]) (*connect.Response[dsecv1.CreatePoolResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last = r.Msg
	p := &dsecv1.Pool{Id: fmt.Sprintf("solo-p%d", len(f.pools)+1), Spec: r.Msg.GetSpec(), Size: r.Msg.GetSize(), Node: "solo"}
	f.pools = append(f.pools, p)
	return connect.NewResponse(&dsecv1.CreatePoolResponse{Pool: p}), nil
}

func (f *fakePools) List(context.Context, *connect.Request[dsecv1.ListPoolsRequest]) (*connect.Response[dsecv1.ListPoolsResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return connect.NewResponse(&dsecv1.ListPoolsResponse{Pools: f.pools}), nil
}

func (f *fakePools) Delete(_ context.Context, r *connect.Request[dsecv1.DeletePoolRequest]) (*connect.Response[dsecv1.DeletePoolResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, p := range f.pools {
		if p.Id == r.Msg.GetId() {
			f.pools = append(f.pools[:i], f.pools[i+1:]...)
			return connect.NewResponse(&dsecv1.DeletePoolResponse{}), nil
		}
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("pool %q not found", r.Msg.GetId()))
}

func fakeAPI(t *testing.T, fn *fakeFn, pools *fakePools) string {
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewFnServiceHandler(fn))
	mux.Handle(dsecv1connect.NewPoolServiceHandler(pools))
	hs := httptest.NewUnstartedServer(mux)
	// The CLI speaks h2c to http:// endpoints.
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	return hs.URL
}

// runCLIStdio is runCLI with the command's stdout and stderr apart.
func runCLIStdio(t *testing.T, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	root := newRoot()
	root.SetArgs(args)
	var out, errb strings.Builder
	root.SetOut(&out)
	root.SetErr(&errb)
	root.SetIn(strings.NewReader(stdin))
	err := root.Execute()
	msg := errb.String()
	if err != nil {
		msg += err.Error()
	}
	return out.String(), msg, report(err)
}

func TestFnRun(t *testing.T) {
	fn := &fakeFn{}
	url := fakeAPI(t, fn, &fakePools{})
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	input := write("input.txt", "42\n")
	base := []string{"--endpoint", url, "--token", "t", "fn", "run"}
	tests := []struct {
		name           string
		args           []string
		stdin          string
		code           int
		stdout, stderr string
	}{
		{"success", []string{"--language", "bash", "--stdin", input, write("ok.sh", "ok echo")}, "", 0, "out:42\n", "warn\n"},
		{"code from stdin", []string{"-l", "bash", "-"}, "ok from stdin", 0, "out:", ""},
		{"exit code", []string{"-l", "bash", write("e.sh", "exit3")}, "", 3, "partial\n", "boom\n"},
		{"time limit", []string{"-l", "bash", "--timeout", "1s", write("t.sh", "tle")}, "", cli.ExitTimeout, "", "program timed out"},
		{"killed", []string{"-l", "bash", write("k.sh", "killed")}, "", 128 + 9, "", "out of memory"},
		{"compile error", []string{"-l", "c", write("bad.c", "badc")}, "", cli.ExitError, "", "main.c:1: error: expected ';'\n"},
		{"compile time limit", []string{"-l", "c", write("slow.c", "slowc")}, "", cli.ExitTimeout, "", "compiling timed out"},
		{"compiled", []string{"-l", "c", write("good.c", "compiled")}, "", 0, "ran\n", ""},
		{"sandbox error", []string{"-l", "bash", write("b.sh", "broken")}, "", cli.ExitInfra, "", "the sandbox's node failed"},
		{"unavailable", []string{"-l", "bash", write("busy.sh", "busy")}, "", cli.ExitInfra, "", "retry after 3s"},
		{"unknown language", []string{"-l", "cobol", write("x.cob", "x")}, "", cli.ExitInfra, "", `language "cobol": unknown`},
		{"no language", []string{write("y.sh", "ok")}, "", cli.ExitUsage, "", "--language is required"},
		{"no file", []string{"-l", "bash"}, "", cli.ExitUsage, "", "want FILE|-"},
		{"two files", []string{"-l", "bash", input, input}, "", cli.ExitUsage, "", "want FILE|-"},
		{"missing file", []string{"-l", "bash", filepath.Join(dir, "nosuch.sh")}, "", cli.ExitUsage, "", "no such file"},
		{"directory", []string{"-l", "bash", dir}, "", cli.ExitUsage, "", "is a directory"},
		{"stdin twice", []string{"-l", "bash", "--stdin", "-", "-"}, "", cli.ExitUsage, "", "already comes from stdin"},
		{"negative timeout", []string{"-l", "bash", "--timeout", "-1s", input}, "", cli.ExitUsage, "", "must not be negative"},
		{"bad memory", []string{"-l", "bash", "--memory", "lots", input}, "", cli.ExitUsage, "", "memory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, errOut, code := runCLIStdio(t, tt.stdin, append(base, tt.args...)...)
			if code != tt.code || !strings.Contains(out, tt.stdout) || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("dsec fn run %s: exit %d, stdout %q, stderr %q; want exit %d, stdout with %q, stderr with %q",
					strings.Join(tt.args, " "), code, out, errOut, tt.code, tt.stdout, tt.stderr)
			}
		})
	}

	// What the request carries: flags, program arguments after --.
	_, errOut, code := runCLIStdio(t, "", append(base, "-l", "python", "--image", "py:3", "--memory", "300m",
		"--timeout", "2s", "--compile-timeout", "3s", write("args.py", "ok"), "--", "a", "-b")...)
	if code != 0 {
		t.Fatalf("fn run with flags: exit %d: %s", code, errOut)
	}
	r := fn.last()
	if r.GetLanguage() != "python" || r.GetImage() != "py:3" || r.GetMemoryLimitMb() != 300 ||
		r.GetRunTimeout().AsDuration().String() != "2s" || r.GetCompileTimeout().AsDuration().String() != "3s" ||
		strings.Join(r.GetArgs(), " ") != "a -b" || r.GetCode() != "ok" {
		t.Fatalf("request sent: %v", r)
	}
}

func TestPoolCommands(t *testing.T) {
	pools := &fakePools{}
	url := fakeAPI(t, &fakeFn{}, pools)
	base := []string{"--endpoint", url, "--token", "t", "pool"}
	run := func(args ...string) (string, string, int) {
		return runCLIStdio(t, "", append(slices.Clone(base), args...)...)
	}

	out, msg, code := run("create", "--image", "busybox:latest", "--size", "3", "--cpu", "0.5", "--memory", "64m",
		"--sandbox-env", "A=1", "--min-size", "1", "--idle-shrink", "5m")
	if code != 0 || out != "solo-p1\n" {
		t.Fatalf("pool create: exit %d, stdout %q: %s", code, out, msg)
	}
	pools.mu.Lock()
	req := pools.last
	pools.mu.Unlock()
	if req.GetSize() != 3 || req.GetMinSize() != 1 || req.GetIdleShrink().AsDuration().String() != "5m0s" ||
		req.GetSpec().GetImage() != "busybox:latest" || req.GetSpec().GetResources().GetMilliCpu() != 500 ||
		req.GetSpec().GetResources().GetMemoryBytes() != 64<<20 || strings.Join(req.GetSpec().GetEnv(), ",") != "A=1" {
		t.Fatalf("pool create sent %v", req)
	}
	if _, _, code := run("create", "--image", "busybox:latest", "--size", "1"); code != 0 {
		t.Fatal("second pool create failed")
	}
	pools.mu.Lock()
	pools.pools[0].Ready, pools.pools[0].InUse, pools.pools[0].Hits, pools.pools[0].Misses = 2, 1, 7, 1
	pools.mu.Unlock()

	out, msg, code = run("ls")
	rows := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if code != 0 || len(rows) != 3 {
		t.Fatalf("pool ls: exit %d: %q %s", code, out, msg)
	}
	if f := strings.Fields(rows[0]); strings.Join(f, " ") != "ID IMAGE SIZE READY IN USE HITS MISSES NODE" {
		t.Fatalf("pool ls header %q", rows[0])
	}
	if f := strings.Fields(rows[1]); strings.Join(f, " ") != "solo-p1 busybox:latest 3 2 1 7 1 solo" {
		t.Fatalf("pool ls row %q", rows[1])
	}

	out, _, code = run("ls", "--json")
	var js []poolJSON
	if err := json.Unmarshal([]byte(out), &js); code != 0 || err != nil || len(js) != 2 {
		t.Fatalf("pool ls --json: exit %d, %v: %s", code, err, out)
	}
	if js[0].ID != "solo-p1" || js[0].Ready != 2 || js[0].InUse != 1 || js[0].MilliCPU != 500 || js[0].Image != "busybox:latest" {
		t.Fatalf("pool ls --json: %+v", js[0])
	}

	if _, msg, code := run("rm", "solo-p1"); code != 0 {
		t.Fatalf("pool rm: exit %d: %s", code, msg)
	}
	if _, msg, code := run("rm", "solo-p1"); code != cli.ExitError || !strings.Contains(msg, "not found") {
		t.Fatalf("pool rm of a deleted pool: exit %d: %s", code, msg)
	}
	if _, msg, code := run("rm", "solo-p2", "solo-p9"); code != cli.ExitError || !strings.Contains(msg, "1 of 2 pools") {
		t.Fatalf("pool rm of two, one unknown: exit %d: %s", code, msg)
	}
	for _, bad := range [][]string{
		{"create", "--size", "2"},
		{"create", "--image", "busybox:latest"},
		{"create", "--image", "busybox:latest", "--size", "0"},
		{"create", "--image", "busybox:latest", "--size", "2", "--min-size", "3"},
		{"create", "--image", "busybox:latest", "--size", "2", "--cpu", "lots"},
		{"rm"},
		{"ls", "extra"},
	} {
		if _, msg, code := run(bad...); code != cli.ExitUsage {
			t.Errorf("pool %s: exit %d (%s), want %d", strings.Join(bad, " "), code, msg, cli.ExitUsage)
		}
	}
}
