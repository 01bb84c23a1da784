package image

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

func TestParseRef(t *testing.T) {
	for _, tc := range []struct {
		in       string
		name     string
		tag      string
		errMatch string
	}{
		{in: "ubuntu", name: "ubuntu", tag: "latest"},
		{in: "ubuntu:22.04", name: "ubuntu", tag: "22.04"},
		{in: "library/python:3.12-slim", name: "library/python", tag: "3.12-slim"},
		{in: "a.b_c__d---e/f:_Tag.X-1", name: "a.b_c__d---e/f", tag: "_Tag.X-1"},
		{in: "ws/swe-bench/django__django-11099:v1", name: "ws/swe-bench/django__django-11099", tag: "v1"},
		{in: "", errMatch: "empty"},
		{in: "Ubuntu", errMatch: "must start and end"},
		{in: "ubUntu", errMatch: "must be lowercase"},
		{in: "a..b", errMatch: `separator ".."`},
		{in: "a___b", errMatch: `separator "___"`},
		{in: "a//b", errMatch: "is empty"},
		{in: "/a", errMatch: "is empty"},
		{in: "a-", errMatch: "must start and end"},
		{in: "ubuntu:", errMatch: "tag is empty"},
		{in: "ubuntu:-x", errMatch: "position 0"},
		{in: "ubuntu:a/b", errMatch: "registry ports"},
		{in: "localhost:5000/x", errMatch: "registry ports"},
		{in: "x@sha256:abc", errMatch: "digest references"},
		{in: "x:" + string(bytes.Repeat([]byte("a"), 129)), errMatch: "longer than 128"},
		{in: string(bytes.Repeat([]byte("a"), 256)), errMatch: "longer than 255"},
	} {
		r, err := ParseRef(tc.in)
		if tc.errMatch != "" {
			assert.ErrorIs(t, err, ErrInvalidRef, tc.in)
			assert.ErrorContains(t, err, tc.errMatch, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		assert.Equal(t, Ref{Name: tc.name, Tag: tc.tag}, r, tc.in)
	}
}

type fixture struct {
	store  *Store
	blobs  blobstore.Repository
	layers map[string]blobstore.Descriptor
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	repo, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	return &fixture{store: NewStore(repo, repo.Refs()), blobs: repo, layers: map[string]blobstore.Descriptor{}}
}

// layer stores a fake layer blob named s (image does not look inside).
func (f *fixture) layer(t *testing.T, s string) blobstore.Descriptor {
	t.Helper()
	if d, ok := f.layers[s]; ok {
		return d
	}
	d, err := f.blobs.Put(context.Background(), bytes.NewReader([]byte("layer "+s)))
	require.NoError(t, err)
	f.layers[s] = d
	return d
}

func (f *fixture) put(t *testing.T, ref string, cfg Config, layers ...string) string {
	t.Helper()
	m := Manifest{Config: cfg, Created: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	for _, l := range layers {
		m.Layers = append(m.Layers, f.layer(t, l))
	}
	d, err := f.store.Put(context.Background(), ref, m)
	require.NoError(t, err)
	return d
}

func TestPutGetTagDelete(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	cfg := Config{Env: []string{"PATH=/usr/bin"}, WorkingDir: "/w", User: "1000", Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-l"}}
	d := f.put(t, "base", cfg, "a", "b")

	m, got, err := f.store.Get(ctx, "base:latest")
	require.NoError(t, err)
	assert.Equal(t, d, got)
	assert.Equal(t, cfg, m.Config)
	assert.Equal(t, []blobstore.Descriptor{f.layer(t, "a"), f.layer(t, "b")}, m.Layers)
	assert.Equal(t, SchemaVersion, m.SchemaVersion)

	// The same manifest under another tag is the same blob.
	d2 := f.put(t, "copy:v1", cfg, "a", "b")
	assert.Equal(t, d, d2)

	_, _, err = f.store.Get(ctx, "foo:bar")
	assert.ErrorIs(t, err, ErrNotFound)
	assert.EqualError(t, err, `image "foo:bar" not found`)

	require.NoError(t, f.store.Tag(ctx, "base", "base:stable"))
	_, got, err = f.store.Get(ctx, "base:stable")
	require.NoError(t, err)
	assert.Equal(t, d, got)
	assert.ErrorIs(t, f.store.Tag(ctx, "nope", "x"), ErrNotFound)

	// Moving a tag.
	d3 := f.put(t, "base", cfg, "a", "c")
	_, got, err = f.store.Get(ctx, "base")
	require.NoError(t, err)
	assert.Equal(t, d3, got)
	assert.NotEqual(t, d, d3)

	require.NoError(t, f.store.Delete(ctx, "base:stable"))
	_, _, err = f.store.Get(ctx, "base:stable")
	assert.ErrorIs(t, err, ErrNotFound)
	assert.ErrorIs(t, f.store.Delete(ctx, "base:stable"), ErrNotFound)

	_, err = f.store.Put(ctx, "Bad", Manifest{})
	assert.ErrorIs(t, err, ErrInvalidRef)
}

// TestManifestCacheIsPrivate: manifests are cached by digest, and what a
// caller gets is its own copy: changing it does not change what the next
// caller (or a Resolve) sees.
func TestManifestCacheIsPrivate(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	cfg := Config{Env: []string{"A=1"}, Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c"}}
	d := f.put(t, "base", cfg, "a", "b")
	first, err := f.store.Manifest(ctx, d)
	require.NoError(t, err)
	first.Config.Env[0] = "A=changed"
	first.Config.Cmd[0] = "changed"
	first.Layers[0].Size = -1
	first.Layers = append(first.Layers[:1], first.Layers...)
	again, _, err := f.store.Get(ctx, "base")
	require.NoError(t, err)
	assert.Equal(t, cfg, again.Config)
	assert.Equal(t, []blobstore.Descriptor{f.layer(t, "a"), f.layer(t, "b")}, again.Layers)
	res, err := f.store.Resolve(ctx, "base", "")
	require.NoError(t, err)
	assert.Equal(t, cfg, res.Config)
}

func TestPutRejectsMissingLayers(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	missing := blobstore.Descriptor{Digest: blobstore.Digest([]byte("nowhere")), Size: 7}
	_, err := f.store.Put(ctx, "x", Manifest{Layers: []blobstore.Descriptor{missing}})
	assert.ErrorIs(t, err, blobstore.ErrNotFound)
	assert.ErrorContains(t, err, "layers[0]")

	wrongSize := f.layer(t, "a")
	wrongSize.Size++
	_, err = f.store.Put(ctx, "x", Manifest{Layers: []blobstore.Descriptor{wrongSize}})
	assert.ErrorContains(t, err, "size")

	_, err = f.store.Put(ctx, "x", Manifest{Layers: []blobstore.Descriptor{{Digest: "sha256:bad"}}})
	assert.ErrorIs(t, err, blobstore.ErrInvalidDigest)

	_, _, err = f.store.Get(ctx, "x")
	assert.ErrorIs(t, err, ErrNotFound, "a failed Put must not tag")
}

func TestList(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	d1 := f.put(t, "lib/py:3", Config{}, "a", "b")
	d2 := f.put(t, "alpha", Config{}, "c")
	list, err := f.store.List(ctx)
	require.NoError(t, err)
	require.Len(t, list, 2)
	assert.Equal(t, "alpha:latest", list[0].Ref)
	assert.Equal(t, d2, list[0].Digest)
	assert.Equal(t, 1, list[0].Layers)
	assert.Equal(t, "lib/py:3", list[1].Ref)
	assert.Equal(t, d1, list[1].Digest)
	assert.Equal(t, 2, list[1].Layers)
	assert.Equal(t, f.layer(t, "a").Size+f.layer(t, "b").Size, list[1].Size)
}

func TestResolve(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	baseCfg := Config{Env: []string{"A=1"}, WorkingDir: "/root"}
	f.put(t, "base:1", baseCfg, "b1", "b2")
	f.put(t, "ws:1", Config{WorkingDir: "/ignored"}, "w1")
	f.put(t, "tk/python:1", Config{}, "py")
	f.put(t, "tk/node:1", Config{}, "node")
	f.put(t, "tk/shares-base:1", Config{}, "b2", "extra")

	names := func(ds []blobstore.Descriptor) []string {
		var out []string
		for _, d := range ds {
			for name, l := range f.layers {
				if l.Digest == d.Digest {
					out = append(out, name)
				}
			}
		}
		return out
	}
	for _, tc := range []struct {
		workspace string
		toolkits  []string
		want      []string
	}{
		{"", nil, []string{"b1", "b2"}},
		{"ws:1", nil, []string{"b1", "b2", "w1"}},
		{"ws:1", []string{"tk/python:1", "tk/node:1"}, []string{"b1", "b2", "w1", "py", "node"}},
		{"", []string{"tk/node:1", "tk/python:1"}, []string{"b1", "b2", "node", "py"}},
		// b2 appears in the base and a toolkit: kept only at its top position.
		{"ws:1", []string{"tk/shares-base:1"}, []string{"b1", "w1", "b2", "extra"}},
	} {
		t.Run(fmt.Sprint(tc.workspace, tc.toolkits), func(t *testing.T) {
			res, err := f.store.Resolve(ctx, "base:1", tc.workspace, tc.toolkits...)
			require.NoError(t, err)
			assert.Equal(t, tc.want, names(res.Layers))
			assert.Equal(t, baseCfg, res.Config)
			assert.Len(t, res.Manifests, 1+len(tc.toolkits)+map[bool]int{true: 1}[tc.workspace != ""])
		})
	}

	_, err := f.store.Resolve(ctx, "base:1", "", "tk/missing:1")
	assert.ErrorIs(t, err, ErrNotFound)
	assert.ErrorContains(t, err, `image "tk/missing:1" not found`)
	_, err = f.store.Resolve(ctx, "", "")
	assert.ErrorContains(t, err, "base image is required")
}
