package edge_test

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/memback"
)

// TestPolicyDiskSnapshot: a whole-disk sandbox (a fullvm's; memback's
// here, whose "disk" is a tar of its files) boots the disk image it names,
// and its snapshot is stored as a disk image that a later fullvm sandbox
// boots with what was written before the snapshot; a layered image is
// refused on fullvm naming the field.
func TestPolicyDiskSnapshot(t *testing.T) {
	ctx := t.Context()
	b := newMemback(t, memback.Options{Kind: runtime.KindFullVM, Disk: true})
	store := memStore(t)
	var disk bytes.Buffer
	tw := tar.NewWriter(&disk)
	for name, body := range map[string]string{"etc/motd": "from the disk image\n"} {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(body))
	}
	tw.Close()
	path := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(path, disk.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := image.ImportDisk(ctx, store, image.NewStore(store, store.Refs()), "disk:1", path, 0); err != nil {
		t.Fatal(err)
	}
	n := startMemNode(t, "pds", b, func(c *edge.Config) { c.Store = store })
	a := tenant("a")
	read := func(id, p string) string {
		t.Helper()
		resp, err := n.client.ReadFileOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeReadFileRequest{Caller: a,
			Request: &dsecv1.ReadFileRequest{SandboxId: id, Path: p}}))
		if err != nil {
			t.Fatalf("read %s in %s: %v", p, id, err)
		}
		return string(resp.Msg.Data)
	}

	sb := n.mustCreate(t, a, &dsecv1.SandboxSpec{Image: "disk:1", Backend: string(runtime.KindFullVM)})
	if got := read(sb.Id, "/etc/motd"); got != "from the disk image\n" {
		t.Fatalf("the sandbox did not boot its disk image: /etc/motd = %q", got)
	}
	if _, err := n.client.WriteFileOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeWriteFileRequest{Caller: a,
		Request: &dsecv1.WriteFileRequest{SandboxId: sb.Id, Path: "/root/mark", Data: []byte("snapped")}})); err != nil {
		t.Fatal(err)
	}
	resp, err := n.client.SnapshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{Caller: a,
		Request: &dsecv1.SnapshotRequest{SandboxId: sb.Id, Ref: "disk:snap"}}))
	if err != nil {
		t.Fatal(err)
	}
	if img := resp.Msg.Image; img.DiskFormat != image.DiskRaw || len(img.Layers) != 1 || img.Digest == "" || img.Digest == img.Layers[0] {
		t.Fatalf("snapshot image %+v: want one raw disk layer and the manifest's digest", img)
	}
	sb2 := n.mustCreate(t, a, &dsecv1.SandboxSpec{Image: "disk:snap", Backend: string(runtime.KindFullVM)})
	if got := read(sb2.Id, "/root/mark"); got != "snapped" {
		t.Fatalf("a sandbox from the snapshot lacks what was written: %q", got)
	}
	if got := read(sb2.Id, "/etc/motd"); got != "from the disk image\n" {
		t.Fatalf("a sandbox from the snapshot lacks its disk's files: %q", got)
	}
	_, err = n.create(t, a, &dsecv1.SandboxSpec{Image: memImage, Backend: string(runtime.KindFullVM)})
	wantCode(t, err, connect.CodeInvalidArgument, "spec.image")
}
