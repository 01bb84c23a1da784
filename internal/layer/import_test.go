package layer

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/image"
)

// Two layers: the lower has a file, a directory with content and a file to
// keep; the upper whites out the file and makes the directory opaque.
var (
	lowerLayer = []tarEntry{
		{name: "gone", typ: tar.TypeReg, body: "deleted above"},
		{name: "keep", typ: tar.TypeReg, body: "kept"},
		{name: "dir/", typ: tar.TypeDir},
		{name: "dir/old", typ: tar.TypeReg, body: "hidden by opaque"},
		{name: "dir/sub/", typ: tar.TypeDir},
		{name: "dir/sub/older", typ: tar.TypeReg, body: "hidden too"},
		{name: "other/", typ: tar.TypeDir},
		{name: "other/x", typ: tar.TypeReg, body: "x"},
	}
	upperLayer = []tarEntry{
		{name: ".wh.gone", typ: tar.TypeReg},
		{name: "dir/", typ: tar.TypeDir},
		{name: "dir/.wh..wh..opq", typ: tar.TypeReg},
		{name: "dir/new", typ: tar.TypeReg, body: "added above"},
		{name: "other/.wh.x", typ: tar.TypeReg},
		{name: "added", typ: tar.TypeReg, body: "new file"},
	}
)

// checkMerged asserts the overlay of lowerLayer and upperLayer.
func checkMerged(t *testing.T, merged string) {
	t.Helper()
	got := snapshot(t, merged)
	assert.ElementsMatch(t, []string{".", "keep", "dir", "dir/new", "other", "added"}, keys(got), describe(got))
	assert.Equal(t, "kept", got["keep"].Content)
	assert.Equal(t, "added above", got["dir/new"].Content)
}

func TestWhiteoutsComposeInOverlay(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	lower, err := buildFromTar(ctx, e.repo, bytes.NewReader(makeTar(t, lowerLayer)), nil)
	require.NoError(t, err)
	upper, err := buildFromTar(ctx, e.repo, bytes.NewReader(makeTar(t, upperLayer)), nil)
	require.NoError(t, err)

	// The upper layer on its own holds overlay-style whiteouts.
	up := snapshot(t, e.mount(t, upper))
	assert.Equal(t, uint32(0o020000), up["gone"].Mode, "a 0:0 character device, mode 0")
	assert.Zero(t, up["gone"].Rdev)
	assert.Equal(t, map[string]string{opaqueXattr: "y"}, up["dir"].Xattrs)
	assert.NotContains(t, up, "dir/.wh..wh..opq")
	assert.NotContains(t, up, ".wh.gone")

	checkMerged(t, overlay(t, e.mount(t, lower), e.mount(t, upper)))
}

// testImage builds a two-layer OCI image (with whiteouts in layer 2) and a
// config, the way a registry image would look.
func testImage(t *testing.T) v1.Image {
	t.Helper()
	var layers []v1.Layer
	for _, entries := range [][]tarEntry{lowerLayer, upperLayer} {
		b := makeTar(t, entries)
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(b)), nil
		})
		require.NoError(t, err)
		layers = append(layers, l)
	}
	img, err := mutate.AppendLayers(empty.Image, layers...)
	require.NoError(t, err)
	img, err = mutate.Config(img, v1.Config{
		Env:        []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"},
		WorkingDir: "/work",
		User:       "1000:1000",
		Entrypoint: []string{"/bin/sh", "-c"},
		Cmd:        []string{"echo hi"},
	})
	require.NoError(t, err)
	img, err = mutate.CreatedAt(img, v1.Time{Time: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)})
	require.NoError(t, err)
	return img
}

func TestImportOCIAndDockerSave(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	img := testImage(t)

	ociDir := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(ociDir, empty.Index)
	require.NoError(t, err)
	require.NoError(t, p.AppendImage(img))

	dockerTar := filepath.Join(t.TempDir(), "image.tar")
	tag, err := name.NewTag("example/app:v1")
	require.NoError(t, err)
	require.NoError(t, tarball.WriteToFile(dockerTar, tag, img))

	wantCfg := image.Config{
		Env:        []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"},
		WorkingDir: "/work",
		User:       "1000:1000",
		Entrypoint: []string{"/bin/sh", "-c"},
		Cmd:        []string{"echo hi"},
	}
	var layerSets [][]blobstore.Descriptor
	for _, tc := range []struct {
		path string
		kind Kind
		ref  string
	}{
		{ociDir, KindOCILayout, "app/oci:v1"},
		{dockerTar, KindDockerSave, "app/docker:v1"},
	} {
		t.Run(string(tc.kind), func(t *testing.T) {
			kind, err := Detect(tc.path)
			require.NoError(t, err)
			require.Equal(t, tc.kind, kind)
			var calls []int64
			m, err := Import(ctx, e.repo, e.images, tc.ref, tc.path, func(done, total int64) {
				assert.Equal(t, int64(2), total)
				calls = append(calls, done)
			})
			require.NoError(t, err)
			assert.Equal(t, []int64{0, 1, 2}, calls)
			require.Len(t, m.Layers, 2)
			assert.Equal(t, wantCfg, m.Config)
			assert.Equal(t, time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC), m.Created)

			stored, _, err := e.images.Get(ctx, tc.ref)
			require.NoError(t, err)
			assert.Equal(t, m.Layers, stored.Layers)
			checkMerged(t, overlay(t, e.mount(t, m.Layers[0]), e.mount(t, m.Layers[1])))
			layerSets = append(layerSets, m.Layers)
		})
	}
	require.Len(t, layerSets, 2)
	assert.Equal(t, layerSets[0], layerSets[1], "the same OCI layers become the same EROFS layers")
	var n int
	require.NoError(t, e.repo.Walk(ctx, func(blobstore.Descriptor) error { n++; return nil }))
	assert.Equal(t, 3, n, "two shared layers and one manifest (both tags point at identical manifests)")
}

func TestImportDirectory(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	src := makeTree(t)
	kind, err := Detect(src)
	require.NoError(t, err)
	assert.Equal(t, KindDir, kind)
	m, err := Import(ctx, e.repo, e.images, "dir-image", src, nil)
	require.NoError(t, err)
	require.Len(t, m.Layers, 1)
	_, _, err = e.images.Get(ctx, "dir-image:latest")
	require.NoError(t, err)
	assert.Equal(t, "kept", snapshot(t, e.mount(t, m.Layers[0]))["etc-file"].Xattrs["user.note"])
}

func TestImportBadInput(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.tar")
	require.NoError(t, os.WriteFile(garbage, bytes.Repeat([]byte("not a tar "), 100), 0o644))
	var truncated bytes.Buffer
	gzipInto(t, &truncated, makeTar(t, rootfsEntries()))
	broken := filepath.Join(dir, "broken.tar.gz")
	require.NoError(t, os.WriteFile(broken, truncated.Bytes()[:truncated.Len()/2], 0o644))
	badOCI := filepath.Join(dir, "bad-oci")
	require.NoError(t, os.MkdirAll(badOCI, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(badOCI, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644))

	for _, tc := range []struct {
		ref, path, want string
	}{
		{"x", filepath.Join(dir, "missing"), "missing"},
		{"x", garbage, "not a directory, tar, tar.gz or tar.zst file"},
		{"x", broken, "broken.tar.gz"},
		{"x", badOCI, "bad-oci (oci-layout)"},
		{"Bad:Ref", garbage, "invalid image reference"},
	} {
		_, err := Import(ctx, e.repo, e.images, tc.ref, tc.path, nil)
		assert.ErrorContains(t, err, tc.want, tc.path)
		_, _, err = e.images.Get(ctx, "x")
		assert.ErrorIs(t, err, image.ErrNotFound, "failed import must not tag")
	}
	left, err := os.ReadDir(e.repo.TempDir())
	require.NoError(t, err)
	assert.Empty(t, left, "a failed import leaves no temp files")
	var n int
	require.NoError(t, e.repo.Walk(ctx, func(blobstore.Descriptor) error { n++; return nil }))
	assert.Zero(t, n)
}
