package edge

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge/lifecycle"
	"github.com/dsec-dev/dsec/internal/edge/snapshot"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// stateTarget checks that sb can take a state operation and returns its
// runtime sandbox; the caller holds sb.stateMu.
func (e *Edge) stateTarget(sb *sandbox) (runtime.Sandbox, bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case sb.st.DestroyBegun():
		return nil, false, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is being destroyed", sb.id))
	case !sb.st.Live():
		return nil, false, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is %s", sb.id, sb.phase()))
	}
	return sb.rt, sb.st.Is(lifecycle.Frozen), nil
}

// freeze stops every process of sb; it is idempotent.
func (e *Edge) freeze(ctx context.Context, sb *sandbox) error {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	rs, frozen, err := e.stateTarget(sb)
	if err != nil || frozen {
		return err
	}
	if err := rs.Freeze(ctx); err != nil {
		return fail.New(fail.Internal, fmt.Errorf("freeze sandbox %q: %w", sb.id, err))
	}
	e.mu.Lock()
	if sb.st.Is(lifecycle.Running) { // else destroyed or lost meanwhile
		e.setState(sb, lifecycle.Frozen, "")
	}
	e.schedule(sb) // its ttl still runs
	e.mu.Unlock()
	e.event(sb, trajectory.KindFreeze, "")
	return nil
}

// thaw resumes a frozen sb; it is idempotent.
func (e *Edge) thaw(ctx context.Context, sb *sandbox) error {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	rs, frozen, err := e.stateTarget(sb)
	if err != nil || !frozen {
		return err
	}
	if err := rs.Thaw(ctx); err != nil {
		return fail.New(fail.Internal, fmt.Errorf("thaw sandbox %q: %w", sb.id, err))
	}
	e.mu.Lock()
	if sb.st.Is(lifecycle.Frozen) {
		e.setState(sb, lifecycle.Running, "")
	}
	sb.lastActive = time.Now()
	e.schedule(sb) // idle again from now
	e.mu.Unlock()
	e.event(sb, trajectory.KindThaw, "")
	return nil
}

// event records a freeze or thaw in sb's trajectory.
func (e *Edge) event(sb *sandbox, kind, reason string) {
	if e.traj == nil {
		return
	}
	if err := e.traj.Event(context.Background(), sb.id, kind, reason); err != nil {
		e.log.Warn("trajectory event", "sandbox", sb.id, "kind", kind, "err", err)
	}
}

// packUpper runs pack on a directory holding sb's writable layer (see
// snapshot.Store.WithWritableLayer: a container's upper directory while it
// is frozen, a VM's diff stream unpacked).
func (e *Edge) packUpper(ctx context.Context, sb *sandbox, rs runtime.Sandbox, frozen bool, pack func(dir string) error) error {
	if !snapshot.CanPack(rs) {
		return fail.New(fail.Unimplemented,
			fmt.Errorf("the %s backend cannot snapshot sandbox %q", sb.kind, sb.id))
	}
	return e.snaps.WithWritableLayer(ctx, sb.id, rs, frozen, pack)
}

// doCheckpoint copies sb's writable layer into a checkpoint layer and
// records a checkpoint (snapshot.Store.Take).
func (e *Edge) doCheckpoint(ctx context.Context, sb *sandbox) (id, layerDigest string, err error) {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	rs, frozen, err := e.stateTarget(sb)
	if err != nil {
		return "", "", err
	}
	if !snapshot.CanPack(rs) {
		return "", "", fail.New(fail.Unimplemented,
			fmt.Errorf("the %s backend cannot snapshot sandbox %q", sb.kind, sb.id))
	}
	e.mu.Lock()
	stack := slices.Clone(sb.rspec.Layers)
	e.mu.Unlock()
	ck, digest, err := e.snaps.Take(ctx, sb.id, rs, frozen, stack)
	if err != nil {
		return "", "", err
	}
	return ck.ID, digest, nil
}

// doRollback kills every process of sb and restarts it on the checkpoint's
// file system with a fresh writable layer: a new runtime sandbox with the
// same ID, resources and environment.
func (e *Edge) doRollback(ctx context.Context, sb *sandbox, id string) error {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	ck, err := e.snaps.Acquire(sb.id, id)
	if err != nil {
		return err
	}
	defer e.snaps.Release(ck)
	e.mu.Lock()
	if sb.st.DestroyBegun() || !sb.st.Live() {
		e.mu.Unlock()
		return fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is %s", sb.id, sb.phase()))
	}
	e.setState(sb, lifecycle.RollingBack, "")
	old, oldPool := sb.rt, sb.pool
	oldStack := sb.rspec.Layers
	spec := sb.rspec
	spec.Layers = slices.Clone(ck.Stack)
	// The new stack's checkpoint layers are held before the old stack's are
	// dropped: a layer both use must not go in between.
	e.snaps.Hold(spec.Layers)
	e.mu.Unlock()

	ctx = context.WithoutCancel(ctx)
	if err := dropRuntime(ctx, oldPool, old); err != nil {
		e.log.Warn("rollback: destroy the old sandbox", "sandbox", sb.id, "err", err)
	}
	rs, err := e.cfg.Backends[sb.kind].Create(ctx, spec)

	e.mu.Lock()
	sb.pool = nil // the pool's sandbox is gone; the new one is the sandbox's own
	var (
		unused = func() {}
		orphan runtime.Sandbox
	)
	rolling := sb.st.Is(lifecycle.RollingBack) // else destroyed meanwhile
	switch {
	case err != nil:
		unused = e.snaps.Drop(spec.Layers)
		if rolling {
			e.loseLocked(sb, fmt.Sprintf("rollback to %s failed: %v", id, err)) // its rt is destroyed above
		}
	case !rolling:
		// Destroyed while rolling back: the new sandbox is not wanted.
		unused = e.snaps.Drop(spec.Layers)
		orphan = rs
	default:
		unused = e.snaps.Drop(oldStack)
		for _, l := range oldStack {
			if e.layers[l.Digest]--; e.layers[l.Digest] <= 0 {
				delete(e.layers, l.Digest)
			}
		}
		sb.layers = sb.layers[:0:0]
		for _, l := range spec.Layers {
			e.layers[l.Digest]++
			sb.layers = append(sb.layers, l.Digest)
		}
		sb.rt = rs
		sb.rspec = spec
		e.setState(sb, lifecycle.Running, "") // the new runtime runs, thawed
		e.startEgressLocked(sb, rs)
		sb.lastActive = time.Now()
	}
	e.mu.Unlock()
	if orphan != nil {
		orphan.Destroy(ctx)
	}
	unused()
	if err != nil {
		// What release does for any lost sandbox; its rt is gone already.
		e.endTrajectory(sb, trajectory.KindLost, "rollback failed")
		e.releaseState(sb)
		return fail.New(fail.Internal, fmt.Errorf("rollback sandbox %q to %s: %w", sb.id, id, err))
	}
	return nil
}

// DefaultMaxLayers bounds a snapshot image's layers: past it, the image's
// layers are merged into one.
const DefaultMaxLayers = 16

// doSnapshot packs sb's writable layer into the shared blob store and tags
// an image of sb's layers plus that one as ref.
func (e *Edge) doSnapshot(ctx context.Context, sb *sandbox, ref string, seq uint64) (*dsecv1.Image, string, error) {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	rs, frozen, err := e.stateTarget(sb)
	if err != nil {
		return nil, "", err
	}
	if ds, ok := rs.(runtime.DiskSnapshotter); ok {
		return e.snapshotDisk(ctx, sb, ds, ref)
	}
	e.mu.Lock()
	stack := slices.Clone(sb.rspec.Layers)
	e.mu.Unlock()
	var desc blobstore.Descriptor
	err = e.packUpper(ctx, sb, rs, frozen, func(upper string) (err error) {
		desc, err = layer.Build(ctx, e.cfg.Store, upper)
		return err
	})
	if err != nil {
		return nil, "", err
	}
	layers, err := e.snaps.ImageLayers(ctx, sb.id, e.cfg.Store, e.local, stack, desc, e.cfg.MaxLayers)
	if err != nil {
		return nil, "", err
	}
	m := image.Manifest{
		Layers:  layers,
		Config:  image.Config{Env: sb.rspec.Env, WorkingDir: sb.rspec.Workdir, User: sb.rspec.User},
		Created: time.Now().UTC(),
		Annotations: map[string]string{
			"dsec.snapshot.sandbox": sb.id,
			"dsec.snapshot.seq":     fmt.Sprint(seq),
			"dsec.snapshot.node":    e.cfg.NodeID,
		},
	}
	digest, err := e.images.Put(ctx, ref, m)
	if err != nil {
		kind := fail.Internal
		if errors.Is(err, image.ErrInvalidRef) {
			kind = fail.InvalidArgument
		}
		return nil, "", fail.New(kind, fmt.Errorf("snapshot sandbox %q: %w", sb.id, err))
	}
	img := &dsecv1.Image{Ref: ref, Digest: digest, Size: m.Size()}
	for _, l := range m.Layers {
		img.Layers = append(img.Layers, l.Digest)
	}
	return img, desc.Digest, nil
}

// snapshotDisk stores a whole-disk sandbox's disk (fullvm) as the disk
// image ref: the image a later fullvm sandbox boots.
func (e *Edge) snapshotDisk(ctx context.Context, sb *sandbox, ds runtime.DiskSnapshotter, ref string) (*dsecv1.Image, string, error) {
	if _, err := image.ParseRef(ref); err != nil {
		return nil, "", fail.New(fail.InvalidArgument, fmt.Errorf("ref: %w", err))
	}
	dir, err := os.MkdirTemp(e.cfg.DataDir, "disk-snapshot-")
	if err != nil {
		return nil, "", fail.New(fail.Internal, err)
	}
	defer os.RemoveAll(dir)
	file := filepath.Join(dir, "disk.qcow2")
	if err := ds.SnapshotDisk(ctx, file); err != nil {
		return nil, "", fmt.Errorf("snapshot sandbox %q: %w", sb.id, err)
	}
	m, err := image.ImportDisk(ctx, e.cfg.Store, e.images, ref, file, 0)
	if err != nil {
		return nil, "", fail.New(fail.Internal, fmt.Errorf("snapshot sandbox %q: %w", sb.id, err))
	}
	_, digest, err := e.images.Get(ctx, ref)
	if err != nil {
		return nil, "", fail.New(fail.Internal, fmt.Errorf("snapshot sandbox %q: %w", sb.id, err))
	}
	disk := m.Layers[0].Digest
	return &dsecv1.Image{Ref: ref, Digest: digest, Size: m.Size(), Layers: []string{disk}, DiskFormat: m.Disk.Format}, disk, nil
}

// releaseState drops what a sandbox that ended held beyond its runtime
// sandbox: its checkpoints and its stack's checkpoint layers. Once only.
func (e *Edge) releaseState(sb *sandbox) {
	e.stopEgress(sb)
	e.mu.Lock()
	if sb.stateReleased {
		e.mu.Unlock()
		return
	}
	sb.stateReleased = true
	stack := sb.rspec.Layers
	e.mu.Unlock()
	e.snaps.Drop(stack)()
	e.snaps.DeleteAll(sb.id)
}

// numbered runs a numbered operation (file operations, snapshot,
// checkpoint, rollback): admit with the trajectory, run detached when the client
// numbered it, record. run fills rec with the result. It returns the
// operation's seq, or the recorded record of a fast-forward. run gets the
// operation's seq (0 when the node keeps no trajectory). With frozenOK a
// frozen sandbox takes the operation: snapshotting a preempted job is what
// freezing it is for.
func (e *Edge) numbered(ctx context.Context, sb *sandbox, seq uint64, rec *trajectory.Record, frozenOK bool, run func(context.Context, uint64) error) (uint64, *trajectory.Record, error) {
	if err := e.pausedUnless(sb, frozenOK); err != nil {
		return 0, nil, err
	}
	op, replay, err := e.admitOp(ctx, sb, seq, rec)
	if err != nil {
		return 0, nil, err
	}
	if replay != nil {
		if replay.Error != nil {
			return 0, nil, recordedError(replay)
		}
		return replay.Seq, replay, nil
	}
	ctx = detach(ctx, seq, op)
	start := time.Now()
	var opSeq uint64
	if op != nil {
		opSeq = op.Seq()
	}
	err = run(ctx, opSeq)
	if op == nil {
		return 0, nil, err
	}
	if cerr := e.commit(ctx, op, rec, start, err); cerr != nil {
		return 0, nil, cerr
	}
	return op.Seq(), nil, err
}

func (e *Edge) snapshot(ctx context.Context, caller *dsecv1.Caller, r *dsecv1.SnapshotRequest, internal string) (*dsecv1.SnapshotResponse, error) {
	if r == nil {
		return nil, invalid("request is required")
	}
	rec := &trajectory.Record{Kind: trajectory.KindSnapshot, RequestID: r.RequestId, Snapshot: &trajectory.Snapshot{Ref: r.Ref}}
	if _, err := image.ParseRef(r.Ref); err != nil {
		return nil, e.refuse(ctx, caller, r.SandboxId, r.Seq, rec, invalid("ref: %v", err))
	}
	if internal == "" {
		internal = r.Ref
	}
	sb, err := e.lookup(caller, r.SandboxId)
	if err != nil {
		return nil, err
	}
	var img *dsecv1.Image
	seq, replay, err := e.numbered(ctx, sb, r.Seq, rec, true, func(ctx context.Context, seq uint64) error {
		var layerDigest string
		var err error
		img, layerDigest, err = e.doSnapshot(ctx, sb, internal, seq)
		if err == nil {
			img.Ref = r.Ref
			rec.Snapshot.Image, rec.Snapshot.Layer = img.Digest, layerDigest
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if replay != nil {
		img = &dsecv1.Image{Ref: replay.Snapshot.Ref, Digest: replay.Snapshot.Image}
	}
	return &dsecv1.SnapshotResponse{Image: img, Seq: seq, Replayed: replay != nil}, nil
}

func (e *Edge) checkpoint(ctx context.Context, caller *dsecv1.Caller, r *dsecv1.CheckpointRequest) (*dsecv1.CheckpointResponse, error) {
	if r == nil {
		return nil, invalid("request is required")
	}
	sb, err := e.lookup(caller, r.SandboxId)
	if err != nil {
		return nil, err
	}
	rec := &trajectory.Record{Kind: trajectory.KindCheckpoint, RequestID: r.RequestId, Checkpoint: &trajectory.Checkpoint{}}
	seq, replay, err := e.numbered(ctx, sb, r.Seq, rec, true, func(ctx context.Context, _ uint64) error {
		id, layerDigest, err := e.doCheckpoint(ctx, sb)
		rec.Checkpoint.ID, rec.Checkpoint.Layer = id, layerDigest
		return err
	})
	if err != nil {
		return nil, err
	}
	if replay != nil {
		rec = replay
	}
	return &dsecv1.CheckpointResponse{CheckpointId: rec.Checkpoint.ID, Seq: seq, Replayed: replay != nil}, nil
}

func (e *Edge) rollback(ctx context.Context, caller *dsecv1.Caller, r *dsecv1.RollbackRequest) (*dsecv1.RollbackResponse, error) {
	if r == nil {
		return nil, invalid("request is required")
	}
	rec := &trajectory.Record{Kind: trajectory.KindRollback, RequestID: r.RequestId, Checkpoint: &trajectory.Checkpoint{ID: r.CheckpointId}}
	if r.CheckpointId == "" {
		return nil, e.refuse(ctx, caller, r.SandboxId, r.Seq, rec, invalid("checkpoint_id is required"))
	}
	sb, err := e.lookup(caller, r.SandboxId)
	if err != nil {
		return nil, err
	}
	seq, replay, err := e.numbered(ctx, sb, r.Seq, rec, true, func(ctx context.Context, _ uint64) error {
		return e.doRollback(ctx, sb, r.CheckpointId)
	})
	if err != nil {
		return nil, err
	}
	return &dsecv1.RollbackResponse{Seq: seq, Replayed: replay != nil}, nil
}

// jobOp freezes or thaws every running sandbox of caller's on this node
// matching labels, a few at a time.
func (e *Edge) jobOp(ctx context.Context, caller *dsecv1.Caller, labels map[string]string, op func(context.Context, *sandbox) error) (*dsecv1.JobResponse, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	if len(labels) == 0 {
		return nil, invalid("labels: a job needs at least one label to select its sandboxes")
	}
	e.mu.Lock()
	var targets []*sandbox
	for _, sb := range e.sandboxes {
		if sb.phase() == StateRunning && !sb.st.DestroyBegun() && (caller.Admin || sb.tenant == caller.Tenant) && matches(sb.spec.Labels, labels) {
			targets = append(targets, sb)
		}
	}
	e.mu.Unlock()
	out := &dsecv1.JobResponse{Results: make([]*dsecv1.JobResult, len(targets))}
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for i, sb := range targets {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			res := &dsecv1.JobResult{Id: sb.id}
			if err := op(ctx, sb); err != nil {
				res.Error = e.itemError(err)
			}
			out.Results[i] = res
		})
	}
	wg.Wait()
	return out, nil
}
