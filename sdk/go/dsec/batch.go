package dsec

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// The batch API: a trainer driving hundreds of sandboxes sends one request
// per step for all of them instead of one per sandbox. Every call returns
// one result per item, in order; one item's failure is that item's result
// and never fails the others. The returned error is nil when every item
// succeeded, a *BatchError holding the failed items' errors when some
// did not (the results are complete either way), and any other error
// when the call as a whole failed (then there are no results).
//
// BatchExec and BatchRollback are steps of each sandbox's trajectory,
// numbered by its handle exactly as Sandbox.ExecWith and RollbackWith
// number them: the items' numbers are taken in order when the call is
// made, items that fail in transit or whose number arrived ahead of an
// earlier one are re-sent with the same number, and a number the server
// refused without recording goes back to its handle. So a trainer can mix
// batch and single operations on the same handles.

// AcquireResult is one sandbox of an Acquire: a handle, numbering its
// operations from 1, or why that sandbox could not be had.
type AcquireResult struct {
	Sandbox *Sandbox
	// Err keeps its Connect code (IsResourceExhausted, IsUnavailable and
	// RetryAfter work on it).
	Err error
}

// Acquire creates count sandboxes of spec in one call, taking warm ones
// from a matching pool first (see CreatePool). When the nodes are full the
// service queues the creates within ctx's deadline; what it cannot place
// in time fails with its own error (ResourceExhausted, or Unavailable with
// a RetryAfter hint when the queue itself is full). The service is told a
// deadline a little before ctx's, so that its answer, with the sandboxes
// it did create, arrives before ctx ends. Failed items are not retried:
// call Acquire again for what is missing.
func (c *Client) Acquire(ctx context.Context, count int, spec Spec) ([]AcquireResult, error) {
	if count < 0 || count > math.MaxInt32 {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("acquire: count: %d is out of range", count))
	}
	if count == 0 {
		return nil, nil
	}
	req := connect.NewRequest(&dsecv1.AcquireRequest{Spec: spec.proto(), Count: int32(count)})
	ctx, done := queued(ctx, req.Header())
	defer done()
	resp, err := c.sandboxes.Acquire(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("acquire %d sandboxes of %q: %w", count, spec.Image, err)
	}
	rs := resp.Msg.GetResults()
	out := make([]AcquireResult, count)
	var errs []error
	for i := range out {
		what := fmt.Sprintf("acquire sandbox %d of %d", i+1, count)
		switch {
		case i >= len(rs):
			out[i].Err = missingResult(what, len(rs), count)
		case rs[i].GetError() != nil:
			out[i].Err = itemError(what, rs[i].GetError())
		case rs[i].GetSandbox() == nil:
			out[i].Err = connect.NewError(connect.CodeInternal, fmt.Errorf("%s: the server returned neither a sandbox nor an error", what))
		default:
			out[i].Sandbox = c.sandbox(rs[i].GetSandbox())
		}
		if out[i].Err != nil {
			errs = append(errs, out[i].Err)
		}
	}
	return out, batchErr(errs)
}

// Acquired returns the handles of the sandboxes an Acquire got, in order.
func Acquired(results []AcquireResult) []*Sandbox {
	var out []*Sandbox
	for _, r := range results {
		if r.Sandbox != nil {
			out = append(out, r.Sandbox)
		}
	}
	return out
}

// BatchExecResult is what one command of a BatchExec did.
type BatchExecResult struct {
	Sandbox *Sandbox
	// Result is set when the command ran, including OutcomeInfraError
	// results (the sandbox or its node failed: mask the step).
	Result *ExecResult
	// Err is set when the command was refused (no such sandbox, bad
	// argument, frozen sandbox, ...); it keeps its Connect code.
	Err error
}

// BatchExec runs one command in each sandbox in one call: cmds[i] in
// sandboxes[i], or cmds[0] in every sandbox when only one command is
// given. Each command is its sandbox handle's next step, as with ExecWith
// (an explicit cmds[i].Seq is used as is). A sandbox should appear once
// per batch: its commands would run concurrently.
func (c *Client) BatchExec(ctx context.Context, sandboxes []*Sandbox, cmds []ExecOptions) ([]BatchExecResult, error) {
	if err := checkBatch("batch exec", sandboxes); err != nil {
		return nil, err
	}
	if len(sandboxes) == 0 {
		return nil, nil
	}
	if len(cmds) != 1 && len(cmds) != len(sandboxes) {
		return nil, connect.NewError(connect.CodeInvalidArgument,
			fmt.Errorf("batch exec: %d commands for %d sandboxes: give one per sandbox, or one for all", len(cmds), len(sandboxes)))
	}
	for i, o := range cmds {
		if len(o.Argv) == 0 && o.Shell == "" {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("batch exec: cmds[%d]: neither argv nor shell is set", i))
		}
	}
	// Numbers are taken only once the batch is known to be well formed,
	// so a refused batch uses up none.
	reqs := make([]*dsecv1.ExecRequest, len(sandboxes))
	seqs := make([]uint64, len(sandboxes))
	for i, sb := range sandboxes {
		o := cmds[0]
		if len(cmds) > 1 {
			o = cmds[i]
		}
		o.Seq = sb.take(o.Seq)
		reqs[i], seqs[i] = o.proto(sb.ID), o.Seq
	}
	out := make([]BatchExecResult, len(sandboxes))
	errs := c.sendBatch(ctx, sandboxes, seqs, func(idx []int) ([]error, error) {
		batch := make([]*dsecv1.ExecRequest, len(idx))
		for j, i := range idx {
			batch[j] = reqs[i]
		}
		resp, err := c.sandboxes.BatchExec(ctx, connect.NewRequest(&dsecv1.BatchExecRequest{Requests: batch}))
		if err != nil {
			return nil, fmt.Errorf("batch exec in %d sandboxes: %w", len(idx), err)
		}
		rs := resp.Msg.GetResults()
		itemErrs := make([]error, len(idx))
		for j, i := range idx {
			what := "exec in sandbox " + sandboxes[i].ID
			switch {
			case j >= len(rs):
				itemErrs[j] = missingResult(what, len(rs), len(idx))
			case rs[j].GetError() != nil:
				itemErrs[j] = itemError(what, rs[j].GetError())
			case rs[j].GetResult() == nil:
				itemErrs[j] = connect.NewError(connect.CodeInternal, fmt.Errorf("%s: the server returned neither a result nor an error", what))
			default:
				out[i].Result = resultFromProto(rs[j].GetResult())
			}
		}
		return itemErrs, nil
	})
	for i := range out {
		out[i].Sandbox = sandboxes[i]
		if errs[i] != nil {
			out[i].Result, out[i].Err = nil, errs[i]
		}
	}
	return out, batchErr(nonNil(errs))
}

// BatchRollbackResult is what one rollback of a BatchRollback did.
type BatchRollbackResult struct {
	Sandbox *Sandbox
	// Result is the rollback's step, set when it succeeded.
	Result *OpResult
	Err    error
}

// BatchRollback rolls sandboxes[i] back to checkpointIDs[i], all in one
// call (see Sandbox.Rollback). Each rollback is its handle's next step.
func (c *Client) BatchRollback(ctx context.Context, sandboxes []*Sandbox, checkpointIDs []string) ([]BatchRollbackResult, error) {
	if err := checkBatch("batch rollback", sandboxes); err != nil {
		return nil, err
	}
	if len(checkpointIDs) != len(sandboxes) {
		return nil, connect.NewError(connect.CodeInvalidArgument,
			fmt.Errorf("batch rollback: %d checkpoint IDs for %d sandboxes: give one per sandbox", len(checkpointIDs), len(sandboxes)))
	}
	if len(sandboxes) == 0 {
		return nil, nil
	}
	for i, id := range checkpointIDs {
		if id == "" {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("batch rollback: checkpoint_ids[%d]: required", i))
		}
	}
	reqs := make([]*dsecv1.RollbackRequest, len(sandboxes))
	seqs := make([]uint64, len(sandboxes))
	for i, sb := range sandboxes {
		seqs[i] = sb.take(0)
		reqs[i] = &dsecv1.RollbackRequest{SandboxId: sb.ID, CheckpointId: checkpointIDs[i], Seq: seqs[i]}
	}
	out := make([]BatchRollbackResult, len(sandboxes))
	errs := c.sendBatch(ctx, sandboxes, seqs, func(idx []int) ([]error, error) {
		batch := make([]*dsecv1.RollbackRequest, len(idx))
		for j, i := range idx {
			batch[j] = reqs[i]
		}
		resp, err := c.sandboxes.BatchRollback(ctx, connect.NewRequest(&dsecv1.BatchRollbackRequest{Requests: batch}))
		if err != nil {
			return nil, fmt.Errorf("batch rollback of %d sandboxes: %w", len(idx), err)
		}
		rs := resp.Msg.GetResults()
		itemErrs := make([]error, len(idx))
		for j, i := range idx {
			what := fmt.Sprintf("roll sandbox %s back to %s", sandboxes[i].ID, checkpointIDs[i])
			switch {
			case j >= len(rs):
				itemErrs[j] = missingResult(what, len(rs), len(idx))
			case rs[j].GetError() != nil:
				itemErrs[j] = itemError(what, rs[j].GetError())
			case rs[j].GetResult() == nil:
				itemErrs[j] = connect.NewError(connect.CodeInternal, fmt.Errorf("%s: the server returned neither a result nor an error", what))
			default:
				r := rs[j].GetResult()
				out[i].Result = &OpResult{Seq: r.GetSeq(), Replayed: r.GetReplayed()}
			}
		}
		return itemErrs, nil
	})
	for i := range out {
		out[i].Sandbox = sandboxes[i]
		if errs[i] != nil {
			out[i].Result, out[i].Err = nil, errs[i]
		}
	}
	return out, batchErr(nonNil(errs))
}

// ReleaseResult is what a Release did to one sandbox.
type ReleaseResult struct {
	ID  string
	Err error
}

// Release ends sandboxes in one call. A sandbox whose spec matches a pool
// that wants more is reset (processes killed, writable layer wiped) and
// goes back to the pool for the next Acquire; the others are destroyed.
func (c *Client) Release(ctx context.Context, sandboxes []*Sandbox) ([]ReleaseResult, error) {
	if err := checkBatch("release", sandboxes); err != nil {
		return nil, err
	}
	if len(sandboxes) == 0 {
		return nil, nil
	}
	ids := make([]string, len(sandboxes))
	for i, sb := range sandboxes {
		ids[i] = sb.ID
	}
	resp, err := c.sandboxes.Release(ctx, connect.NewRequest(&dsecv1.ReleaseRequest{Ids: ids}))
	if err != nil {
		return nil, fmt.Errorf("release %d sandboxes: %w", len(ids), err)
	}
	rs := resp.Msg.GetResults()
	out := make([]ReleaseResult, len(ids))
	var errs []error
	for i, id := range ids {
		out[i].ID = id
		what := "release sandbox " + id
		switch {
		case i >= len(rs):
			out[i].Err = missingResult(what, len(rs), len(ids))
		case rs[i].GetId() != "" && rs[i].GetId() != id:
			out[i].Err = connect.NewError(connect.CodeInternal, fmt.Errorf("%s: the server answered for %s in its place", what, rs[i].GetId()))
		case rs[i].GetError() != nil:
			out[i].Err = itemError(what, rs[i].GetError())
		}
		if out[i].Err != nil {
			errs = append(errs, out[i].Err)
		}
	}
	return out, batchErr(errs)
}

// checkBatch refuses nil handles and handles without an ID before any
// number is taken.
func checkBatch(verb string, sandboxes []*Sandbox) error {
	for i, sb := range sandboxes {
		if sb == nil || sb.ID == "" {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s: sandboxes[%d]: no sandbox (nil handle or empty ID)", verb, i))
		}
	}
	return nil
}

func missingResult(what string, got, want int) error {
	return connect.NewError(connect.CodeInternal, fmt.Errorf("%s: the server returned %d results for %d items", what, got, want))
}

func nonNil(errs []error) []error {
	var out []error
	for _, err := range errs {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}

// giveBackFanout bounds the Get calls that check refused numbers.
const giveBackFanout = 16

// sendBatch runs a numbered batch: call(idx) sends the items at positions
// idx and returns one error per item (nil for success) or the error of
// the whole call. Items are re-sent, with their numbers, as a single
// numbered operation would be (see resend): after a failure in transit or
// Unavailable, and while an earlier number of their handle is still on its
// way; unnumbered items are sent once, since repeating them could run them
// twice. Then the numbers the server refused without recording go back to
// their handles (see Sandbox.send). It returns each item's final error.
func (c *Client) sendBatch(ctx context.Context, sbs []*Sandbox, seqs []uint64, call func(idx []int) ([]error, error)) []error {
	errs := make([]error, len(sbs))
	pending := make([]int, len(sbs))
	for i := range pending {
		pending[i] = i
	}
	deadline := time.Now().Add(resendFor)
	wait := 20 * time.Millisecond
	for len(pending) > 0 {
		itemErrs, err := call(pending)
		var (
			again []int
			hint  time.Duration
		)
		for j, i := range pending {
			e := err
			if e == nil {
				e = itemErrs[j]
			}
			errs[i] = e
			if e != nil && seqs[i] != 0 && retriable(e) {
				again = append(again, i)
				hint = max(hint, RetryAfter(e))
			}
		}
		if len(again) == 0 || time.Now().After(deadline) {
			break
		}
		pause := min(max(wait, hint), max(time.Until(deadline), 0))
		select {
		case <-ctx.Done():
			again = nil
		case <-time.After(pause):
		}
		pending = again
		wait = min(2*wait, time.Second)
	}

	// Give back refused numbers, concurrently but bounded: a batch of
	// thousands refused for a frozen job must not cost thousands of
	// sequential round trips.
	sem := make(chan struct{}, giveBackFanout)
	var wg sync.WaitGroup
	for i, e := range errs {
		if e == nil || seqs[i] == 0 || !maybeUnrecorded(e) || sbs[i].NextSeqToSend() != seqs[i]+1 {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if sb, gerr := c.Get(ctx, sbs[i].ID); gerr == nil && sb.NextSeq == seqs[i] {
				sbs[i].giveBack(seqs[i])
			}
		}()
	}
	wg.Wait()
	return errs
}
