package layer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// DirLayers keeps node-local directory layers: trees copied with CopyTree
// (a frozen sandbox's overlay upper directory: a checkpoint), each a plain
// directory <root>/layers/<hex of its tree digest> that an overlay stacks
// as a lower directory as is, with no image to build and nothing to mount.
// Such a layer never leaves the node and does not outlive the process that
// made it: the store is emptied when opened, and nothing is fsynced.
//
// A layer is made in two steps, so that the caller can publish it and
// count its users under one lock: Stage copies the tree to a staging
// directory, Commit renames it into place. Retire is Commit's inverse: a
// rename out of place, with the slow removal left to the caller.
// Identical trees share one directory.
type DirLayers struct {
	root   string
	layers string
	tmp    string
}

// NewDirLayers opens the store at root, removing whatever it held.
func NewDirLayers(root string) (*DirLayers, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("directory layers %q: %w", root, err)
	}
	if err := os.RemoveAll(abs); err != nil {
		return nil, fmt.Errorf("directory layers %q: %w", root, err)
	}
	return DirLayersAt(abs), nil
}

// DirLayersAt is the store at the absolute path root as it is: for a
// caller that empties the directory itself when its process starts. The
// store's directories are made when first needed.
func DirLayersAt(root string) *DirLayers {
	return &DirLayers{root: root, layers: filepath.Join(root, "layers"), tmp: filepath.Join(root, "tmp")}
}

// Root returns the store's directory.
func (s *DirLayers) Root() string { return s.root }

// Path returns the directory of the layer digest (which may not exist).
func (s *DirLayers) Path(digest string) (string, error) {
	if err := blobstore.ValidateDigest(digest); err != nil {
		return "", err
	}
	return filepath.Join(s.layers, strings.TrimPrefix(digest, "sha256:")), nil
}

// Contains reports whether path names one of the store's layers.
func (s *DirLayers) Contains(path string) bool {
	return filepath.Dir(path) == s.layers
}

// Layers lists the digests of the committed layers.
func (s *DirLayers) Layers() ([]string, error) {
	ents, err := os.ReadDir(s.layers)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(ents))
	for _, e := range ents {
		out = append(out, "sha256:"+e.Name())
	}
	return out, nil
}

// Staged is a copied tree not yet in place.
type Staged struct {
	s      *DirLayers
	dir    string
	digest string
}

// Stage copies the tree src into the store's staging area. The caller
// commits it or discards it.
func (s *DirLayers) Stage(ctx context.Context, src string) (*Staged, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	// layers is traversable like the mount cache's root: whoever mounts
	// a sandbox's overlay reaches the lower directories through it.
	if err := os.MkdirAll(s.layers, 0o755); err != nil {
		return nil, fmt.Errorf("directory layers %s: %w", s.root, err)
	}
	if err := os.MkdirAll(s.tmp, 0o700); err != nil {
		return nil, fmt.Errorf("directory layers %s: %w", s.root, err)
	}
	dir := filepath.Join(s.tmp, "stage-"+hex.EncodeToString(b[:]))
	digest, err := CopyTree(ctx, src, dir)
	if err != nil {
		if rerr := os.RemoveAll(dir); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	return &Staged{s: s, dir: dir, digest: digest}, nil
}

// Digest is the staged tree's digest (see CopyTree).
func (st *Staged) Digest() string { return st.digest }

// Commit puts the staged tree in place and returns the layer's directory.
// When the same tree is there already, that one is the layer and the
// staged copy is left for Discard. It only renames: cheap enough to call
// under the lock that counts the layer's users.
func (st *Staged) Commit() (string, error) {
	final, err := st.s.Path(st.digest)
	if err != nil {
		return "", err
	}
	err = unix.Renameat2(unix.AT_FDCWD, st.dir, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE)
	switch {
	case err == nil:
		st.dir = ""
	case errors.Is(err, unix.EEXIST):
	default:
		return "", fmt.Errorf("commit directory layer %s: %w", st.digest, err)
	}
	return final, nil
}

// Discard removes the staged copy unless Commit moved it into place; it
// may be called more than once.
func (st *Staged) Discard() error {
	if st.dir == "" {
		return nil
	}
	err := os.RemoveAll(st.dir)
	st.dir = ""
	return err
}

// Retire takes the layer digest out of place at once (a rename), so that
// the same tree committed again afterwards is a new directory, and returns
// the function that removes its files, for the caller to run outside its
// locks. Retiring a layer that is not there is not an error.
func (s *DirLayers) Retire(digest string) (remove func() error, err error) {
	final, err := s.Path(digest)
	if err != nil {
		return nil, err
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, err
	}
	gone := filepath.Join(s.tmp, "gone-"+hex.EncodeToString(b[:]))
	if err := os.Rename(final, gone); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return func() error { return nil }, nil
		}
		return nil, fmt.Errorf("retire directory layer %s: %w", digest, err)
	}
	return func() error { return os.RemoveAll(gone) }, nil
}
