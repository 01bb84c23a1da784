package controlplane

// Run: Create, ExecStream and Destroy in one round trip (`dsec run`). The
// server does what Create does up to placement (auth, validation, quota,
// the admission queue, a node with a warm sandbox of the spec first) and
// then forwards the whole call to the chosen edge as one RunOnEdge, which
// creates, runs and destroys there. Until the edge says the sandbox
// exists (its first message), a refusal or an unreachable node is retried
// elsewhere, as a create is; after that the command may have started, so
// a node failure is an infra_error result, as for an exec.

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/limits"
)

func (ss *sandboxService) Run(ctx context.Context, req *connect.Request[dsecv1.RunRequest], out *connect.ServerStream[dsecv1.RunResponse]) error {
	s := ss.s
	var started time.Time
	outcome, err := s.run(ctx, req.Msg, out, &started)
	if err != nil {
		op := "create"
		if !started.IsZero() {
			op = "exec"
		}
		s.metrics.fail(op, err)
		return err
	}
	s.metrics.execTime.WithLabelValues(outcome).Observe(time.Since(started).Seconds())
	return nil
}

// run serves one Run; started is set when the sandbox exists.
func (s *Server) run(ctx context.Context, r *dsecv1.RunRequest, out *connect.ServerStream[dsecv1.RunResponse], started *time.Time) (string, error) {
	p, err := principal(ctx)
	if err != nil {
		return "", err
	}
	ex := r.GetExec()
	switch {
	case ex == nil:
		return "", errf(connect.CodeInvalidArgument, "exec: required")
	case ex.GetSandboxId() != "":
		return "", errf(connect.CodeInvalidArgument, "exec.sandbox_id: must be empty (Run creates the sandbox)")
	case ex.GetSeq() != 0:
		return "", errf(connect.CodeInvalidArgument, "exec.seq: must be 0 (a Run's sandbox is new)")
	}
	if err := limits.Exec("exec.", ex); err != nil {
		return "", err
	}
	prep, quota, res, err := s.admit(ctx, p, r.GetSpec())
	if err != nil {
		return "", err
	}
	var outcome string
	err = s.onSomeEdge(ctx, p, quota, prep, res, "run", func(res reservation) (bool, error) {
		var err error
		outcome, err = s.runOnEdge(ctx, p, prep, ex, res, out, started)
		return !started.IsZero(), err
	})
	return outcome, err
}

// runContext bounds a RunOnEdge: a create, then the command's own timeout,
// with slack for the round trips; without a timeout only the caller's
// context bounds it, as for an exec.
func runContext(ctx context.Context, ex *dsecv1.ExecRequest) (context.Context, context.CancelFunc) {
	if d := ex.GetTimeout().AsDuration(); ex.GetTimeout() != nil && d > 0 && d <= limits.MaxExecTimeout {
		return context.WithTimeout(ctx, createTimeout+d+execSlack)
	}
	return context.WithCancel(ctx)
}

// runOnEdge forwards one Run to the node of res and relays its events.
// started is set when the node says the sandbox exists; until then an
// error means nothing was created.
func (s *Server) runOnEdge(ctx context.Context, p iam.Principal, prep *prepared, ex *dsecv1.ExecRequest, res reservation,
	out *connect.ServerStream[dsecv1.RunResponse], started *time.Time) (string, error) {
	cctx, cancel := runContext(ctx, ex)
	defer cancel()
	stream, err := s.edges.get(res.url).RunOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeRunRequest{
		Caller: callerOf(p), SandboxId: res.id, Spec: prep.edge, Exec: ex, Limits: prep.limits.Proto(), Resolved: prep.resolved,
	}))
	if err != nil {
		return "", err
	}
	defer stream.Close()
	outcome := ""
	for stream.Receive() {
		msg := stream.Msg()
		if started.IsZero() {
			*started = time.Now()
			s.reg.completed(res.id)
			s.metrics.creates.WithLabelValues(prep.user.Backend).Inc()
		}
		if r := msg.GetResult(); r != nil {
			outcome = r.GetOutcome()
		}
		if err := out.Send(msg); err != nil {
			// The caller went away; cancelling the call makes the node
			// stop the command and destroy the sandbox.
			return "", err
		}
	}
	err = stream.Err()
	sendInfra := func(reason string) (string, error) {
		r := infraResult(reason)
		return r.Outcome, out.Send(&dsecv1.RunResponse{Event: &dsecv1.RunResponse_Result{Result: r}, SandboxId: res.id})
	}
	switch {
	case started.IsZero():
		if err == nil {
			err = errf(connect.CodeInternal, "node %s ended the run without creating the sandbox", res.node)
		}
		return "", err
	case outcome != "":
		// The node destroyed the sandbox before sending the result.
		s.reg.forget(res.id)
		s.metrics.destroys.Inc()
		return outcome, nil
	case err != nil && connect.IsWireError(err):
		// An answer (the exec failed): the node destroyed the sandbox
		// before sending it. Anything else is the transport failing
		// (a connection cut mid-stream is not even Unavailable).
		s.reg.forget(res.id)
		s.metrics.destroys.Inc()
		return "", err
	case ctx.Err() != nil:
		return "", toConnect(ctx.Err())
	case err != nil:
		return sendInfra(fmt.Sprintf("node %s stopped answering mid-run: %v", res.node, err))
	default:
		return sendInfra(fmt.Sprintf("node %s ended the run without a result", res.node))
	}
}
