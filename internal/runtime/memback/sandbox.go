package memback

import (
	"context"

	"fmt"
	"io/fs"
	"path"
	"strings"
	"sync"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// node is one file or directory of a sandbox's tree.
type node struct {
	data []byte
	mode uint32
	dir  bool
}

func (n *node) clone() *node {
	c := *n
	c.data = append([]byte(nil), n.data...)
	return &c
}

func (n *node) same(o *node) bool {
	return n.dir == o.dir && n.mode == o.mode && string(n.data) == string(o.data)
}

// Sandbox is one in-memory sandbox. All methods are safe for concurrent use.
type Sandbox struct {
	b    *Backend
	id   string
	spec runtime.Spec
	// done is closed when the sandbox dies (Kill) or is destroyed.
	done chan struct{}

	mu sync.Mutex
	// tree is the sandbox's file system by clean absolute path; removed
	// are paths of the base the sandbox deleted (its whiteouts).
	tree    map[string]*node
	removed map[string]bool
	// thawed is closed while the sandbox runs and replaced by an open
	// channel while it is frozen: calls wait on it.
	thawed    chan struct{}
	frozen    bool
	dead      string // why it died; "" while alive
	destroyed bool
	// events are the input events received (Options.Display).
	events []runtime.InputEvent
	// kill ends the commands running now (Kill, Reset, Destroy).
	kill    context.Context
	killAll context.CancelFunc
}

var (
	_ runtime.Sandbox      = (*Sandbox)(nil)
	_ runtime.DiffArchiver = (*Sandbox)(nil)
)

func newSandbox(b *Backend, spec runtime.Spec) *Sandbox {
	thawed := make(chan struct{})
	close(thawed)
	kill, killAll := context.WithCancel(context.Background())
	return &Sandbox{
		b: b, id: spec.ID, spec: spec, done: make(chan struct{}),
		tree: b.freshFS(), removed: map[string]bool{},
		thawed: thawed, kill: kill, killAll: killAll,
	}
}

// ID is the runtime ID the sandbox was created with.
func (s *Sandbox) ID() string { return s.id }

// Spec is what the sandbox was created from.
func (s *Sandbox) Spec() runtime.Spec { return s.spec }

// Done is closed once the sandbox died or was destroyed.
func (s *Sandbox) Done() <-chan struct{} { return s.done }

// Frozen reports whether the sandbox is frozen now.
func (s *Sandbox) Frozen() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.frozen
}

// Kill makes the sandbox die as if its init process had exited: Done is
// closed, running commands end and every later call but Destroy returns
// runtime.ErrSandboxGone.
func (s *Sandbox) Kill(reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead != "" || s.destroyed {
		return
	}
	s.dead = reason
	s.killAll()
	close(s.done)
}

// enter waits while the sandbox is frozen (as a real sandbox's agent would
// not answer) and returns the context its commands must stop at.
func (s *Sandbox) enter(ctx context.Context) (context.Context, error) {
	for {
		s.mu.Lock()
		if err := s.goneLocked(); err != nil {
			s.mu.Unlock()
			return nil, err
		}
		if !s.frozen {
			kill := s.kill
			s.mu.Unlock()
			return kill, nil
		}
		wait := s.thawed
		s.mu.Unlock()
		select {
		case <-wait:
		case <-s.done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (s *Sandbox) goneLocked() error {
	switch {
	case s.destroyed:
		return fmt.Errorf("sandbox %q was destroyed: %w", s.id, runtime.ErrSandboxGone)
	case s.dead != "":
		return fmt.Errorf("sandbox %q died (%s): %w", s.id, s.dead, runtime.ErrSandboxGone)
	}
	return nil
}

// Freeze stops the sandbox: calls wait until Thaw. Idempotent.
func (s *Sandbox) Freeze(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return err
	}
	if !s.frozen {
		s.frozen = true
		s.thawed = make(chan struct{})
	}
	return nil
}

// Thaw resumes a frozen sandbox. Idempotent.
func (s *Sandbox) Thaw(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return err
	}
	if s.frozen {
		s.frozen = false
		close(s.thawed)
	}
	return nil
}

// Destroy ends the sandbox and forgets it. Idempotent.
func (s *Sandbox) Destroy(ctx context.Context) error {
	s.mu.Lock()
	if s.destroyed {
		s.mu.Unlock()
		return nil
	}
	s.destroyed = true
	s.killAll()
	if s.dead == "" {
		close(s.done)
	}
	if s.frozen {
		s.frozen = false
		close(s.thawed)
	}
	s.tree, s.removed = nil, nil
	s.mu.Unlock()
	s.b.forget(s.id, s)
	return nil
}

// reset kills running commands and gives the sandbox a fresh tree.
func (s *Sandbox) reset(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return err
	}
	s.killAll()
	s.kill, s.killAll = context.WithCancel(context.Background())
	s.tree, s.removed = s.b.freshFS(), map[string]bool{}
	s.events = nil
	if s.frozen {
		s.frozen = false
		close(s.thawed)
	}
	return nil
}

// cleanPath makes p a clean absolute path, refusing an empty one.
func cleanPath(p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("empty path: %w", fs.ErrInvalid)
	}
	return path.Clean("/" + p), nil
}

func addParents(tree map[string]*node, p string) {
	for d := path.Dir(p); ; d = path.Dir(d) {
		if _, ok := tree[d]; !ok {
			tree[d] = &node{dir: true, mode: 0o755}
		}
		if d == "/" {
			return
		}
	}
}

// writeLocked writes one file, creating its parents; the caller holds mu.
func (s *Sandbox) writeLocked(p string, data []byte, mode uint32) error {
	for d := path.Dir(p); d != "/"; d = path.Dir(d) {
		if n := s.tree[d]; n != nil && !n.dir {
			return fmt.Errorf("write %s: %s is not a directory: %w", p, d, runtime.ErrFailedPrecondition)
		}
	}
	if n := s.tree[p]; n != nil && n.dir {
		return fmt.Errorf("write %s: is a directory: %w", p, runtime.ErrFailedPrecondition)
	}
	if limit := s.spec.Resources.DiskBytes; limit > 0 {
		used := int64(len(data))
		for q, n := range s.tree {
			if q != p && !s.inBase(q, n) {
				used += int64(len(n.data))
			}
		}
		if used > limit {
			return fmt.Errorf("write %s: writable layer full (%d bytes of %d): %w", p, used, limit, runtime.ErrFailedPrecondition)
		}
	}
	addParents(s.tree, p)
	s.tree[p] = &node{data: append([]byte(nil), data...), mode: mode & 0o7777}
	return nil
}

// inBase reports whether n at p is what the base has there.
func (s *Sandbox) inBase(p string, n *node) bool {
	b := s.b.base[p]
	return b != nil && b.same(n)
}

// removeLocked deletes p and everything under it; the caller holds mu.
func (s *Sandbox) removeLocked(p string) error {
	if p == "/" {
		return fmt.Errorf("remove /: %w", fs.ErrPermission)
	}
	if _, ok := s.tree[p]; !ok {
		return fmt.Errorf("remove %s: %w", p, fs.ErrNotExist)
	}
	for q := range s.tree {
		if q == p || strings.HasPrefix(q, p+"/") {
			delete(s.tree, q)
			if _, ok := s.b.base[q]; ok {
				s.removed[q] = true
			}
		}
	}
	return nil
}

// WriteFile writes data to p (parents are created) with mode.
func (s *Sandbox) WriteFile(ctx context.Context, p string, data []byte, mode uint32) error {
	if _, err := s.enter(ctx); err != nil {
		return err
	}
	cp, err := cleanPath(p)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return err
	}
	return s.writeLocked(cp, data, mode)
}

// ReadFile returns p's content; a file larger than maxBytes (when > 0)
// is runtime.ErrTooLarge.
func (s *Sandbox) ReadFile(ctx context.Context, p string, maxBytes int64) ([]byte, error) {
	if _, err := s.enter(ctx); err != nil {
		return nil, err
	}
	cp, err := cleanPath(p)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return nil, err
	}
	n := s.tree[cp]
	switch {
	case n == nil:
		return nil, fmt.Errorf("read %s: %w", cp, fs.ErrNotExist)
	case n.dir:
		return nil, fmt.Errorf("read %s: is a directory: %w", cp, runtime.ErrFailedPrecondition)
	case maxBytes > 0 && int64(len(n.data)) > maxBytes:
		return nil, fmt.Errorf("read %s: %d bytes, more than %d: %w", cp, len(n.data), maxBytes, runtime.ErrTooLarge)
	}
	return append([]byte(nil), n.data...), nil
}

// Files returns the sandbox's regular files and their content, for tests
// that look at a sandbox from outside.
func (s *Sandbox) Files() map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]string{}
	for p, n := range s.tree {
		if !n.dir {
			out[p] = string(n.data)
		}
	}
	return out
}
