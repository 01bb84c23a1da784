package edge_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
)

// fnImages stores n images of the busybox base plus a small layer of
// their own each (so each has its own fncall pool) and returns their refs.
func fnImages(t *testing.T, w *world, n int) []string {
	t.Helper()
	images := image.NewStore(w.store, w.store.Refs())
	base, _, err := images.Get(t.Context(), baseImage)
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for i := range n {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "which"), []byte(fmt.Sprint(i)), 0o644); err != nil {
			t.Fatal(err)
		}
		d, err := layer.Build(t.Context(), w.store, dir)
		if err != nil {
			t.Fatal(err)
		}
		m := base
		m.Layers = append(append(m.Layers[:0:0], base.Layers...), d)
		ref := fmt.Sprintf("fnimg-%d:1", i)
		if _, err := images.Put(t.Context(), ref, m); err != nil {
			t.Fatal(err)
		}
		refs = append(refs, ref)
	}
	return refs
}

func (n *node) runCodeIn(ctx context.Context, img, code string) (*dsecv1.RunCodeResponse, error) {
	resp, err := n.client.RunCodeOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRunCodeRequest{
		Caller: tenant("a"), Request: &dsecv1.RunCodeRequest{Language: "sh", Code: code}, Image: img,
	}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// TestFnPoolsBounded: fncall sandboxes are charged to no tenant and to no
// capacity, and a call may name any image, so the node keeps pools for at
// most Config.FnPools images: a call for another image closes the least
// recently used idle pool, and is Unavailable when every pool is busy.
func TestFnPoolsBounded(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "fnb", func(c *edge.Config) { c.FnWarm, c.FnMax, c.FnPools = 1, 1, 2 })
	imgs := fnImages(t, w, 3)
	for _, img := range imgs {
		res, err := n.runCodeIn(t.Context(), img, "cat /which")
		if err != nil || res.Status != "Success" {
			t.Fatalf("call in %s: %v, %v", img, res, err)
		}
		if got := len(n.edge.FnPoolsInUse()); got > 2 {
			t.Fatalf("after a call in %s the node keeps %d fncall pools, want at most 2", img, got)
		}
	}

	// Both pools busy (imgs[1] and imgs[2]): a call for a third image is
	// refused rather than growing the node's fncall sandboxes.
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for _, img := range imgs[1:] {
		wg.Go(func() {
			if res, err := n.runCodeIn(ctx, img, "sleep 5"); err != nil || res.Status != "Success" {
				t.Errorf("long call in %s: %v, %v", img, res, err)
			}
		})
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		busy := 0
		for _, u := range n.edge.FnPoolsInUse() {
			if u > 0 {
				busy++
			}
		}
		if busy == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the two long calls did not both start: in use %v", n.edge.FnPoolsInUse())
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, err := n.runCodeIn(ctx, imgs[0], "true")
	wantCode(t, err, connect.CodeUnavailable, "busy")
	wg.Wait()
}
