package dsec

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

// fakeSandboxes answers Exec, Checkpoint, Get and FreezeJob from scripts
// and records the seq of every numbered request.
type fakeSandboxes struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu      sync.Mutex
	seqs    []uint64
	frozen  bool   // Exec and Checkpoint are refused, unrecorded
	nextSeq uint64 // what Get reports
	job     []*dsecv1.JobResult
}

func (f *fakeSandboxes) numbered(seq uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seqs = append(f.seqs, seq)
	if f.frozen {
		return connect.NewError(connect.CodeFailedPrecondition, errors.New(`sandbox "n1-x" is frozen: thaw it first`))
	}
	f.nextSeq = seq + 1
	return nil
}

func (f *fakeSandboxes) Exec(_ context.Context, r *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResponse], error) {
	if err := f.numbered(r.Msg.GetSeq()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ExecResponse{Result: &dsecv1.ExecResult{Outcome: OutcomeOK, Seq: r.Msg.GetSeq()}}), nil
}

func (f *fakeSandboxes) Checkpoint(_ context.Context, r *connect.Request[dsecv1.CheckpointRequest]) (*connect.Response[dsecv1.CheckpointResponse], error) {
	if err := f.numbered(r.Msg.GetSeq()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.CheckpointResponse{CheckpointId: "ck-1", Seq: r.Msg.GetSeq()}), nil
}

func (f *fakeSandboxes) Get(_ context.Context, r *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.GetSandboxResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: &dsecv1.Sandbox{Id: r.Msg.GetId(), NextSeq: f.nextSeq}}), nil
}

func (f *fakeSandboxes) FreezeJob(context.Context, *connect.Request[dsecv1.JobRequest]) (*connect.Response[dsecv1.JobResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return connect.NewResponse(&dsecv1.JobResponse{Results: f.job}), nil
}

func (f *fakeSandboxes) set(frozen bool, nextSeq uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.frozen, f.nextSeq = frozen, nextSeq
}

func fakeClient(t *testing.T, f *fakeSandboxes) *Client {
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(f))
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	return New(hs.URL, "t", WithHTTPClient(hs.Client()))
}

func TestRefusedNumberIsGivenBack(t *testing.T) {
	f := &fakeSandboxes{nextSeq: 1}
	c := fakeClient(t, f)
	ctx := t.Context()
	sb := c.Sandbox("n1-x")
	if ck, err := sb.CheckpointWith(ctx, OpOptions{}); err != nil || ck.ID != "ck-1" || ck.Seq != 1 {
		t.Fatalf("CheckpointWith = %+v, %v", ck, err)
	}
	f.set(true, 2)
	if _, err := sb.ExecShell(ctx, "true"); !IsFailedPrecondition(err) {
		t.Fatalf("exec in a frozen sandbox: %v", err)
	}
	if _, err := sb.Checkpoint(ctx); !IsFailedPrecondition(err) {
		t.Fatalf("checkpoint of a frozen sandbox: %v", err)
	}
	if got := sb.NextSeqToSend(); got != 2 {
		t.Fatalf("after two unrecorded refusals the handle sends %d next, want 2", got)
	}
	f.set(false, 2)
	if res, err := sb.ExecShell(ctx, "true"); err != nil || res.Seq != 2 {
		t.Fatalf("exec after thaw = %+v, %v; want seq 2", res, err)
	}
	// A number the sandbox did record (Get says it moved on) stays used.
	f.set(true, 4)
	if _, err := sb.ExecShell(ctx, "true"); !IsFailedPrecondition(err) {
		t.Fatal(err)
	}
	if got := sb.NextSeqToSend(); got != 4 {
		t.Fatalf("the handle sends %d next, want 4", got)
	}
	// An unnumbered handle has nothing to give back.
	un := c.Sandbox("n1-x", Unnumbered())
	if _, err := un.Checkpoint(ctx); !IsFailedPrecondition(err) || un.NextSeqToSend() != 0 {
		t.Fatalf("unnumbered checkpoint: %v, next %d", err, un.NextSeqToSend())
	}
	f.mu.Lock()
	seqs := slices.Clone(f.seqs)
	f.mu.Unlock()
	if want := []uint64{1, 2, 2, 2, 3, 0}; !slices.Equal(seqs, want) {
		t.Fatalf("seqs sent %v, want %v", seqs, want)
	}
	if _, err := sb.Snapshot(ctx, ""); !IsInvalidArgument(err) || sb.NextSeqToSend() != 4 {
		t.Fatalf("snapshot without a ref: %v (next %d); want InvalidArgument before taking a number", err, sb.NextSeqToSend())
	}
	if err := sb.Rollback(ctx, ""); !IsInvalidArgument(err) || sb.NextSeqToSend() != 4 {
		t.Fatalf("rollback without a checkpoint: %v", err)
	}
}

func TestJobResultsKeepCodes(t *testing.T) {
	f := &fakeSandboxes{job: []*dsecv1.JobResult{
		{Id: "n1-a"},
		{Id: "n2-b", Error: &dsecv1.ItemError{Code: "failed_precondition", Message: "sandbox is being destroyed"}},
	}}
	c := fakeClient(t, f)
	results, err := c.FreezeJob(t.Context(), map[string]string{"job": "x"})
	var be *BatchError
	if !errors.As(err, &be) || len(be.Errs) != 1 || !IsFailedPrecondition(err) {
		t.Fatalf("FreezeJob error %v, want a BatchError with the one failure", err)
	}
	if len(results) != 2 || results[0] != (JobResult{ID: "n1-a"}) || results[1].ID != "n2-b" || !IsFailedPrecondition(results[1].Err) {
		t.Fatalf("FreezeJob results %+v", results)
	}
	f.mu.Lock()
	f.job = []*dsecv1.JobResult{{Id: "n1-a"}}
	f.mu.Unlock()
	if results, err := c.FreezeJob(t.Context(), map[string]string{"job": "x"}); err != nil || len(results) != 1 {
		t.Fatalf("FreezeJob = %+v, %v", results, err)
	}
}
