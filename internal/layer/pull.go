package layer

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/image"
)

// Annotations a pulled image's manifest carries: where it came from, so a
// later pull can tell that the registry still serves what was converted.
const (
	AnnotationSource       = "dsec.source"
	AnnotationSourceDigest = "dsec.source.digest"
)

// PullOption changes how Pull works.
type PullOption func(*pullOptions)

type pullOptions struct {
	importOptions
	transport http.RoundTripper
}

// PullMaxBytes bounds what the image may expand to, as WithMaxBytes does
// for Import.
func PullMaxBytes(n int64) PullOption { return func(o *pullOptions) { o.maxBytes = n } }

// PullTransport sends the registry requests (default http.DefaultTransport).
func PullTransport(t http.RoundTripper) PullOption { return func(o *pullOptions) { o.transport = t } }

// PullResult says what a pull did.
type PullResult struct {
	Manifest image.Manifest
	// Source is the registry reference pulled, fully qualified.
	Source string
	// SourceDigest is the digest of the manifest (or index) the registry
	// served.
	SourceDigest string
	// Converted is false when an image already converted from that
	// manifest was reused: nothing was fetched but the manifest.
	Converted bool
}

// ParseRemote parses a registry reference: [HOST[:PORT]/]REPO[:TAG|@DIGEST],
// Docker Hub when there is no host. Registries on loopback and private
// networks are reached over plain HTTP, others over HTTPS.
func ParseRemote(ref string) (name.Reference, error) {
	r, err := name.ParseReference(ref, name.StrictValidation)
	if err != nil {
		// Without strict validation a tag defaults to latest.
		r, err = name.ParseReference(ref)
	}
	if err != nil {
		return nil, fmt.Errorf("%w %q: %v", image.ErrInvalidRef, ref, err)
	}
	return r, nil
}

// DefaultName is the local NAME:TAG a pull of r is stored as without one
// given: r's repository (Docker Hub's "library/" dropped) and r's tag, or
// for a digest reference the digest's first 12 hex digits as the tag.
func DefaultName(r name.Reference) string {
	repo := r.Context().RepositoryStr()
	if r.Context().RegistryStr() == name.DefaultRegistry {
		repo = strings.TrimPrefix(repo, "library/")
	}
	switch t := r.(type) {
	case name.Tag:
		return repo + ":" + t.TagStr()
	case name.Digest:
		return repo + ":" + strings.TrimPrefix(t.DigestStr(), "sha256:")[:12]
	}
	return repo
}

// Pull converts the image a registry serves under src into EROFS layers in
// store (one per OCI layer, as Import does) and tags it ref. The manifest
// records src and the digest the registry served; when an image converted
// from that digest is already stored (ref itself, or any other tag), it is
// reused and nothing is converted. progress counts layers converted.
func Pull(ctx context.Context, store blobstore.Store, images *image.Store, ref, src string, progress Progress, opts ...PullOption) (PullResult, error) {
	if _, err := image.ParseRef(ref); err != nil {
		return PullResult{}, err
	}
	r, err := ParseRemote(src)
	if err != nil {
		return PullResult{}, err
	}
	var o pullOptions
	for _, opt := range opts {
		opt(&o)
	}
	if progress == nil {
		progress = func(int64, int64) {}
	}
	ropts := []remote.Option{
		remote.WithContext(ctx),
		// Anonymous: credentials for private registries (a keychain)
		// are not wired yet.
		remote.WithAuth(authn.Anonymous),
		remote.WithPlatform(v1.Platform{OS: "linux", Architecture: runtime.GOARCH}),
	}
	if o.transport != nil {
		ropts = append(ropts, remote.WithTransport(o.transport))
	}
	// One request for the manifest: its digest says whether there is
	// anything to convert.
	desc, err := remote.Get(r, ropts...)
	if err != nil {
		return PullResult{}, fmt.Errorf("pull %s: %w", r.Name(), err)
	}
	res := PullResult{Source: r.Name(), SourceDigest: desc.Digest.String()}
	if m, ok, err := converted(ctx, images, ref, res.SourceDigest); err != nil {
		return PullResult{}, fmt.Errorf("pull %s: %w", r.Name(), err)
	} else if ok {
		if _, err := images.Put(ctx, ref, m); err != nil {
			return PullResult{}, fmt.Errorf("pull %s: %w", r.Name(), err)
		}
		m.SchemaVersion = image.SchemaVersion
		res.Manifest = m
		return res, nil
	}
	img, err := desc.Image()
	if err != nil {
		return PullResult{}, fmt.Errorf("pull %s: %w", r.Name(), err)
	}
	var b *budget
	if o.maxBytes > 0 {
		b = &budget{limit: o.maxBytes}
	}
	m, err := importImage(ctx, store, img, progress, b)
	if err != nil {
		return PullResult{}, fmt.Errorf("pull %s: %w", r.Name(), err)
	}
	m.Annotations = map[string]string{AnnotationSource: res.Source, AnnotationSourceDigest: res.SourceDigest}
	if _, err := images.Put(ctx, ref, m); err != nil {
		return PullResult{}, fmt.Errorf("pull %s: %w", r.Name(), err)
	}
	m.SchemaVersion = image.SchemaVersion
	res.Manifest, res.Converted = m, true
	return res, nil
}

// converted finds an image converted from the registry manifest digest:
// ref's own first, then any other.
func converted(ctx context.Context, images *image.Store, ref, digest string) (image.Manifest, bool, error) {
	m, _, err := images.Get(ctx, ref)
	switch {
	case err == nil:
		if m.Annotations[AnnotationSourceDigest] == digest {
			return m, true, nil
		}
	case !errors.Is(err, image.ErrNotFound):
		return image.Manifest{}, false, err
	}
	all, err := images.List(ctx)
	if err != nil {
		return image.Manifest{}, false, err
	}
	for _, e := range all {
		m, err := images.Manifest(ctx, e.Digest)
		if err != nil {
			continue // deleted meanwhile, or unreadable: convert instead
		}
		if m.Annotations[AnnotationSourceDigest] == digest {
			return m, true, nil
		}
	}
	return image.Manifest{}, false, nil
}
