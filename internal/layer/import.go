package layer

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/image"
)

// Kind is what an import path holds.
type Kind string

// Import source kinds.
const (
	KindDir        Kind = "directory"
	KindOCILayout  Kind = "oci-layout"
	KindDockerSave Kind = "docker-save"
	KindTarball    Kind = "rootfs-tarball"
)

// Progress receives import progress. Units depend on the input (bytes read
// of a tarball, layers done of an image); show done/total as a fraction.
// total is never zero.
type Progress func(done, total int64)

// Detect tells what path holds: a directory (KindDir), a directory with an
// oci-layout file (KindOCILayout), an uncompressed tar with manifest.json at
// its top (KindDockerSave), or any other tar, plain, gzip or zstd
// (KindTarball).
func Detect(path string) (Kind, error) {
	info, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("import %s: %w", path, err)
	}
	if info.IsDir() {
		if _, err := os.Stat(filepath.Join(path, "oci-layout")); err == nil {
			return KindOCILayout, nil
		}
		return KindDir, nil
	}
	if !info.Mode().IsRegular() {
		return "", fmt.Errorf("import %s: neither a directory nor a regular file", path)
	}
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("import %s: %w", path, err)
	}
	defer f.Close()
	head := make([]byte, 512)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("import %s: %w", path, err)
	}
	head = head[:n]
	kind, err := detect(head)
	if err != nil {
		return "", fmt.Errorf("import %s: %w", path, err)
	}
	if kind != compressNone {
		return KindTarball, nil
	}
	if n < 512 || string(head[257:262]) != "ustar" {
		return "", fmt.Errorf("import %s: not a directory, tar, tar.gz or tar.zst file", path)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", fmt.Errorf("import %s: %w", path, err)
	}
	if isDockerSave(f) {
		return KindDockerSave, nil
	}
	return KindTarball, nil
}

// isDockerSave looks for a top-level manifest.json shaped like the one
// `docker save` writes. Headers are read with seeks over file contents, so
// this is cheap even for a large archive.
func isDockerSave(f io.Reader) bool {
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err != nil {
			return false
		}
		if cleanName(hdr.Name) != "manifest.json" || hdr.Size > 16<<20 {
			continue
		}
		var m []struct {
			Config string
			Layers []string
		}
		if err := json.NewDecoder(tr).Decode(&m); err != nil {
			return false
		}
		return len(m) > 0 && m[0].Config != ""
	}
}

// ImportOption changes how Import works.
type ImportOption func(*importOptions)

type importOptions struct{ maxBytes int64 }

// WithMaxBytes bounds what the image may expand to, over all its layers:
// the bytes of every file and an entry's header size for every entry, as
// extracted (after decompression; a sparse file counts its full size). An
// import past it fails with a *SizeLimitError as soon as the entry that
// passes it is read, before that entry is written. 0 is no bound.
func WithMaxBytes(n int64) ImportOption { return func(o *importOptions) { o.maxBytes = n } }

// Import builds the layers of the image at path (see Detect for what it may
// be), stores them and the manifest, and tags the manifest ref. Layers
// already in the store are not duplicated. A failed import leaves no
// temporary files and no ref; layers of a multi-layer image it already
// stored stay until garbage collection (a tarball is one layer, refused
// before it is stored).
func Import(ctx context.Context, store blobstore.Store, images *image.Store, ref, path string, progress Progress, opts ...ImportOption) (image.Manifest, error) {
	if _, err := image.ParseRef(ref); err != nil {
		return image.Manifest{}, err
	}
	var o importOptions
	for _, opt := range opts {
		opt(&o)
	}
	var b *budget
	if o.maxBytes > 0 {
		b = &budget{limit: o.maxBytes}
	}
	if progress == nil {
		progress = func(int64, int64) {}
	}
	kind, err := Detect(path)
	if err != nil {
		return image.Manifest{}, err
	}
	var m image.Manifest
	switch kind {
	case KindDir:
		progress(0, 1)
		if err := b.takeTree(path); err != nil {
			return image.Manifest{}, err
		}
		desc, err := Build(ctx, store, path)
		if err != nil {
			return image.Manifest{}, fmt.Errorf("import %s: %w", path, err)
		}
		progress(1, 1)
		m.Layers = []blobstore.Descriptor{desc}
	case KindTarball:
		desc, err := importTarball(ctx, store, path, progress, b)
		if err != nil {
			return image.Manifest{}, fmt.Errorf("import %s: %w", path, err)
		}
		m.Layers = []blobstore.Descriptor{desc}
	case KindOCILayout, KindDockerSave:
		img, err := openImage(kind, path)
		if err != nil {
			return image.Manifest{}, fmt.Errorf("import %s (%s): %w", path, kind, err)
		}
		m, err = importImage(ctx, store, img, progress, b)
		if err != nil {
			return image.Manifest{}, fmt.Errorf("import %s (%s): %w", path, kind, err)
		}
	}
	if m.Created.IsZero() {
		m.Created = time.Now().UTC().Truncate(time.Second)
	}
	if _, err := images.Put(ctx, ref, m); err != nil {
		return image.Manifest{}, fmt.Errorf("import %s: %w", path, err)
	}
	m.SchemaVersion = image.SchemaVersion
	return m, nil
}

// scratchDir makes a temporary extraction directory, on the blob store's
// file system when it has one (rootfs trees can be large).
func scratchDir(store blobstore.Store) (string, error) {
	parent := ""
	if ing, ok := store.(blobstore.Ingester); ok {
		parent = ing.TempDir()
	}
	return os.MkdirTemp(parent, "extract-*")
}

// buildFromTar extracts a tar stream to a scratch directory and builds it,
// charging what it extracts to b (nil: unbounded).
func buildFromTar(ctx context.Context, store blobstore.Store, r io.Reader, b *budget) (blobstore.Descriptor, error) {
	dir, err := scratchDir(store)
	if err != nil {
		return blobstore.Descriptor{}, err
	}
	defer os.RemoveAll(dir)
	if err := extract(ctx, r, dir, b); err != nil {
		return blobstore.Descriptor{}, err
	}
	return Build(ctx, store, dir)
}

func importTarball(ctx context.Context, store blobstore.Store, path string, progress Progress, b *budget) (blobstore.Descriptor, error) {
	f, err := os.Open(path)
	if err != nil {
		return blobstore.Descriptor{}, err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return blobstore.Descriptor{}, err
	}
	total := max(info.Size(), 1)
	progress(0, total)
	desc, err := buildFromTar(ctx, store, &countingReader{r: f, total: total, progress: progress}, b)
	if err != nil {
		return blobstore.Descriptor{}, err
	}
	progress(total, total)
	return desc, nil
}

type countingReader struct {
	r        io.Reader
	n, total int64
	progress Progress
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	c.progress(min(c.n, c.total), c.total)
	return n, err
}

func openImage(kind Kind, path string) (v1.Image, error) {
	if kind == KindDockerSave {
		// With no tag, the archive must hold exactly one image.
		return tarball.ImageFromPath(path, nil)
	}
	p, err := layout.FromPath(path)
	if err != nil {
		return nil, err
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, err
	}
	return pickImage(idx)
}

// pickImage chooses the image of an OCI layout: the only one, or the one
// for linux on this machine's architecture.
func pickImage(idx v1.ImageIndex) (v1.Image, error) {
	var images []v1.Image
	var platforms []*v1.Platform
	var walk func(idx v1.ImageIndex) error
	walk = func(idx v1.ImageIndex) error {
		im, err := idx.IndexManifest()
		if err != nil {
			return err
		}
		for _, d := range im.Manifests {
			switch {
			case d.MediaType.IsIndex():
				child, err := idx.ImageIndex(d.Digest)
				if err != nil {
					return err
				}
				if err := walk(child); err != nil {
					return err
				}
			case d.MediaType.IsImage():
				img, err := idx.Image(d.Digest)
				if err != nil {
					return err
				}
				images = append(images, img)
				platforms = append(platforms, d.Platform)
			}
		}
		return nil
	}
	if err := walk(idx); err != nil {
		return nil, err
	}
	switch len(images) {
	case 0:
		return nil, errors.New("no image in the layout")
	case 1:
		return images[0], nil
	}
	for i, p := range platforms {
		if p != nil && p.OS == "linux" && p.Architecture == runtime.GOARCH {
			return images[i], nil
		}
	}
	return nil, fmt.Errorf("%d images in the layout and none for linux/%s", len(images), runtime.GOARCH)
}

// importImage turns each OCI layer into one EROFS layer, bottom first, and
// carries over the image config.
func importImage(ctx context.Context, store blobstore.Store, img v1.Image, progress Progress, b *budget) (image.Manifest, error) {
	cfg, err := img.ConfigFile()
	if err != nil {
		return image.Manifest{}, fmt.Errorf("config: %w", err)
	}
	layers, err := img.Layers()
	if err != nil {
		return image.Manifest{}, fmt.Errorf("layers: %w", err)
	}
	if len(layers) == 0 {
		return image.Manifest{}, errors.New("image has no layers")
	}
	total := int64(len(layers))
	progress(0, total)
	m := image.Manifest{
		Created: cfg.Created.UTC(),
		Config: image.Config{
			Env:        cfg.Config.Env,
			WorkingDir: cfg.Config.WorkingDir,
			User:       cfg.Config.User,
			Entrypoint: cfg.Config.Entrypoint,
			Cmd:        cfg.Config.Cmd,
		},
	}
	for i, l := range layers {
		desc, err := importLayer(ctx, store, l, b)
		if err != nil {
			return image.Manifest{}, fmt.Errorf("layer %d: %w", i, err)
		}
		m.Layers = append(m.Layers, desc)
		progress(int64(i+1), total)
	}
	return m, nil
}

func importLayer(ctx context.Context, store blobstore.Store, l v1.Layer, b *budget) (blobstore.Descriptor, error) {
	rc, err := l.Uncompressed()
	if err != nil {
		return blobstore.Descriptor{}, err
	}
	defer rc.Close()
	return buildFromTar(ctx, store, rc, b)
}

// takeTree charges a directory tree to b, as Extract would charge it.
func (b *budget) takeTree(root string) error {
	if b == nil {
		return nil
	}
	return filepath.WalkDir(root, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		n := int64(entryCost)
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			n += info.Size()
		}
		return b.take(n)
	})
}
