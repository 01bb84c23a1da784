// Package image keeps DSec images: a manifest (an ordered list of EROFS
// layer digests plus the defaults a process starts with) stored as a blob,
// and tags ("name:tag") stored as blob store refs pointing at manifests, so
// that moving a tag is one atomic ref update and identical manifests are
// stored once.
//
// A sandbox is composed from a base image, an optional workspace image and
// any number of toolkit images; Resolve turns those into the ordered layer
// list the runtime mounts.
package image

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// ErrNotFound means no image has that reference. Errors match it with
// errors.Is and read `image "name:tag" not found`.
var ErrNotFound = errors.New("image not found")

type notFoundError struct{ ref Ref }

func (e notFoundError) Error() string        { return fmt.Sprintf("image %q not found", e.ref.String()) }
func (e notFoundError) Is(target error) bool { return target == ErrNotFound }

// Config holds the defaults every process in a sandbox starts with.
type Config struct {
	Env        []string `json:"env,omitempty"`
	WorkingDir string   `json:"workingDir,omitempty"`
	User       string   `json:"user,omitempty"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
}

// SchemaVersion is the manifest format written by this package.
const SchemaVersion = 1

// Manifest describes one image. Layers are EROFS blobs, bottom first.
type Manifest struct {
	SchemaVersion int                    `json:"schemaVersion"`
	Layers        []blobstore.Descriptor `json:"layers"`
	Config        Config                 `json:"config"`
	Created       time.Time              `json:"created"`
	Annotations   map[string]string      `json:"annotations,omitempty"`
	// Disk is set on a disk image (ImportDisk): its one layer is a whole
	// bootable disk, not an EROFS layer, and only the fullvm backend runs
	// it (CheckBackend).
	Disk *Disk `json:"disk,omitempty"`
}

// Size is the total size of the manifest's layers.
func (m Manifest) Size() int64 {
	var n int64
	for _, l := range m.Layers {
		n += l.Size
	}
	return n
}

// Store keeps manifests in a blob store and tags in its refs, under
// "images/<name>:<tag>".
type Store struct {
	blobs blobstore.Store
	refs  blobstore.Refs

	// manifests caches parsed manifests by digest. A manifest is content
	// addressed, so an entry can never go stale; tags are still read on
	// every Get (they move). Every create resolves its images on the server
	// and again on the edge, and reading, verifying and decoding the
	// manifest blob each time was ~4 % of dsecd's CPU in a create loop.
	mu        sync.Mutex
	manifests map[string]Manifest
}

// maxCachedManifests bounds the cache; when full it is emptied (images in
// use are read back at once, cold ones are not).
const maxCachedManifests = 1024

// NewStore returns an image store over blobs and refs (usually the two
// halves of one blobstore.Repository).
func NewStore(blobs blobstore.Store, refs blobstore.Refs) *Store {
	return &Store{blobs: blobs, refs: refs}
}

const refPrefix = "images/"

func refName(r Ref) string { return refPrefix + r.String() }

// Put stores m and points ref at it, returning the manifest digest. Every
// layer must already be in the blob store with the size m states.
func (s *Store) Put(ctx context.Context, ref string, m Manifest) (string, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return "", err
	}
	if m.SchemaVersion == 0 {
		m.SchemaVersion = SchemaVersion
	}
	if m.SchemaVersion != SchemaVersion {
		return "", fmt.Errorf("put image %q: schemaVersion %d not supported", r, m.SchemaVersion)
	}
	for i, l := range m.Layers {
		st, err := s.blobs.Stat(ctx, l.Digest)
		if err != nil {
			return "", fmt.Errorf("put image %q: layers[%d]: %w", r, i, err)
		}
		if st.Size != l.Size {
			return "", fmt.Errorf("put image %q: layers[%d] %s: size %d, but the stored blob has %d bytes", r, i, l.Digest, l.Size, st.Size)
		}
	}
	b, err := json.Marshal(m)
	if err != nil {
		return "", fmt.Errorf("put image %q: %w", r, err)
	}
	desc, err := s.blobs.Put(ctx, bytes.NewReader(b))
	if err != nil {
		return "", fmt.Errorf("put image %q: manifest: %w", r, err)
	}
	if err := s.refs.Set(ctx, refName(r), desc.Digest); err != nil {
		return "", fmt.Errorf("put image %q: tag: %w", r, err)
	}
	return desc.Digest, nil
}

// Get returns the manifest ref points at and its digest.
func (s *Store) Get(ctx context.Context, ref string) (Manifest, string, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return Manifest{}, "", err
	}
	digest, err := s.refs.Get(ctx, refName(r))
	if errors.Is(err, blobstore.ErrNotFound) {
		return Manifest{}, "", notFoundError{r}
	}
	if err != nil {
		return Manifest{}, "", fmt.Errorf("image %q: %w", r, err)
	}
	m, err := s.Manifest(ctx, digest)
	if err != nil {
		return Manifest{}, "", fmt.Errorf("image %q: %w", r, err)
	}
	return m, digest, nil
}

// Manifest reads a manifest by digest (tags not involved).
func (s *Store) Manifest(ctx context.Context, digest string) (Manifest, error) {
	s.mu.Lock()
	m, ok := s.manifests[digest]
	s.mu.Unlock()
	if ok {
		return m.clone(), nil
	}
	m, err := s.readManifest(ctx, digest)
	if err != nil {
		return Manifest{}, err
	}
	s.mu.Lock()
	if s.manifests == nil || len(s.manifests) >= maxCachedManifests {
		s.manifests = make(map[string]Manifest)
	}
	s.manifests[digest] = m
	s.mu.Unlock()
	return m.clone(), nil
}

// clone copies m deeply, so that a caller may change what it got without
// changing the cached manifest.
func (m Manifest) clone() Manifest {
	m.Layers = slices.Clone(m.Layers)
	m.Config.Env = slices.Clone(m.Config.Env)
	m.Config.Entrypoint = slices.Clone(m.Config.Entrypoint)
	m.Config.Cmd = slices.Clone(m.Config.Cmd)
	m.Annotations = maps.Clone(m.Annotations)
	if m.Disk != nil {
		d := *m.Disk
		m.Disk = &d
	}
	return m
}

// readManifest reads, verifies and decodes a manifest blob.
func (s *Store) readManifest(ctx context.Context, digest string) (Manifest, error) {
	b, err := blobstore.ReadAll(ctx, s.blobs, digest)
	if err != nil {
		return Manifest{}, fmt.Errorf("manifest: %w", err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return Manifest{}, fmt.Errorf("manifest %s: %w", digest, err)
	}
	if m.SchemaVersion != SchemaVersion {
		return Manifest{}, fmt.Errorf("manifest %s: schemaVersion %d not supported", digest, m.SchemaVersion)
	}
	return m, nil
}

// Tag points dst at the manifest src points at.
func (s *Store) Tag(ctx context.Context, src, dst string) error {
	d, err := ParseRef(dst)
	if err != nil {
		return err
	}
	_, digest, err := s.Get(ctx, src)
	if err != nil {
		return err
	}
	if err := s.refs.Set(ctx, refName(d), digest); err != nil {
		return fmt.Errorf("tag image %q: %w", d, err)
	}
	return nil
}

// Delete removes the tag ref. The manifest and layers stay until garbage
// collection finds nothing referring to them.
func (s *Store) Delete(ctx context.Context, ref string) error {
	r, err := ParseRef(ref)
	if err != nil {
		return err
	}
	err = s.refs.Delete(ctx, refName(r))
	if errors.Is(err, blobstore.ErrNotFound) {
		return notFoundError{r}
	}
	if err != nil {
		return fmt.Errorf("delete image %q: %w", r, err)
	}
	return nil
}

// Entry summarises one tagged image.
type Entry struct {
	Ref     string    `json:"ref"`
	Digest  string    `json:"digest"`
	Layers  int       `json:"layers"`
	Size    int64     `json:"size"`
	Created time.Time `json:"created"`
}

// List returns every tagged image, sorted by reference. Tags whose
// manifest cannot be read are logged and skipped, so one damaged image does
// not hide the rest.
func (s *Store) List(ctx context.Context) ([]Entry, error) {
	refs, err := s.refs.List(ctx, refPrefix)
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	entries := make([]Entry, 0, len(refs))
	for _, r := range refs {
		name := strings.TrimPrefix(r.Name, refPrefix)
		m, err := s.Manifest(ctx, r.Digest)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			slog.Warn("image: skipping unreadable image", "ref", name, "err", err)
			continue
		}
		entries = append(entries, Entry{Ref: name, Digest: r.Digest, Layers: len(m.Layers), Size: m.Size(), Created: m.Created})
	}
	return entries, nil
}

// Resolved is what a sandbox is built from.
type Resolved struct {
	// Layers bottom first: base, workspace, toolkits in the order given.
	Layers []blobstore.Descriptor
	// Config is the base image's.
	Config Config
	// Manifests are the digests of the images used, in the same order as
	// the arguments (workspace omitted if empty), for provenance.
	Manifests []string
}

// Resolve composes a sandbox's root filesystem: the base image's layers,
// then the workspace's (if workspace is not empty), then each toolkit's, the
// last toolkit on top. A layer that appears more than once is kept only at
// its topmost position: the lower copy could only ever be shadowed by the
// upper one, and overlayfs need not see the same lowerdir twice.
func (s *Store) Resolve(ctx context.Context, base, workspace string, toolkits ...string) (Resolved, error) {
	return s.ResolveFor(ctx, "", base, workspace, toolkits...)
}

// ResolveFor is Resolve for a sandbox of backend kind: it also refuses
// images the backend cannot run (CheckBackend; an empty kind checks
// nothing).
func (s *Store) ResolveFor(ctx context.Context, kind, base, workspace string, toolkits ...string) (Resolved, error) {
	if base == "" {
		return Resolved{}, fmt.Errorf("resolve: base image is required: %w", ErrInvalidRef)
	}
	refs := []string{base}
	if workspace != "" {
		refs = append(refs, workspace)
	}
	refs = append(refs, toolkits...)
	ms := make([]Manifest, len(refs))
	digests := make([]string, len(refs))
	for i, ref := range refs {
		m, digest, err := s.Get(ctx, ref)
		if err != nil {
			return Resolved{}, fmt.Errorf("resolve: %w", err)
		}
		ms[i], digests[i] = m, digest
	}
	if kind != "" {
		if err := CheckBackend(kind, ms, SpecFields(workspace != "", len(toolkits))); err != nil {
			return Resolved{}, fmt.Errorf("resolve: %w", err)
		}
	}
	res, err := Compose(ms, digests)
	if err != nil {
		return Resolved{}, fmt.Errorf("resolve: images %q: %w", refs, err)
	}
	return res, nil
}

// Compose is Resolve over manifests already read (base first, then the
// workspace's if any, then each toolkit's), with their digests: the
// server reads each image once, checking the caller may use it, and
// composes from what it read, so that placement, pool keys and the layers
// the edge mounts are the same whatever a tag does meanwhile.
func Compose(ms []Manifest, digests []string) (Resolved, error) {
	if len(ms) == 0 || len(ms) != len(digests) {
		return Resolved{}, fmt.Errorf("compose: %d manifests, %d digests: %w", len(ms), len(digests), ErrInvalidRef)
	}
	res := Resolved{Config: ms[0].Config, Manifests: append([]string(nil), digests...)}
	var all []blobstore.Descriptor
	for _, m := range ms {
		all = append(all, m.Layers...)
	}
	if len(all) == 0 {
		return Resolved{}, errors.New("the images have no layers")
	}
	seen := map[string]bool{}
	for i := len(all) - 1; i >= 0; i-- {
		if seen[all[i].Digest] {
			continue
		}
		seen[all[i].Digest] = true
		res.Layers = append(res.Layers, all[i])
	}
	for i, j := 0, len(res.Layers)-1; i < j; i, j = i+1, j-1 {
		res.Layers[i], res.Layers[j] = res.Layers[j], res.Layers[i]
	}
	return res, nil
}
