package layer

import (
	"context"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"net/http"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// countingTransport counts the registry's blob downloads.
type countingTransport struct{ blobs atomic.Int64 }

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.Contains(r.URL.Path, "/blobs/") && r.Method == http.MethodGet {
		c.blobs.Add(1)
	}
	return http.DefaultTransport.RoundTrip(r)
}

// TestPull pulls an image from go-containerregistry's in-process registry
// (a host with a port, plain HTTP on loopback): its two layers become
// EROFS layers identical to an import of the same image, the manifest
// records the registry's digest, a second pull of an unchanged tag fetches
// no blob and converts nothing (under another local name too), and a pull
// after the tag moved converts again.
func TestPull(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	srv := httptest.NewServer(registry.New())
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	src := host + "/example/app:v1"
	tag, err := name.NewTag(src)
	require.NoError(t, err)
	img := testImage(t)
	require.NoError(t, remote.Write(tag, img))
	regDigest, err := img.Digest()
	require.NoError(t, err)

	r, err := ParseRemote(src)
	require.NoError(t, err)
	assert.Equal(t, "example/app:v1", DefaultName(r))

	tr := &countingTransport{}
	var calls []int64
	res, err := Pull(ctx, e.repo, e.images, "example/app:v1", src, func(done, total int64) {
		assert.Equal(t, int64(2), total)
		calls = append(calls, done)
	}, PullTransport(tr))
	require.NoError(t, err)
	assert.True(t, res.Converted)
	assert.Equal(t, []int64{0, 1, 2}, calls)
	assert.Equal(t, regDigest.String(), res.SourceDigest)
	assert.Equal(t, src, res.Source)
	require.Len(t, res.Manifest.Layers, 2)
	assert.Equal(t, "/work", res.Manifest.Config.WorkingDir)
	checkMerged(t, overlay(t, e.mount(t, res.Manifest.Layers[0]), e.mount(t, res.Manifest.Layers[1])))
	stored, _, err := e.images.Get(ctx, "example/app:v1")
	require.NoError(t, err)
	assert.Equal(t, regDigest.String(), stored.Annotations[AnnotationSourceDigest])
	fetched := tr.blobs.Load()
	assert.GreaterOrEqual(t, fetched, int64(3), "config and two layers fetched")
	blobs := len(walk(t, e.repo))

	for _, local := range []string{"example/app:v1", "other:name"} {
		res2, err := Pull(ctx, e.repo, e.images, local, src, nil, PullTransport(tr))
		require.NoError(t, err, local)
		assert.False(t, res2.Converted, "%s: an unchanged image was converted again", local)
		assert.Equal(t, res.Manifest.Layers, res2.Manifest.Layers, local)
		assert.Equal(t, fetched, tr.blobs.Load(), "%s: a pull of an unchanged image fetched blobs", local)
	}
	assert.Len(t, walk(t, e.repo), blobs, "no new blob for an image already converted")
	_, _, err = e.images.Get(ctx, "other:name")
	require.NoError(t, err)

	// The tag moves to an image with a third layer: converted again, the
	// two layers it shares are the same EROFS layers.
	layers, err := img.Layers()
	require.NoError(t, err)
	img2, err := mutate.AppendLayers(img, layers[0])
	require.NoError(t, err)
	require.NoError(t, remote.Write(tag, img2))
	res3, err := Pull(ctx, e.repo, e.images, "example/app:v1", src, nil, PullTransport(tr))
	require.NoError(t, err)
	assert.True(t, res3.Converted)
	require.Len(t, res3.Manifest.Layers, 3)
	assert.Equal(t, res.Manifest.Layers, res3.Manifest.Layers[:2])
}

func TestPullRefused(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	srv := httptest.NewServer(registry.New())
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	_, err := Pull(ctx, e.repo, e.images, "x:1", host+"/no/such:image", nil)
	assert.ErrorContains(t, err, "no/such")
	_, err = Pull(ctx, e.repo, e.images, "Bad Name", host+"/a:b", nil)
	assert.Error(t, err)
	_, err = Pull(ctx, e.repo, e.images, "x:1", "UPPER/case::", nil)
	assert.Error(t, err)
	assert.Empty(t, walk(t, e.repo))
}

func walk(t *testing.T, s blobstore.Store) []blobstore.Descriptor {
	t.Helper()
	var all []blobstore.Descriptor
	require.NoError(t, s.Walk(context.Background(), func(d blobstore.Descriptor) error {
		all = append(all, d)
		return nil
	}))
	return all
}
