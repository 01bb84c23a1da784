package controlplane

import (
	"context"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// runEvents is what one Run stream delivered.
type runEvents struct {
	first          string // sandbox_id of the first message
	stdout, stderr string
	result         *dsecv1.ExecResult
	resultID       string
	destroyErr     string
}

// run calls Run and collects its events; onCreated, when set, is called
// once the server says the sandbox exists.
func (c *cluster) run(ctx context.Context, token string, r *dsecv1.RunRequest, onCreated func(id string)) (runEvents, error) {
	var ev runEvents
	st, err := c.clients.sb.Run(ctx, req(token, r))
	if err != nil {
		return ev, err
	}
	defer st.Close()
	var out, errOut strings.Builder
	for st.Receive() {
		m := st.Msg()
		if ev.first == "" {
			ev.first = m.GetSandboxId()
			if onCreated != nil {
				onCreated(ev.first)
			}
		}
		out.Write(m.GetStdout())
		errOut.Write(m.GetStderr())
		if m.GetResult() != nil {
			ev.result, ev.resultID, ev.destroyErr = m.GetResult(), m.GetSandboxId(), m.GetDestroyError()
		}
	}
	ev.stdout, ev.stderr = out.String(), errOut.String()
	return ev, st.Err()
}

func runReq(image string, argv ...string) *dsecv1.RunRequest {
	return &dsecv1.RunRequest{Spec: &dsecv1.SandboxSpec{Image: image}, Exec: &dsecv1.ExecRequest{Argv: argv}}
}

func TestRun(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	c.addEdge("n1", placement.Capacity{MilliCPU: 100_000, Sandboxes: 8}, placement.Share{})
	c.addEdge("n2", placement.Capacity{MilliCPU: 100_000, Sandboxes: 8}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	alice := c.createTenant("alice", &dsecv1.Quota{MaxSandboxes: 1})
	live := func(token string) int { return len(c.list(token, nil)) }

	t.Run("create, exec and destroy in one call", func(t *testing.T) {
		creates := c.metric("dsec_server_sandbox_creates_total", nil)
		destroys := c.metric("dsec_server_sandbox_destroys_total", nil)
		ev, err := c.run(ctx, alice, runReq("busybox:1", "sh", "-c", "echo out; echo err >&2; echo $X; exit 3"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ids.NodeOf(ev.first); err != nil || ev.resultID != ev.first {
			t.Fatalf("first message names sandbox %q, the result %q (%v)", ev.first, ev.resultID, err)
		}
		if ev.stdout != "out\n\n" || ev.stderr != "err\n" {
			t.Errorf("output %q / %q", ev.stdout, ev.stderr)
		}
		r := ev.result
		if r.GetOutcome() != "failed" || r.GetExitCode() != 3 || len(r.GetStdout()) != 0 || ev.destroyErr != "" {
			t.Errorf("result %v, destroy error %q", r, ev.destroyErr)
		}
		// Gone when the call returns, and its quota slot free again.
		if n := live(alice); n != 0 {
			t.Errorf("alice has %d sandboxes after the run", n)
		}
		if got := c.metric("dsec_server_sandbox_creates_total", nil) - creates; got != 1 {
			t.Errorf("creates counted %v, want 1", got)
		}
		if got := c.metric("dsec_server_sandbox_destroys_total", nil) - destroys; got != 1 {
			t.Errorf("destroys counted %v, want 1", got)
		}
		ev, err = c.run(ctx, alice, &dsecv1.RunRequest{
			Spec: &dsecv1.SandboxSpec{Image: "busybox:1", Env: []string{"X=spec"}},
			Exec: &dsecv1.ExecRequest{Argv: []string{"sh", "-c", "echo $X $Y; pwd"}, Env: []string{"Y=exec"}, Cwd: "/tmp"},
		}, nil)
		if err != nil || ev.stdout != "spec exec\n/tmp\n" || ev.result.GetOutcome() != "ok" {
			t.Fatalf("second run: %q, %v, %v", ev.stdout, ev.result, err)
		}
	})

	t.Run("refusals create nothing", func(t *testing.T) {
		_, err := c.run(ctx, alice, runReq("nope:1", "true"), nil)
		wantCode(t, err, connect.CodeNotFound, "nope:1")
		_, err = c.run(ctx, alice, runReq("busybox:1"), nil)
		wantCode(t, err, connect.CodeInvalidArgument, "exec.argv")
		_, err = c.run(ctx, alice, &dsecv1.RunRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1"}}, nil)
		wantCode(t, err, connect.CodeInvalidArgument, "exec")
		_, err = c.run(ctx, alice, &dsecv1.RunRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:1"},
			Exec: &dsecv1.ExecRequest{SandboxId: "n1-0123456789abcdef", Argv: []string{"true"}}}, nil)
		wantCode(t, err, connect.CodeInvalidArgument, "exec.sandbox_id")
		_, err = c.run(ctx, "alice.wrong", runReq("busybox:1", "true"), nil)
		wantCode(t, err, connect.CodeUnauthenticated, "")
		// The quota counts a Run's sandbox like any other.
		sb, err := c.create(alice, &dsecv1.SandboxSpec{Image: "busybox:1"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.run(ctx, alice, runReq("busybox:1", "true"), nil)
		wantCode(t, err, connect.CodeResourceExhausted, "")
		if err := c.destroy(alice, sb.GetId()); err != nil {
			t.Fatal(err)
		}
		if n := live(alice); n != 0 {
			t.Errorf("alice has %d sandboxes after refused runs", n)
		}
	})

	t.Run("the sandbox is destroyed when the caller goes away", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		var id string
		_, err := c.run(cctx, c.admin, runReq("busybox:1", "sleep", "60"), func(got string) { id = got; cancel() })
		if connect.CodeOf(err) != connect.CodeCanceled {
			t.Fatalf("cancelled run: %v", err)
		}
		c.waitFor("the abandoned run's sandbox destroyed", func() bool { return byID(c.list(c.admin, nil))[id] == nil })
	})

	t.Run("a node that dies mid-run gives infra_error", func(t *testing.T) {
		ev, err := c.run(ctx, c.admin, runReq("busybox:1", "sleep", "60"), func(id string) {
			node, err := ids.NodeOf(id)
			if err != nil {
				t.Errorf("sandbox id %q: %v", id, err)
				return
			}
			c.edges[node].stop()
		})
		if err != nil {
			t.Fatal(err)
		}
		if ev.result.GetOutcome() != "infra_error" || !strings.Contains(ev.result.GetInfraError(), "mid-run") {
			t.Fatalf("result %v", ev.result)
		}
	})
}
