package dsec

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

// fakeBatch is a SandboxService whose sandboxes keep a trajectory counter
// each, as the edge does: a numbered exec is recorded when its seq is the
// next expected one, replayed when it is older, refused as "beyond the
// next expected" when it is newer. A frozen sandbox refuses without
// recording; an unknown one is NotFound.
type fakeBatch struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu       sync.Mutex
	next     map[string]uint64 // sandbox -> next expected seq
	frozen   map[string]bool
	sent     []string // "id:seq" of every exec item received, in order
	failCall []error  // whole-call errors to answer first, one per call
	// reverse runs a batch's items last first, as a node running them
	// concurrently may.
	reverse bool
}

func newFakeBatch(ids ...string) *fakeBatch {
	f := &fakeBatch{next: map[string]uint64{}, frozen: map[string]bool{}}
	for _, id := range ids {
		f.next[id] = 1
	}
	return f
}

func (f *fakeBatch) exec(r *dsecv1.ExecRequest) *dsecv1.BatchExecItem {
	id, seq := r.GetSandboxId(), r.GetSeq()
	f.sent = append(f.sent, fmt.Sprintf("%s:%d", id, seq))
	item := &dsecv1.BatchExecItem{SandboxId: id}
	next, ok := f.next[id]
	switch {
	case !ok:
		item.Error = &dsecv1.ItemError{Code: "not_found", Message: fmt.Sprintf("sandbox %q not found", id)}
	case f.frozen[id]:
		item.Error = &dsecv1.ItemError{Code: "failed_precondition", Message: fmt.Sprintf("sandbox %q is frozen: thaw it first", id)}
	case seq > next:
		item.Error = &dsecv1.ItemError{Code: "failed_precondition", Message: fmt.Sprintf("seq %d is beyond the next expected %d", seq, next)}
	case seq != 0 && seq < next:
		item.Result = &dsecv1.ExecResult{Outcome: OutcomeOK, Seq: seq, Replayed: true, Stdout: []byte(r.GetShell())}
	default:
		if seq == 0 {
			seq = next
		}
		f.next[id] = seq + 1
		item.Result = &dsecv1.ExecResult{Outcome: OutcomeOK, Seq: seq, Stdout: []byte(r.GetShell())}
	}
	return item
}

func (f *fakeBatch) BatchExec(_ context.Context, r *connect.Request[dsecv1.BatchExecRequest]) (*connect.Response[dsecv1.BatchExecResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.failCall) > 0 {
		err := f.failCall[0]
		f.failCall = f.failCall[1:]
		return nil, err
	}
	reqs := r.Msg.GetRequests()
	resp := &dsecv1.BatchExecResponse{Results: make([]*dsecv1.BatchExecItem, len(reqs))}
	for i := range reqs {
		if f.reverse {
			i = len(reqs) - 1 - i
		}
		resp.Results[i] = f.exec(reqs[i])
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeBatch) Exec(_ context.Context, r *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	item := f.exec(r.Msg)
	if item.Error != nil {
		return nil, itemError("exec", item.Error)
	}
	return connect.NewResponse(&dsecv1.ExecResponse{Result: item.Result}), nil
}

func (f *fakeBatch) Get(_ context.Context, r *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.GetSandboxResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	next, ok := f.next[r.Msg.GetId()]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("no such sandbox"))
	}
	return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: &dsecv1.Sandbox{Id: r.Msg.GetId(), NextSeq: next}}), nil
}

func (f *fakeBatch) Acquire(_ context.Context, r *connect.Request[dsecv1.AcquireRequest]) (*connect.Response[dsecv1.AcquireResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &dsecv1.AcquireResponse{}
	for i := range int(r.Msg.GetCount()) {
		if i == 1 {
			resp.Results = append(resp.Results, &dsecv1.BatchCreateResult{Error: &dsecv1.ItemError{
				Code: "unavailable", Message: "admission queue full (64 waiting); retry after 3s"}})
			continue
		}
		id := fmt.Sprintf("n1-%016x", i)
		f.next[id] = 1
		resp.Results = append(resp.Results, &dsecv1.BatchCreateResult{Sandbox: &dsecv1.Sandbox{
			Id: id, State: StateRunning, NextSeq: 1, Spec: r.Msg.GetSpec()}})
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeBatch) Release(_ context.Context, r *connect.Request[dsecv1.ReleaseRequest]) (*connect.Response[dsecv1.ReleaseResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &dsecv1.ReleaseResponse{}
	for _, id := range r.Msg.GetIds() {
		res := &dsecv1.BatchDestroyResult{Id: id}
		if _, ok := f.next[id]; !ok {
			res.Error = &dsecv1.ItemError{Code: "not_found", Message: "no such sandbox"}
		}
		delete(f.next, id)
		resp.Results = append(resp.Results, res)
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeBatch) setFrozen(id string, frozen bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.frozen[id] = frozen
}

func (f *fakeBatch) sentSince(n int) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.sent[n:])
}

func (f *fakeBatch) sentCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.sent)
}

func fakeBatchClient(t *testing.T, f *fakeBatch) *Client {
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(f))
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	return New(hs.URL, "t", WithHTTPClient(hs.Client()))
}

func TestBatchExecNumbersLikeExec(t *testing.T) {
	f := newFakeBatch("n1-a", "n1-b", "n1-c")
	c := fakeBatchClient(t, f)
	ctx := t.Context()
	a, b, cc := c.Sandbox("n1-a"), c.Sandbox("n1-b"), c.Sandbox("n1-c")
	missing := c.Sandbox("n1-missing")

	// One command for all: each handle's step 1.
	res, err := c.BatchExec(ctx, []*Sandbox{a, b, cc}, []ExecOptions{{Shell: "echo one"}})
	if err != nil {
		t.Fatalf("BatchExec: %v", err)
	}
	for i, r := range res {
		if r.Err != nil || r.Result == nil || r.Result.Seq != 1 || string(r.Result.Stdout) != "echo one" {
			t.Fatalf("item %d = %+v (result %+v)", i, r, r.Result)
		}
	}

	// One command each; b is frozen (refused, unrecorded) and the fourth
	// sandbox does not exist: both fail alone.
	f.setFrozen("n1-b", true)
	res, err = c.BatchExec(ctx, []*Sandbox{a, b, cc, missing},
		[]ExecOptions{{Shell: "a2"}, {Shell: "b2"}, {Shell: "c2"}, {Shell: "m1"}})
	var be *BatchError
	if !errors.As(err, &be) || len(be.Errs) != 2 {
		t.Fatalf("BatchExec error = %v, want a BatchError with 2 failures", err)
	}
	if res[0].Result.Seq != 2 || string(res[0].Result.Stdout) != "a2" || res[2].Result.Seq != 2 {
		t.Fatalf("healthy items = %+v, %+v", res[0].Result, res[2].Result)
	}
	if !IsFailedPrecondition(res[1].Err) || res[1].Result != nil || res[1].Sandbox != b {
		t.Fatalf("frozen item = %+v", res[1])
	}
	if !IsNotFound(res[3].Err) || !strings.Contains(res[3].Err.Error(), "n1-missing") {
		t.Fatalf("missing item = %+v", res[3])
	}
	// The frozen sandbox's number went back; the others moved on.
	if a.NextSeqToSend() != 3 || b.NextSeqToSend() != 2 || cc.NextSeqToSend() != 3 {
		t.Fatalf("next numbers a=%d b=%d c=%d, want 3 2 3", a.NextSeqToSend(), b.NextSeqToSend(), cc.NextSeqToSend())
	}

	// Single execs continue the same numbering.
	f.setFrozen("n1-b", false)
	if r, err := b.ExecShell(ctx, "b2"); err != nil || r.Seq != 2 || r.Replayed {
		t.Fatalf("exec on b after thaw = %+v, %v; want seq 2", r, err)
	}
	if r, err := a.ExecShell(ctx, "a3"); err != nil || r.Seq != 3 {
		t.Fatalf("exec on a = %+v, %v; want seq 3", r, err)
	}

	// A restarted trainer re-sending step 1 as a batch gets it replayed.
	a2 := c.Sandbox("n1-a")
	res, err = c.BatchExec(ctx, []*Sandbox{a2}, []ExecOptions{{Shell: "echo one"}})
	if err != nil || !res[0].Result.Replayed || res[0].Result.Seq != 1 {
		t.Fatalf("re-sent step 1 = %+v, %v; want replayed", res[0].Result, err)
	}
}

func TestBatchExecResends(t *testing.T) {
	f := newFakeBatch("n1-a", "n1-b")
	c := fakeBatchClient(t, f)
	ctx := t.Context()
	a, b := c.Sandbox("n1-a"), c.Sandbox("n1-b")

	// A whole call refused with Unavailable (and a hint) is sent again
	// with the same numbers.
	unavailable := connect.NewError(connect.CodeUnavailable, errors.New("admission queue full; retry after 0.05s"))
	f.mu.Lock()
	f.failCall = []error{unavailable}
	f.mu.Unlock()
	n := f.sentCount()
	res, err := c.BatchExec(ctx, []*Sandbox{a, b}, []ExecOptions{{Shell: "x"}})
	if err != nil || res[0].Result.Seq != 1 || res[1].Result.Seq != 1 {
		t.Fatalf("BatchExec after one Unavailable = %+v, %v", res, err)
	}
	if got := f.sentSince(n); !slices.Equal(got, []string{"n1-a:1", "n1-b:1"}) {
		t.Fatalf("items received %v", got)
	}

	// The same handle twice in one batch: its second number may arrive
	// "beyond the next expected" and is re-sent alone until it fits.
	f.mu.Lock()
	f.reverse = true
	f.mu.Unlock()
	n = f.sentCount()
	res, err = c.BatchExec(ctx, []*Sandbox{a, a}, []ExecOptions{{Shell: "y"}})
	if err != nil || res[0].Result.Seq != 2 || res[1].Result.Seq != 3 || res[1].Result.Replayed {
		t.Fatalf("BatchExec with a repeated handle = %+v, %v", res, err)
	}
	if got := f.sentSince(n); !slices.Equal(got, []string{"n1-a:3", "n1-a:2", "n1-a:3"}) {
		t.Fatalf("items received %v, want a:3 refused, a:2, a:3 re-sent", got)
	}

	// An unnumbered handle's item is sent once, even when the call fails
	// in a way that would be re-sent for a numbered one.
	un := c.Sandbox("n1-b", Unnumbered())
	f.mu.Lock()
	f.failCall = []error{unavailable}
	f.mu.Unlock()
	n = f.sentCount()
	res, err = c.BatchExec(ctx, []*Sandbox{un}, []ExecOptions{{Shell: "z"}})
	if !IsUnavailable(err) || !IsUnavailable(res[0].Err) || RetryAfter(res[0].Err) != 50*time.Millisecond {
		t.Fatalf("unnumbered BatchExec = %+v, %v; want the Unavailable with its hint", res, err)
	}
	if got := f.sentSince(n); len(got) != 0 {
		t.Fatalf("unnumbered item re-sent: %v", got)
	}
}

func TestBatchRefusedBeforeNumbering(t *testing.T) {
	f := newFakeBatch("n1-a", "n1-b")
	c := fakeBatchClient(t, f)
	ctx := t.Context()
	a, b := c.Sandbox("n1-a"), c.Sandbox("n1-b")
	for name, call := range map[string]func() error{
		"two commands for three": func() error {
			_, err := c.BatchExec(ctx, []*Sandbox{a, b, a}, []ExecOptions{{Shell: "x"}, {Shell: "y"}})
			return err
		},
		"no commands": func() error { _, err := c.BatchExec(ctx, []*Sandbox{a}, nil); return err },
		"empty command": func() error {
			_, err := c.BatchExec(ctx, []*Sandbox{a, b}, []ExecOptions{{Shell: "x"}, {}})
			return err
		},
		"nil handle":   func() error { _, err := c.BatchExec(ctx, []*Sandbox{a, nil}, []ExecOptions{{Shell: "x"}}); return err },
		"rollback ids": func() error { _, err := c.BatchRollback(ctx, []*Sandbox{a, b}, []string{"ck"}); return err },
		"rollback empty id": func() error {
			_, err := c.BatchRollback(ctx, []*Sandbox{a, b}, []string{"ck", ""})
			return err
		},
		"release nil": func() error { _, err := c.Release(ctx, []*Sandbox{nil}); return err },
		"acquire -1":  func() error { _, err := c.Acquire(ctx, -1, Spec{Image: "x:1"}); return err },
	} {
		if err := call(); !IsInvalidArgument(err) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	if a.NextSeqToSend() != 1 || b.NextSeqToSend() != 1 || f.sentCount() != 0 {
		t.Fatalf("refused batches took numbers (a %d, b %d) or reached the server (%d items)", a.NextSeqToSend(), b.NextSeqToSend(), f.sentCount())
	}
	if res, err := c.BatchExec(ctx, nil, []ExecOptions{{Shell: "x"}}); res != nil || err != nil {
		t.Fatalf("empty batch = %v, %v", res, err)
	}
}

func TestAcquireAndRelease(t *testing.T) {
	f := newFakeBatch()
	c := fakeBatchClient(t, f)
	ctx := t.Context()
	res, err := c.Acquire(ctx, 3, Spec{Image: "busybox:latest"})
	var be *BatchError
	if !errors.As(err, &be) || len(be.Errs) != 1 || len(res) != 3 {
		t.Fatalf("Acquire = %+v, %v; want 3 results and one failure", res, err)
	}
	if !IsUnavailable(res[1].Err) || RetryAfter(res[1].Err) != 3*time.Second || RetryAfter(err) != 3*time.Second {
		t.Fatalf("failed item %v: want Unavailable with a 3s hint, got %v", res[1].Err, RetryAfter(res[1].Err))
	}
	sbs := Acquired(res)
	if len(sbs) != 2 || sbs[0].NextSeqToSend() != 1 || sbs[0].Spec.Image != "busybox:latest" || sbs[0].State != StateRunning {
		t.Fatalf("acquired handles %+v", sbs)
	}
	if r, err := sbs[1].ExecShell(ctx, "x"); err != nil || r.Seq != 1 {
		t.Fatalf("first exec on an acquired handle = %+v, %v", r, err)
	}
	rel, err := c.Release(ctx, append(sbs, c.Sandbox("n1-gone")))
	if !errors.As(err, &be) || len(be.Errs) != 1 {
		t.Fatalf("Release error %v", err)
	}
	if rel[0] != (ReleaseResult{ID: sbs[0].ID}) || rel[1].Err != nil || rel[2].ID != "n1-gone" || !IsNotFound(rel[2].Err) {
		t.Fatalf("Release results %+v", rel)
	}
}

func TestRetryAfter(t *testing.T) {
	withMeta := connect.NewError(connect.CodeUnavailable, errors.New("no capacity: admission queue full"))
	withMeta.Meta().Set(RetryAfterHeader, "2")
	tests := []struct {
		name string
		err  error
		want time.Duration
	}{
		{"nil", nil, 0},
		{"metadata", fmt.Errorf("create sandbox: %w", withMeta), 2 * time.Second},
		{"message seconds", connect.NewError(connect.CodeUnavailable, errors.New("queue full, retry after 1.5s")), 1500 * time.Millisecond},
		{"message bare number", errors.New("unavailable: Retry-After: 4"), 4 * time.Second},
		{"message ms", errors.New("retry_after=250ms"), 250 * time.Millisecond},
		{"no hint", connect.NewError(connect.CodeUnavailable, errors.New("node down")), 0},
		{"garbage", errors.New("retry after soon"), 0},
		{"item error", itemError("sandbox 2 of 4", &dsecv1.ItemError{Code: "unavailable", Message: "queue full; retry after 7s"}), 7 * time.Second},
	}
	for _, tt := range tests {
		if got := RetryAfter(tt.err); got != tt.want {
			t.Errorf("%s: RetryAfter(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// A Retry-After header on a real Connect error response reaches
// RetryAfter through the client, and a create is not re-sent by itself.
func TestRetryAfterFromServer(t *testing.T) {
	var calls int
	var mu sync.Mutex
	h := &createRefuser{calls: &calls, mu: &mu}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(h))
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	c := New(hs.URL, "t", WithHTTPClient(hs.Client()))
	_, err := c.Create(t.Context(), Spec{Image: "busybox:latest"})
	if !IsUnavailable(err) || RetryAfter(err) != 5*time.Second {
		t.Fatalf("Create = %v (retry after %v); want Unavailable with a 5s hint", err, RetryAfter(err))
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 1 {
		t.Fatalf("create sent %d times, want once", calls)
	}
}

type createRefuser struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu    *sync.Mutex
	calls *int
}

func (r *createRefuser) Create(context.Context, *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.CreateSandboxResponse], error) {
	r.mu.Lock()
	*r.calls++
	r.mu.Unlock()
	err := connect.NewError(connect.CodeUnavailable, errors.New("no capacity and the admission queue is full"))
	err.Meta().Set(RetryAfterHeader, "5")
	return nil, err
}

// waiter holds a create in a pretend admission queue until its deadline.
type waiter struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu      sync.Mutex
	timeout string
}

func (w *waiter) Create(ctx context.Context, r *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.CreateSandboxResponse], error) {
	w.mu.Lock()
	w.timeout = r.Header().Get("Connect-Timeout-Ms")
	w.mu.Unlock()
	if _, ok := ctx.Deadline(); !ok {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("no deadline"))
	}
	<-ctx.Done()
	return nil, connect.NewError(connect.CodeResourceExhausted, errors.New("waited in the admission queue for room: no node has a slot free"))
}

// A create that waits for room until the caller's deadline ends with the
// server's answer, not with the caller's own timeout racing it.
func TestQueuedCallGetsTheServersAnswer(t *testing.T) {
	w := &waiter{}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(w))
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	c := New(hs.URL, "t", WithHTTPClient(hs.Client()))
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	_, err := c.Create(ctx, Spec{Image: "busybox:latest"})
	if !IsResourceExhausted(err) || !strings.Contains(err.Error(), "admission queue") {
		t.Fatalf("Create = %v, want the server's ResourceExhausted", err)
	}
	w.mu.Lock()
	sent := w.timeout
	w.mu.Unlock()
	if ms, err := strconv.Atoi(sent); err != nil || ms > 900 || ms < 1 {
		t.Fatalf("server deadline %q ms, want at most 900 (a tenth before the caller's 1s)", sent)
	}
}
