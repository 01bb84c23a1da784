package memback

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// OCI whiteout names (what runtime.DiffArchiver's stream carries).
const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

// PutArchive extracts a tar stream of regular files and directories into
// dir (created if missing); other entry types are refused.
func (s *Sandbox) PutArchive(ctx context.Context, dir string, r io.Reader) error {
	if _, err := s.enter(ctx); err != nil {
		return err
	}
	root, err := cleanPath(dir)
	if err != nil {
		return err
	}
	tr := tar.NewReader(r)
	type entry struct {
		p    string
		n    *node
		hdrn string
	}
	var entries []entry
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("put archive: %w", err)
		}
		p := path.Join(root, path.Clean("/"+hdr.Name))
		switch hdr.Typeflag {
		case tar.TypeDir:
			entries = append(entries, entry{p, &node{dir: true, mode: uint32(hdr.Mode) & 0o7777}, hdr.Name})
		case tar.TypeReg:
			data, err := io.ReadAll(tr)
			if err != nil {
				return fmt.Errorf("put archive %s: %w", hdr.Name, err)
			}
			entries = append(entries, entry{p, &node{data: data, mode: uint32(hdr.Mode) & 0o7777}, hdr.Name})
		default:
			return fmt.Errorf("put archive %s: entry type %q is not supported by memback: %w", hdr.Name, hdr.Typeflag, fs.ErrInvalid)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return err
	}
	if n := s.tree[root]; n != nil && !n.dir {
		return fmt.Errorf("put archive: %s is not a directory: %w", root, runtime.ErrFailedPrecondition)
	}
	addParents(s.tree, root+"/x")
	for _, e := range entries {
		if e.n.dir {
			if n := s.tree[e.p]; n != nil && !n.dir {
				return fmt.Errorf("put archive %s: a file is in the way: %w", e.hdrn, runtime.ErrFailedPrecondition)
			}
			addParents(s.tree, e.p)
			s.tree[e.p] = e.n
			continue
		}
		if err := s.writeLocked(e.p, e.n.data, e.n.mode); err != nil {
			return err
		}
	}
	return nil
}

// GetArchive writes dir and everything under it as a tar stream, names
// relative to dir.
func (s *Sandbox) GetArchive(ctx context.Context, dir string, w io.Writer) error {
	if _, err := s.enter(ctx); err != nil {
		return err
	}
	root, err := cleanPath(dir)
	if err != nil {
		return err
	}
	s.mu.Lock()
	if err := s.goneLocked(); err != nil {
		s.mu.Unlock()
		return err
	}
	if n := s.tree[root]; n == nil || !n.dir {
		s.mu.Unlock()
		return fmt.Errorf("get archive %s: %w", root, fs.ErrNotExist)
	}
	snap := map[string]*node{}
	for p, n := range s.tree {
		if p != root && under(p, root) {
			snap[strings.TrimPrefix(strings.TrimPrefix(p, root), "/")] = n.clone()
		}
	}
	s.mu.Unlock()
	tw := tar.NewWriter(w)
	for _, name := range sortedKeys(snap) {
		if err := writeEntry(tw, name, snap[name]); err != nil {
			return err
		}
	}
	return tw.Close()
}

func under(p, root string) bool { return root == "/" || p == root || strings.HasPrefix(p, root+"/") }

// epoch is every entry's time: the tree keeps none, and a fixed one makes
// archives of equal trees equal.
var epoch = time.Unix(0, 0).UTC()

func writeEntry(tw *tar.Writer, name string, n *node) error {
	hdr := &tar.Header{Name: name, Mode: int64(n.mode), ModTime: epoch, Format: tar.FormatPAX}
	if n.dir {
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
	} else {
		hdr.Typeflag, hdr.Size = tar.TypeReg, int64(len(n.data))
	}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	if !n.dir {
		if _, err := tw.Write(n.data); err != nil {
			return err
		}
	}
	return nil
}

// WriteDiff writes what the sandbox changed over its base as a tar stream
// with OCI whiteouts: new and changed files and directories (with their
// parents), ".wh.NAME" for a base entry removed, and ".wh..wh..opq" in a
// base directory removed and made again. A frozen sandbox stays frozen and
// is read as it is (what the edge does to pack a frozen sandbox).
func (s *Sandbox) WriteDiff(ctx context.Context, w io.Writer) error {
	s.mu.Lock()
	if err := s.goneLocked(); err != nil {
		s.mu.Unlock()
		return err
	}
	entries := map[string]*node{} // name (no leading /) → node; nil: whiteout marker
	whiteouts := map[string]bool{}
	for p, n := range s.tree {
		if p == "/" || s.inBase(p, n) && !s.removed[p] {
			continue
		}
		if b := s.b.base[p]; b != nil && b.dir && n.dir && !s.removed[p] {
			continue // an unchanged base directory (its mode aside)
		}
		entries[p] = n.clone()
		if s.removed[p] && n.dir {
			whiteouts[path.Join(p, whiteoutOpaque)] = true
		}
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = s.tree[d].clone()
			}
		}
	}
	for p := range s.removed {
		if _, back := s.tree[p]; back || s.removedAncestor(p) {
			continue
		}
		whiteouts[path.Join(path.Dir(p), whiteoutPrefix+path.Base(p))] = true
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = s.tree[d].clone()
			}
		}
	}
	s.mu.Unlock()

	names := make([]string, 0, len(entries)+len(whiteouts))
	for p := range entries {
		names = append(names, p)
	}
	for p := range whiteouts {
		names = append(names, p)
	}
	slices.Sort(names)
	tw := tar.NewWriter(w)
	for _, p := range names {
		if err := ctx.Err(); err != nil {
			return err
		}
		name := strings.TrimPrefix(p, "/")
		if whiteouts[p] {
			hdr := &tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, ModTime: epoch, Format: tar.FormatPAX}
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
			continue
		}
		if err := writeEntry(tw, name, entries[p]); err != nil {
			return err
		}
	}
	return tw.Close()
}

// removedAncestor reports whether a parent of p was removed and not made
// again (its whiteout hides p); the caller holds mu.
func (s *Sandbox) removedAncestor(p string) bool {
	for d := path.Dir(p); d != "/"; d = path.Dir(d) {
		if _, back := s.tree[d]; s.removed[d] && !back {
			return true
		}
	}
	return false
}
