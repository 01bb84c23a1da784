package edge

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// The verifier box: a grading command runs in a fresh sandbox built from
// the graded sandbox's images as created (its spec's images, resolved
// again: no writable layer, no checkpoint layer), with its resources and
// environment and no network, into which only the declared artifacts are
// copied. Whatever else the workload changed (a conftest.py that passes
// every test, a patched test runner, a trojaned binary, a login profile)
// stays behind. The verifier is not a tenant's sandbox: it is never
// listed, takes no operation but the one command, and is destroyed when
// that ends; one runs at a time per graded sandbox.

func (s *service) VerifyOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeVerifyRequest]) (*connect.Response[dsecv1.VerifyResponse], error) {
	res, err := s.e.verify(ctx, req.Msg.GetCaller(), req.Msg.GetRequest())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.VerifyResponse{Result: res}), nil
}

func (e *Edge) verify(ctx context.Context, caller *dsecv1.Caller, req *dsecv1.VerifyRequest) (*dsecv1.ExecResult, error) {
	if req == nil {
		return nil, invalid("request is required")
	}
	rec := verifyRecord(req)
	if err := limits.Verify("request.", req); err != nil {
		return nil, e.refuse(ctx, caller, req.GetSandboxId(), req.GetSeq(), rec, err)
	}
	rreq, err := toRuntimeExec(req.Exec)
	if err != nil {
		return nil, e.refuse(ctx, caller, req.GetSandboxId(), req.GetSeq(), rec, err)
	}
	sb, err := e.lookup(caller, req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := e.paused(sb); err != nil {
		return nil, err
	}
	if !sb.verifyMu.TryLock() {
		return nil, fail.New(fail.ResourceExhausted, fmt.Errorf("sandbox %q: a verify of it is running; one runs at a time", sb.id))
	}
	defer sb.verifyMu.Unlock()
	op, replay, err := e.admitOp(ctx, sb, req.GetSeq(), rec)
	if err != nil {
		return nil, err
	}
	if replay != nil {
		return replayedExec(replay)
	}
	ctx = detach(ctx, req.GetSeq(), op)
	start := time.Now()
	res, err := e.runVerify(ctx, sb, req.GetArtifacts(), rreq)
	if op == nil {
		return res, err
	}
	if res != nil {
		fillExecResult(rec, res)
		res.Seq = op.Seq()
	}
	if cerr := e.commit(ctx, op, rec, start, err); cerr != nil {
		return nil, cerr
	}
	return res, err
}

// verifyRecord is the trajectory record of a verify request.
func verifyRecord(req *dsecv1.VerifyRequest) *trajectory.Record {
	rec := execRequestRecord(req.GetExec())
	rec.Kind = trajectory.KindVerify
	rec.Verify = &trajectory.Verification{Artifacts: req.GetArtifacts()}
	return rec
}

// runVerify builds the verifier, copies the artifacts, runs the command.
// The graded sandbox's loss is an infra_error result, as for an exec; so
// is a verifier the node could not build (the platform failed, not the
// work); an artifact the sandbox does not have is the caller's
// FailedPrecondition, naming it.
func (e *Edge) runVerify(ctx context.Context, sb *sandbox, artifacts []string, rreq runtime.ExecRequest) (*dsecv1.ExecResult, error) {
	rs, err := e.begin(sb)
	var lost errLost
	if errors.As(err, &lost) {
		return infraResult(lost), nil
	}
	if err != nil {
		return nil, err
	}
	// The image's layers as the sandbox was created from them (not
	// resolved again: a tag may have moved since).
	e.mu.Lock()
	vspec := sb.rspec
	vspec.Layers = sb.image
	e.mu.Unlock()
	vspec.ID = ids.NewSandbox(e.cfg.NodeID)
	vspec.Hostname = ""
	if len(vspec.Layers) == 0 {
		e.end(sb, rs, nil)
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q: its image's layers are not known on this node (recovered after a restart): no verifier", sb.id))
	}
	vs, err := e.cfg.Backends[sb.kind].Create(ctx, vspec)
	if err != nil {
		e.end(sb, rs, nil)
		if ctx.Err() != nil {
			return nil, fail.New(fail.Canceled, ctx.Err())
		}
		e.log.Warn("verifier not created", "sandbox", sb.id, "err", err)
		return infraResult(fmt.Errorf("verifier of sandbox %q could not be created: %w", sb.id, err)), nil
	}
	defer func() {
		if err := vs.Destroy(context.WithoutCancel(ctx)); err != nil {
			e.log.Warn("destroy verifier", "sandbox", sb.id, "verifier", vspec.ID, "err", err)
		}
	}()
	var copyErr error
	for _, a := range artifacts {
		if copyErr = copyArtifact(ctx, rs, vs, a); copyErr != nil {
			break
		}
	}
	if err := e.end(sb, rs, copyErr); err != nil {
		if errors.As(err, &lost) {
			return infraResult(lost), nil
		}
		return nil, opError(ctx, sb.id, "verify", err)
	}
	res, err := vs.Exec(ctx, rreq, nil)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fail.New(fail.Canceled, ctx.Err())
		}
		if errors.Is(err, runtime.ErrSandboxGone) {
			return infraResult(fmt.Errorf("verifier of sandbox %q was lost: %w", sb.id, err)), nil
		}
		return nil, opError(ctx, sb.id, "verify", err)
	}
	return toProtoResult(res), nil
}

// copyArtifact streams p (a file or a directory) from the graded
// sandbox into the verifier at the same path.
func copyArtifact(ctx context.Context, from, to runtime.Sandbox, p string) error {
	// A file's archive holds it under its base name (extracted into its
	// directory), a directory's its contents (extracted into it). A
	// one-byte read tells which: it succeeds, or is too large, only for a
	// regular file.
	dst := p
	if _, err := from.ReadFile(ctx, p, 1); err == nil || errors.Is(err, runtime.ErrTooLarge) {
		dst = path.Dir(p)
	}
	pr, pw := io.Pipe()
	got := make(chan error, 1)
	go func() {
		err := from.GetArchive(ctx, p, pw)
		pw.CloseWithError(err)
		got <- err
	}()
	err := to.PutArchive(ctx, dst, pr)
	pr.CloseWithError(errors.New("verifier stopped reading"))
	if gerr := <-got; gerr != nil {
		return artifactErr(p, gerr)
	}
	if err != nil {
		return fail.New(fail.Internal, fmt.Errorf("artifact %s into the verifier: %w", p, err))
	}
	return nil
}

func artifactErr(p string, err error) error {
	var fe *fail.Error
	if errors.As(err, &fe) {
		return err
	}
	return fail.New(fail.FailedPrecondition, fmt.Errorf("artifact %s: %w", p, err))
}
