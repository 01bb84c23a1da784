// Package snapshot keeps what the edge knows of sandboxes' file systems
// over time: checkpoints (a sandbox's writable layer copied, on this node,
// for a rollback), and the layers of a snapshot image (a sandbox's
// writable layer packed into the shared blob store, over the layers it
// runs on, so that any node and any backend can run it).
//
// The writable layer comes from the backend in one of two ways: a
// container's overlay upper directory, read in place while the sandbox is
// frozen (runtime.Differ), or a tar stream with OCI whiteouts from a VM
// guest, whose disk the host never mounts (runtime.DiffArchiver), unpacked
// by layer.Extract — which checks every path and turns the whiteouts into
// overlayfs ones — into a staging directory that is then packed exactly as
// an upper directory is.
//
// Errors carry fail kinds (what the edge answers callers), and messages
// name the sandbox.
//
// Lock order: the edge's lock, then Store.mu; Store never calls out while
// holding mu, and files are removed outside it.
package snapshot

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/runtime"
)

// Store is the node's checkpoint area: the checkpoints by ID and the
// directory layers they and the sandboxes rolled back onto them use. It
// does not outlive the edge: Open empties it.
type Store struct {
	dirs *layer.DirLayers
	// unpack is where DiffArchiver streams are unpacked before packing.
	unpack string
	log    *slog.Logger

	mu          sync.Mutex
	checkpoints map[string]*Checkpoint
	// users counts the checkpoints and sandboxes using each directory
	// layer; a layer nobody uses is retired at once.
	users map[string]int
}

// Checkpoint is a sandbox's file system at one moment: the layer stack it
// ran on plus a copy of its writable layer, a directory layer stacked by
// the overlay as it is (it never leaves the node, so it needs no image).
type Checkpoint struct {
	ID      string
	Sandbox string
	// Stack is what a rollback runs on, bottom first.
	Stack []runtime.Layer
	// refs counts rollbacks reading it now; one deleted meanwhile goes
	// when the last is done.
	refs    int
	deleted bool
}

// Open empties root and returns the store kept there.
func Open(root string, log *slog.Logger) (*Store, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("checkpoint store %q: %w", root, err)
	}
	if err := os.RemoveAll(abs); err != nil {
		return nil, fmt.Errorf("checkpoint store: %w", err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("checkpoint store: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	return &Store{
		dirs:        layer.DirLayersAt(filepath.Join(abs, "dirs")),
		unpack:      filepath.Join(abs, "unpack"),
		log:         log,
		checkpoints: map[string]*Checkpoint{},
		users:       map[string]int{},
	}, nil
}

// IsLocal reports whether l is one of the store's directory layers (not a
// file of the shared blob store).
func (s *Store) IsLocal(l runtime.Layer) bool { return s.dirs.Contains(l.Path) }

func (s *Store) local(stack []runtime.Layer) []string {
	var out []string
	for _, l := range stack {
		if s.IsLocal(l) {
			out = append(out, l.Digest)
		}
	}
	return out
}

// Hold counts one more user (a sandbox running on it) of each directory
// layer of stack.
func (s *Store) Hold(stack []runtime.Layer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holdLocked(stack)
}

func (s *Store) holdLocked(stack []runtime.Layer) {
	for _, d := range s.local(stack) {
		s.users[d]++
	}
}

// Drop counts one user fewer of each directory layer of stack. A layer
// nobody uses any more is retired at once (renamed away, so that a
// checkpoint of the same tree taken afterwards gets a directory of its
// own); the returned function removes its files, and is for the caller
// to run once it holds no lock.
func (s *Store) Drop(stack []runtime.Layer) (remove func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dropLocked(stack)
}

func (s *Store) dropLocked(stack []runtime.Layer) func() {
	var removals []func() error
	for _, d := range s.local(stack) {
		if s.users[d]--; s.users[d] > 0 {
			continue
		}
		delete(s.users, d)
		rm, err := s.dirs.Retire(d)
		if err != nil {
			s.log.Warn("delete checkpoint layer", "layer", d, "err", err)
			continue
		}
		removals = append(removals, rm)
	}
	return func() {
		for _, rm := range removals {
			if err := rm(); err != nil {
				s.log.Warn("delete checkpoint layer", "err", err)
			}
		}
	}
}

// Take copies the writable layer of rs (frozen: already frozen) into a
// checkpoint layer and records a checkpoint of sandbox over stack. The
// layer's digest is its tree digest (layer.CopyTree): it names the copied
// files and their content, not an image file.
func (s *Store) Take(ctx context.Context, sandbox string, rs runtime.Sandbox, frozen bool, stack []runtime.Layer) (*Checkpoint, string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, "", fail.New(fail.Internal, err)
	}
	var staged *layer.Staged
	err := s.WithWritableLayer(ctx, sandbox, rs, frozen, func(dir string) (err error) {
		staged, err = s.dirs.Stage(ctx, dir)
		return err
	})
	if err != nil {
		return nil, "", err
	}
	// A copy the store had already (the same tree) goes, outside mu.
	defer func() {
		if err := staged.Discard(); err != nil {
			s.log.Warn("checkpoint: remove a duplicate copy", "sandbox", sandbox, "err", err)
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	// Committed and held under mu: a layer retired meanwhile (its count
	// reached zero) is renamed away first, so this one is not removed.
	path, err := staged.Commit()
	if err != nil {
		return nil, "", fail.New(fail.Internal, fmt.Errorf("checkpoint sandbox %q: %w", sandbox, err))
	}
	ck := &Checkpoint{
		ID:      "ck-" + hex.EncodeToString(b[:]),
		Sandbox: sandbox,
		Stack:   append(slices.Clone(stack), runtime.Layer{Digest: staged.Digest(), Path: path}),
	}
	s.holdLocked(ck.Stack)
	s.checkpoints[ck.ID] = ck
	return ck, staged.Digest(), nil
}

func notFound(sandbox, id string) error {
	return fail.New(fail.NotFound, fmt.Errorf("checkpoint %q of sandbox %q not found", id, sandbox))
}

// Acquire returns sandbox's checkpoint id, held for a rollback until
// Release: deleting it meanwhile keeps its layers until then.
func (s *Store) Acquire(sandbox, id string) (*Checkpoint, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ck := s.checkpoints[id]
	if ck == nil || ck.deleted || ck.Sandbox != sandbox {
		return nil, notFound(sandbox, id)
	}
	ck.refs++
	return ck, nil
}

// Release ends an Acquire; a checkpoint deleted meanwhile goes now.
func (s *Store) Release(ck *Checkpoint) {
	s.mu.Lock()
	ck.refs--
	remove := func() {}
	if ck.deleted && ck.refs == 0 {
		remove = s.dropLocked(ck.Stack)
	}
	s.mu.Unlock()
	remove()
}

// Delete forgets sandbox's checkpoint id; its layers go once no rollback
// reads them and no sandbox runs on them.
func (s *Store) Delete(sandbox, id string) error {
	s.mu.Lock()
	ck := s.checkpoints[id]
	if ck == nil || ck.deleted || ck.Sandbox != sandbox {
		s.mu.Unlock()
		return notFound(sandbox, id)
	}
	ck.deleted = true
	delete(s.checkpoints, id)
	remove := func() {}
	if ck.refs == 0 {
		remove = s.dropLocked(ck.Stack)
	}
	s.mu.Unlock()
	remove()
	return nil
}

// DeleteAll deletes every checkpoint of a sandbox that ended.
func (s *Store) DeleteAll(sandbox string) {
	s.mu.Lock()
	var ids []string
	for id, ck := range s.checkpoints {
		if ck.Sandbox == sandbox {
			ids = append(ids, id)
		}
	}
	s.mu.Unlock()
	for _, id := range ids {
		s.Delete(sandbox, id)
	}
}

// Count is how many checkpoints the store holds, and how many directory
// layers are in use.
func (s *Store) Count() (checkpoints, layers int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.checkpoints), len(s.users)
}

// CanPack reports whether rs can hand over its writable layer.
func CanPack(rs runtime.Sandbox) bool {
	switch rs.(type) {
	case runtime.Differ, runtime.DiffArchiver:
		return true
	}
	return false
}

// WithWritableLayer runs fn on a directory holding what sandbox (its
// runtime rs) changed over its layers, in overlayfs form (whiteouts as
// 0:0 character devices, opaque directories by xattr):
//   - a runtime.Differ's upper directory itself, with rs frozen meanwhile
//     (unless frozen says it is already; it is thawed after);
//   - a runtime.DiffArchiver's stream, unpacked with layer.Extract into a
//     staging directory removed after (the backend keeps the workload
//     stopped while it writes: the edge does not freeze it, which would
//     stop a VM's agent too).
//
// fn must not keep the directory. A Differ is preferred when rs is both.
func (s *Store) WithWritableLayer(ctx context.Context, sandbox string, rs runtime.Sandbox, frozen bool, fn func(dir string) error) error {
	packErr := func(err error) error {
		return fail.New(fail.Internal, fmt.Errorf("pack sandbox %q: %w", sandbox, err))
	}
	if d, ok := rs.(runtime.Differ); ok {
		if !frozen {
			if err := rs.Freeze(ctx); err != nil {
				return fail.New(fail.Internal, fmt.Errorf("freeze sandbox %q: %w", sandbox, err))
			}
			defer func() {
				if err := rs.Thaw(context.WithoutCancel(ctx)); err != nil {
					s.log.Warn("thaw after pack", "sandbox", sandbox, "err", err)
				}
			}()
		}
		if err := fn(d.UpperDir()); err != nil {
			return packErr(err)
		}
		return nil
	}
	da, ok := rs.(runtime.DiffArchiver)
	if !ok {
		return fail.New(fail.Unimplemented, fmt.Errorf("the backend cannot snapshot sandbox %q", sandbox))
	}
	dir, err := s.unpackDiff(ctx, da)
	if dir != "" {
		defer func() {
			if err := os.RemoveAll(dir); err != nil {
				s.log.Warn("remove an unpacked writable layer", "sandbox", sandbox, "err", err)
			}
		}()
	}
	if err != nil {
		return packErr(err)
	}
	if err := fn(dir); err != nil {
		return packErr(err)
	}
	return nil
}

// unpackDiff streams da's writable layer into a new staging directory,
// which it returns (also on error, for the caller to remove).
func (s *Store) unpackDiff(ctx context.Context, da runtime.DiffArchiver) (string, error) {
	if err := os.MkdirAll(s.unpack, 0o700); err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp(s.unpack, "diff-")
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pr, pw := io.Pipe()
	werr := make(chan error, 1)
	go func() {
		err := da.WriteDiff(ctx, pw)
		pw.CloseWithError(err) // nil: EOF
		werr <- err
	}()
	xerr := layer.Extract(ctx, pr, dir)
	if xerr == nil {
		// What follows the archive's end (padding) is read, so that the
		// writer finishes; on an error it is stopped instead.
		io.Copy(io.Discard, pr)
	}
	pr.CloseWithError(errors.New("extraction ended"))
	if xerr != nil {
		cancel()
	}
	if err := <-werr; err != nil && xerr == nil {
		return dir, fmt.Errorf("write diff: %w", err)
	}
	if xerr != nil {
		return dir, fmt.Errorf("unpack diff: %w", xerr)
	}
	return dir, nil
}

// ImageLayers are the layers of a snapshot image of a sandbox that runs on
// stack and whose writable layer was packed as top: the stack's layers as
// the shared store holds them (a checkpoint's directory layer built into
// an EROFS one, a layer missing from the store copied in), then top; or,
// past maxLayers, all of them merged into one.
func (s *Store) ImageLayers(ctx context.Context, sandbox string, store blobstore.Repository, local blobstore.Local, stack []runtime.Layer, top blobstore.Descriptor, maxLayers int) ([]blobstore.Descriptor, error) {
	if len(stack)+1 > maxLayers {
		// Past the bound the stack is merged from the files (and checkpoint
		// directories) the sandbox runs on.
		files := make([]string, 0, len(stack)+1)
		for _, l := range stack {
			files = append(files, l.Path)
		}
		upper, err := blobstore.LocalPath(ctx, local, top.Digest)
		if err != nil {
			return nil, fail.New(fail.Internal, err)
		}
		files = append(files, upper)
		merged, err := layer.Merge(ctx, store, files)
		if err != nil {
			return nil, fail.New(fail.Internal, fmt.Errorf("snapshot sandbox %q: merge %d layers: %w", sandbox, len(files), err))
		}
		return []blobstore.Descriptor{merged}, nil
	}
	layers := make([]blobstore.Descriptor, 0, len(stack)+1)
	for _, l := range stack {
		var st blobstore.Descriptor
		var err error
		if s.IsLocal(l) {
			// A checkpoint layer is a directory on this node: the image
			// needs it as an EROFS layer in the shared store.
			st, err = layer.Build(ctx, store, l.Path)
		} else if st, err = store.Stat(ctx, l.Digest); errors.Is(err, blobstore.ErrNotFound) {
			st, err = blobstore.PutFile(ctx, store, l.Path)
		}
		if err != nil {
			return nil, fail.New(fail.Unavailable, fmt.Errorf("snapshot sandbox %q: layer %s: %w", sandbox, l.Digest, err))
		}
		layers = append(layers, st)
	}
	return append(layers, top), nil
}
