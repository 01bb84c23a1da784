package edge_test

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/ids"
)

func (n *node) pools(t *testing.T, caller *dsecv1.Caller) []*dsecv1.Pool {
	t.Helper()
	resp, err := n.client.ListPoolsOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeListRequest{Caller: caller}))
	if err != nil {
		t.Fatalf("list pools: %v", err)
	}
	return resp.Msg.Pools
}

// waitPool polls the pool until ok holds; the deadline bounds a broken test.
func (n *node) waitPool(t *testing.T, id string, ok func(*dsecv1.Pool) bool) *dsecv1.Pool {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, p := range n.pools(t, admin) {
			if p.Id == id && ok(p) {
				return p
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool %s never reached the wanted state: %v", id, n.pools(t, admin))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestWarmPool(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "wp1", nil)
	spec := func(env string) *dsecv1.SandboxSpec {
		return &dsecv1.SandboxSpec{Image: baseImage, Env: []string{env}, Labels: map[string]string{"job": "p"}}
	}
	poolID := ids.NewSandbox(n.id)
	_, err := n.client.CreatePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreatePoolRequest{
		Caller: tenant("a"), PoolId: poolID, Request: &dsecv1.CreatePoolRequest{Spec: spec("X=1"), Size: 2},
	}))
	if err != nil {
		t.Fatal(err)
	}
	n.waitPool(t, poolID, func(p *dsecv1.Pool) bool { return p.Ready == 2 })

	// A matching create by the pool's tenant is served warm.
	first := n.mustCreate(t, tenant("a"), spec("X=1"))
	if p := n.waitPool(t, poolID, func(*dsecv1.Pool) bool { return true }); p.Hits != 1 || p.InUse != 1 {
		t.Fatalf("after a matching create: hits %d in use %d, want 1 and 1", p.Hits, p.InUse)
	}
	if got := n.sh(t, first.Id, "echo $X"); got != "1\n" {
		t.Fatalf("env of a pooled sandbox: %q", got)
	}
	// The user leaves files and a daemon behind, then the sandbox ends.
	n.sh(t, first.Id, "echo secret > /leak; rm /bin/ls; mkdir -p /tmp/d && echo t > /tmp/d/f; (setsid sleep 1000 >/dev/null 2>&1 &); true")
	if err := n.destroy(t, tenant("a"), first.Id); err != nil {
		t.Fatal(err)
	}
	n.waitPool(t, poolID, func(p *dsecv1.Pool) bool { return p.Ready == 2 && p.InUse == 0 })

	// The next users see a clean sandbox: no file, no process, the base
	// image's files back.
	for range 2 {
		sb := n.mustCreate(t, tenant("a"), spec("X=1"))
		out := n.sh(t, sb.Id, "cat /leak 2>&1; ls /tmp/d 2>&1; test -e /bin/ls && echo ls-back; ps -o args | grep -c '[s]leep 1000'; true")
		if strings.Contains(out, "secret") || strings.Contains(out, "f\n") || !strings.Contains(out, "ls-back") || !strings.HasSuffix(out, "0\n") {
			t.Fatalf("a sandbox from the pool shows its previous user's state:\n%s", out)
		}
		defer n.destroy(t, tenant("a"), sb.Id)
	}
	hits := n.waitPool(t, poolID, func(*dsecv1.Pool) bool { return true }).Hits

	// Another tenant, or another spec, is not served from the pool.
	other := n.mustCreate(t, tenant("b"), spec("X=1"))
	diff := n.mustCreate(t, tenant("a"), spec("X=2"))
	if p := n.waitPool(t, poolID, func(*dsecv1.Pool) bool { return true }); p.Hits != hits {
		t.Errorf("hits went from %d to %d for a create by another tenant or of another spec", hits, p.Hits)
	}
	for _, id := range []string{other.Id, diff.Id} {
		if err := n.destroy(t, admin, id); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(n.pools(t, tenant("b"))); got != 0 {
		t.Errorf("tenant b lists %d pools of tenant a", got)
	}

	// Bad requests name the field.
	_, err = n.client.CreatePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreatePoolRequest{
		Caller: tenant("a"), PoolId: ids.NewSandbox(n.id), Request: &dsecv1.CreatePoolRequest{Spec: spec("X=1"), Size: 0},
	}))
	wantCode(t, err, connect.CodeInvalidArgument, "size")
	_, err = n.client.CreatePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreatePoolRequest{
		Caller: tenant("a"), PoolId: ids.NewSandbox(n.id), Request: &dsecv1.CreatePoolRequest{Spec: spec("X=1"), Size: 2, MinSize: 3},
	}))
	wantCode(t, err, connect.CodeInvalidArgument, "min_size")

	// Delete: another tenant gets NotFound; the owner removes it and its
	// ready sandboxes go.
	_, err = n.client.DeletePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeDeletePoolRequest{Caller: tenant("b"), PoolId: poolID}))
	wantCode(t, err, connect.CodeNotFound, poolID)
	if _, err := n.client.DeletePoolOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeDeletePoolRequest{Caller: tenant("a"), PoolId: poolID})); err != nil {
		t.Fatal(err)
	}
	if got := len(n.pools(t, admin)); got != 0 {
		t.Fatalf("%d pools after delete", got)
	}
}

func TestBatchOnEdge(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "bt1", nil)
	a := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage})
	b := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage})
	resp, err := n.client.BatchExecOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeBatchExecRequest{
		Caller: tenant("a"),
		Request: &dsecv1.BatchExecRequest{Requests: []*dsecv1.ExecRequest{
			{SandboxId: a.Id, Shell: "echo a > /f; cat /f"},
			{SandboxId: ids.NewSandbox(n.id), Argv: []string{"true"}},
			{SandboxId: b.Id, Shell: "exit 3"},
		}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	r := resp.Msg.Results
	if len(r) != 3 {
		t.Fatalf("%d results for 3 requests", len(r))
	}
	if r[0].Result.GetOutcome() != string(edge.OutcomeOK) || string(r[0].Result.GetStdout()) != "a\n" || r[0].SandboxId != a.Id {
		t.Errorf("item 0: %v", r[0])
	}
	if r[1].Error.GetCode() != connect.CodeNotFound.String() || r[1].Result != nil {
		t.Errorf("item 1 (unknown sandbox): %v, want a not_found item error", r[1])
	}
	if r[2].Result.GetExitCode() != 3 || r[2].Result.GetOutcome() != string(edge.OutcomeFailed) {
		t.Errorf("item 2: %v", r[2])
	}

	ck, err := n.client.CheckpointOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCheckpointRequest{
		Caller: tenant("a"), Request: &dsecv1.CheckpointRequest{SandboxId: a.Id},
	}))
	if err != nil {
		t.Fatal(err)
	}
	n.sh(t, a.Id, "echo changed > /f")
	rb, err := n.client.BatchRollbackOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeBatchRollbackRequest{
		Caller: tenant("a"),
		Request: &dsecv1.BatchRollbackRequest{Requests: []*dsecv1.RollbackRequest{
			{SandboxId: a.Id, CheckpointId: ck.Msg.CheckpointId},
			{SandboxId: b.Id, CheckpointId: "no-such-checkpoint"},
		}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	if rb.Msg.Results[0].Error != nil || rb.Msg.Results[1].Error == nil {
		t.Fatalf("batch rollback results: %v", rb.Msg.Results)
	}
	if got := n.sh(t, a.Id, "cat /f"); got != "a\n" {
		t.Errorf("after batch rollback /f is %q, want a", got)
	}
}

func (n *node) runCode(t *testing.T, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	t.Helper()
	resp, err := n.client.RunCodeOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeRunCodeRequest{
		Caller: tenant("a"), Request: req, Image: baseImage,
	}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func TestRunCodeOnEdge(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "fn1", func(c *edge.Config) { c.FnWarm, c.FnMax, c.FnQueue = 1, 1, 1 })
	sh := func(code string) *dsecv1.RunCodeRequest { return &dsecv1.RunCodeRequest{Language: "sh", Code: code} }

	res, err := n.runCode(t, &dsecv1.RunCodeRequest{Language: "sh", Code: `read x; echo "hi $x $1"; cat in.txt`,
		Stdin: []byte("there\n"), Args: []string{"arg"}, Files: map[string][]byte{"in.txt": []byte("file\n")}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != "Success" || string(res.RunResult.GetStdout()) != "hi there arg\nfile\n" || res.RunResult.GetStatus() != "Finished" {
		t.Fatalf("hello: %v", res)
	}

	res, err = n.runCode(t, sh("echo out > out.txt; echo err >&2; exit 3"))
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != "Failed" || res.RunResult.GetReturnCode() != 3 || string(res.RunResult.GetStderr()) != "err\n" {
		t.Fatalf("exit 3: %v", res)
	}

	req := sh("echo data > out.txt")
	req.FetchFiles = []string{"out.txt", "missing.txt"}
	res, err = n.runCode(t, req)
	if err != nil {
		t.Fatal(err)
	}
	if string(res.Files["out.txt"]) != "data\n" || len(res.Files) != 1 {
		t.Fatalf("fetch_files: %v", res.Files)
	}

	req = sh("sleep 5")
	req.RunTimeout = durationpb.New(300 * time.Millisecond)
	res, err = n.runCode(t, req)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != "Failed" || res.RunResult.GetStatus() != "TimeLimitExceeded" {
		t.Fatalf("time limit: %v", res)
	}

	// Consecutive calls never see each other's files or processes.
	if _, err := n.runCode(t, sh("echo x > /tmp/left; (setsid sleep 1000 >/dev/null 2>&1 &); true")); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		res, err = n.runCode(t, sh("ls /tmp/left 2>/dev/null; ps -o args | grep -c '[s]leep 1000'; true"))
		if err != nil {
			t.Fatal(err)
		}
		if string(res.RunResult.GetStdout()) != "0\n" {
			t.Fatalf("a call sees an earlier call's state: %q", res.RunResult.GetStdout())
		}
	}

	_, err = n.runCode(t, &dsecv1.RunCodeRequest{Language: "cobol", Code: "x"})
	wantCode(t, err, connect.CodeInvalidArgument, "cobol")

	// One sandbox at most and one waiting call: of three concurrent long
	// calls, one runs, one waits and runs next, one is refused at once
	// with a retry-after hint. (If the sandbox is still being reset from
	// the call before, the first caller waits too and two are refused.)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		ok, ful int
		hint    string
	)
	for range 3 {
		wg.Go(func() {
			r := sh("sleep 1")
			_, err := n.runCode(t, r)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				ok++
			case connect.CodeOf(err) == connect.CodeUnavailable:
				ful++
				var ce *connect.Error
				if errors.As(err, &ce) {
					hint = ce.Meta().Get("Retry-After")
				}
			default:
				t.Errorf("concurrent call: %v", err)
			}
		})
	}
	wg.Wait()
	if ok < 1 || ok+ful != 3 || ful < 1 || hint == "" {
		t.Fatalf("3 calls with 1 sandbox and a queue of 1: %d ran, %d refused (Retry-After %q); want 2 (or 1) run, the others refused with a hint", ok, ful, hint)
	}
}
