package vmimage_test

import (
	"context"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/cavaliergopher/cpio"

	"github.com/dsec-dev/dsec/internal/runtime/microvm/vmimage"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// TestEnsure fetches (or finds in the cache) the kernel and checks the
// initramfs: the agent as /init, every module of Modules, each after the
// modules it depends on.
func TestEnsure(t *testing.T) {
	testutil.RequireRoot(t)
	agentBin := testutil.BuildBinary(t, "./cmd/dsec-agent")
	img, err := vmimage.Ensure(context.Background(), vmimage.Options{AgentPath: agentBin})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(img.Kernel); err != nil {
		t.Fatal(err)
	}
	again, err := vmimage.Ensure(context.Background(), vmimage.Options{AgentPath: agentBin})
	if err != nil || *again != *img {
		t.Fatalf("second Ensure: %+v, %v; want %+v (cached)", again, err, img)
	}
	f, err := os.Open(img.Initrd)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	agent, _ := os.ReadFile(agentBin)
	r := cpio.NewReader(f)
	files := map[string]int64{}
	var dep string
	for {
		h, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = h.Size
		if h.Name == "lib/modules/modules.dep" {
			b, _ := io.ReadAll(r)
			dep = string(b)
		}
	}
	if files["init"] != int64(len(agent)) {
		t.Errorf("/init is %d bytes, the agent %d", files["init"], len(agent))
	}
	loaded := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(dep), "\n") {
		name, rest, _ := strings.Cut(line, ":")
		for _, d := range strings.Fields(rest) {
			if !loaded[d] {
				t.Errorf("modules.dep: %s comes before its dependency %s", name, d)
			}
		}
		if files["lib/modules/"+name+".ko"] == 0 {
			t.Errorf("modules.dep names %s, the archive lacks it", name)
		}
		loaded[name] = true
	}
	for _, m := range vmimage.Modules {
		if !loaded[m] {
			t.Errorf("module %s missing", m)
		}
	}
}
