package microvm_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge/snapshot"
	"github.com/dsec-dev/dsec/internal/layer"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container/containertest"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// changes is what each sandbox does to its file system before its
// writable layer is packed: a new file, a new directory tree, a changed
// base file, a removed base file (a whiteout), and a directory of the
// base replaced by a new one (an opaque directory).
const changes = `set -e
echo "from $1" > /newfile
mkdir -p /d/e && echo deep > /d/e/f
echo "10.0.0.1 changed" >> /etc/hosts
rm /etc/group
rm -rf /home && mkdir /home && echo only > /home/only
`

// check verifies the changes inside a sandbox built from the packed layer.
const check = `set -e
test "$(cat /newfile)" = "from $1"
test "$(cat /d/e/f)" = deep
grep -q changed /etc/hosts && grep -q localhost /etc/hosts
test ! -e /etc/group
test "$(ls /home)" = only
test -e /etc/passwd
echo ok
`

// TestSnapshotAcrossBackends packs a microVM's writable layer (the guest
// agent's tar stream, unpacked on the host by the edge's snapshot code)
// into a layer that a container sandbox runs, and a container's writable
// layer into one a microVM runs.
func TestSnapshotAcrossBackends(t *testing.T) {
	mv := newEnv(t)
	c, err := containertest.New(t, "dmvc-", testsuite.BusyboxRootfs(t))
	if c != nil {
		t.Cleanup(c.Close)
	}
	if err != nil {
		t.Fatal(err)
	}
	store, err := blobstore.NewDir(filepath.Join(c.Root, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	snaps, err := snapshot.Open(t.TempDir(), slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	base := c.Layer

	run := func(sb rt.Sandbox, script, arg string) string {
		t.Helper()
		res, err := sb.Exec(ctx, rt.ExecRequest{Argv: []string{"/bin/sh", "-c", script, "sh", arg}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode != 0 {
			t.Fatalf("%s in %s: exit %d, stdout %q, stderr %q", strings.SplitN(script, "\n", 2)[0], sb.ID(), res.ExitCode, res.Stdout, res.Stderr)
		}
		return string(res.Stdout)
	}
	pack := func(sb rt.Sandbox) rt.Layer {
		t.Helper()
		var l rt.Layer
		err := snaps.WithWritableLayer(ctx, sb.ID(), sb, false, func(dir string) error {
			desc, err := layer.Build(ctx, store, dir)
			if err != nil {
				return err
			}
			p, err := store.Path(desc.Digest)
			l = rt.Layer{Digest: desc.Digest, Path: p}
			return err
		})
		if err != nil {
			t.Fatalf("pack %s: %v", sb.ID(), err)
		}
		return l
	}

	// microVM → container.
	vm, err := mv.backend.Create(ctx, rt.Spec{ID: "snapvm1", Layers: []rt.Layer{base}})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Destroy(ctx)
	run(vm, changes, "vm")
	vmDiff := pack(vm)
	cs, err := c.Backend.Create(ctx, rt.Spec{ID: fmt.Sprintf("snapc-%d", 1), Layers: []rt.Layer{base, vmDiff}})
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Destroy(ctx)
	if out := run(cs, check, "vm"); out != "ok\n" {
		t.Fatalf("container from the microVM's snapshot: %q", out)
	}

	// container → microVM.
	cs2, err := c.Backend.Create(ctx, rt.Spec{ID: "snapc-2", Layers: []rt.Layer{base}})
	if err != nil {
		t.Fatal(err)
	}
	defer cs2.Destroy(ctx)
	run(cs2, changes, "container")
	cDiff := pack(cs2)
	vm2, err := mv.backend.Create(ctx, rt.Spec{ID: "snapvm2", Layers: []rt.Layer{base, cDiff}})
	if err != nil {
		t.Fatal(err)
	}
	defer vm2.Destroy(ctx)
	if out := run(vm2, check, "container"); out != "ok\n" {
		t.Fatalf("microVM from the container's snapshot: %q", out)
	}
}
