package edge

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// Exec outcomes (ExecResult.outcome; the contract's, spec.Outcome).
const (
	OutcomeOK         = spec.OutcomeOK
	OutcomeFailed     = spec.OutcomeFailed
	OutcomeTimeout    = spec.OutcomeTimeout
	OutcomeInfraError = spec.OutcomeInfraError
)

// service adapts the Edge to the generated EdgeService handler.
type service struct{ e *Edge }

var _ dsecv1connect.EdgeServiceHandler = (*service)(nil)

func (s *service) CreateOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeCreateRequest]) (*connect.Response[dsecv1.CreateSandboxResponse], error) {
	sb, err := s.e.create(ctx, req.Msg.Caller, req.Msg.SandboxId, req.Msg.Spec, req.Msg.Limits, req.Msg.Resolved)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.CreateSandboxResponse{Sandbox: sb}), nil
}

func (s *service) GetOnEdge(_ context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.GetSandboxResponse], error) {
	sb, err := s.e.get(req.Msg.Caller, req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: sb}), nil
}

func (s *service) ListOnEdge(_ context.Context, req *connect.Request[dsecv1.EdgeListRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	list, err := s.e.list(req.Msg.Caller, req.Msg.Labels)
	if err != nil {
		return nil, err
	}
	slices.SortFunc(list, func(a, b *dsecv1.Sandbox) int { return strings.Compare(a.Id, b.Id) })
	return connect.NewResponse(&dsecv1.ListSandboxesResponse{Sandboxes: list}), nil
}

func (s *service) ExecOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeExecRequest]) (*connect.Response[dsecv1.ExecResponse], error) {
	res, err := s.e.exec(ctx, req.Msg.Caller, req.Msg.Request, nil)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ExecResponse{Result: res}), nil
}

func (s *service) ExecStreamOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeExecRequest], stream *connect.ServerStream[dsecv1.ExecStreamResponse]) error {
	var (
		mu      sync.Mutex
		sendErr error
	)
	// Send serialises the message before returning, so data is not
	// retained past the call, as OutputFunc requires.
	out := func(st runtime.Stream, data []byte) {
		mu.Lock()
		defer mu.Unlock()
		if sendErr != nil {
			return
		}
		msg := &dsecv1.ExecStreamResponse{}
		if st == runtime.Stderr {
			msg.Event = &dsecv1.ExecStreamResponse_Stderr{Stderr: data}
		} else {
			msg.Event = &dsecv1.ExecStreamResponse_Stdout{Stdout: data}
		}
		sendErr = stream.Send(msg)
	}
	res, err := s.e.exec(ctx, req.Msg.Caller, req.Msg.Request, out)
	if err != nil {
		return err
	}
	if res.Replayed {
		// A fast-forward ran nothing: the recorded output goes out first.
		if len(res.Stdout) > 0 {
			out(runtime.Stdout, res.Stdout)
		}
		if len(res.Stderr) > 0 {
			out(runtime.Stderr, res.Stderr)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if sendErr != nil {
		return sendErr
	}
	// The output went out as it came; the result does not repeat it.
	res.Stdout, res.Stderr = nil, nil
	return stream.Send(&dsecv1.ExecStreamResponse{Event: &dsecv1.ExecStreamResponse_Result{Result: res}})
}

func (s *service) WriteFileOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeWriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	r := req.Msg.Request
	if r == nil {
		return nil, invalid("request is required")
	}
	mode := r.Mode
	if mode == 0 {
		mode = 0o644
	}
	rec := &trajectory.Record{Kind: trajectory.KindWriteFile, RequestID: r.RequestId,
		File: &trajectory.File{Path: r.Path, Mode: mode, Data: trajectory.NewData(r.Data)}}
	if err := limits.WriteFile("request.", r); err != nil {
		return nil, s.e.refuse(ctx, req.Msg.Caller, r.SandboxId, r.Seq, rec, err)
	}
	seq, replay, err := s.e.fileOp(ctx, req.Msg.Caller, r.SandboxId, r.Seq, "write "+r.Path, rec, func(ctx context.Context, rs runtime.Sandbox) error {
		return rs.WriteFile(ctx, r.Path, r.Data, mode)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.WriteFileResponse{Seq: seq, Replayed: replay != nil}), nil
}

func (s *service) ReadFileOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	r := req.Msg.Request
	if r == nil {
		return nil, invalid("request is required")
	}
	var data []byte
	rec := &trajectory.Record{Kind: trajectory.KindReadFile, RequestID: r.RequestId,
		File: &trajectory.File{Path: r.Path, MaxBytes: r.MaxBytes}}
	if err := limits.ReadFile("request.", r); err != nil {
		return nil, s.e.refuse(ctx, req.Msg.Caller, r.SandboxId, r.Seq, rec, err)
	}
	// The file is buffered whole (here, in its record, in each hop's
	// message): at most limits.MaxReadBytes of it.
	bound := limits.Read(r.MaxBytes)
	seq, replay, err := s.e.fileOp(ctx, req.Msg.Caller, r.SandboxId, r.Seq, "read "+r.Path, rec, func(ctx context.Context, rs runtime.Sandbox) error {
		var err error
		data, err = rs.ReadFile(ctx, r.Path, bound)
		if errors.Is(err, runtime.ErrTooLarge) {
			// The caller's to fix (a larger bound, or another way to
			// read), not the platform's fault.
			return limits.TooLarge("request.", r.Path, bound)
		}
		if err == nil {
			rec.File.Data = trajectory.NewData(data)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if replay != nil {
		if replay.File == nil || replay.File.Data == nil {
			return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("seq %d is a %s record, not a read", replay.Seq, replay.Kind))
		}
		data = replay.File.Data.Inline
	}
	return connect.NewResponse(&dsecv1.ReadFileResponse{Data: data, Seq: seq, Replayed: replay != nil}), nil
}

func (s *service) SubmitRewardOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSubmitRewardRequest]) (*connect.Response[dsecv1.SubmitRewardResponse], error) {
	res, err := s.e.reward(ctx, req.Msg.Caller, req.Msg.Request)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) SnapshotOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSnapshotRequest]) (*connect.Response[dsecv1.SnapshotResponse], error) {
	res, err := s.e.snapshot(ctx, req.Msg.Caller, req.Msg.Request, req.Msg.InternalRef)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) CheckpointOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeCheckpointRequest]) (*connect.Response[dsecv1.CheckpointResponse], error) {
	res, err := s.e.checkpoint(ctx, req.Msg.Caller, req.Msg.Request)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) RollbackOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeRollbackRequest]) (*connect.Response[dsecv1.RollbackResponse], error) {
	res, err := s.e.rollback(ctx, req.Msg.Caller, req.Msg.Request)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) DeleteCheckpointOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeDeleteCheckpointRequest]) (*connect.Response[dsecv1.DeleteCheckpointResponse], error) {
	r := req.Msg.Request
	if r == nil {
		return nil, invalid("request is required")
	}
	sb, err := s.e.lookup(req.Msg.Caller, r.SandboxId)
	if err != nil {
		return nil, err
	}
	if err := s.e.snaps.Delete(sb.id, r.CheckpointId); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.DeleteCheckpointResponse{}), nil
}

func (s *service) FreezeOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.FreezeResponse], error) {
	sb, err := s.e.lookup(req.Msg.Caller, req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	if err := s.e.freeze(ctx, sb); err != nil {
		return nil, err
	}
	out, err := s.e.get(req.Msg.Caller, sb.id)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.FreezeResponse{Sandbox: out}), nil
}

func (s *service) ThawOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.ThawResponse], error) {
	sb, err := s.e.lookup(req.Msg.Caller, req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	if err := s.e.thaw(ctx, sb); err != nil {
		return nil, err
	}
	out, err := s.e.get(req.Msg.Caller, sb.id)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ThawResponse{Sandbox: out}), nil
}

func (s *service) FreezeJobOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeListRequest]) (*connect.Response[dsecv1.JobResponse], error) {
	res, err := s.e.jobOp(ctx, req.Msg.Caller, req.Msg.Labels, s.e.freeze)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) ThawJobOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeListRequest]) (*connect.Response[dsecv1.JobResponse], error) {
	res, err := s.e.jobOp(ctx, req.Msg.Caller, req.Msg.Labels, s.e.thaw)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) GetTrajectoryOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeGetTrajectoryRequest]) (*connect.Response[dsecv1.GetTrajectoryResponse], error) {
	res, err := s.e.trajectoryPage(ctx, req.Msg.Caller, req.Msg.Request)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}

func (s *service) DestroyOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.DestroySandboxResponse], error) {
	sb, err := s.e.lookup(req.Msg.Caller, req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	if err := s.e.destroy(ctx, sb, reasonRequest); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.DestroySandboxResponse{}), nil
}

// fileOp runs op on a running sandbox of caller's and records it as rec
// (op fills in the result). It returns the operation's seq, or the recorded
// record when seq was recorded already (fast-forward).
func (e *Edge) fileOp(ctx context.Context, caller *dsecv1.Caller, id string, seq uint64, what string,
	rec *trajectory.Record, op func(context.Context, runtime.Sandbox) error) (uint64, *trajectory.Record, error) {
	sb, err := e.lookup(caller, id)
	if err != nil {
		return 0, nil, err
	}
	return e.numbered(ctx, sb, seq, rec, false, func(ctx context.Context, _ uint64) error {
		return e.runFileOp(ctx, sb, id, what, op)
	})
}

func (e *Edge) runFileOp(ctx context.Context, sb *sandbox, id, what string, op func(context.Context, runtime.Sandbox) error) error {
	rs, err := e.begin(sb)
	if err != nil {
		return opError(ctx, id, what, err)
	}
	if err := e.end(sb, rs, op(ctx, rs)); err != nil {
		return opError(ctx, id, what, err)
	}
	return nil
}

// detach lets an operation whose client numbered it run to completion even
// if the client goes away: the client will re-send the number after a
// reconnect and must get the outcome, not a half-run command.
func detach(ctx context.Context, seq uint64, op *trajectory.Op) context.Context {
	if seq != 0 && op != nil {
		return context.WithoutCancel(ctx)
	}
	return ctx
}

// exec runs one command. A sandbox that is lost, or dies during the exec,
// gives a result with outcome infra_error rather than an error, so that a
// trainer can mask it instead of learning from it.
func (e *Edge) exec(ctx context.Context, caller *dsecv1.Caller, req *dsecv1.ExecRequest, out runtime.OutputFunc) (*dsecv1.ExecResult, error) {
	if req == nil {
		return nil, invalid("request is required")
	}
	rreq, err := toRuntimeExec(req)
	if err != nil {
		return nil, e.refuse(ctx, caller, req.SandboxId, req.Seq, execRequestRecord(req), err)
	}
	sb, err := e.lookup(caller, req.SandboxId)
	if err != nil {
		return nil, err
	}
	if err := e.paused(sb); err != nil {
		return nil, err
	}
	rec := execRequestRecord(req)
	op, replay, err := e.admitOp(ctx, sb, req.Seq, rec)
	if err != nil {
		return nil, err
	}
	if replay != nil {
		return replayedExec(replay)
	}
	ctx = detach(ctx, req.Seq, op)
	start := time.Now()
	res, err := e.runExec(ctx, sb, rreq, out)
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

func (e *Edge) runExec(ctx context.Context, sb *sandbox, rreq runtime.ExecRequest, out runtime.OutputFunc) (*dsecv1.ExecResult, error) {
	rs, err := e.begin(sb)
	var lost errLost
	if errors.As(err, &lost) {
		return infraResult(lost), nil
	}
	if err != nil {
		return nil, err
	}
	start := time.Now()
	rreq.Env = e.proxyEnv(sb, rs, rreq.Env)
	res, err := rs.Exec(ctx, rreq, out)
	e.metrics.execSeconds.WithLabelValues(string(sb.kind)).Observe(time.Since(start).Seconds())
	if err = e.end(sb, rs, err); err != nil {
		if errors.As(err, &lost) {
			return infraResult(lost), nil
		}
		return nil, opError(ctx, sb.id, "exec", err)
	}
	return toProtoResult(res), nil
}

func infraResult(err error) *dsecv1.ExecResult {
	return &dsecv1.ExecResult{Outcome: string(OutcomeInfraError), InfraError: err.Error(), ExitCode: -1}
}

// toRuntimeExec checks an exec request as the server does (limits.Exec)
// and turns it into the runtime's, with the output bound held to the
// ceiling: what a result carries is buffered whole here and on the way.
func toRuntimeExec(r *dsecv1.ExecRequest) (runtime.ExecRequest, error) {
	if err := limits.Exec("request.", r); err != nil {
		return runtime.ExecRequest{}, err
	}
	return runtime.ExecRequest{
		Argv:           r.Argv,
		Shell:          r.Shell,
		Env:            r.Env,
		Cwd:            r.Cwd,
		User:           r.User,
		Stdin:          r.Stdin,
		Timeout:        r.GetTimeout().AsDuration(),
		MaxOutputBytes: limits.Output(r.MaxOutputBytes),
	}, nil
}

func toProtoResult(r runtime.ExecResult) *dsecv1.ExecResult {
	outcome := OutcomeOK
	switch {
	case r.TimedOut:
		outcome = OutcomeTimeout
	case r.ExitCode != 0 || r.Signal != 0:
		outcome = OutcomeFailed
	}
	return &dsecv1.ExecResult{
		Outcome:         string(outcome),
		ExitCode:        int32(r.ExitCode),
		Signal:          int32(r.Signal),
		Stdout:          r.Stdout,
		Stderr:          r.Stderr,
		StdoutTruncated: r.StdoutTruncated,
		StderrTruncated: r.StderrTruncated,
		Duration:        durationpb.New(r.Duration),
		TimedOut:        r.TimedOut,
		OomKilled:       r.OOMKilled,
		PidsExhausted:   r.PidsExhausted,
		DiskFull:        r.DiskFull,
	}
}

// RequireClusterToken wraps an internal service (EdgeService here,
// NodeService on servers) so that it refuses requests that do not carry
// the cluster token, with a Connect error in whichever protocol the caller
// speaks.
func RequireClusterToken(token string, next http.Handler) http.Handler {
	want := []byte("Bearer " + token)
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) == 1 {
			next.ServeHTTP(w, r)
			return
		}
		code := connect.CodeUnauthenticated
		msg := "missing cluster token (Authorization: Bearer)"
		if len(got) > 0 {
			code, msg = connect.CodePermissionDenied, "wrong cluster token"
		}
		ew.Write(w, r, connect.NewError(code, fmt.Errorf("edge service: %s", msg)))
	})
}

// ClusterAuth is a client interceptor that presents the cluster token on
// every call (heartbeats here, EdgeService calls on servers).
func ClusterAuth(token string) connect.Interceptor { return bearer(token) }

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return conn
	}
}

func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}
