package edge

// Run: one command in a sandbox that lives only for it (`dsec run`, the
// SDKs' Run). The server forwards the whole call here in one hop, so the
// node does create, exec and destroy back to back with no round trip in
// between, and with exactly their semantics: the create takes a recycled
// sandbox of a hot spec when there is one, the exec records on the
// trajectory, and the destroy hands the sandbox back to its pool.

import (
	"context"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// runDestroyTimeout bounds the destroy at the end of a Run, which runs even
// when the caller has gone away.
const runDestroyTimeout = 30 * time.Second

func (s *service) RunOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeRunRequest], stream *connect.ServerStream[dsecv1.RunResponse]) error {
	m := req.Msg
	if m.Exec == nil {
		return invalid("exec is required")
	}
	// A command that cannot run must not cost a sandbox.
	if _, err := toRuntimeExec(m.Exec); err != nil {
		return err
	}
	if m.Exec.Seq != 0 {
		return invalid("exec.seq %d: a Run's sandbox is new, its command is not numbered", m.Exec.Seq)
	}
	created, err := s.e.create(ctx, m.Caller, m.SandboxId, m.Spec, m.Limits, m.Resolved)
	if err != nil {
		return err
	}
	id := created.Id
	res, destroyErr, execErr := s.e.runIn(ctx, m.Caller, id, m.Exec, stream)
	if execErr != nil {
		return execErr
	}
	return stream.Send(&dsecv1.RunResponse{
		Event:        &dsecv1.RunResponse_Result{Result: res},
		SandboxId:    id,
		DestroyError: destroyErr,
	})
}

// runIn tells the server that sandbox id exists, runs the command in it
// with its output streamed, and destroys it whatever happened (the caller
// may be gone: the destroy does not use ctx's cancellation). It returns
// the exec's result, why the destroy failed ("" if it did not), and the
// exec's error.
func (e *Edge) runIn(ctx context.Context, caller *dsecv1.Caller, id string, r *dsecv1.ExecRequest, stream *connect.ServerStream[dsecv1.RunResponse]) (*dsecv1.ExecResult, string, error) {
	var (
		mu      sync.Mutex
		sendErr error
	)
	send := func(msg *dsecv1.RunResponse) {
		mu.Lock()
		defer mu.Unlock()
		if sendErr == nil {
			sendErr = stream.Send(msg)
		}
	}
	// First message: the sandbox exists. Until it arrives, the server may
	// place the Run on another node when this one fails; after it, never
	// (the command may have started).
	send(&dsecv1.RunResponse{SandboxId: id})
	var (
		res *dsecv1.ExecResult
		err error
	)
	if sendErr == nil {
		r.SandboxId = id
		// Send serialises the message before returning, so data is not
		// retained past the call, as OutputFunc requires.
		res, err = e.exec(ctx, caller, r, func(st runtime.Stream, data []byte) {
			msg := &dsecv1.RunResponse{}
			if st == runtime.Stderr {
				msg.Event = &dsecv1.RunResponse_Stderr{Stderr: data}
			} else {
				msg.Event = &dsecv1.RunResponse_Stdout{Stdout: data}
			}
			send(msg)
		})
	}
	destroyErr := ""
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), runDestroyTimeout)
	defer cancel()
	sb, lerr := e.lookup(caller, id)
	if lerr == nil {
		lerr = e.destroy(dctx, sb, reasonRequest)
	}
	if lerr != nil && !fail.Is(lerr, fail.NotFound) {
		// NotFound: something else (a TTL of zero, a shutdown) ended it.
		destroyErr = apiText(lerr)
	}
	mu.Lock()
	defer mu.Unlock()
	switch {
	case sendErr != nil:
		return nil, destroyErr, sendErr
	case err != nil:
		return nil, destroyErr, err
	}
	// The output went out as it came; the result does not repeat it.
	res.Stdout, res.Stderr = nil, nil
	return res, destroyErr, nil
}
