// Package memback is an in-memory runtime.Backend: sandboxes whose file
// system is a map and whose "processes" are a handful of built-in commands
// (echo, cat, sleep, exit, true, false, rm, mkdir, write), optionally with
// a screen, keyboard and mouse (runtime.Display).
//
// It exists so that what the edge and the control plane decide — quotas,
// admission, placement, pool accounting, sandbox states, error codes — can
// be tested without root, namespaces or a container image, in milliseconds,
// beside (never instead of) the tests that run the real backends. It keeps
// the runtime contract where a policy can observe it: Create honours the
// context and can be told to fail (ErrBusy, ErrInvalidSpec), Freeze makes
// other calls wait until Thaw, a killed sandbox closes Done and answers
// ErrSandboxGone, Destroy is idempotent, and the writable layer is handed
// over as an OCI tar stream (runtime.DiffArchiver), as a VM guest hands it.
//
// Layers are recorded, not read: a sandbox starts from Options.Base (the
// same files for every sandbox, standing for its image), and its writable
// layer is whatever it changed over them.
package memback

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// Options configures a Backend. The zero value is a container-kind backend
// whose sandboxes start empty and do not implement runtime.Resetter.
type Options struct {
	// Kind is what Kind reports (default runtime.KindContainer), so that
	// one memback can stand for any backend of an edge's config.
	Kind runtime.Kind
	// Base are the files every sandbox starts with (path → content),
	// standing for its image's layers; parents are implied directories.
	Base map[string]string
	// Reset makes sandboxes implement runtime.Resetter, so that warm and
	// automatic pools recycle them.
	Reset bool
	// Display makes sandboxes implement runtime.Display (a screen of
	// Screen pixels whose colour follows the input received), standing for
	// a fullvm's screen, keyboard and mouse.
	Display bool
	// Disk makes sandboxes implement runtime.DiskSnapshotter, standing for
	// a fullvm's whole disk: the "disk" is a tar of the sandbox's files
	// (what GetArchive of / writes), SnapshotDisk writes one, and Create
	// loads the one its first layer's path names, if it is a file.
	Disk bool
	// CreateHook, when set, is called by every Create before it builds the
	// sandbox; an error it returns is Create's (say runtime.ErrBusy, to
	// stand for a saturated node).
	CreateHook func(ctx context.Context, spec runtime.Spec) error
}

// Backend creates in-memory sandboxes. It is safe for concurrent use.
type Backend struct {
	opts Options
	base map[string]*node

	mu      sync.Mutex
	live    map[string]*Sandbox
	created int
	resets  int
}

var _ runtime.Backend = (*Backend)(nil)

// New returns a Backend; Options.Base paths must be absolute or relative
// to the root, and clean.
func New(opts Options) (*Backend, error) {
	if opts.Kind == "" {
		opts.Kind = runtime.KindContainer
	}
	base := map[string]*node{"/": {dir: true, mode: 0o755}}
	for p, content := range opts.Base {
		cp, err := cleanPath(p)
		if err != nil {
			return nil, fmt.Errorf("memback options Base[%q]: %w", p, err)
		}
		if cp == "/" {
			return nil, fmt.Errorf("memback options Base[%q]: the root is a directory, not a file", p)
		}
		addParents(base, cp)
		base[cp] = &node{data: []byte(content), mode: 0o644}
	}
	return &Backend{opts: opts, base: base, live: map[string]*Sandbox{}}, nil
}

// Kind reports Options.Kind.
func (b *Backend) Kind() runtime.Kind { return b.opts.Kind }

// Create builds a sandbox from spec. Runtime IDs must be unique among live
// sandboxes, as the real backends require.
func (b *Backend) Create(ctx context.Context, spec runtime.Spec) (runtime.Sandbox, error) {
	if spec.ID == "" {
		return nil, fmt.Errorf("spec.ID is required: %w", runtime.ErrInvalidSpec)
	}
	if spec.Resources.MilliCPU < 0 || spec.Resources.MemoryBytes < 0 || spec.Resources.Pids < 0 || spec.Resources.DiskBytes < 0 {
		return nil, fmt.Errorf("spec.resources must not be negative: %w", runtime.ErrInvalidSpec)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if b.opts.CreateHook != nil {
		if err := b.opts.CreateHook(ctx, spec); err != nil {
			return nil, err
		}
	}
	sb := newSandbox(b, spec)
	if b.opts.Disk && len(spec.Layers) > 0 {
		if err := sb.loadDisk(ctx, spec.Layers[0].Path); err != nil {
			return nil, err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, dup := b.live[spec.ID]; dup {
		return nil, fmt.Errorf("spec.ID %q: a live sandbox has it: %w", spec.ID, runtime.ErrInvalidSpec)
	}
	b.live[spec.ID] = sb
	b.created++
	switch {
	case b.opts.Disk:
		return withDisk{sb}, nil
	case b.opts.Reset && b.opts.Display:
		return resettableDisplay{&resettable{sb}}, nil
	case b.opts.Reset:
		return &resettable{sb}, nil
	case b.opts.Display:
		return withDisplay{sb}, nil
	}
	return sb, nil
}

// Live returns the IDs of the sandboxes created and not yet destroyed
// (a killed sandbox stays until it is destroyed, as a dead container's
// cgroup and mounts do): tests check that nothing leaked.
func (b *Backend) Live() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return sortedKeys(b.live)
}

// Stats says how many sandboxes Create built and how many Resets ran.
func (b *Backend) Stats() (created, resets int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.created, b.resets
}

// Sandbox returns the live sandbox with runtime ID id, or nil.
func (b *Backend) Sandbox(id string) *Sandbox {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.live[id]
}

func (b *Backend) forget(id string, sb *Sandbox) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.live[id] == sb {
		delete(b.live, id)
	}
}

// freshFS is a copy of the base tree: what a new or reset sandbox sees.
func (b *Backend) freshFS() map[string]*node {
	fs := make(map[string]*node, len(b.base))
	for p, n := range b.base {
		fs[p] = n.clone()
	}
	return fs
}

// resettable is a Sandbox that also implements runtime.Resetter.
type resettable struct{ *Sandbox }

var _ runtime.Resetter = (*resettable)(nil)

// Reset puts the sandbox back to the state Create left it in.
func (r *resettable) Reset(ctx context.Context) error {
	if err := r.reset(ctx); err != nil {
		return err
	}
	r.b.mu.Lock()
	r.b.resets++
	r.b.mu.Unlock()
	return nil
}

// sortedKeys are m's keys in order, for stable test output.
func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }
