package e2e

import (
	"archive/tar"
	"bytes"
	"io"
	"io/fs"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	ggmutate "github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// startRegistry runs go-containerregistry's in-process registry with the
// busybox rootfs pushed as HOST:PORT/tools/busybox:v1, and returns that
// reference.
func startRegistry(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(registry.New())
	t.Cleanup(srv.Close)
	ref := strings.TrimPrefix(srv.URL, "http://") + "/tools/busybox:v1"
	// Tarred once: the library opens the layer several times (digest,
	// size, upload) and each must give the same bytes.
	b, err := tarTree(busyboxRootfs(t))
	if err != nil {
		t.Fatal(err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(b)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	img, err := ggmutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, img); err != nil {
		t.Fatal(err)
	}
	return ref
}

// tarTree tars a directory of regular files, directories and symlinks.
func tarTree(root string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if d.Type()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		hdr.Name = rel
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = io.Copy(tw, f)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return buf.Bytes(), tw.Close()
}

// TestImagePull pulls an image from a registry on a host with a port (the
// in-process registry on loopback) through `dsec image pull`: converted
// once and run; pulled again, nothing is converted; a tenant may not make
// the server reach a loopback registry.
func TestImagePull(t *testing.T) {
	bins := build(t)
	c, _ := startUp(t, bins)
	testPull(t, c, startRegistry(t))
}

func testPull(t *testing.T, c cli, ref string) {
	t.Helper()
	out := c.ok(t, "image", "pull", "-q", ref)
	if !strings.HasPrefix(out, "tools/busybox:v1 sha256:") || !strings.Contains(out, "(converted, from sha256:") {
		t.Fatalf("image pull printed %q", out)
	}
	if got := c.ok(t, "run", "--image", "tools/busybox:v1", "--", "echo", "pulled"); got != "pulled" {
		t.Fatalf("run of the pulled image printed %q", got)
	}
	again := c.ok(t, "image", "pull", ref, "copy:1")
	if !strings.HasPrefix(again, "copy:1 ") || !strings.Contains(again, "(up to date,") {
		t.Fatalf("a second pull of an unchanged image printed %q", again)
	}
	if strings.Fields(again)[1] != strings.Fields(out)[1] {
		t.Fatalf("the second pull made another manifest: %q then %q", out, again)
	}

	tok := c.ok(t, "tenant", "create", "puller")
	tenant := cli{bin: c.bin, endpoint: c.endpoint, token: tok}
	r := tenant.run(t, nil, "image", "pull", ref)
	if r.code == 0 || !strings.Contains(r.stderr, "admin only") {
		t.Fatalf("a tenant's pull from a loopback registry: %+v, want refused", r)
	}
	if r := c.run(t, nil, "image", "pull", "Not A Ref"); r.code == 0 {
		t.Fatalf("pull of a bad reference: %+v", r)
	}
}
