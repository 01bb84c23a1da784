package controlplane

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// answer is what the API made of one input: a Connect code (OK when the
// call succeeded), the exec outcome when there was a result, and the
// message or output to look into.
type answer struct {
	code    connect.Code
	outcome string
	text    string
}

// codeOK is the code of a call that succeeded (Connect has no name for it).
const codeOK connect.Code = 0

func (a answer) String() string { return fmt.Sprintf("%v/%q: %q", a.code, a.outcome, a.text) }

func answerOf(res *dsecv1.ExecResult, err error) answer {
	if err != nil {
		return answer{code: connect.CodeOf(err), text: err.Error()}
	}
	return answer{outcome: res.GetOutcome(), text: res.GetInfraError() + string(res.GetStdout()) + string(res.GetStderr())}
}

// httpCode is the Connect code /run_code's HTTP status stands for.
func httpCode(status int) connect.Code {
	if status == http.StatusOK {
		return codeOK
	}
	for _, c := range []connect.Code{connect.CodeInvalidArgument, connect.CodeUnauthenticated, connect.CodeNotFound,
		connect.CodeResourceExhausted, connect.CodeUnavailable, connect.CodeInternal} {
		if httpStatus(c) == status {
			return c
		}
	}
	return connect.CodeUnknown
}

// TestUserErrors is the API's classification table: what a caller sends,
// and the code or exec outcome it gets. A caller's bad input is
// InvalidArgument naming the field (never infra_error, "node not
// responding" or Unavailable, which trainers mask: a sample that could
// produce one would escape its reward); a create that no node can ever
// hold is refused at once. Real edge, real container backend.
func TestUserErrors(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 8000, MemoryBytes: 8 << 30, Sandboxes: 8}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	spec := &dsecv1.SandboxSpec{Image: "busybox:1"}
	sb, err := c.create(c.admin, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer c.destroy(c.admin, sb.GetId())
	id := sb.GetId()
	// numbered gets its own sandbox: its operations carry seq 1, 2, ...
	nb, err := c.create(c.admin, spec)
	if err != nil {
		t.Fatal(err)
	}
	defer c.destroy(c.admin, nb.GetId())
	if res, err := c.exec(c.admin, id, "sh", "-c", "head -c 2097152 /dev/zero > /tmp/2m"); err != nil || res.GetOutcome() != "ok" {
		t.Fatalf("make /tmp/2m: %v %v", res, err)
	}

	exec := func(r *dsecv1.ExecRequest) answer {
		if r.SandboxId == "" {
			r.SandboxId = id
		}
		resp, err := c.clients.sb.Exec(ctx, req(c.admin, r))
		if err != nil {
			return answerOf(nil, err)
		}
		return answerOf(resp.Msg.GetResult(), nil)
	}
	execStream := func(r *dsecv1.ExecRequest) answer {
		r.SandboxId = id
		st, err := c.clients.sb.ExecStream(ctx, req(c.admin, r))
		if err != nil {
			return answerOf(nil, err)
		}
		defer st.Close()
		var res *dsecv1.ExecResult
		for st.Receive() {
			if r := st.Msg().GetResult(); r != nil {
				res = r
			}
		}
		if err := st.Err(); err != nil {
			return answerOf(nil, err)
		}
		return answerOf(res, nil)
	}
	run := func(x *dsecv1.ExecRequest) answer {
		ev, err := c.run(ctx, c.admin, &dsecv1.RunRequest{Spec: spec, Exec: x}, nil)
		return answerOf(ev.result, err)
	}
	batch := func(x *dsecv1.ExecRequest) answer {
		x.SandboxId = id
		resp, err := c.clients.sb.BatchExec(ctx, req(c.admin, &dsecv1.BatchExecRequest{Requests: []*dsecv1.ExecRequest{x}}))
		if err != nil {
			return answerOf(nil, err)
		}
		it := resp.Msg.GetResults()[0]
		if e := it.GetError(); e != nil {
			var code connect.Code
			if err := code.UnmarshalText([]byte(e.GetCode())); err != nil {
				return answer{code: connect.CodeUnknown, text: e.GetCode() + ": " + e.GetMessage()}
			}
			return answer{code: code, text: e.GetMessage()}
		}
		return answerOf(it.GetResult(), nil)
	}
	readFile := func(r *dsecv1.ReadFileRequest) answer {
		if r.SandboxId == "" {
			r.SandboxId = id
		}
		_, err := c.clients.sb.ReadFile(ctx, req(c.admin, r))
		return answerOf(&dsecv1.ExecResult{Outcome: "ok"}, err)
	}
	writeFile := func(r *dsecv1.WriteFileRequest) answer {
		if r.SandboxId == "" {
			r.SandboxId = id
		}
		_, err := c.clients.sb.WriteFile(ctx, req(c.admin, r))
		return answerOf(&dsecv1.ExecResult{Outcome: "ok"}, err)
	}
	runCode := func(body map[string]any) answer {
		status, _, out := c.postRunCode(t, c.admin, body)
		a := answer{code: httpCode(status), text: fmt.Sprint(out["message"])}
		if status == http.StatusOK {
			a.outcome = fmt.Sprint(out["status"])
		}
		return a
	}
	args := func(n, size int) []string {
		a := []string{"true"}
		for range n {
			a = append(a, strings.Repeat("x", size))
		}
		return a
	}
	huge := &durationpb.Duration{Seconds: 9_300_000_000}
	const invalid = connect.CodeInvalidArgument

	for _, tc := range []struct {
		name    string
		call    func() answer
		code    connect.Code
		outcome string // for code OK
		mention string
	}{
		{"argv with NUL", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"echo", "a\x00b"}}) }, invalid, "", "argv[1]"},
		{"env with NUL", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Env: []string{"A=b\x00c"}}) }, invalid, "", "env[0]"},
		{"env name with NUL", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Env: []string{"A\x00=b"}}) }, invalid, "", "env[0]"},
		{"shell with NUL", func() answer { return exec(&dsecv1.ExecRequest{Shell: "echo a\x00b"}) }, invalid, "", "shell"},
		{"cwd with NUL", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Cwd: "/tmp\x00x"}) }, invalid, "", "cwd"},
		{"user with NUL", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, User: "root\x00"}) }, invalid, "", "user"},
		{"one 2 MiB argument", func() answer { return exec(&dsecv1.ExecRequest{Argv: args(1, 2<<20)}) }, invalid, "", "argv[1]"},
		{"2 MiB of arguments", func() answer { return exec(&dsecv1.ExecRequest{Argv: args(32, 64<<10)}) }, invalid, "", "argv and env"},
		{"2 MiB of environment", func() answer {
			env := make([]string, 32)
			for i := range env {
				env[i] = fmt.Sprintf("V%d=%s", i, strings.Repeat("x", 64<<10))
			}
			return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Env: env})
		}, invalid, "", "argv and env"},
		{"800 KiB of arguments run", func() answer { return exec(&dsecv1.ExecRequest{Argv: args(8, 100<<10)}) }, codeOK, "ok", ""},
		{"timeout 9.3e9 s", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: huge}) }, invalid, "", "timeout"},
		{"timeout past the limit", func() answer {
			return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: durationpb.New(limits.MaxExecTimeout + time.Hour)})
		}, invalid, "", "timeout"},
		{"timeout 1 h runs", func() answer {
			return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: durationpb.New(time.Hour)})
		}, codeOK, "ok", ""},
		{"negative timeout", func() answer {
			return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: durationpb.New(-time.Second)})
		}, invalid, "", "timeout"},
		{"negative max_output_bytes", func() answer { return exec(&dsecv1.ExecRequest{Argv: []string{"true"}, MaxOutputBytes: -1}) }, invalid, "", "max_output_bytes"},
		{"no command", func() answer { return exec(&dsecv1.ExecRequest{}) }, invalid, "", "argv"},
		{"stream: argv with NUL", func() answer { return execStream(&dsecv1.ExecRequest{Argv: []string{"echo", "a\x00b"}}) }, invalid, "", "argv[1]"},
		{"stream: timeout 9.3e9 s", func() answer { return execStream(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: huge}) }, invalid, "", "timeout"},
		{"batch: argv with NUL", func() answer { return batch(&dsecv1.ExecRequest{Argv: []string{"echo", "a\x00b"}}) }, invalid, "", "requests[0].argv[1]"},
		{"batch: timeout 9.3e9 s", func() answer { return batch(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: huge}) }, invalid, "", "requests[0].timeout"},
		{"run: argv with NUL", func() answer { return run(&dsecv1.ExecRequest{Argv: []string{"echo", "a\x00b"}}) }, invalid, "", "exec.argv[1]"},
		{"run: timeout 9.3e9 s", func() answer { return run(&dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: huge}) }, invalid, "", "exec.timeout"},
		{"write: path with NUL", func() answer { return writeFile(&dsecv1.WriteFileRequest{Path: "/tmp/a\x00b", Data: []byte("x")}) }, invalid, "", "path"},
		{"write: path too long", func() answer { return writeFile(&dsecv1.WriteFileRequest{Path: "/" + strings.Repeat("a", 5000)}) }, invalid, "", "path"},
		{"read: path with NUL", func() answer { return readFile(&dsecv1.ReadFileRequest{Path: "/etc/passwd\x00"}) }, invalid, "", "path"},
		{"read: file larger than max_bytes", func() answer { return readFile(&dsecv1.ReadFileRequest{Path: "/tmp/2m", MaxBytes: 1 << 20}) }, invalid, "", "max_bytes"},
		{"read: within max_bytes", func() answer { return readFile(&dsecv1.ReadFileRequest{Path: "/tmp/2m", MaxBytes: 4 << 20}) }, codeOK, "ok", ""},
		// Numbered requests go to the node even when invalid (it records
		// the refusal under the number): the node says InvalidArgument.
		{"numbered: argv with NUL", func() answer {
			return exec(&dsecv1.ExecRequest{SandboxId: nb.GetId(), Seq: 1, Argv: []string{"echo", "a\x00b"}})
		}, invalid, "", "argv[1]"},
		{"numbered: timeout 9.3e9 s", func() answer {
			return exec(&dsecv1.ExecRequest{SandboxId: nb.GetId(), Seq: 2, Argv: []string{"true"}, Timeout: huge})
		}, invalid, "", "timeout"},
		{"numbered: write path with NUL", func() answer {
			return writeFile(&dsecv1.WriteFileRequest{SandboxId: nb.GetId(), Seq: 3, Path: "/a\x00"})
		}, invalid, "", "path"},
		{"numbered: read path with NUL", func() answer {
			return readFile(&dsecv1.ReadFileRequest{SandboxId: nb.GetId(), Seq: 4, Path: "/a\x00"})
		}, invalid, "", "path"},
		{"create: memory beyond any machine", func() answer {
			_, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MemoryBytes: math.MaxInt64}})
			return answerOf(nil, err)
		}, invalid, "", "memory_bytes"},
		{"create: CPU beyond any machine", func() answer {
			_, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: math.MaxInt64 / 2}})
			return answerOf(nil, err)
		}, invalid, "", "milli_cpu"},
		{"create: memory no node can ever hold", func() answer {
			_, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MemoryBytes: 1 << 43}})
			return answerOf(nil, err)
		}, connect.CodeResourceExhausted, "", "memory_bytes"},
		// A CPU limit is a limit, not a reservation: one above the
		// node's cores is the whole node's CPU (as cpu 4 on a 2-core
		// node, the reference's own example spec).
		{"create: CPU beyond any node is the whole node", func() answer {
			sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 1 << 29}})
			if err != nil {
				return answerOf(nil, err)
			}
			return answerOf(c.exec(c.admin, sb.GetId(), "true"))
		}, codeOK, "ok", ""},
		{"run_code: unknown field", func() answer { return runCode(map[string]any{"code": "print(1)", "language": "python", "imag": "x:1"}) }, invalid, "", `"imag"`},
		{"run_code: image runs the call", func() answer {
			return runCode(map[string]any{"code": "echo hi", "language": "sh", "image": "busybox:1"})
		}, codeOK, "Success", ""},
		{"run_code: image is honoured", func() answer {
			return runCode(map[string]any{"code": "print(1)", "language": "python", "image": "nope:1"})
		}, connect.CodeNotFound, "", "nope:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.call()
			if got.code != tc.code || (tc.code == codeOK && got.outcome != tc.outcome) {
				t.Fatalf("got %v, want %v %q", got, tc.code, tc.outcome)
			}
			if tc.mention != "" && !strings.Contains(got.text, tc.mention) {
				t.Fatalf("%v does not name %q", got, tc.mention)
			}
			if strings.Contains(got.text, "not responding") || strings.Contains(got.text, "failed the operation") || got.outcome == "infra_error" {
				t.Fatalf("a caller's input came back as an infrastructure failure: %v", got)
			}
		})
	}
	// The sandboxes are fine after all that.
	for _, s := range []string{id, nb.GetId()} {
		if res, err := c.exec(c.admin, s, "echo", "ok"); err != nil || string(res.GetStdout()) != "ok\n" {
			t.Errorf("sandbox %s after the table: %v %v", s, res, err)
		}
	}
}
