package edge

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// checkpoint is a sandbox's file system at one moment: the layer stack it
// ran on plus a copy of its writable layer. That copy is a directory layer
// (layer.DirLayers) in the node's checkpoint area, stacked by the overlay as
// is: it never leaves the node, so it needs no EROFS image. The directory
// stays while a checkpoint or a sandbox uses it.
type checkpoint struct {
	id      string
	sandbox string
	stack   []runtime.Layer
	// refs counts rollbacks reading the checkpoint right now; a checkpoint
	// deleted meanwhile is dropped when the last one is done.
	refs    int
	deleted bool
}

// ckDirs is the node's store of checkpoint layers, under the checkpoint
// area that New empties (checkpoints do not outlive the edge).
func (e *Edge) ckDirs() *layer.DirLayers {
	return layer.DirLayersAt(filepath.Join(e.ckStore.Root(), "dirs"))
}

// localLayers are the checkpoint layers in stack: those that are
// directories of the node's checkpoint store, not files of the shared blob
// store.
func (e *Edge) localLayers(stack []runtime.Layer) []string {
	dirs := e.ckDirs()
	var out []string
	for _, l := range stack {
		if dirs.Contains(l.Path) {
			out = append(out, l.Digest)
		}
	}
	return out
}

// holdLayers and dropLayers count users of checkpoint layers; a layer no
// checkpoint and no sandbox uses is retired at once (renamed away, under
// mu, so that a checkpoint of the same tree committed afterwards gets a
// directory of its own) and its files are removed outside mu, by
// removeLayers with what dropLayers returns. The caller holds mu.
func (e *Edge) holdLayers(digests []string) {
	for _, d := range digests {
		e.ckLayers[d]++
	}
}

func (e *Edge) dropLayers(digests []string) (removals []func() error) {
	for _, d := range digests {
		if e.ckLayers[d]--; e.ckLayers[d] > 0 {
			continue
		}
		delete(e.ckLayers, d)
		rm, err := e.ckDirs().Retire(d)
		if err != nil {
			e.log.Warn("delete checkpoint layer", "layer", d, "err", err)
			continue
		}
		removals = append(removals, rm)
	}
	return removals
}

func (e *Edge) removeLayers(removals []func() error) {
	for _, rm := range removals {
		if err := rm(); err != nil {
			e.log.Warn("delete checkpoint layer", "err", err)
		}
	}
}

// stateTarget checks that sb can take a state operation and returns its
// runtime sandbox; the caller holds sb.stateMu.
func (e *Edge) stateTarget(sb *sandbox) (runtime.Sandbox, bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case sb.destroying != nil:
		return nil, false, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is being destroyed", sb.id))
	case sb.state != StateRunning:
		return nil, false, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is %s", sb.id, sb.state))
	}
	return sb.rt, sb.frozen, nil
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
	sb.frozen = true
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
	sb.frozen = false
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

// packUpper freezes sb (unless it is frozen already), runs pack on its
// writable layer (the overlay upper directory) and thaws it.
func (e *Edge) packUpper(ctx context.Context, sb *sandbox, rs runtime.Sandbox, frozen bool, pack func(upper string) error) error {
	d, ok := rs.(runtime.Differ)
	if !ok {
		return fail.New(fail.Unimplemented,
			fmt.Errorf("the %s backend cannot snapshot sandbox %q", sb.kind, sb.id))
	}
	if !frozen {
		if err := rs.Freeze(ctx); err != nil {
			return fail.New(fail.Internal, fmt.Errorf("freeze sandbox %q: %w", sb.id, err))
		}
		defer func() {
			if err := rs.Thaw(context.WithoutCancel(ctx)); err != nil {
				e.log.Warn("thaw after pack", "sandbox", sb.id, "err", err)
			}
		}()
	}
	err := pack(d.UpperDir())
	if err != nil {
		return fail.New(fail.Internal, fmt.Errorf("pack sandbox %q: %w", sb.id, err))
	}
	return nil
}

// doCheckpoint copies sb's writable layer into a checkpoint layer and
// records a checkpoint. The layer's digest is its tree digest (see
// layer.CopyTree): it names the copied files and their content, not an
// image file.
func (e *Edge) doCheckpoint(ctx context.Context, sb *sandbox) (id, layerDigest string, err error) {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	rs, frozen, err := e.stateTarget(sb)
	if err != nil {
		return "", "", err
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", "", fail.New(fail.Internal, err)
	}
	var staged *layer.Staged
	err = e.packUpper(ctx, sb, rs, frozen, func(upper string) (err error) {
		staged, err = e.ckDirs().Stage(ctx, upper)
		return err
	})
	if err != nil {
		return "", "", err
	}
	// A copy the store had already (the same tree) goes, outside mu.
	defer func() {
		if err := staged.Discard(); err != nil {
			e.log.Warn("checkpoint: remove a duplicate copy", "sandbox", sb.id, "err", err)
		}
	}()
	e.mu.Lock()
	defer e.mu.Unlock()
	// Committed and held under mu: a layer retired meanwhile (its count
	// reached zero) is renamed away first, so this one is not removed.
	path, err := staged.Commit()
	if err != nil {
		return "", "", fail.New(fail.Internal, fmt.Errorf("checkpoint sandbox %q: %w", sb.id, err))
	}
	ck := &checkpoint{
		id:      "ck-" + hex.EncodeToString(b[:]),
		sandbox: sb.id,
		stack:   append(slices.Clone(sb.rspec.Layers), runtime.Layer{Digest: staged.Digest(), Path: path}),
	}
	e.holdLayers(e.localLayers(ck.stack))
	e.checkpoints[ck.id] = ck
	return ck.id, staged.Digest(), nil
}

// findCheckpoint returns sb's checkpoint id, holding it for a rollback.
func (e *Edge) holdCheckpoint(sb *sandbox, id string) (*checkpoint, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	ck := e.checkpoints[id]
	if ck == nil || ck.deleted || ck.sandbox != sb.id {
		return nil, fail.New(fail.NotFound, fmt.Errorf("checkpoint %q of sandbox %q not found", id, sb.id))
	}
	ck.refs++
	return ck, nil
}

// releaseCheckpoint ends a rollback's hold; a checkpoint deleted meanwhile
// goes now.
func (e *Edge) releaseCheckpoint(ck *checkpoint) {
	e.mu.Lock()
	ck.refs--
	var unused []func() error
	if ck.deleted && ck.refs == 0 {
		unused = e.dropLayers(e.localLayers(ck.stack))
	}
	e.mu.Unlock()
	e.removeLayers(unused)
}

// deleteCheckpoint forgets a checkpoint; its layers go once no rollback
// reads them and no sandbox runs on them.
func (e *Edge) deleteCheckpoint(sb *sandbox, id string) error {
	e.mu.Lock()
	ck := e.checkpoints[id]
	if ck == nil || ck.deleted || ck.sandbox != sb.id {
		e.mu.Unlock()
		return fail.New(fail.NotFound, fmt.Errorf("checkpoint %q of sandbox %q not found", id, sb.id))
	}
	ck.deleted = true
	delete(e.checkpoints, id)
	var unused []func() error
	if ck.refs == 0 {
		unused = e.dropLayers(e.localLayers(ck.stack))
	}
	e.mu.Unlock()
	e.removeLayers(unused)
	return nil
}

// dropCheckpoints deletes every checkpoint of a sandbox that ended.
func (e *Edge) dropCheckpoints(sb *sandbox) {
	e.mu.Lock()
	var ids []string
	for id, ck := range e.checkpoints {
		if ck.sandbox == sb.id {
			ids = append(ids, id)
		}
	}
	e.mu.Unlock()
	for _, id := range ids {
		e.deleteCheckpoint(sb, id)
	}
}

// doRollback kills every process of sb and restarts it on the checkpoint's
// file system with a fresh writable layer: a new runtime sandbox with the
// same ID, resources and environment.
func (e *Edge) doRollback(ctx context.Context, sb *sandbox, id string) error {
	sb.stateMu.Lock()
	defer sb.stateMu.Unlock()
	ck, err := e.holdCheckpoint(sb, id)
	if err != nil {
		return err
	}
	defer e.releaseCheckpoint(ck)
	e.mu.Lock()
	if sb.destroying != nil || sb.state != StateRunning {
		e.mu.Unlock()
		return fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is %s", sb.id, sb.state))
	}
	sb.rolling = true
	old, oldPool := sb.rt, sb.pool
	oldStack := sb.rspec.Layers
	spec := sb.rspec
	spec.Layers = slices.Clone(ck.stack)
	// The new stack's checkpoint layers are held before the old stack's are
	// dropped: a layer both use must not go in between.
	e.holdLayers(e.localLayers(spec.Layers))
	e.mu.Unlock()

	ctx = context.WithoutCancel(ctx)
	if err := dropRuntime(ctx, oldPool, old); err != nil {
		e.log.Warn("rollback: destroy the old sandbox", "sandbox", sb.id, "err", err)
	}
	rs, err := e.cfg.Backends[sb.kind].Create(ctx, spec)

	e.mu.Lock()
	sb.rolling = false
	sb.pool = nil // the pool's sandbox is gone; the new one is the sandbox's own
	var (
		unused []func() error
		orphan runtime.Sandbox
	)
	switch {
	case err != nil:
		unused = e.dropLayers(e.localLayers(spec.Layers))
		e.loseLocked(sb, fmt.Sprintf("rollback to %s failed: %v", id, err)) // its rt is destroyed above
	case sb.destroying != nil || sb.state != StateRunning:
		// Destroyed while rolling back: the new sandbox is not wanted.
		unused = e.dropLayers(e.localLayers(spec.Layers))
		orphan = rs
	default:
		unused = e.dropLayers(e.localLayers(oldStack))
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
		sb.frozen = false
		sb.lastActive = time.Now()
	}
	e.mu.Unlock()
	if orphan != nil {
		orphan.Destroy(ctx)
	}
	e.removeLayers(unused)
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
	var layers []blobstore.Descriptor
	if len(stack)+1 > e.cfg.MaxLayers {
		// Past the bound the stack is merged from the files (and checkpoint
		// directories) the sandbox runs on.
		files := make([]string, 0, len(stack)+1)
		for _, l := range stack {
			files = append(files, l.Path)
		}
		upper, err := e.local.Path(desc.Digest)
		if err != nil {
			return nil, "", fail.New(fail.Internal, err)
		}
		files = append(files, upper)
		merged, err := layer.Merge(ctx, e.cfg.Store, files)
		if err != nil {
			return nil, "", fail.New(fail.Internal, fmt.Errorf("snapshot sandbox %q: merge %d layers: %w", sb.id, len(files), err))
		}
		layers = []blobstore.Descriptor{merged}
	} else {
		layers = make([]blobstore.Descriptor, 0, len(stack)+1)
		for _, l := range stack {
			var st blobstore.Descriptor
			if e.ckDirs().Contains(l.Path) {
				// A checkpoint layer is a directory on this node: the image
				// needs it as an EROFS layer in the shared store.
				st, err = layer.Build(ctx, e.cfg.Store, l.Path)
			} else if st, err = e.cfg.Store.Stat(ctx, l.Digest); errors.Is(err, blobstore.ErrNotFound) {
				st, err = blobstore.PutFile(ctx, e.cfg.Store, l.Path)
			}
			if err != nil {
				return nil, "", fail.New(fail.Unavailable, fmt.Errorf("snapshot sandbox %q: layer %s: %w", sb.id, l.Digest, err))
			}
			layers = append(layers, st)
		}
		layers = append(layers, desc)
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

// releaseState drops what a sandbox that ended held beyond its runtime
// sandbox: its checkpoints and its stack's checkpoint layers. Once only.
func (e *Edge) releaseState(sb *sandbox) {
	e.mu.Lock()
	if sb.stateReleased {
		e.mu.Unlock()
		return
	}
	sb.stateReleased = true
	unused := e.dropLayers(e.localLayers(sb.rspec.Layers))
	e.mu.Unlock()
	e.removeLayers(unused)
	e.dropCheckpoints(sb)
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
		if sb.state == StateRunning && sb.destroying == nil && (caller.Admin || sb.tenant == caller.Tenant) && matches(sb.spec.Labels, labels) {
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
