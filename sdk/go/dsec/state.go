package dsec

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// A sandbox's state as an object: snapshots (a new image made of the
// sandbox's file system, to start other sandboxes from), checkpoints and
// rollbacks in place (per-step branching), and freeze/thaw (pause every
// process, keeping memory), per sandbox or for a whole job by label.
//
// Snapshot, Checkpoint and Rollback are steps of the sandbox's trajectory,
// numbered by the handle like Exec: a client that restarts and re-issues
// them gets the recorded outcome back (Replayed) instead of taking them
// again. Freeze and thaw are not numbered: they are recorded as events, so
// a job-wide pause does not shift the numbers a trainer counts.

// OpOptions numbers a Snapshot, Checkpoint or Rollback explicitly.
type OpOptions struct {
	// Seq is the operation's step in the sandbox's trajectory. Zero lets a
	// numbered handle take its next number (or, on an Unnumbered handle,
	// the server number it).
	Seq uint64
	// RequestID is kept in the trajectory record.
	RequestID string
}

// OpResult is a numbered operation's step and whether it was replayed
// (recorded earlier and not done again).
type OpResult struct {
	Seq      uint64
	Replayed bool
}

// CheckpointResult names a checkpoint and the step that took it.
type CheckpointResult struct {
	// ID names the checkpoint for Rollback and DeleteCheckpoint.
	ID       string
	Seq      uint64
	Replayed bool
}

// Snapshot packs the sandbox's file system into a new image tagged ref
// (NAME:TAG, private to the caller's tenant): the sandbox's layers plus one
// holding what changed. Sandboxes created from ref, on any node, start
// from the file system as it was; processes and /tmp (a tmpfs) are not
// part of it. The sandbox is frozen while its layer is packed and keeps
// running afterwards. The image's Seq is the snapshot's step.
func (s *Sandbox) Snapshot(ctx context.Context, ref string) (*Image, error) {
	return s.SnapshotWith(ctx, ref, OpOptions{})
}

// SnapshotWith is Snapshot with an explicit step number or request id.
func (s *Sandbox) SnapshotWith(ctx context.Context, ref string, opts OpOptions) (*Image, error) {
	if ref == "" {
		// Refused before it takes a number: see OpOptions.
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("snapshot: ref: image reference is required"))
	}
	req := &dsecv1.SnapshotRequest{SandboxId: s.ID, Ref: ref, RequestId: opts.RequestID, Seq: s.take(opts.Seq)}
	var resp *connect.Response[dsecv1.SnapshotResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.Snapshot(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot sandbox %s as %s: %w", s.ID, ref, err)
	}
	im := imageFromProto(resp.Msg.GetImage())
	im.Seq, im.Replayed = resp.Msg.GetSeq(), resp.Msg.GetReplayed()
	return im, nil
}

// Checkpoint records the sandbox's file system in place and returns the
// checkpoint's ID, for Rollback. A checkpoint lives on the sandbox's node
// until DeleteCheckpoint or the sandbox's end.
func (s *Sandbox) Checkpoint(ctx context.Context) (string, error) {
	ck, err := s.CheckpointWith(ctx, OpOptions{})
	if err != nil {
		return "", err
	}
	return ck.ID, nil
}

// CheckpointWith is Checkpoint with an explicit step number or request id;
// it also returns the checkpoint's step.
func (s *Sandbox) CheckpointWith(ctx context.Context, opts OpOptions) (*CheckpointResult, error) {
	req := &dsecv1.CheckpointRequest{SandboxId: s.ID, RequestId: opts.RequestID, Seq: s.take(opts.Seq)}
	var resp *connect.Response[dsecv1.CheckpointResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.Checkpoint(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("checkpoint sandbox %s: %w", s.ID, err)
	}
	return &CheckpointResult{ID: resp.Msg.GetCheckpointId(), Seq: resp.Msg.GetSeq(), Replayed: resp.Msg.GetReplayed()}, nil
}

// Rollback kills every process in the sandbox and resets its file system
// to exactly the checkpoint's. The sandbox keeps its ID; the checkpoint
// stays, so the sandbox can be rolled back to it again.
func (s *Sandbox) Rollback(ctx context.Context, checkpointID string) error {
	_, err := s.RollbackWith(ctx, checkpointID, OpOptions{})
	return err
}

// RollbackWith is Rollback with an explicit step number or request id; it
// also returns the rollback's step.
func (s *Sandbox) RollbackWith(ctx context.Context, checkpointID string, opts OpOptions) (*OpResult, error) {
	if checkpointID == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("rollback: checkpoint_id: required"))
	}
	req := &dsecv1.RollbackRequest{SandboxId: s.ID, CheckpointId: checkpointID, RequestId: opts.RequestID, Seq: s.take(opts.Seq)}
	var resp *connect.Response[dsecv1.RollbackResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.Rollback(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("roll sandbox %s back to %s: %w", s.ID, checkpointID, err)
	}
	return &OpResult{Seq: resp.Msg.GetSeq(), Replayed: resp.Msg.GetReplayed()}, nil
}

// DeleteCheckpoint frees a checkpoint. A rollback reading it meanwhile
// still completes. It is not a step of the trajectory.
func (s *Sandbox) DeleteCheckpoint(ctx context.Context, checkpointID string) error {
	_, err := s.c.sandboxes.DeleteCheckpoint(ctx, connect.NewRequest(&dsecv1.DeleteCheckpointRequest{
		SandboxId: s.ID, CheckpointId: checkpointID,
	}))
	if err != nil {
		return fmt.Errorf("delete checkpoint %s of sandbox %s: %w", checkpointID, s.ID, err)
	}
	return nil
}

// Freeze stops every process in the sandbox (cgroup freezer): they use no
// CPU and keep their memory. Until Thaw, operations on the sandbox fail
// with FailedPrecondition (IsFailedPrecondition) and Get reports
// StateFrozen. Freezing a frozen sandbox does nothing.
func (s *Sandbox) Freeze(ctx context.Context) error {
	if _, err := s.c.sandboxes.Freeze(ctx, connect.NewRequest(&dsecv1.FreezeRequest{SandboxId: s.ID})); err != nil {
		return fmt.Errorf("freeze sandbox %s: %w", s.ID, err)
	}
	return nil
}

// Thaw resumes a frozen sandbox. Thawing a running sandbox does nothing.
func (s *Sandbox) Thaw(ctx context.Context) error {
	if _, err := s.c.sandboxes.Thaw(ctx, connect.NewRequest(&dsecv1.ThawRequest{SandboxId: s.ID})); err != nil {
		return fmt.Errorf("thaw sandbox %s: %w", s.ID, err)
	}
	return nil
}

// JobResult is what a job-wide freeze or thaw did to one sandbox.
type JobResult struct {
	// ID is the sandbox's, or "node/NODE" for a node that did not answer
	// (its sandboxes are in an unknown state).
	ID string
	// Err is nil when the sandbox was frozen (thawed); it keeps its Connect
	// code.
	Err error
}

// FreezeJob freezes every sandbox of the caller carrying all of labels (at
// least one is required), on every node, in one call: a trainer that loses
// its GPUs pauses its whole job. It returns one result per sandbox and, if
// any failed, a *BatchError holding those failures as well.
func (c *Client) FreezeJob(ctx context.Context, labels map[string]string) ([]JobResult, error) {
	return c.job(ctx, "freeze", labels, c.sandboxes.FreezeJob)
}

// ThawJob resumes every sandbox FreezeJob(labels) froze (every frozen
// sandbox carrying all of labels); results as FreezeJob.
func (c *Client) ThawJob(ctx context.Context, labels map[string]string) ([]JobResult, error) {
	return c.job(ctx, "thaw", labels, c.sandboxes.ThawJob)
}

func (c *Client) job(ctx context.Context, verb string, labels map[string]string,
	call func(context.Context, *connect.Request[dsecv1.JobRequest]) (*connect.Response[dsecv1.JobResponse], error)) ([]JobResult, error) {
	resp, err := call(ctx, connect.NewRequest(&dsecv1.JobRequest{Labels: labels}))
	if err != nil {
		return nil, fmt.Errorf("%s job %v: %w", verb, labels, err)
	}
	out := make([]JobResult, 0, len(resp.Msg.GetResults()))
	var errs []error
	for _, r := range resp.Msg.GetResults() {
		jr := JobResult{ID: r.GetId()}
		if r.GetError() != nil {
			jr.Err = itemError(verb+" "+r.GetId(), r.GetError())
			errs = append(errs, jr.Err)
		}
		out = append(out, jr)
	}
	return out, batchErr(errs)
}
