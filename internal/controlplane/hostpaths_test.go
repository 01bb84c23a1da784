package controlplane

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/redact"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// Errors a caller gets do not name host paths: a refused import said
// where the server spooled and extracted the upload
// (/var/lib/dsec/blobs/tmp/upload-…, extract-…), and an edge failing on its
// layers names its blob store; the caller hears what was wrong instead.
func TestNoHostPathsInErrors(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 8000, MemoryBytes: 8 << 30, Sandboxes: 4}, placement.Share{})
	alice := c.createTenant("alice", nil)
	host := func(t *testing.T, what string, err error, mention string) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: no error", what)
		}
		if strings.Contains(err.Error(), c.root) || strings.Contains(err.Error(), "/tmp/") {
			t.Errorf("%s: %q names a host path", what, err)
		}
		if !strings.Contains(err.Error(), mention) {
			t.Errorf("%s: %q does not say %q", what, err, mention)
		}
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte("not a tar inside"))
	zw.Close()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	tw.WriteHeader(&tar.Header{Name: "a", Typeflag: tar.TypeSymlink, Linkname: "/etc"})
	tw.WriteHeader(&tar.Header{Name: "a/b", Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.Close()
	for _, tc := range []struct {
		name    string
		data    []byte
		mention string
	}{
		{"not an archive", []byte("not an archive at all"), "not a directory, tar"},
		{"gzip of garbage", gz.Bytes(), "read tar"},
		{"entry under a symlink", tb.Bytes(), `entry "a/b"`},
	} {
		_, err := c.upload(alice, "x:1", false, tc.data)
		wantCode(t, err, connect.CodeInvalidArgument, "")
		host(t, "import of "+tc.name, err, tc.mention)
	}

	// An edge whose blob store lost a layer file.
	img, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t))
	if err != nil {
		t.Fatal(err)
	}
	hex := strings.TrimPrefix(img.GetLayers()[0], "sha256:")
	blob := filepath.Join(c.store.Root(), "blobs", "sha256", hex)
	// A layer file that is no EROFS image: the node fails to mount it
	// under its data dir, and says so without the path.
	os.Chmod(blob, 0o644)
	if err := os.WriteFile(blob, []byte("not an erofs image"), 0o444); err != nil {
		t.Fatal(err)
	}
	_, err = c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1"})
	host(t, "create over a broken layer", err, "")
	for _, sb := range c.list(c.admin, nil) {
		if strings.Contains(sb.GetReason(), c.root) {
			t.Errorf("sandbox %s's reason %q names a host path", sb.GetId(), sb.GetReason())
		}
	}
	if err := os.Remove(blob); err != nil {
		t.Fatal(err)
	}
	_, err = c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1"})
	host(t, "create over a missing layer", err, "layer")
	if !strings.Contains(err.Error(), redact.Placeholder) && !strings.Contains(err.Error(), hex) {
		t.Errorf("create over a missing layer: %q says nothing of the layer", err)
	}
}
