package edge_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

func (n *node) trajectory(t *testing.T, caller *dsecv1.Caller, id string, pageSize int32) ([]string, uint64) {
	t.Helper()
	var out []string
	var next uint64
	token := ""
	for {
		resp, err := n.client.GetTrajectoryOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeGetTrajectoryRequest{
			Caller: caller, Request: &dsecv1.GetTrajectoryRequest{SandboxId: id, PageSize: pageSize, PageToken: token, IncludeData: true},
		}))
		if err != nil {
			t.Fatalf("trajectory of %s: %v", id, err)
		}
		out = append(out, resp.Msg.Records...)
		next = resp.Msg.NextSeq
		if token = resp.Msg.NextPageToken; token == "" {
			return out, next
		}
	}
}

func verifyLines(t *testing.T, lines []string) []*trajectory.Record {
	t.Helper()
	if n, err := trajectory.Verify(strings.NewReader(strings.Join(lines, "\n"))); err != nil || n != len(lines) {
		t.Fatalf("verify %d records: checked %d, %v", len(lines), n, err)
	}
	recs := make([]*trajectory.Record, len(lines))
	for i, l := range lines {
		r, err := trajectory.Parse([]byte(l))
		if err != nil {
			t.Fatal(err)
		}
		recs[i] = r
	}
	return recs
}

// TestTrajectory drives fast-forward, the record of every operation and the
// trajectory's survival of its sandbox through a real edge.
func TestTrajectory(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "tr1", nil)
	alice := tenant("alice")
	sb := n.mustCreate(t, alice, &dsecv1.SandboxSpec{Image: baseImage})
	if sb.NextSeq != 1 {
		t.Fatalf("a new sandbox's next_seq is %d, want 1", sb.NextSeq)
	}
	appendCount := "echo x >> /tmp/f; wc -l < /tmp/f"

	t.Run("non-idempotent command re-sent runs once", func(t *testing.T) {
		var first *dsecv1.ExecResult
		for i := range 3 {
			res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: appendCount, Seq: 1, RequestId: "r1"})
			if err != nil {
				t.Fatal(err)
			}
			if strings.TrimSpace(string(res.Stdout)) != "1" || res.Seq != 1 || res.Replayed != (i > 0) {
				t.Fatalf("send %d: stdout %q seq %d replayed %v", i+1, res.Stdout, res.Seq, res.Replayed)
			}
			if first == nil {
				first = res
			} else if res.Duration.AsDuration() != first.Duration.AsDuration() {
				t.Errorf("replayed duration %v differs from the recorded %v", res.Duration.AsDuration(), first.Duration.AsDuration())
			}
		}
		res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "wc -l < /tmp/f"})
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimSpace(string(res.Stdout)) != "1" || res.Seq != 2 || res.Replayed {
			t.Fatalf("unnumbered exec: stdout %q seq %d replayed %v; want 1 line, seq 2", res.Stdout, res.Seq, res.Replayed)
		}
	})

	t.Run("numbers out of order or reused are refused", func(t *testing.T) {
		_, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "true", Seq: 9})
		wantCode(t, err, connect.CodeFailedPrecondition, "next expected seq 3")
		_, err = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "echo other", Seq: 1})
		wantCode(t, err, connect.CodeFailedPrecondition, "different request")
		// Another tenant learns nothing, not even that the number exists.
		_, err = n.exec(t, tenant("bob"), sb.Id, &dsecv1.ExecRequest{Shell: appendCount, Seq: 1})
		wantCode(t, err, connect.CodeNotFound, sb.Id)
	})

	t.Run("concurrent duplicates execute once", func(t *testing.T) {
		const dup = 5
		var wg sync.WaitGroup
		results := make([]*dsecv1.ExecResult, dup)
		errs := make([]error, dup)
		for i := range dup {
			wg.Go(func() {
				results[i], errs[i] = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "echo y >> /tmp/g; sleep 0.3; wc -l < /tmp/g", Seq: 3})
			})
		}
		wg.Wait()
		ran := 0
		for i := range dup {
			if errs[i] != nil {
				t.Fatalf("duplicate %d: %v", i, errs[i])
			}
			if strings.TrimSpace(string(results[i].Stdout)) != "1" {
				t.Errorf("duplicate %d printed %q, want 1", i, results[i].Stdout)
			}
			if !results[i].Replayed {
				ran++
			}
		}
		if ran != 1 {
			t.Fatalf("%d of %d duplicates ran, want exactly 1", ran, dup)
		}
	})

	t.Run("a numbered exec outlives its caller", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		req := &dsecv1.ExecRequest{SandboxId: sb.Id, Shell: "sleep 1; echo done >> /tmp/h; echo finished", Seq: 4}
		_, err := n.client.ExecOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeExecRequest{Caller: alice, Request: req}))
		if err == nil {
			t.Fatal("the caller's deadline did not end its call")
		}
		// The re-send waits for the first run and gets its result.
		res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: req.Shell, Seq: 4})
		if err != nil {
			t.Fatal(err)
		}
		if !res.Replayed || strings.TrimSpace(string(res.Stdout)) != "finished" {
			t.Fatalf("re-send: replayed %v stdout %q", res.Replayed, res.Stdout)
		}
		res, err = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "cat /tmp/h"})
		if err != nil || strings.TrimSpace(string(res.Stdout)) != "done" {
			t.Fatalf("the command did not run to completion once: %q %v", res.GetStdout(), err)
		}
	})

	var big []byte
	t.Run("files, large output and rewards", func(t *testing.T) {
		wr := &dsecv1.WriteFileRequest{SandboxId: sb.Id, Path: "/tmp/w.txt", Data: []byte("hello"), Seq: 6}
		for i := range 2 {
			resp, err := n.client.WriteFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeWriteFileRequest{Caller: alice, Request: wr}))
			if err != nil {
				t.Fatal(err)
			}
			if resp.Msg.Seq != 6 || resp.Msg.Replayed != (i > 0) {
				t.Fatalf("write %d: %+v", i, resp.Msg)
			}
		}
		rd := &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/tmp/w.txt", Seq: 7}
		for i := range 2 {
			resp, err := n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{Caller: alice, Request: rd}))
			if err != nil {
				t.Fatal(err)
			}
			if string(resp.Msg.Data) != "hello" || resp.Msg.Replayed != (i > 0) {
				t.Fatalf("read %d: %+v", i, resp.Msg)
			}
		}
		// A failed read is recorded as such and fast-forwards as the same error.
		miss := &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/nonexistent", Seq: 8}
		for range 2 {
			_, err := n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{Caller: alice, Request: miss}))
			wantCode(t, err, connect.CodeNotFound, "nonexistent")
		}
		// Output beyond the inline bound goes to the blob store and comes back.
		res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "head -c 100000 /dev/urandom | od -x", Seq: 9})
		if err != nil {
			t.Fatal(err)
		}
		big = res.Stdout
		if len(big) <= trajectory.DefaultInlineMax {
			t.Fatalf("output of %d bytes is not beyond the inline bound", len(big))
		}
		again, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "head -c 100000 /dev/urandom | od -x", Seq: 9})
		if err != nil || !again.Replayed || string(again.Stdout) != string(big) {
			t.Fatalf("replayed large output differs (replayed %v, %d bytes, %v)", again.GetReplayed(), len(again.GetStdout()), err)
		}
		for i := range 2 {
			resp, err := n.client.SubmitRewardOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSubmitRewardRequest{Caller: alice,
				Request: &dsecv1.SubmitRewardRequest{SandboxId: sb.Id, Value: 0.75, Metadata: map[string]string{"task": "t1"}, Seq: 10}}))
			if err != nil {
				t.Fatalf("reward %d: %v", i, err)
			}
			if resp.Msg.Seq != 10 || resp.Msg.Replayed != (i > 0) {
				t.Fatalf("reward %d: %+v", i, resp.Msg)
			}
		}
	})

	t.Run("the trajectory records everything, chained", func(t *testing.T) {
		lines, next := n.trajectory(t, alice, sb.Id, 3)
		if next != 11 {
			t.Fatalf("next_seq %d, want 11", next)
		}
		recs := verifyLines(t, lines)
		kinds := map[uint64]string{}
		for _, r := range recs {
			kinds[r.Seq] = r.Kind
		}
		want := map[uint64]string{0: "create", 1: "exec", 2: "exec", 3: "exec", 4: "exec", 5: "exec", 6: "write_file", 7: "read_file", 8: "read_file", 9: "exec", 10: "reward"}
		// seq 5 is the `cat /tmp/h` exec after seq 4.
		for seq, k := range want {
			if kinds[seq] != k {
				t.Errorf("seq %d is %q, want %q", seq, kinds[seq], k)
			}
		}
		if len(recs) != len(want) {
			t.Errorf("%d records, want %d", len(recs), len(want))
		}
		env := recs[0].Environment
		if env == nil || env.Image != baseImage || len(env.Layers) != 1 || env.Layers[0] != w.layer || env.Tenant != "alice" {
			t.Errorf("creation record environment %+v", env)
		}
		for _, r := range recs {
			if r.Seq == 9 && string(r.Exec.Stdout.Inline) != string(big) {
				t.Errorf("include_data did not inline the large output")
			}
			if r.Seq == 10 && (r.Reward == nil || r.Reward.Value != 0.75 || r.Reward.Metadata["task"] != "t1") {
				t.Errorf("reward record %+v", r.Reward)
			}
		}
	})

	t.Run("destroy ends the trajectory; rewards may follow", func(t *testing.T) {
		if err := n.destroy(t, alice, sb.Id); err != nil {
			t.Fatal(err)
		}
		res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: appendCount, Seq: 1})
		if err != nil || !res.Replayed {
			t.Fatalf("a recorded number of a destroyed sandbox still fast-forwards: %+v %v", res, err)
		}
		_, err = n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: "true"})
		wantCode(t, err, connect.CodeFailedPrecondition, "destroyed")
		resp, err := n.client.SubmitRewardOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSubmitRewardRequest{Caller: alice,
			Request: &dsecv1.SubmitRewardRequest{SandboxId: sb.Id, Value: 1}}))
		if err != nil {
			t.Fatal(err)
		}
		lines, _ := n.trajectory(t, alice, sb.Id, 0)
		recs := verifyLines(t, lines)
		last, prev := recs[len(recs)-1], recs[len(recs)-2]
		if prev.Kind != trajectory.KindDestroy || last.Kind != trajectory.KindReward || last.Seq != resp.Msg.Seq {
			t.Fatalf("trajectory ends with %s, %s (seq %d), want destroy then the reward (seq %d)", prev.Kind, last.Kind, last.Seq, resp.Msg.Seq)
		}
	})
}

// TestTrajectoryAcrossRestart stops an edge and starts another on the same
// data dir: the sandboxes it had are known again, their trajectories are
// readable and recorded numbers still fast-forward.
func TestTrajectoryAcrossRestart(t *testing.T) {
	w := newWorld(t)
	dataDir := t.TempDir()
	start := func() (*edge.Edge, dsecv1connect.EdgeServiceClient, func()) {
		mux := http.NewServeMux()
		srv := httptest.NewServer(mux)
		e, err := edge.New(edge.Config{
			NodeID: "rs1", DataDir: dataDir, Store: w.store,
			Backends:     map[runtime.Kind]runtime.Backend{runtime.KindContainer: w.backend},
			AdvertiseURL: srv.URL, ClusterToken: token,
		})
		if err != nil {
			t.Fatal(err)
		}
		e.Mount(mux)
		client := dsecv1connect.NewEdgeServiceClient(srv.Client(), srv.URL, connect.WithInterceptors(edge.ClusterAuth(token)))
		return e, client, func() {
			if err := e.Close(context.Background()); err != nil {
				t.Errorf("close: %v", err)
			}
			srv.Close()
		}
	}
	e1, c1, stop1 := start()
	n1 := &node{edge: e1, id: "rs1", client: c1}
	sb := n1.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage})
	res, err := n1.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "echo before", Seq: 1})
	if err != nil || string(res.Stdout) != "before\n" {
		t.Fatalf("exec: %+v %v", res, err)
	}
	before, _ := n1.trajectory(t, admin, sb.Id, 0)
	stop1()

	e2, c2, stop2 := start()
	defer stop2()
	n2 := &node{edge: e2, id: "rs1", client: c2}
	got := n2.waitState(t, sb.Id, string(edge.StateDestroyed))
	if got.Spec.GetImage() != baseImage || len(got.Layers) != 1 {
		t.Errorf("recovered sandbox %+v", got)
	}
	after, _ := n2.trajectory(t, admin, sb.Id, 0)
	if len(after) != len(before)+1 || strings.Join(after[:len(before)], "\n") != strings.Join(before, "\n") {
		t.Fatalf("trajectory before the restart:\n%s\nafter:\n%s", strings.Join(before, "\n"), strings.Join(after, "\n"))
	}
	verifyLines(t, after)
	res, err = n2.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "echo before", Seq: 1})
	if err != nil || !res.Replayed || string(res.Stdout) != "before\n" {
		t.Fatalf("fast-forward after restart: %+v %v", res, err)
	}
}

// TestTrajectoryOff checks that an edge without a log refuses numbered
// operations rather than silently running them again.
func TestTrajectoryOff(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "off1", func(c *edge.Config) { c.NoTrajectory = true })
	sb := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage})
	if sb.NextSeq != 0 {
		t.Errorf("next_seq %d without a log, want 0", sb.NextSeq)
	}
	if _, err := n.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "true"}); err != nil {
		t.Fatal(err)
	}
	_, err := n.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "true", Seq: 1})
	wantCode(t, err, connect.CodeFailedPrecondition, "trajectory logging off")
}

// TestTrajectoryRefusal checks that a numbered request refused for its
// arguments uses up its number (recorded as an error), so that the client's
// numbering and the sandbox's stay in step.
func TestTrajectoryRefusal(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "rf1", nil)
	sb := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage})
	for range 2 {
		_, err := n.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "true", Env: []string{"=x"}, Seq: 1})
		wantCode(t, err, connect.CodeInvalidArgument, "must be K=V")
	}
	res, err := n.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "echo next", Seq: 2})
	if err != nil || res.Seq != 2 || res.Replayed {
		t.Fatalf("the number after a refusal: %+v %v", res, err)
	}
	lines, _ := n.trajectory(t, admin, sb.Id, 0)
	recs := verifyLines(t, lines)
	if recs[1].Seq != 1 || recs[1].Error == nil || recs[1].Error.Code != "invalid_argument" || strings.HasPrefix(recs[1].Error.Message, "invalid_argument") {
		t.Fatalf("refusal record %+v", recs[1].Error)
	}
}
