package container_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// TestInodesManyLayers: readdir's inode numbers are lstat's, and every
// file has the overlay's st_dev, over several layers whose directories
// merge (/etc and /multi come from all of them). Every layer.Build image
// has the same file system UUID, with which overlay's xino=auto would fall
// back to xino=off past one layer; the conformance suite's image has one.
func TestInodesManyLayers(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	layers := []rt.Layer{e.layer}
	for i := range 4 {
		n := strconv.Itoa(i)
		layers = append(layers, e.buildLayer(t, map[string]string{"etc/layer" + n: n, "multi/f" + n: n, "multi/d" + n + "/f": n}))
	}
	spec := e.newSpec()
	spec.Layers = layers
	sb, err := e.backend.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	probe, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/infoprobe"))
	if err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		if err := sb.WriteFile(ctx, "/tmp/infoprobe", probe, 0o755); err != nil {
			t.Fatal(err)
		}
		sh(t, sb, "echo x > /multi/f0 && mkdir /multi/new && touch /etc/layer3")
		out := strings.TrimSpace(sh(t, sb, "/tmp/infoprobe inodes / /etc /multi /multi/d1 /multi/d3 /bin"))
		if !strings.HasPrefix(out, "checked ") {
			t.Errorf("%s: readdir and lstat disagree over %d layers:\n%s", when, len(layers), out)
		}
	}
	check("fresh sandbox")
	reset(t, sb)
	check("after Reset")
}
