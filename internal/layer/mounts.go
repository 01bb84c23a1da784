package layer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// Mounts is the node-wide, reference-counted cache of read-only EROFS
// mounts: each layer is mounted once under root, at <root>/<hex>, and the
// directory is handed to every sandbox that uses the layer as an overlayfs
// lowerdir. The layer stays mounted while anyone holds it.
//
// Layers are mounted with mount(2) straight from the EROFS file (file-backed
// EROFS, no loop device), read-only, nodev and nosuid.
//
// Lock order: an entry's lock, then Mounts.mu. Mounts.mu is never held
// while waiting for an entry, so a slow mount of one layer does not delay
// Acquire or Release of another.
type Mounts struct {
	root   string
	linger time.Duration

	mu      sync.Mutex
	entries map[string]*mountEntry
	// dirs counts the holders of directory layers (see Acquire).
	dirs map[string]int
}

type mountEntry struct {
	// lock is a one-slot semaphore rather than a sync.Mutex so that waiting
	// for it honours a context.
	lock chan struct{}
	// Guarded by lock.
	refs    int
	mounted bool
	idle    uint64 // bumped at each last release; a stale expiry timer sees the change
	dead    bool   // removed from the map; Acquire must look again
}

// MountsOption configures NewMounts.
type MountsOption func(*Mounts)

// WithLinger keeps a layer mounted for d after its last release, so a
// create-destroy-create sequence (the common case: the next rollout uses the
// same image) does not pay an unmount and a mount each time. Zero unmounts
// at once.
func WithLinger(d time.Duration) MountsOption { return func(m *Mounts) { m.linger = d } }

// NewMounts returns the mount cache rooted at root (created if missing).
//
// Mounts left under root by a process that died are unmounted (lazily, with
// MNT_DETACH) and their directories removed, rather than adopted: their
// reference counts died with the process, nothing on the host can be known
// to use them, and a sandbox still running keeps its own copy of the mount in
// its mount namespace (or keeps a detached mount alive). Remounting a layer
// costs well under a millisecond.
func NewMounts(root string, opts ...MountsOption) (*Mounts, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("layer mounts root %q: %w", root, err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("layer mounts root %q: %w", root, err)
	}
	m := &Mounts{root: abs, entries: map[string]*mountEntry{}, dirs: map[string]int{}}
	for _, o := range opts {
		o(m)
	}
	if err := m.cleanup(); err != nil {
		return nil, err
	}
	if err := shareRoot(abs); err != nil {
		return nil, fmt.Errorf("layer mounts root %q: %w", root, err)
	}
	return m, nil
}

// shareRoot makes root a mount point with shared propagation, so that a
// layer mounted on the host after a sandbox's mount namespace was created
// (the sandbox was started ahead of demand) still appears in it: sandboxes
// make their copy of the tree a slave of the host's.
func shareRoot(root string) error {
	points, err := mountPoints(func(p string) bool { return p == root })
	if err != nil {
		return err
	}
	if len(points) == 0 {
		if err := unix.Mount(root, root, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind mount: %w", err)
		}
	}
	if err := unix.Mount("", root, "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make shared: %w", err)
	}
	return nil
}

// Root returns the directory layers are mounted under.
func (m *Mounts) Root() string { return m.root }

func (m *Mounts) dir(digest string) string {
	return filepath.Join(m.root, strings.TrimPrefix(digest, "sha256:"))
}

// Acquire makes sure the layer digest, stored in the EROFS file file, is
// mounted and returns its directory. Every successful Acquire must be
// matched by one Release.
//
// A layer that is a directory rather than an EROFS file (a node-local
// checkpoint, see DirLayers) needs no mount: its directory is returned as
// is, and counted only so that Release pairs with Acquire.
func (m *Mounts) Acquire(ctx context.Context, digest, file string) (string, error) {
	if err := blobstore.ValidateDigest(digest); err != nil {
		return "", fmt.Errorf("acquire layer: %w", err)
	}
	if fi, err := os.Stat(file); err == nil && fi.IsDir() {
		m.mu.Lock()
		m.dirs[digest]++
		m.mu.Unlock()
		return file, nil
	}
	for {
		m.mu.Lock()
		e := m.entries[digest]
		if e == nil {
			e = &mountEntry{lock: make(chan struct{}, 1)}
			m.entries[digest] = e
		}
		m.mu.Unlock()

		select {
		case e.lock <- struct{}{}:
		case <-ctx.Done():
			return "", fmt.Errorf("acquire layer %s: %w", digest, ctx.Err())
		}
		if e.dead {
			<-e.lock
			continue
		}
		dir := m.dir(digest)
		if !e.mounted {
			if err := mountErofs(file, dir); err != nil {
				if e.refs == 0 {
					// Nobody holds it: forget the entry, so a failed mount
					// leaves nothing behind.
					e.dead = true
					m.mu.Lock()
					if m.entries[digest] == e {
						delete(m.entries, digest)
					}
					m.mu.Unlock()
				}
				<-e.lock
				return "", fmt.Errorf("acquire layer %s from %s: %w", digest, file, err)
			}
			e.mounted = true
		}
		e.refs++
		<-e.lock
		return dir, nil
	}
}

// Release drops one reference to digest; the last one unmounts the layer
// and removes its directory.
func (m *Mounts) Release(digest string) error {
	m.mu.Lock()
	if n, ok := m.dirs[digest]; ok {
		if n <= 1 {
			delete(m.dirs, digest)
		} else {
			m.dirs[digest] = n - 1
		}
		m.mu.Unlock()
		return nil
	}
	e := m.entries[digest]
	m.mu.Unlock()
	if e == nil {
		return fmt.Errorf("release layer %s: not acquired", digest)
	}
	e.lock <- struct{}{}
	defer func() { <-e.lock }()
	if e.dead || e.refs == 0 {
		return fmt.Errorf("release layer %s: not acquired", digest)
	}
	e.refs--
	if e.refs > 0 {
		return nil
	}
	if m.linger > 0 {
		e.idle++
		idle := e.idle
		time.AfterFunc(m.linger, func() { m.expire(digest, e, idle) })
		return nil
	}
	return m.unmountLocked(digest, e)
}

// expire unmounts a lingering layer unless it was acquired again since.
func (m *Mounts) expire(digest string, e *mountEntry, idle uint64) {
	e.lock <- struct{}{}
	defer func() { <-e.lock }()
	if e.dead || e.refs > 0 || e.idle != idle {
		return
	}
	if err := m.unmountLocked(digest, e); err != nil {
		slog.Warn("unmount lingering layer", "digest", digest, "err", err)
	}
}

// Close unmounts the layers nobody holds (lingering ones); held layers stay.
// When none is held any more, the root's own bind mount goes too.
func (m *Mounts) Close() error {
	m.mu.Lock()
	all := make(map[string]*mountEntry, len(m.entries))
	for d, e := range m.entries {
		all[d] = e
	}
	m.mu.Unlock()
	var errs []error
	for d, e := range all {
		e.lock <- struct{}{}
		if !e.dead && e.refs == 0 && e.mounted {
			errs = append(errs, m.unmountLocked(d, e))
		}
		<-e.lock
	}
	held := 0
	for _, e := range all {
		e.lock <- struct{}{}
		if !e.dead && e.refs > 0 {
			held++
		}
		<-e.lock
	}
	if held == 0 {
		if err := unix.Unmount(m.root, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m.root, err))
		}
	}
	return errors.Join(errs...)
}

// unmountLocked retires e and unmounts its layer; e's lock is held.
func (m *Mounts) unmountLocked(digest string, e *mountEntry) error {
	e.dead = true
	m.mu.Lock()
	if m.entries[digest] == e {
		delete(m.entries, digest)
	}
	m.mu.Unlock()
	if err := unmountDir(m.dir(digest)); err != nil {
		return fmt.Errorf("release layer %s: %w", digest, err)
	}
	return nil
}

// Refs returns how many holders the layer has (0 if not mounted).
func (m *Mounts) Refs(digest string) int {
	m.mu.Lock()
	if n, ok := m.dirs[digest]; ok {
		m.mu.Unlock()
		return n
	}
	e := m.entries[digest]
	m.mu.Unlock()
	if e == nil {
		return 0
	}
	e.lock <- struct{}{}
	defer func() { <-e.lock }()
	if e.dead {
		return 0
	}
	return e.refs
}

func mountErofs(file, dir string) error {
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	err := unix.Mount(file, dir, "erofs", unix.MS_RDONLY|unix.MS_NODEV|unix.MS_NOSUID, "")
	if err != nil {
		os.Remove(dir)
		if errors.Is(err, unix.ENOTBLK) {
			return fmt.Errorf("mount erofs: %w (file-backed EROFS needs Linux 6.12+, and the file must not live on overlayfs or a FUSE passthrough mount)", err)
		}
		return fmt.Errorf("mount erofs: %w", err)
	}
	return nil
}

func unmountDir(dir string) error {
	err := unix.Unmount(dir, 0)
	if errors.Is(err, unix.EBUSY) {
		// Still pinned (say, an overlay mounted on the host uses it); detach
		// so it disappears once the last user goes.
		err = unix.Unmount(dir, unix.MNT_DETACH)
	}
	if err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: not mounted
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		// EBUSY: a sandbox being created right now still has a copy of this
		// mount in its new mount namespace (it detaches the host's mounts a
		// moment later). The empty directory is harmless: the next Acquire
		// mounts on it again and NewMounts removes leftovers.
		if errors.Is(err, unix.EBUSY) {
			return nil
		}
		return err
	}
	return nil
}

// cleanup unmounts whatever is mounted under root and removes the leftover
// layer directories.
func (m *Mounts) cleanup() error {
	points, err := mountPointsUnder(m.root)
	if err != nil {
		return fmt.Errorf("layer mounts root %s: %w", m.root, err)
	}
	// Deepest first, in case something was mounted inside a layer dir.
	sort.Sort(sort.Reverse(sort.StringSlice(points)))
	for _, p := range points {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("layer mounts root %s: unmount stale %s: %w", m.root, p, err)
		}
		slog.Info("layer: unmounted stale layer mount", "dir", p)
	}
	entries, err := os.ReadDir(m.root)
	if err != nil {
		return fmt.Errorf("layer mounts root %s: %w", m.root, err)
	}
	for _, e := range entries {
		if e.IsDir() && blobstore.ValidateDigest("sha256:"+e.Name()) == nil {
			if err := os.Remove(filepath.Join(m.root, e.Name())); err != nil {
				return fmt.Errorf("layer mounts root %s: %w", m.root, err)
			}
		}
	}
	return nil
}

// mountPointsUnder lists mount points strictly below root in this mount
// namespace.
func mountPointsUnder(root string) ([]string, error) {
	return mountPoints(func(p string) bool { return strings.HasPrefix(p, root+"/") })
}

// mountPoints lists the mount points in /proc/self/mountinfo that match.
func mountPoints(match func(string) bool) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		p := unescapeMountinfo(fields[4])
		if match(p) {
			out = append(out, p)
		}
	}
	return out, sc.Err()
}

// unescapeMountinfo undoes the octal escapes (\040 for space, ...) the
// kernel writes in mountinfo paths.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }
