package main

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

// fakeImport records what an import sent.
type fakeImport struct {
	dsecv1connect.UnimplementedImageServiceHandler
	header *dsecv1.ImportHeader
	data   []byte
}

func (f *fakeImport) Import(_ context.Context, st *connect.ClientStream[dsecv1.ImportImageRequest]) (*connect.Response[dsecv1.ImportImageResponse], error) {
	for st.Receive() {
		if h := st.Msg().GetHeader(); h != nil {
			f.header = h
		}
		f.data = append(f.data, st.Msg().GetChunk()...)
	}
	return connect.NewResponse(&dsecv1.ImportImageResponse{Image: &dsecv1.Image{Ref: f.header.GetRef(), Digest: "sha256:00", DiskFormat: "raw"}}), nil
}

// TestImageImportDisk: --disk uploads the file as it is with the header's
// disk flag set; a directory is refused before anything is sent.
func TestImageImportDisk(t *testing.T) {
	f := &fakeImport{}
	url := fakeServer(t, func() (string, http.Handler) { return dsecv1connect.NewImageServiceHandler(f) })
	disk := filepath.Join(t.TempDir(), "disk.raw")
	want := bytes.Repeat([]byte{0xd5}, 3<<20)
	if err := os.WriteFile(disk, want, 0o644); err != nil {
		t.Fatal(err)
	}
	out, msg, code := runCLIStdio(t, "", "--endpoint", url, "--token", "t", "image", "import", "--disk", "-q", "vm:1", disk)
	if code != 0 {
		t.Fatalf("image import --disk: exit %d: %s %s", code, out, msg)
	}
	if !f.header.GetDisk() || f.header.GetRef() != "vm:1" || !bytes.Equal(f.data, want) {
		t.Errorf("import sent header %v and %d bytes; want disk set and the file's %d bytes", f.header, len(f.data), len(want))
	}
	f.header = nil
	_, msg, code = runCLIStdio(t, "", "--endpoint", url, "--token", "t", "image", "import", "--disk", "vm:2", t.TempDir())
	if code == 0 || f.header != nil {
		t.Errorf("image import --disk of a directory: exit %d, sent %v: %s", code, f.header, msg)
	}
}
