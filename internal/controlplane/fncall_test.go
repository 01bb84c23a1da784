package controlplane

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"net/netip"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// postRunCode sends a SandboxFusion /run_code body and decodes the reply
// into a generic map, so the test sees the exact field names.
func (c *cluster) postRunCode(t *testing.T, token string, body any) (int, http.Header, map[string]any) {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	r, err := http.NewRequest(http.MethodPost, c.url+"/run_code", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("Content-Type", "application/json")
	if token != "" {
		r.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("/run_code reply (HTTP %d) is not JSON: %v", resp.StatusCode, err)
	}
	return resp.StatusCode, resp.Header, out
}

func keys(m map[string]any) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

func TestRunCode(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 64}, placement.Share{})
	// The "sh" language needs only a POSIX shell: busybox stands in for the
	// language image under its default name.
	if _, err := c.importPath(c.admin, fncall.DefaultImage, testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}

	code, _, out := c.postRunCode(t, c.admin, map[string]any{
		"code": "read x; echo \"$x $1\"; cat a.txt; echo o > out.txt; echo e >&2", "language": "sh",
		"compile_timeout": 5, "run_timeout": 5.5, "memory_limit_MB": 128, "stdin": "hi\n",
		"files":       map[string]string{"a.txt": base64.StdEncoding.EncodeToString([]byte("A\n"))},
		"fetch_files": []string{"out.txt"}, "args": []string{"arg"},
	})
	if code != http.StatusOK {
		t.Fatalf("HTTP %d: %v", code, out)
	}
	if got, want := keys(out), []string{"compile_result", "executor_pod_name", "files", "message", "run_result", "status"}; !slices.Equal(got, want) {
		t.Errorf("response fields %v, want %v", got, want)
	}
	run, _ := out["run_result"].(map[string]any)
	if got, want := keys(run), []string{"execution_time", "return_code", "status", "stderr", "stdout"}; !slices.Equal(got, want) {
		t.Errorf("run_result fields %v, want %v", got, want)
	}
	files, _ := out["files"].(map[string]any)
	if out["status"] != "Success" || run["status"] != "Finished" || run["stdout"] != "hi arg\nA\n" || run["stderr"] != "e\n" ||
		run["return_code"] != 0.0 || out["compile_result"] != nil || files["out.txt"] != base64.StdEncoding.EncodeToString([]byte("o\n")) {
		t.Fatalf("reply %v", out)
	}
	if et, ok := run["execution_time"].(float64); !ok || et <= 0 {
		t.Errorf("execution_time %v", run["execution_time"])
	}

	_, _, out = c.postRunCode(t, c.admin, map[string]any{"code": "exit 4", "language": "sh"})
	run, _ = out["run_result"].(map[string]any)
	if out["status"] != "Failed" || run["status"] != "Finished" || run["return_code"] != 4.0 {
		t.Fatalf("exit 4: %v", out)
	}
	_, _, out = c.postRunCode(t, c.admin, map[string]any{"code": "sleep 5", "language": "sh", "run_timeout": 0.3})
	run, _ = out["run_result"].(map[string]any)
	if out["status"] != "Failed" || run["status"] != "TimeLimitExceeded" {
		t.Fatalf("time limit: %v", out)
	}

	// Bad input and missing tokens are refused with a reason.
	code, _, out = c.postRunCode(t, c.admin, map[string]any{"code": "x", "language": "cobol"})
	if code != http.StatusBadRequest || out["status"] != "SandboxError" {
		t.Fatalf("unknown language: HTTP %d %v", code, out)
	}
	code, _, out = c.postRunCode(t, c.admin, map[string]any{"code": "x", "language": "sh", "run_timeout": -1})
	if code != http.StatusBadRequest {
		t.Fatalf("negative run_timeout: HTTP %d %v", code, out)
	}
	code, _, _ = c.postRunCode(t, "", map[string]any{"code": "echo", "language": "sh"})
	if code != http.StatusUnauthorized {
		t.Fatalf("no token: HTTP %d, want 401", code)
	}
	// Open to loopback without a token, when configured.
	c.srv.cfg.RunCodeOpen = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	code, _, out = c.postRunCode(t, "", map[string]any{"code": "echo open", "language": "sh"})
	if code != http.StatusOK || out["status"] != "Success" {
		t.Fatalf("tokenless call from an open network: HTTP %d %v", code, out)
	}
	c.srv.cfg.RunCodeOpen = nil

	// The Connect API serves the same call.
	fn := dsecv1connect.NewFnServiceClient(http.DefaultClient, c.url)
	resp, err := fn.RunCode(context.Background(), req(c.admin, &dsecv1.RunCodeRequest{Language: "sh", Code: "echo connect"}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.Status != "Success" || string(resp.Msg.RunResult.GetStdout()) != "connect\n" {
		t.Fatalf("FnService.RunCode: %v", resp.Msg)
	}
}

func TestAdmissionQueue(t *testing.T) {
	c := newCluster(t)
	c.srv.cfg.QueueSize = 1
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 2}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	spec := &dsecv1.SandboxSpec{Image: "busybox:1"}
	var held []string
	for range 2 {
		sb, err := c.create(c.admin, spec)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, sb.GetId())
	}
	c.waitFor("the node to report itself full", func() bool {
		res, err := c.srv.place(adminPrincipal(), nil, mustPrepare(t, c, spec), nil)
		if err == nil {
			c.srv.reg.release(res.id)
		}
		return err != nil
	})

	// A create waits at most the queue timeout, then says it waited.
	c.srv.cfg.QueueTimeout = 300 * time.Millisecond
	_, err := c.create(c.admin, spec)
	wantCode(t, err, connect.CodeResourceExhausted, "admission queue")
	c.srv.cfg.QueueTimeout = time.Minute

	// A create without a deadline waits in the queue...
	done := make(chan error, 1)
	go func() {
		_, err := c.create(c.admin, spec)
		done <- err
	}()
	c.waitFor("a create to wait in the queue", func() bool { return c.srv.queued.Load() == 1 })
	// ... the next finds the queue full: Unavailable with a retry-after hint.
	_, err = c.create(c.admin, spec)
	wantCode(t, err, connect.CodeUnavailable, "retry after")
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Meta().Get("Retry-After") == "" {
		t.Errorf("queue-full refusal has no Retry-After header: %v", err)
	}
	select {
	case err := <-done:
		t.Fatalf("the queued create returned before room appeared: %v", err)
	default:
	}
	// Room appears: the queued create goes through.
	if err := c.destroy(c.admin, held[0]); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("queued create: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the queued create never got the room a destroy freed")
	}
	if c.srv.queued.Load() != 0 {
		t.Errorf("queue length %d after the wait", c.srv.queued.Load())
	}

	// A create that no node could hold even empty does not wait (it
	// held a queue slot for the whole timeout): refused at once, naming
	// the field, and with no queue slot taken.
	c.srv.cfg.QueueTimeout = time.Hour
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	huge := &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MemoryBytes: 1 << 43}}
	_, err = c.clients.sb.Create(ctx, req(c.admin, &dsecv1.CreateSandboxRequest{Spec: huge}))
	wantCode(t, err, connect.CodeResourceExhausted, "spec.resources.memory_bytes")
	if ctx.Err() != nil || c.srv.queued.Load() != 0 {
		t.Errorf("the impossible create waited (%v) or holds a queue slot (%d)", ctx.Err(), c.srv.queued.Load())
	}
	c.srv.cfg.QueueTimeout = time.Minute
}

func TestBatchAndPools(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 64}, placement.Share{})
	c.addEdge("n2", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 64}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	alice := c.createTenant("alice", nil)
	spec := &dsecv1.SandboxSpec{Image: "busybox:1", Env: []string{"P=1"}}
	pools := dsecv1connect.NewPoolServiceClient(http.DefaultClient, c.url)
	created, err := pools.Create(ctx, req(alice, &dsecv1.CreatePoolRequest{Spec: spec, Size: 3}))
	if err != nil {
		t.Fatal(err)
	}
	pool := created.Msg.GetPool()
	if pool.GetSpec().GetImage() != "busybox:1" {
		t.Errorf("pool spec image %q, want the name alice used", pool.GetSpec().GetImage())
	}
	listed := func() *dsecv1.Pool {
		resp, err := pools.List(ctx, req(alice, &dsecv1.ListPoolsRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range resp.Msg.GetPools() {
			if p.GetId() == pool.GetId() {
				return p
			}
		}
		t.Fatalf("pool %s not listed", pool.GetId())
		return nil
	}
	c.waitFor("the pool to fill and be heartbeated", func() bool {
		return listed().GetReady() == 3 && len(c.srv.reg.warmNodes(mustPrepare(t, c, spec).key, "alice")) == 1
	})

	// Acquire takes the warm ones, on the pool's node.
	acq, err := c.clients.sb.Acquire(ctx, req(alice, &dsecv1.AcquireRequest{Spec: spec, Count: 3}))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i, r := range acq.Msg.GetResults() {
		if r.GetError() != nil {
			t.Fatalf("acquire item %d: %v", i, r.GetError())
		}
		if r.GetSandbox().GetNode() != pool.GetNode() {
			t.Errorf("acquired sandbox on %s, the pool is on %s", r.GetSandbox().GetNode(), pool.GetNode())
		}
		ids = append(ids, r.GetSandbox().GetId())
	}
	if h := listed().GetHits(); h != 3 {
		t.Errorf("pool hits %d after acquiring 3, want 3", h)
	}

	// BatchExec: per-item results; an unknown sandbox fails alone.
	reqs := []*dsecv1.ExecRequest{
		{SandboxId: ids[0], Shell: "echo $P"},
		{SandboxId: "n1-0123456789abcdef", Argv: []string{"true"}},
		{SandboxId: ids[1], Shell: "exit 2"},
		{SandboxId: ids[2]},
	}
	be, err := c.clients.sb.BatchExec(ctx, req(alice, &dsecv1.BatchExecRequest{Requests: reqs}))
	if err != nil {
		t.Fatal(err)
	}
	r := be.Msg.GetResults()
	if len(r) != 4 || string(r[0].GetResult().GetStdout()) != "1\n" || r[1].GetError().GetCode() != "not_found" ||
		r[2].GetResult().GetExitCode() != 2 || r[3].GetError().GetCode() != "invalid_argument" {
		t.Fatalf("batch exec results: %v", r)
	}

	// BatchRollback to per-sandbox checkpoints.
	var rbs []*dsecv1.RollbackRequest
	for _, id := range ids[:2] {
		ck, err := c.clients.sb.Checkpoint(ctx, req(alice, &dsecv1.CheckpointRequest{SandboxId: id}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.exec(alice, id, "touch", "/after"); err != nil {
			t.Fatal(err)
		}
		rbs = append(rbs, &dsecv1.RollbackRequest{SandboxId: id, CheckpointId: ck.Msg.GetCheckpointId()})
	}
	rbs = append(rbs, &dsecv1.RollbackRequest{SandboxId: ids[2]})
	rb, err := c.clients.sb.BatchRollback(ctx, req(alice, &dsecv1.BatchRollbackRequest{Requests: rbs}))
	if err != nil {
		t.Fatal(err)
	}
	if rr := rb.Msg.GetResults(); rr[0].GetError() != nil || rr[1].GetError() != nil || rr[2].GetError().GetCode() != "invalid_argument" {
		t.Fatalf("batch rollback results: %v", rr)
	}
	for _, id := range ids[:2] {
		if res, err := c.exec(alice, id, "test", "-e", "/after"); err != nil || res.GetExitCode() == 0 {
			t.Fatalf("after rollback /after exists in %s: %v %v", id, res, err)
		}
	}

	// Release ends them; the pool refills.
	rel, err := c.clients.sb.Release(ctx, req(alice, &dsecv1.ReleaseRequest{Ids: append(ids, "n1-0123456789abcdef")}))
	if err != nil {
		t.Fatal(err)
	}
	if rr := rel.Msg.GetResults(); rr[0].GetError() != nil || rr[3].GetError().GetCode() != "not_found" {
		t.Fatalf("release results: %v", rr)
	}
	c.waitFor("the pool to refill", func() bool { return listed().GetReady() == 3 && listed().GetInUse() == 0 })
	if _, err := pools.Delete(ctx, req(alice, &dsecv1.DeletePoolRequest{Id: pool.GetId()})); err != nil {
		t.Fatal(err)
	}
	_, err = pools.Delete(ctx, req(alice, &dsecv1.DeletePoolRequest{Id: pool.GetId()}))
	wantCode(t, err, connect.CodeNotFound, pool.GetId())
}

func adminPrincipal() iam.Principal { return iam.Principal{Tenant: iam.AdminTenant, Admin: true} }

func mustPrepare(t *testing.T, c *cluster, spec *dsecv1.SandboxSpec) *prepared {
	t.Helper()
	prep, err := c.srv.prepare(context.Background(), adminPrincipal(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return prep
}
