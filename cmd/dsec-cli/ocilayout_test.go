package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/dsec-dev/dsec/internal/layer"
)

// go-containerregistry is linked into this test only: it writes the OCI
// layouts, and reads the archives back the way the server does
// (internal/layer opens a docker-save upload with tarball.ImageFromPath).

// writeLayout writes images into a fresh OCI layout and returns its path.
func writeLayout(t *testing.T, add func(p layout.Path) error) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := add(p); err != nil {
		t.Fatal(err)
	}
	return dir
}

func randomImage(t *testing.T, layers int64) v1.Image {
	t.Helper()
	img, err := random.Image(2048, layers)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func TestWriteDockerSaveRoundTrip(t *testing.T) {
	img := randomImage(t, 3)
	// The same layer twice, as images with repeated empty layers have.
	first, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.AppendLayers(img, first[0])
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.Config(img, v1.Config{Env: []string{"A=1"}, WorkingDir: "/work", Cmd: []string{"sh"}})
	if err != nil {
		t.Fatal(err)
	}
	dir := writeLayout(t, func(p layout.Path) error { return p.AppendImage(img) })

	archive := filepath.Join(t.TempDir(), "image.tar")
	f, err := os.Create(archive)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeDockerSave(dir, "app:v1", f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}

	if kind, err := layer.Detect(archive); err != nil || kind != layer.KindDockerSave {
		t.Fatalf("the server would see %q (%v), want %q", kind, err, layer.KindDockerSave)
	}
	got, err := tarball.ImageFromPath(archive, nil)
	if err != nil {
		t.Fatalf("read back: %v", err)
	}
	wantCfg, _ := img.RawConfigFile()
	gotCfg, err := got.RawConfigFile()
	if err != nil || !bytes.Equal(gotCfg, wantCfg) {
		t.Errorf("config %s (%v), want %s", gotCfg, err, wantCfg)
	}
	wantLayers, _ := img.Layers()
	gotLayers, err := got.Layers()
	if err != nil || len(gotLayers) != len(wantLayers) {
		t.Fatalf("%d layers (%v), want %d", len(gotLayers), err, len(wantLayers))
	}
	for i := range wantLayers {
		wd, _ := wantLayers[i].Digest()
		gd, err := gotLayers[i].Digest()
		if err != nil || gd != wd {
			t.Errorf("layer %d digest %s (%v), want %s", i, gd, err, wd)
		}
		wdiff, _ := wantLayers[i].DiffID()
		gdiff, err := gotLayers[i].DiffID()
		if err != nil || gdiff != wdiff {
			t.Errorf("layer %d diff id %s (%v), want %s", i, gdiff, err, wdiff)
		}
	}
}

func TestWriteDockerSaveRefuses(t *testing.T) {
	twoImages := writeLayout(t, func(p layout.Path) error {
		if err := p.AppendImage(randomImage(t, 1)); err != nil {
			return err
		}
		return p.AppendImage(randomImage(t, 1))
	})
	idx, err := random.Index(1024, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	nested := writeLayout(t, func(p layout.Path) error { return p.AppendIndex(idx) })

	// A layout whose index names a blob outside blobs/.
	escaping := writeLayout(t, func(p layout.Path) error { return p.AppendImage(randomImage(t, 1)) })
	rewriteJSON(t, filepath.Join(escaping, "index.json"), func(m map[string]any) {
		m["manifests"].([]any)[0].(map[string]any)["digest"] = "sha256:../../../etc/passwd"
	})

	// A layout with a truncated layer blob.
	short := writeLayout(t, func(p layout.Path) error { return p.AppendImage(randomImage(t, 1)) })
	truncateLayer(t, short)

	for _, tc := range []struct {
		name, dir, want string
	}{
		{"two images", twoImages, "holds 2 manifests; import it with --server-path"},
		{"index of indexes", nested, "index of several images; import it with --server-path"},
		{"bad digest", escaping, `malformed digest "sha256:../../../etc/passwd"`},
		{"truncated blob", short, "the manifest says"},
		{"no index", t.TempDir(), "index.json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			err := writeDockerSave(tc.dir, "app:v1", &buf)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.dir) {
				t.Errorf("error %v, want one naming %s and saying %q", err, tc.dir, tc.want)
			}
		})
	}
}

func rewriteJSON(t *testing.T, path string, edit func(map[string]any)) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// truncateLayer cuts the first layer blob of the layout's one image short.
func truncateLayer(t *testing.T, dir string) {
	t.Helper()
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	ii, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	im, err := ii.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	img, err := ii.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, err := ls[0].Digest()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(dir, "blobs", d.Algorithm, d.Hex), 10); err != nil {
		t.Fatal(err)
	}
}
