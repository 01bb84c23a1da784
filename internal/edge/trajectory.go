package edge

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strconv"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// reasonRestart is why a sandbox found in the trajectory log at start,
// without a destroy or lost record, is lost: its processes ended with the
// edge process that ran it (or were cleaned up by the backend at start).
const reasonRestart = "node restarted: the edge process that ran it ended without destroying it"

// openTrajectory opens the node's trajectory log and turns what it recovered
// into sandbox records, so that Get, List, heartbeats and GetTrajectory know
// the sandboxes of the previous edge process: destroyed ones as destroyed,
// the rest as lost (with a lost record appended to their trajectory).
func (e *Edge) openTrajectory() error {
	l, err := trajectory.Open(trajectory.Options{
		Dir:    filepath.Join(e.cfg.DataDir, "trajectory"),
		Store:  e.cfg.Store,
		Logger: e.log,
	})
	if err != nil {
		return err
	}
	e.traj = l
	ctx := context.Background()
	for _, in := range l.Sandboxes() {
		state, reason := StateLost, reasonRestart
		switch {
		case in.Ended == nil:
			if err := l.End(ctx, in.Sandbox, trajectory.KindLost, reasonRestart); err != nil {
				l.Close()
				return fmt.Errorf("recover sandbox %s: %w", in.Sandbox, err)
			}
		case in.Ended.Kind == trajectory.KindDestroy:
			state, reason = StateDestroyed, in.Ended.Reason
		default:
			reason = in.Ended.Reason
		}
		sb := recoveredSandbox(in)
		e.mu.Lock()
		e.sandboxes[sb.id] = sb
		e.setState(sb, state, reason)
		e.mu.Unlock()
		e.queueShip(sb.id)
		e.log.Info("recovered sandbox from its trajectory", "sandbox", sb.id, "state", state)
	}
	return nil
}

// recoveredSandbox rebuilds the edge's record of a sandbox from its
// creation record.
func recoveredSandbox(in trajectory.Info) *sandbox {
	env := in.Environment
	if env == nil {
		env = &trajectory.Environment{}
	}
	spec := &dsecv1.SandboxSpec{
		Backend:    env.Backend,
		Image:      env.Image,
		Workspace:  env.Workspace,
		Toolkits:   env.Toolkits,
		Labels:     env.Labels,
		Env:        env.Env,
		IdleAction: env.IdleAction,
	}
	if env.MilliCPU != 0 || env.MemoryBytes != 0 || env.Pids != 0 || env.DiskBytes != 0 {
		spec.Resources = &dsecv1.Resources{MilliCpu: env.MilliCPU, MemoryBytes: env.MemoryBytes, Pids: env.Pids, DiskBytes: env.DiskBytes}
	}
	if d, err := time.ParseDuration(env.TTL); err == nil {
		spec.Ttl = durationpb.New(d)
	}
	if d, err := time.ParseDuration(env.IdleTimeout); err == nil {
		spec.IdleTimeout = durationpb.New(d)
	}
	return &sandbox{
		id:         in.Sandbox,
		tenant:     env.Tenant,
		kind:       runtime.Kind(env.Backend),
		spec:       spec,
		req:        placement.Capacity{MilliCPU: env.MilliCPU, MemoryBytes: env.MemoryBytes, Sandboxes: 1},
		layers:     env.Layers,
		createdAt:  in.Created,
		lastActive: in.Created,
	}
}

// environment is the creation record's description of sb.
func environment(sb *sandbox) *trajectory.Environment {
	env := &trajectory.Environment{
		Tenant:      sb.tenant,
		Backend:     string(sb.kind),
		Image:       sb.spec.Image,
		Workspace:   sb.spec.Workspace,
		Toolkits:    sb.spec.Toolkits,
		Layers:      sb.layers,
		MilliCPU:    sb.spec.GetResources().GetMilliCpu(),
		MemoryBytes: sb.spec.GetResources().GetMemoryBytes(),
		Pids:        sb.spec.GetResources().GetPids(),
		DiskBytes:   sb.spec.GetResources().GetDiskBytes(),
		Env:         sb.spec.Env,
		Labels:      sb.spec.Labels,
	}
	if sb.ttl > 0 {
		env.TTL = sb.ttl.String()
	}
	if sb.idle > 0 {
		env.IdleTimeout = sb.idle.String()
		env.IdleAction = sb.spec.IdleAction
	}
	return env
}

// shipPace is the shortest time between two batches of ended trajectories
// the ship loop writes. A batch costs a few flushes of the disk however
// many trajectories it holds, so under a stream of destroys the loop
// gathers what ends within this time into one batch; an end that comes
// after a quiet spell is shipped at once.
const shipPace = 100 * time.Millisecond

// shipBatchMax bounds how many ended sandboxes one batch ships; more wait
// for the next one.
const shipBatchMax = 1024

// shipLoop ships ended trajectories soon after they end, in batches, and
// running ones periodically, until ctx is done. Whatever is still queued
// when it stops is shipped by Close (ShipAll), or by Forget before the
// sandbox is forgotten.
func (e *Edge) shipLoop(ctx context.Context) {
	t := time.NewTicker(e.cfg.ShipInterval)
	defer t.Stop()
	pace := time.NewTimer(0)
	defer pace.Stop()
	var last time.Time
	ids := make([]string, 0, 64)
	for {
		select {
		case <-ctx.Done():
			return
		case id := <-e.ship:
			ids = append(ids[:0], id)
		case <-t.C:
			if err := e.traj.ShipAll(ctx); err != nil {
				e.log.Warn("ship trajectories", "err", err)
			}
			continue
		}
		// Gather the ends that come before the pace allows the next
		// batch, then whatever else is queued.
		if wait := time.Until(last.Add(shipPace)); wait > 0 {
			pace.Reset(wait)
		gather:
			for len(ids) < shipBatchMax {
				select {
				case <-ctx.Done():
					return
				case id := <-e.ship:
					ids = append(ids, id)
				case <-pace.C:
					break gather
				}
			}
			pace.Stop()
		}
	drain:
		for len(ids) < shipBatchMax {
			select {
			case id := <-e.ship:
				ids = append(ids, id)
			default:
				break drain
			}
		}
		if err := e.traj.ShipBatch(ctx, ids); err != nil {
			e.log.Warn("ship trajectories", "sandboxes", len(ids), "err", err)
		}
		last = time.Now()
	}
}

// queueShip asks the ship loop to ship id's trajectory soon; when the queue
// is full the periodic pass picks it up.
func (e *Edge) queueShip(id string) {
	select {
	case e.ship <- id:
	default:
	}
}

// endTrajectory appends sb's final record (destroy or lost) and queues it
// for shipping.
func (e *Edge) endTrajectory(sb *sandbox, kind, reason string) {
	if e.traj == nil {
		return
	}
	if err := e.traj.End(context.Background(), sb.id, kind, reason); err != nil {
		e.log.Warn("end trajectory", "sandbox", sb.id, "err", err)
		return
	}
	e.queueShip(sb.id)
}

// forgetTrajectory drops a forgotten sandbox's part of the node's log once
// it is shipped.
func (e *Edge) forgetTrajectory(id string) {
	if e.traj == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.traj.Forget(ctx, id); err != nil {
		e.log.Warn("forget trajectory", "sandbox", id, "err", err)
	}
}

// nextSeq is the number sb's trajectory expects next; 0 without one.
func (e *Edge) nextSeq(id string) uint64 {
	if e.traj == nil {
		return 0
	}
	in, err := e.traj.Info(id)
	if err != nil {
		return 0
	}
	return in.NextSeq
}

// admitOp admits a recorded operation on sb. It returns the Op to commit
// the outcome with, or, for a number already recorded, the recorded record
// (fast-forward). Neither is returned when the operation runs unrecorded:
// logging is off, or the sandbox has no open trajectory (still creating, or
// ended), in which case its state decides what the caller gets.
func (e *Edge) admitOp(ctx context.Context, sb *sandbox, seq uint64, req *trajectory.Record) (*trajectory.Op, *trajectory.Record, error) {
	if e.traj == nil {
		if seq != 0 {
			return nil, nil, fail.New(fail.FailedPrecondition,
				fmt.Errorf("node %q keeps no trajectory (started with trajectory logging off): send operations without seq", e.cfg.NodeID))
		}
		return nil, nil, nil
	}
	op, rec, err := e.traj.Begin(ctx, sb.id, seq, req)
	var ahead *trajectory.SeqAheadError
	switch {
	case err == nil:
		return op, rec, nil
	case errors.As(err, &ahead), errors.Is(err, trajectory.ErrMismatch):
		return nil, nil, fail.New(fail.FailedPrecondition, err)
	case errors.Is(err, trajectory.ErrUnknown), errors.Is(err, trajectory.ErrEnded):
		if seq != 0 && errors.Is(err, trajectory.ErrUnknown) {
			return nil, nil, fail.New(fail.FailedPrecondition,
				fmt.Errorf("sandbox %q has no trajectory yet (still being created)", sb.id))
		}
		return nil, nil, nil
	case ctx.Err() != nil:
		return nil, nil, fail.New(fail.Canceled, err)
	}
	return nil, nil, fail.New(fail.Unavailable, fmt.Errorf("trajectory of sandbox %q: %w", sb.id, err))
}

// commit records an operation's outcome, detached from the caller's
// context: once the operation ran, its record must be written.
func (e *Edge) commit(ctx context.Context, op *trajectory.Op, rec *trajectory.Record, start time.Time, opErr error) error {
	rec.Start = trajectory.Timestamp(start)
	rec.End = trajectory.Timestamp(time.Now())
	if opErr != nil {
		rec.Error = &trajectory.Error{Code: apiCode(opErr).String(), Message: apiMessage(opErr)}
	}
	if err := op.Commit(context.WithoutCancel(ctx), rec); err != nil {
		e.log.Error("trajectory record not written", "sandbox", rec.Sandbox, "seq", op.Seq(), "err", err)
		return fail.New(fail.Unavailable, fmt.Errorf("record seq %d: %w", op.Seq(), err))
	}
	return nil
}

// refuse answers a numbered request the node will not run (bad
// arguments): the refusal is recorded under its number, so that the
// client's numbering and the sandbox's stay in step and a re-send gets the
// same refusal. Unnumbered requests are simply refused.
func (e *Edge) refuse(ctx context.Context, caller *dsecv1.Caller, id string, seq uint64, rec *trajectory.Record, why error) error {
	if seq == 0 || e.traj == nil {
		return why
	}
	sb, err := e.lookup(caller, id)
	if err != nil {
		return err
	}
	op, replay, err := e.admitOp(ctx, sb, seq, rec)
	switch {
	case err != nil:
		return err
	case replay != nil && replay.Error != nil:
		return recordedError(replay)
	case op == nil || replay != nil:
		return why
	}
	if cerr := e.commit(ctx, op, rec, time.Now(), why); cerr != nil {
		return cerr
	}
	return why
}

// recordedError turns a recorded failure back into the error it was.
func recordedError(rec *trajectory.Record) error {
	return fail.New(fail.ParseKind(rec.Error.Code), fmt.Errorf("recorded at seq %d: %s", rec.Seq, rec.Error.Message))
}

// execRequestRecord is the request half of an exec's record.
func execRequestRecord(r *dsecv1.ExecRequest) *trajectory.Record {
	x := &trajectory.Exec{
		Argv:           r.Argv,
		Shell:          r.Shell,
		Env:            r.Env,
		Cwd:            r.Cwd,
		User:           r.User,
		MaxOutputBytes: r.MaxOutputBytes,
	}
	if r.Timeout != nil {
		x.Timeout = r.Timeout.AsDuration().String()
	}
	if len(r.Stdin) > 0 {
		x.Stdin = trajectory.NewData(r.Stdin)
	}
	return &trajectory.Record{Kind: trajectory.KindExec, RequestID: r.RequestId, Exec: x}
}

// fillExecResult puts an exec result into its record.
func fillExecResult(rec *trajectory.Record, res *dsecv1.ExecResult) {
	x := rec.Exec
	x.Outcome = res.Outcome
	x.ExitCode = res.ExitCode
	x.Signal = res.Signal
	x.Stdout = trajectory.NewData(res.Stdout)
	x.Stderr = trajectory.NewData(res.Stderr)
	x.StdoutTruncated = res.StdoutTruncated
	x.StderrTruncated = res.StderrTruncated
	x.TimedOut = res.TimedOut
	x.OOMKilled = res.OomKilled
	x.PidsExhausted = res.PidsExhausted
	x.DiskFull = res.DiskFull
	x.InfraError = res.InfraError
	x.DurationNanos = res.GetDuration().AsDuration().Nanoseconds()
}

// replayedExec is the recorded result of an exec, flagged replayed.
func replayedExec(rec *trajectory.Record) (*dsecv1.ExecResult, error) {
	if rec.Error != nil {
		return nil, recordedError(rec)
	}
	x := rec.Exec
	if x == nil {
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("seq %d is a %s record, not an exec", rec.Seq, rec.Kind))
	}
	return &dsecv1.ExecResult{
		Outcome:         x.Outcome,
		ExitCode:        x.ExitCode,
		Signal:          x.Signal,
		Stdout:          x.Stdout.Inline,
		Stderr:          x.Stderr.Inline,
		StdoutTruncated: x.StdoutTruncated,
		StderrTruncated: x.StderrTruncated,
		Duration:        durationpb.New(time.Duration(x.DurationNanos)),
		TimedOut:        x.TimedOut,
		OomKilled:       x.OOMKilled,
		PidsExhausted:   x.PidsExhausted,
		DiskFull:        x.DiskFull,
		InfraError:      x.InfraError,
		Seq:             rec.Seq,
		Replayed:        true,
	}, nil
}

// reward appends a reward record to the sandbox's trajectory.
func (e *Edge) reward(ctx context.Context, caller *dsecv1.Caller, r *dsecv1.SubmitRewardRequest) (*dsecv1.SubmitRewardResponse, error) {
	if r == nil {
		return nil, invalid("request is required")
	}
	if math.IsNaN(r.Value) || math.IsInf(r.Value, 0) {
		return nil, invalid("request.value %v must be a finite number", r.Value)
	}
	sb, err := e.lookup(caller, r.SandboxId)
	if err != nil {
		return nil, err
	}
	if e.traj == nil {
		return nil, fail.New(fail.FailedPrecondition,
			fmt.Errorf("node %q keeps no trajectory (started with trajectory logging off)", e.cfg.NodeID))
	}
	req := &trajectory.Record{Kind: trajectory.KindReward, RequestID: r.RequestId,
		Reward: &trajectory.Reward{Value: r.Value, Metadata: r.Metadata}}
	op, rec, err := e.admitOp(ctx, sb, r.Seq, req)
	if err != nil {
		return nil, err
	}
	if rec != nil {
		if rec.Error != nil {
			return nil, recordedError(rec)
		}
		return &dsecv1.SubmitRewardResponse{Seq: rec.Seq, Replayed: true}, nil
	}
	if op == nil {
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q has no trajectory yet (still being created)", sb.id))
	}
	if err := e.commit(ctx, op, req, time.Now(), nil); err != nil {
		return nil, err
	}
	return &dsecv1.SubmitRewardResponse{Seq: op.Seq()}, nil
}

// Page sizes of GetTrajectory.
const (
	defaultTrajectoryPage = 1000
	maxTrajectoryPage     = 10000
)

// trajectoryPage serves one page of a sandbox's trajectory.
func (e *Edge) trajectoryPage(ctx context.Context, caller *dsecv1.Caller, r *dsecv1.GetTrajectoryRequest) (*dsecv1.GetTrajectoryResponse, error) {
	if r == nil {
		return nil, invalid("request is required")
	}
	size, from, err := pageBounds(r)
	if err != nil {
		return nil, err
	}
	sb, err := e.lookup(caller, r.SandboxId)
	if err != nil {
		return nil, err
	}
	if e.traj == nil {
		return nil, fail.New(fail.FailedPrecondition,
			fmt.Errorf("node %q keeps no trajectory (started with trajectory logging off)", e.cfg.NodeID))
	}
	lines, next, nextSeq, err := e.traj.PageBytes(ctx, sb.id, from, size, limits.MaxPageBytes, r.IncludeData)
	switch {
	case errors.Is(err, trajectory.ErrUnknown):
		return nil, fail.New(fail.NotFound, fmt.Errorf("sandbox %q has no trajectory on node %q", sb.id, e.cfg.NodeID))
	case err != nil:
		return nil, fail.New(fail.InvalidArgument, err)
	}
	out := &dsecv1.GetTrajectoryResponse{NextSeq: nextSeq, Records: make([]string, len(lines))}
	for i, l := range lines {
		out.Records[i] = string(l)
	}
	if next >= 0 {
		out.NextPageToken = strconv.Itoa(next)
	}
	return out, nil
}

// PageBounds checks a GetTrajectory request's paging: the page size (with
// its default) and the record position the page token names. Servers call
// it too, so its error is an API (Connect) error, InvalidArgument.
func PageBounds(r *dsecv1.GetTrajectoryRequest) (size, from int, err error) {
	size, from, err = pageBounds(r)
	return size, from, apiError(err)
}

func pageBounds(r *dsecv1.GetTrajectoryRequest) (size, from int, err error) {
	size = int(r.PageSize)
	switch {
	case size < 0:
		return 0, 0, invalid("page_size %d must not be negative", size)
	case size == 0:
		size = defaultTrajectoryPage
	case size > maxTrajectoryPage:
		size = maxTrajectoryPage
	}
	if r.PageToken != "" {
		from, err = strconv.Atoi(r.PageToken)
		if err != nil || from < 0 {
			return 0, 0, invalid("page_token %q is not one this API returned", r.PageToken)
		}
	}
	return size, from, nil
}
