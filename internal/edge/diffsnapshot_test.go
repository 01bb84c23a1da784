package edge_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/memback"
)

// TestDiffArchiverSnapshotRunsAsContainer: a sandbox whose backend hands
// its writable layer over as a tar stream (runtime.DiffArchiver, as a VM
// does; memback standing for the microvm backend here) is snapshotted
// into an image a container sandbox runs, whiteouts included; it is
// checkpointed and rolled back onto the checkpoint's layer too.
func TestDiffArchiverSnapshotRunsAsContainer(t *testing.T) {
	w := newWorld(t)
	vm, err := memback.New(memback.Options{Kind: runtime.KindMicroVM, Base: map[string]string{"/etc/hosts": "h"}})
	if err != nil {
		t.Fatal(err)
	}
	n := w.startNode(t, "da1", func(c *edge.Config) {
		c.Backends[runtime.KindMicroVM] = vm
		c.Capacity[runtime.KindMicroVM] = placement.Capacity{MilliCPU: 1 << 20, MemoryBytes: 1 << 40}
	})
	ctx := t.Context()
	a := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage, Backend: string(runtime.KindMicroVM)})
	res, err := n.exec(t, admin, a.Id, &dsecv1.ExecRequest{Shell: "rm /etc/hosts; write /data/note hello"})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("change the sandbox: %v %v", res, err)
	}

	resp, err := n.client.SnapshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{Caller: admin,
		Request: &dsecv1.SnapshotRequest{SandboxId: a.Id, Ref: "vmsnap:1"}}))
	if err != nil {
		t.Fatal(err)
	}
	if l := resp.Msg.Image.Layers; len(l) != 2 || l[0] != w.layer {
		t.Fatalf("snapshot layers %v, want the base layer and the diff", l)
	}
	c := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: "vmsnap:1"})
	if got := n.sh(t, c.Id, "cat /data/note; test -e /etc/hosts && echo hosts || echo no-hosts; cat /etc/passwd | head -c 4"); got != "hellono-hosts\nroot" {
		t.Fatalf("container from the diff snapshot shows %q, want the note, no /etc/hosts and the base image", got)
	}

	ck, err := n.client.CheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: admin,
		Request: &dsecv1.CheckpointRequest{SandboxId: a.Id}}))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.client.RollbackOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: admin,
		Request: &dsecv1.RollbackRequest{SandboxId: a.Id, CheckpointId: ck.Msg.CheckpointId}})); err != nil {
		t.Fatal(err)
	}
	// The new runtime sandbox runs on the image's layer plus the
	// checkpoint's directory layer, which holds the unpacked diff.
	rs := vm.Sandbox(a.Id)
	if rs == nil {
		t.Fatalf("no runtime sandbox after the rollback: %v", vm.Live())
	}
	layers := rs.Spec().Layers
	if len(layers) != 2 || layers[0].Digest != w.layer {
		t.Fatalf("rolled back onto %+v", layers)
	}
	if b, err := os.ReadFile(filepath.Join(layers[1].Path, "data/note")); err != nil || string(b) != "hello" {
		t.Fatalf("checkpoint layer data/note: %q %v", b, err)
	}
	if got, _ := n.get(t, admin, a.Id); got.State != "running" || !strings.HasPrefix(got.Layers[1], "sha256:") {
		t.Fatalf("after rollback: %v", got)
	}
	if err := n.destroy(t, admin, a.Id); err != nil {
		t.Fatal(err)
	}
	// The sandbox's end drops its checkpoints, and the layer with them.
	if _, err := os.Stat(layers[1].Path); err == nil {
		t.Fatalf("the checkpoint layer %s outlived its sandbox", layers[1].Path)
	}
}
