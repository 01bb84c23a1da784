package dsec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Image describes one image ref.
type Image struct {
	// Ref is NAME:TAG.
	Ref    string
	Digest string
	// Layers are the layer digests, bottom first.
	Layers    []string
	Size      int64
	CreatedAt time.Time
	// Tenant owns the image; empty for public images.
	Tenant string
	// DiskFormat is set on a disk image (imported with Disk()): "qcow2"
	// or "raw". Only sandboxes of backend fullvm boot it.
	DiskFormat string

	// Seq and Replayed are set on the image Sandbox.Snapshot returns: the
	// snapshot's step in the source sandbox's trajectory, and whether it
	// was recorded earlier and not taken again (then only Ref and Digest
	// are set; Images().Get describes it in full).
	Seq      uint64
	Replayed bool
}

func imageFromProto(p *dsecv1.Image) *Image {
	im := &Image{
		Ref:    p.GetRef(),
		Digest: p.GetDigest(),
		Layers: p.GetLayers(),
		Size:   p.GetSize(),
		Tenant: p.GetTenant(),

		DiskFormat: p.GetDiskFormat(),
	}
	if p.CreatedAt != nil {
		im.CreatedAt = p.CreatedAt.AsTime()
	}
	return im
}

// Images is the image part of the API.
type Images struct{ c *Client }

// Images returns the image API.
func (c *Client) Images() Images { return Images{c} }

// ImportOption changes how an image is imported.
type ImportOption func(*dsecv1.ImportHeader)

// Public makes the imported image visible to every tenant (admin only).
func Public() ImportOption {
	return func(h *dsecv1.ImportHeader) { h.Public = true }
}

// Disk imports one bootable disk file, qcow2 or raw, for backend fullvm
// (dsec image import --disk): it is stored as it is, not built into
// layers. A qcow2 with a backing file or an external data file is refused.
func Disk() ImportOption {
	return func(h *dsecv1.ImportHeader) { h.Disk = true }
}

// importChunk is the upload chunk size: large enough that per-message
// overhead is negligible, small enough to keep memory flat.
const importChunk = 1 << 20

// Import uploads an image as a stream and tags it ref. r yields a rootfs
// tarball (plain, gzip or zstd), an OCI layout or docker-save archive.
func (im Images) Import(ctx context.Context, ref string, r io.Reader, opts ...ImportOption) (*Image, error) {
	h := &dsecv1.ImportHeader{Ref: ref}
	for _, o := range opts {
		o(h)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := im.c.images.Import(ctx)
	fail := func(err error) (*Image, error) {
		return nil, fmt.Errorf("import image %s: %w", ref, err)
	}
	// A Send that returns io.EOF means the server has stopped reading (it
	// refused the import); its reason comes with CloseAndReceive.
	err := stream.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Header{Header: h}})
	buf := make([]byte, importChunk)
	for err == nil {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			err = stream.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Chunk{Chunk: buf[:n]}})
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			cancel()
			return fail(fmt.Errorf("read upload: %w", rerr))
		}
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return fail(err)
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		return fail(err)
	}
	return imageFromProto(resp.Msg.GetImage()), nil
}

// ImportServerPath imports path as it exists on the server's file system
// (directory, rootfs tarball, OCI layout dir or docker-save archive).
func (im Images) ImportServerPath(ctx context.Context, ref, path string, opts ...ImportOption) (*Image, error) {
	h := &dsecv1.ImportHeader{Ref: ref, ServerPath: path}
	for _, o := range opts {
		o(h)
	}
	stream := im.c.images.Import(ctx)
	if err := stream.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Header{Header: h}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("import image %s from server path %s: %w", ref, path, err)
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		return nil, fmt.Errorf("import image %s from server path %s: %w", ref, path, err)
	}
	return imageFromProto(resp.Msg.GetImage()), nil
}

// List returns the images the caller can see.
func (im Images) List(ctx context.Context) ([]*Image, error) {
	resp, err := im.c.images.List(ctx, connect.NewRequest(&dsecv1.ListImagesRequest{}))
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	out := make([]*Image, 0, len(resp.Msg.GetImages()))
	for _, p := range resp.Msg.GetImages() {
		out = append(out, imageFromProto(p))
	}
	return out, nil
}

// Get describes one image.
func (im Images) Get(ctx context.Context, ref string) (*Image, error) {
	resp, err := im.c.images.Get(ctx, connect.NewRequest(&dsecv1.GetImageRequest{Ref: ref}))
	if err != nil {
		return nil, fmt.Errorf("get image %s: %w", ref, err)
	}
	return imageFromProto(resp.Msg.GetImage()), nil
}

// Tag points dst at the image src points at.
func (im Images) Tag(ctx context.Context, src, dst string) (*Image, error) {
	resp, err := im.c.images.Tag(ctx, connect.NewRequest(&dsecv1.TagImageRequest{Src: src, Dst: dst}))
	if err != nil {
		return nil, fmt.Errorf("tag image %s as %s: %w", src, dst, err)
	}
	return imageFromProto(resp.Msg.GetImage()), nil
}

// Delete removes the ref (its layers stay until garbage collection).
func (im Images) Delete(ctx context.Context, ref string) error {
	if _, err := im.c.images.Delete(ctx, connect.NewRequest(&dsecv1.DeleteImageRequest{Ref: ref})); err != nil {
		return fmt.Errorf("delete image %s: %w", ref, err)
	}
	return nil
}

// PullOptions say how Pull stores the image.
type PullOptions struct {
	// Ref is the local NAME:TAG; default the source's repository and tag.
	Ref string
	// Public makes the image visible to every tenant (admin only).
	Public bool
	// Progress, if set, is called as layers are converted.
	Progress func(layersDone, layersTotal int64)
}

// Pulled is what Pull did.
type Pulled struct {
	Image *Image
	// Converted is false when the registry's image had been converted
	// before and nothing was converted.
	Converted bool
	// SourceDigest is the manifest (or index) digest the registry served.
	SourceDigest string
}

// Pull has the server convert the image a registry serves under source
// ([HOST[:PORT]/]REPO[:TAG|@DIGEST]) into the store, once.
func (im Images) Pull(ctx context.Context, source string, o PullOptions) (*Pulled, error) {
	stream, err := im.c.images.Pull(ctx, connect.NewRequest(&dsecv1.PullImageRequest{Source: source, Ref: o.Ref, Public: o.Public}))
	if err != nil {
		return nil, fmt.Errorf("pull image %s: %w", source, err)
	}
	defer stream.Close()
	for stream.Receive() {
		m := stream.Msg()
		if m.GetImage() != nil {
			return &Pulled{Image: imageFromProto(m.GetImage()), Converted: m.GetConverted(), SourceDigest: m.GetSourceDigest()}, nil
		}
		if o.Progress != nil {
			o.Progress(m.GetLayersDone(), m.GetLayersTotal())
		}
	}
	if err := stream.Err(); err != nil {
		return nil, fmt.Errorf("pull image %s: %w", source, err)
	}
	return nil, fmt.Errorf("pull image %s: the server ended the stream without the image", source)
}
