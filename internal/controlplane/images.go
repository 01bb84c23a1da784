package controlplane

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sort"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
)

// Image namespaces. A tenant's private image "foo:1" is stored as the image
// "t/<tenant>/foo:1"; public images (imported by the admin) keep their own
// name. Edges resolve whatever name the server puts in the spec, so they need
// not know about tenants; users only ever see their own names.
const tenantImagePrefix = "t/"

func tenantScope(tenant string) string { return tenantImagePrefix + tenant + "/" }

// userRef turns an internal image name back into the name its owner used.
func userRef(internal, owner string) string {
	if owner == "" || owner == iam.AdminTenant {
		return internal
	}
	return strings.TrimPrefix(internal, tenantScope(owner))
}

// ownerOf says which tenant an internal image name belongs to ("" = public).
func ownerOf(internal string) string {
	rest, ok := strings.CutPrefix(internal, tenantImagePrefix)
	if !ok {
		return ""
	}
	t, _, ok := strings.Cut(rest, "/")
	if !ok {
		return ""
	}
	return t
}

// checkUserRef parses a ref as the caller wrote it. Tenants may not spell
// internal names: "t/..." is reserved for the server's bookkeeping.
func checkUserRef(p iam.Principal, field, ref string) (image.Ref, error) {
	if ref == "" {
		return image.Ref{}, errf(connect.CodeInvalidArgument, "%s: image reference is required", field)
	}
	r, err := image.ParseRef(ref)
	if err != nil {
		return image.Ref{}, errf(connect.CodeInvalidArgument, "%s: %w", field, err)
	}
	if !p.Admin && strings.HasPrefix(r.Name, tenantImagePrefix) {
		return image.Ref{}, errf(connect.CodeInvalidArgument, "%s: image names starting with %q are reserved", field, tenantImagePrefix)
	}
	return r, nil
}

// resolveImage finds the image a caller means by ref: its own private image
// first, then a public one. The admin addresses internal names directly.
// Images the caller may not see are NotFound, exactly like missing ones.
func (s *Server) resolveImage(ctx context.Context, p iam.Principal, field, ref string) (internal string, m image.Manifest, digest string, err error) {
	r, err := checkUserRef(p, field, ref)
	if err != nil {
		return "", image.Manifest{}, "", err
	}
	candidates := []string{r.String()}
	if !p.Admin {
		candidates = []string{tenantScope(p.Tenant) + r.String(), r.String()}
	}
	for _, c := range candidates {
		m, digest, err := s.images.Get(ctx, c)
		if errors.Is(err, image.ErrNotFound) {
			continue
		}
		if err != nil {
			return "", image.Manifest{}, "", errf(connect.CodeInternal, "%s: image %q: %w", field, r.String(), err)
		}
		return c, m, digest, nil
	}
	return "", image.Manifest{}, "", errf(connect.CodeNotFound, "%s: image %q not found", field, r.String())
}

type imageService struct{ s *Server }

func toImage(internal, digest string, m image.Manifest) *dsecv1.Image {
	owner := ownerOf(internal)
	img := &dsecv1.Image{
		Ref: userRef(internal, owner), Digest: digest, Size: m.Size(), Tenant: owner,
	}
	if !m.Created.IsZero() {
		img.CreatedAt = timestamppb.New(m.Created)
	}
	if m.Disk != nil {
		img.DiskFormat = m.Disk.Format
	}
	for _, l := range m.Layers {
		img.Layers = append(img.Layers, l.Digest)
	}
	return img
}

// forCaller adjusts an image for display: the admin sees internal names so
// that it can address every tenant's images.
func forCaller(p iam.Principal, internal string, img *dsecv1.Image) *dsecv1.Image {
	if p.Admin {
		img.Ref = internal
	}
	return img
}

func (is *imageService) Import(ctx context.Context, stream *connect.ClientStream[dsecv1.ImportImageRequest]) (*connect.Response[dsecv1.ImportImageResponse], error) {
	s := is.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if !stream.Receive() {
		if err := stream.Err(); err != nil {
			return nil, err
		}
		return nil, errf(connect.CodeInvalidArgument, "header: the first message must be an ImportHeader, got none")
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, errf(connect.CodeInvalidArgument, "header: the first message must be an ImportHeader")
	}
	r, err := checkUserRef(p, "header.ref", hdr.GetRef())
	if err != nil {
		return nil, err
	}
	if hdr.GetPublic() && !p.Admin {
		return nil, errf(connect.CodePermissionDenied, "header.public: only the admin may import public images")
	}
	if hdr.GetServerPath() != "" && !p.Admin {
		return nil, errf(connect.CodePermissionDenied, "header.server_path: only the admin may import from the server's file system")
	}
	// The admin owns the public namespace: its imports are public.
	internal := r.String()
	if !p.Admin {
		internal = tenantScope(p.Tenant) + internal
	}

	limit, limitName, err := s.importLimit(ctx, p)
	if err != nil {
		return nil, err
	}
	path := hdr.GetServerPath()
	if path == "" {
		tmp, err := s.spool(stream, limit, limitName)
		if err != nil {
			return nil, err
		}
		defer os.Remove(tmp)
		path = tmp
	} else if stream.Receive() {
		return nil, errf(connect.CodeInvalidArgument, "chunk: header.server_path is set, so no chunks may follow")
	} else if err := stream.Err(); err != nil {
		return nil, err
	}

	var m image.Manifest
	if hdr.GetDisk() {
		m, err = image.ImportDisk(ctx, s.cfg.Store, s.images, internal, path, limit)
	} else {
		m, err = layer.Import(ctx, s.cfg.Store, s.images, internal, path, nil, layer.WithMaxBytes(limit))
	}
	if err != nil {
		s.metrics.fail("image_import", err)
		if ctx.Err() != nil {
			return nil, toConnect(ctx.Err())
		}
		if errors.Is(err, layer.ErrTooLarge) || errors.Is(err, image.ErrDiskTooLarge) {
			return nil, errf(connect.CodeResourceExhausted, "import %q: %s %d exceeded: the image expands to more than %d bytes after decompression", r.String(), limitName, limit, limit)
		}
		if errors.Is(err, image.ErrInvalidRef) {
			return nil, errf(connect.CodeInvalidArgument, "header.ref: %w", err)
		}
		// The caller hears what was wrong with its upload, not where the
		// server spooled it (the interceptor redacts any other host path).
		s.log.Info("image import refused", "ref", internal, "tenant", p.Tenant, "err", err)
		msg := err.Error()
		if hdr.GetServerPath() == "" {
			msg = strings.ReplaceAll(msg, "import "+path+": ", "")
			msg = strings.ReplaceAll(msg, path, "the upload")
		}
		return nil, errf(connect.CodeInvalidArgument, "import %q: %s", r.String(), msg)
	}
	_, digest, err := s.images.Get(ctx, internal)
	if err != nil {
		return nil, toConnect(err)
	}
	s.log.Info("image imported", "ref", internal, "tenant", p.Tenant, "digest", digest, "layers", len(m.Layers))
	return connect.NewResponse(&dsecv1.ImportImageResponse{Image: forCaller(p, internal, toImage(internal, digest, m))}), nil
}

// importLimit is what one import by p may expand to, and the name of the
// setting that says so (for errors).
func (s *Server) importLimit(ctx context.Context, p iam.Principal) (int64, string, error) {
	if !p.Admin {
		t, err := s.iam.Tenant(ctx, p.Tenant)
		if err != nil {
			return 0, "", errf(connect.CodeUnavailable, "tenant %q: %w", p.Tenant, err)
		}
		if t.Quota.MaxImportBytes > 0 {
			return t.Quota.MaxImportBytes, fmt.Sprintf("tenant %q quota max_import_bytes", p.Tenant), nil
		}
	}
	return s.cfg.MaxImportBytes, "the server's import size limit (--max-import-size)", nil
}

// spoolSlack is what an upload may exceed the import limit by: compressing
// data that does not compress adds a little.
func spoolSlack(limit int64) int64 { return limit/64 + 1<<20 }

// spool writes the uploaded chunks to a temp file, on the blob store's file
// system when it has one so that large uploads do not fill /tmp. An upload
// larger than the import limit (and a little slack) is refused as it
// arrives: it cannot expand to less.
func (s *Server) spool(stream *connect.ClientStream[dsecv1.ImportImageRequest], limit int64, limitName string) (string, error) {
	dir := ""
	if ing, ok := s.cfg.Store.(blobstore.Ingester); ok {
		dir = ing.TempDir()
	}
	f, err := os.CreateTemp(dir, "upload-*")
	if err != nil {
		return "", errf(connect.CodeInternal, "spool upload: %w", err)
	}
	fail := func(err error) (string, error) {
		f.Close()
		os.Remove(f.Name())
		return "", err
	}
	var n int64
	for stream.Receive() {
		if stream.Msg().GetHeader() != nil {
			return fail(errf(connect.CodeInvalidArgument, "header: sent twice"))
		}
		c := stream.Msg().GetChunk()
		if n+int64(len(c)) > limit+spoolSlack(limit) {
			return fail(errf(connect.CodeResourceExhausted, "upload: %s %d exceeded: more than %d bytes uploaded", limitName, limit, n+int64(len(c))))
		}
		if _, err := f.Write(c); err != nil {
			return fail(errf(connect.CodeInternal, "spool upload: %w", err))
		}
		n += int64(len(c))
	}
	if err := stream.Err(); err != nil {
		return fail(err)
	}
	if n == 0 {
		return fail(errf(connect.CodeInvalidArgument, "chunk: no data uploaded and header.server_path is empty"))
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return "", errf(connect.CodeInternal, "spool upload: %w", err)
	}
	return f.Name(), nil
}

func (is *imageService) List(ctx context.Context, _ *connect.Request[dsecv1.ListImagesRequest]) (*connect.Response[dsecv1.ListImagesResponse], error) {
	s := is.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	entries, err := s.images.List(ctx)
	if err != nil {
		return nil, toConnect(err)
	}
	// A tenant's private image shadows a public one of the same name, as
	// in resolveImage.
	private := map[string]bool{}
	scope := tenantScope(p.Tenant)
	for _, e := range entries {
		if rest, ok := strings.CutPrefix(e.Ref, scope); ok && !p.Admin {
			private[rest] = true
		}
	}
	var out []*dsecv1.Image
	for _, e := range entries {
		owner := ownerOf(e.Ref)
		switch {
		case p.Admin:
		case owner == p.Tenant:
		case owner == "" && !private[e.Ref]:
		default:
			continue
		}
		m, err := s.images.Manifest(ctx, e.Digest)
		if err != nil {
			continue // deleted or damaged since List read it
		}
		out = append(out, forCaller(p, e.Ref, toImage(e.Ref, e.Digest, m)))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Ref < out[j].Ref })
	return connect.NewResponse(&dsecv1.ListImagesResponse{Images: out}), nil
}

func (is *imageService) Get(ctx context.Context, req *connect.Request[dsecv1.GetImageRequest]) (*connect.Response[dsecv1.GetImageResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	internal, m, digest, err := is.s.resolveImage(ctx, p, "ref", req.Msg.GetRef())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.GetImageResponse{Image: forCaller(p, internal, toImage(internal, digest, m))}), nil
}

func (is *imageService) Tag(ctx context.Context, req *connect.Request[dsecv1.TagImageRequest]) (*connect.Response[dsecv1.TagImageResponse], error) {
	s := is.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	src, _, _, err := s.resolveImage(ctx, p, "src", req.Msg.GetSrc())
	if err != nil {
		return nil, err
	}
	dst, err := checkUserRef(p, "dst", req.Msg.GetDst())
	if err != nil {
		return nil, err
	}
	internal := dst.String()
	if !p.Admin {
		internal = tenantScope(p.Tenant) + internal
	}
	if err := s.images.Tag(ctx, src, internal); err != nil {
		return nil, toConnect(fmt.Errorf("tag %q as %q: %w", req.Msg.GetSrc(), req.Msg.GetDst(), err))
	}
	m, digest, err := s.images.Get(ctx, internal)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&dsecv1.TagImageResponse{Image: forCaller(p, internal, toImage(internal, digest, m))}), nil
}

func (is *imageService) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteImageRequest]) (*connect.Response[dsecv1.DeleteImageResponse], error) {
	s := is.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	internal, _, _, err := s.resolveImage(ctx, p, "ref", req.Msg.GetRef())
	if err != nil {
		return nil, err
	}
	if !p.Admin && ownerOf(internal) != p.Tenant {
		return nil, errf(connect.CodePermissionDenied, "ref: image %q is public; only the admin may delete it", req.Msg.GetRef())
	}
	if err := s.images.Delete(ctx, internal); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&dsecv1.DeleteImageResponse{}), nil
}

// Pull converts a registry's image into the store (see layer.Pull),
// streaming the layers converted so far.
func (is *imageService) Pull(ctx context.Context, req *connect.Request[dsecv1.PullImageRequest], stream *connect.ServerStream[dsecv1.PullImageResponse]) error {
	s := is.s
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	msg := req.Msg
	if msg.GetSource() == "" {
		return errf(connect.CodeInvalidArgument, "source: a registry reference is required")
	}
	src, err := layer.ParseRemote(msg.GetSource())
	if err != nil {
		return errf(connect.CodeInvalidArgument, "source: %w", err)
	}
	ref := msg.GetRef()
	if ref == "" {
		ref = layer.DefaultName(src)
	}
	r, err := checkUserRef(p, "ref", ref)
	if err != nil {
		return err
	}
	if msg.GetPublic() && !p.Admin {
		return errf(connect.CodePermissionDenied, "public: only the admin may pull public images")
	}
	internal := r.String()
	if !p.Admin {
		internal = tenantScope(p.Tenant) + internal
	}
	limit, limitName, err := s.importLimit(ctx, p)
	if err != nil {
		return err
	}
	opts := []layer.PullOption{layer.PullMaxBytes(limit)}
	if !p.Admin {
		// A tenant names the host the server connects to: it must not be
		// the server's own network (its loopback services, the nodes,
		// a cloud metadata endpoint).
		opts = append(opts, layer.PullTransport(publicTransport))
	}
	var sendErr error
	progress := func(done, total int64) {
		if sendErr == nil {
			sendErr = stream.Send(&dsecv1.PullImageResponse{LayersDone: done, LayersTotal: total})
		}
	}
	res, err := layer.Pull(ctx, s.cfg.Store, s.images, internal, src.Name(), progress, opts...)
	if err != nil {
		s.metrics.fail("image_pull", err)
		s.log.Info("image pull failed", "ref", internal, "source", src.Name(), "tenant", p.Tenant, "err", err)
		return pullError(ctx, r.String(), src.Name(), limitName, limit, err)
	}
	if sendErr != nil {
		return sendErr
	}
	_, digest, err := s.images.Get(ctx, internal)
	if err != nil {
		return toConnect(err)
	}
	s.log.Info("image pulled", "ref", internal, "source", res.Source, "source_digest", res.SourceDigest,
		"tenant", p.Tenant, "digest", digest, "layers", len(res.Manifest.Layers), "converted", res.Converted)
	return stream.Send(&dsecv1.PullImageResponse{
		LayersDone: int64(len(res.Manifest.Layers)), LayersTotal: int64(len(res.Manifest.Layers)),
		Image:        forCaller(p, internal, toImage(internal, digest, res.Manifest)),
		Converted:    res.Converted,
		SourceDigest: res.SourceDigest,
	})
}

// pullError gives a failed pull its code: the registry's answer where it
// gave one, Unavailable when it could not be reached.
func pullError(ctx context.Context, ref, src, limitName string, limit int64, err error) error {
	var terr *transport.Error
	var ne net.Error
	switch {
	case ctx.Err() != nil:
		return toConnect(ctx.Err())
	case errors.Is(err, layer.ErrTooLarge):
		return errf(connect.CodeResourceExhausted, "pull %s: %s %d exceeded: the image expands to more than %d bytes after decompression", src, limitName, limit, limit)
	case errors.Is(err, image.ErrInvalidRef):
		return errf(connect.CodeInvalidArgument, "ref %q: %w", ref, err)
	case errors.Is(err, errBlockedAddress):
		return errf(connect.CodePermissionDenied, "source %s: %v", src, errBlockedAddress)
	case errors.As(err, &terr):
		switch terr.StatusCode {
		case http.StatusNotFound:
			return errf(connect.CodeNotFound, "source %s: %w", src, err)
		case http.StatusUnauthorized, http.StatusForbidden:
			return errf(connect.CodePermissionDenied, "source %s: the registry refused: %w", src, err)
		}
		return errf(connect.CodeUnavailable, "source %s: %w", src, err)
	case errors.As(err, &ne):
		return errf(connect.CodeUnavailable, "source %s: %w", src, err)
	}
	return errf(connect.CodeInvalidArgument, "pull %s: %v", src, err)
}

// errBlockedAddress refuses a tenant's registry at a non-public address.
var errBlockedAddress = errors.New("registries at loopback, private or link-local addresses are for the admin only")

// publicTransport reaches only public addresses: the check is on the
// address dialled, after DNS, so a public name that resolves to a private
// address is refused too. It uses no proxy (a proxy would dial for it).
var publicTransport = func() http.RoundTripper {
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second,
		Control: func(_, address string, _ syscall.RawConn) error {
			host, _, err := net.SplitHostPort(address)
			if err != nil {
				return err
			}
			ip, err := netip.ParseAddr(host)
			if err != nil {
				return err
			}
			ip = ip.Unmap()
			if !ip.IsGlobalUnicast() || ip.IsPrivate() || ip.IsLoopback() || ip.IsLinkLocalUnicast() {
				return errBlockedAddress
			}
			return nil
		}}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	t.DialContext = d.DialContext
	return t
}()
