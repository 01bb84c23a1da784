package controlplane

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// uploadDisk imports data as a disk image (dsec image import --disk).
func (c *cluster) uploadDisk(token, ref string, data []byte) (*dsecv1.Image, error) {
	st := c.clients.img.Import(context.Background())
	st.RequestHeader().Set("Authorization", "Bearer "+token)
	if err := st.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Header{Header: &dsecv1.ImportHeader{Ref: ref, Disk: true}}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	if err := st.Send(&dsecv1.ImportImageRequest{Part: &dsecv1.ImportImageRequest_Chunk{Chunk: data}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	resp, err := st.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetImage(), nil
}

// TestDiskImages: a disk image imports as one blob with its format, a
// qcow2 that names a host file is refused, and a create that puts a disk
// image on a layered backend, or a layered image on fullvm, is refused
// as InvalidArgument naming the spec's field, before any node is asked.
func TestDiskImages(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed (scripts/deps.sh)")
	}
	c := newMemCluster(t)
	tok := c.createTenant("vm", nil)

	raw := make([]byte, 1<<20)
	im, err := c.uploadDisk(tok, "disk:raw", raw)
	if err != nil {
		t.Fatal(err)
	}
	if im.GetDiskFormat() != "raw" || len(im.GetLayers()) != 1 || im.GetSize() != int64(len(raw)) {
		t.Fatalf("imported raw disk: %v, want disk_format raw, one layer of %d bytes", im, len(raw))
	}

	dir := t.TempDir()
	base, backed := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "backed.qcow2")
	for _, args := range [][]string{
		{"create", "-q", "-f", "qcow2", base, "16M"},
		{"create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, backed},
	} {
		if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %q: %v: %s", args, err, out)
		}
	}
	q, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	if im, err := c.uploadDisk(tok, "disk:qcow2", q); err != nil || im.GetDiskFormat() != "qcow2" {
		t.Fatalf("imported qcow2 disk: %v, %v; want disk_format qcow2", im, err)
	}
	b, err := os.ReadFile(backed)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.uploadDisk(tok, "disk:backed", b)
	wantCode(t, err, connect.CodeInvalidArgument, "backing file")

	_, err = c.create(tok, &dsecv1.SandboxSpec{Image: "disk:raw"})
	wantCode(t, err, connect.CodeInvalidArgument, "spec.image")
	_, err = c.create(tok, &dsecv1.SandboxSpec{Image: memImage, Toolkits: []string{"disk:raw"}})
	wantCode(t, err, connect.CodeInvalidArgument, "spec.toolkits[0]")
	_, err = c.create(tok, &dsecv1.SandboxSpec{Backend: "fullvm", Image: memImage})
	wantCode(t, err, connect.CodeInvalidArgument, "spec.image")
	_, err = c.create(tok, &dsecv1.SandboxSpec{Backend: "fullvm", Image: "disk:raw", Workspace: memImage})
	wantCode(t, err, connect.CodeInvalidArgument, "spec.workspace")
}
