package edge_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
)

// changeScript changes the base image's tree in every way a layer diff must
// capture: a created file, a modified file, a deleted file, a directory
// replaced by a file, a file replaced by a directory and a directory
// replaced by a new one (opaque).
const changeScript = `set -e
mkdir -p /work/sub && echo created > /work/sub/new.txt
echo extra >> /etc/nsswitch.conf
rm /etc/group
rmdir /mnt && echo now-a-file > /mnt
rm /etc/hosts && mkdir /etc/hosts && echo inside > /etc/hosts/f
rm -rf /usr/sbin && mkdir /usr/sbin && echo only > /usr/sbin/only`

// fingerprint describes the paths changeScript touches, and a few it does
// not, by type, mode and content.
const fingerprint = `for p in /work /work/sub /work/sub/new.txt /etc/nsswitch.conf /etc/group /etc/passwd /mnt /etc/hosts /etc/hosts/f /usr/sbin /usr/sbin/only /usr/sbin/chroot /after; do
  if [ -e "$p" ] || [ -L "$p" ]; then echo "$p $(stat -c '%F %a' "$p")"; if [ -f "$p" ]; then md5sum < "$p"; fi; else echo "$p absent"; fi
done
ls -1a /usr/sbin /etc /work/sub 2>&1; true`

func (n *node) sh(t *testing.T, id, script string) string {
	t.Helper()
	res, err := n.exec(t, admin, id, &dsecv1.ExecRequest{Shell: script})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d: %s%s", script, res.ExitCode, res.Stdout, res.Stderr)
	}
	return string(res.Stdout)
}

func TestSnapshotCheckpointRollback(t *testing.T) {
	w := newWorld(t)
	dataDir := t.TempDir()
	n := w.startNode(t, "st1", func(c *edge.Config) { c.DataDir = dataDir; c.MaxLayers = 3 })
	ctx := t.Context()
	a := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage, Labels: map[string]string{"job": "j1"}})
	before := n.sh(t, a.Id, fingerprint)
	n.sh(t, a.Id, changeScript)
	want := n.sh(t, a.Id, fingerprint)
	if want == before {
		t.Fatal("the change script changed nothing")
	}

	var snap *dsecv1.Image
	t.Run("snapshot restores on a fresh sandbox", func(t *testing.T) {
		resp, err := n.client.SnapshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{Caller: admin,
			Request: &dsecv1.SnapshotRequest{SandboxId: a.Id, Ref: "snap:1"}}))
		if err != nil {
			t.Fatal(err)
		}
		snap = resp.Msg.Image
		if len(snap.Layers) != 2 || snap.Layers[0] != w.layer {
			t.Fatalf("snapshot image layers %v, want the base layer and one more", snap.Layers)
		}
		if got := n.sh(t, a.Id, fingerprint); got != want {
			t.Fatalf("the source sandbox changed across its snapshot:\n%s\nwant:\n%s", got, want)
		}
		b := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: "snap:1"})
		if got := n.sh(t, b.Id, fingerprint); got != want {
			t.Fatalf("restored sandbox:\n%s\nwant:\n%s", got, want)
		}
		// A snapshot of a snapshot adds one layer; past MaxLayers (3 here)
		// the chain is merged into one layer that still restores exactly.
		n.sh(t, b.Id, "echo after > /after")
		wantB := n.sh(t, b.Id, fingerprint)
		resp, err = n.client.SnapshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{Caller: admin,
			Request: &dsecv1.SnapshotRequest{SandboxId: b.Id, Ref: "snap:2"}}))
		if err != nil || len(resp.Msg.Image.Layers) != 3 {
			t.Fatalf("snapshot of a snapshot: %v %v", resp.Msg.GetImage().GetLayers(), err)
		}
		c := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: "snap:2"})
		n.sh(t, c.Id, "rm /after")
		wantC := n.sh(t, c.Id, fingerprint)
		resp, err = n.client.SnapshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{Caller: admin,
			Request: &dsecv1.SnapshotRequest{SandboxId: c.Id, Ref: "snap:3"}}))
		if err != nil || len(resp.Msg.Image.Layers) != 1 {
			t.Fatalf("snapshot past the bound: layers %v, %v; want them merged into one", resp.Msg.GetImage().GetLayers(), err)
		}
		d := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: "snap:3"})
		if got := n.sh(t, d.Id, fingerprint); got != wantC || wantC == wantB {
			t.Fatalf("merged snapshot restores:\n%s\nwant:\n%s", got, wantC)
		}
	})

	t.Run("rollback restores the checkpoint and kills later processes", func(t *testing.T) {
		resp, err := n.client.CheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: admin,
			Request: &dsecv1.CheckpointRequest{SandboxId: a.Id}}))
		if err != nil {
			t.Fatal(err)
		}
		ck := resp.Msg.CheckpointId
		n.sh(t, a.Id, "sleep 1000 >/dev/null 2>&1 & echo changed > /work/sub/new.txt; rm /etc/nsswitch.conf; mkdir /mnt2; rm -rf /etc/hosts; echo after > /after")
		if got := n.sh(t, a.Id, fingerprint); got == want {
			t.Fatal("changes after the checkpoint did not show")
		}
		for range 2 { // a second rollback to the same checkpoint works too
			if _, err := n.client.RollbackOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: admin,
				Request: &dsecv1.RollbackRequest{SandboxId: a.Id, CheckpointId: ck}})); err != nil {
				t.Fatal(err)
			}
			if got := n.sh(t, a.Id, fingerprint); got != want {
				t.Fatalf("after rollback:\n%s\nwant:\n%s", got, want)
			}
			if ps := n.sh(t, a.Id, "ps -o args"); strings.Contains(ps, "sleep 1000") {
				t.Fatalf("a process started after the checkpoint survived the rollback:\n%s", ps)
			}
			if got := n.sh(t, a.Id, "test -e /mnt2 && echo yes || echo no"); got != "no\n" {
				t.Fatalf("/mnt2 created after the checkpoint: %q", got)
			}
			n.sh(t, a.Id, "echo scribble > /work/sub/new.txt")
		}
		got, err := n.get(t, admin, a.Id)
		if err != nil || got.State != string(edge.StateRunning) || got.Id != a.Id {
			t.Fatalf("after rollback: %+v %v", got, err)
		}

		// A rolled-back sandbox runs on its checkpoint's layer (a directory
		// on the node); its snapshot needs that layer as an image layer, and
		// past MaxLayers (3) merges it with the others.
		wantA := n.sh(t, a.Id, fingerprint)
		for i, wantLayers := range []int{3, 1} {
			if i == 1 {
				resp, err := n.client.CheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: admin,
					Request: &dsecv1.CheckpointRequest{SandboxId: a.Id}}))
				if err != nil {
					t.Fatal(err)
				}
				n.sh(t, a.Id, "echo lost > /after")
				if _, err := n.client.RollbackOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: admin,
					Request: &dsecv1.RollbackRequest{SandboxId: a.Id, CheckpointId: resp.Msg.CheckpointId}})); err != nil {
					t.Fatal(err)
				}
			}
			ref := fmt.Sprintf("rolled:%d", i)
			resp, err := n.client.SnapshotOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeSnapshotRequest{Caller: admin,
				Request: &dsecv1.SnapshotRequest{SandboxId: a.Id, Ref: ref}}))
			if err != nil || len(resp.Msg.Image.Layers) != wantLayers {
				t.Fatalf("snapshot of a rolled-back sandbox: layers %v, %v; want %d", resp.Msg.GetImage().GetLayers(), err, wantLayers)
			}
			r := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: ref})
			if got := n.sh(t, r.Id, fingerprint); got != wantA {
				t.Fatalf("snapshot %s of a rolled-back sandbox restores:\n%s\nwant:\n%s", ref, got, wantA)
			}
		}

		// Two checkpoints of the same files share one layer directory;
		// deleting one leaves the other whole.
		layerDirs := func() int {
			t.Helper()
			dirs, err := filepath.Glob(filepath.Join(dataDir, "checkpoints", "dirs", "layers", "*"))
			if err != nil {
				t.Fatal(err)
			}
			return len(dirs)
		}
		var same [2]string
		for i := range same {
			resp, err := n.client.CheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: admin,
				Request: &dsecv1.CheckpointRequest{SandboxId: a.Id}}))
			if err != nil {
				t.Fatal(err)
			}
			same[i] = resp.Msg.CheckpointId
		}
		held := layerDirs()
		if _, err := n.client.DeleteCheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeDeleteCheckpointRequest{Caller: admin,
			Request: &dsecv1.DeleteCheckpointRequest{SandboxId: a.Id, CheckpointId: same[0]}})); err != nil {
			t.Fatal(err)
		}
		if layerDirs() != held {
			t.Fatalf("deleting one of two checkpoints of the same files removed a layer directory (%d left of %d)", layerDirs(), held)
		}
		n.sh(t, a.Id, "echo lost > /after")
		if _, err := n.client.RollbackOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: admin,
			Request: &dsecv1.RollbackRequest{SandboxId: a.Id, CheckpointId: same[1]}})); err != nil {
			t.Fatal(err)
		}
		if got := n.sh(t, a.Id, fingerprint); got != wantA {
			t.Fatalf("after rollback to the second of two identical checkpoints:\n%s\nwant:\n%s", got, wantA)
		}
		_, err = n.client.RollbackOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: admin,
			Request: &dsecv1.RollbackRequest{SandboxId: a.Id, CheckpointId: "ck-nope"}}))
		wantCode(t, err, connect.CodeNotFound, "ck-nope")

		// Deleting a checkpoint while a rollback reads it is safe: the
		// rollback finishes (or finds it gone) and the layer goes after.
		resp, err = n.client.CheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: admin,
			Request: &dsecv1.CheckpointRequest{SandboxId: a.Id}}))
		if err != nil {
			t.Fatal(err)
		}
		ck2 := resp.Msg.CheckpointId
		var wg sync.WaitGroup
		var rbErr, delErr error
		wg.Go(func() {
			_, rbErr = n.client.RollbackOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: admin,
				Request: &dsecv1.RollbackRequest{SandboxId: a.Id, CheckpointId: ck2}}))
		})
		wg.Go(func() {
			_, delErr = n.client.DeleteCheckpointOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeDeleteCheckpointRequest{Caller: admin,
				Request: &dsecv1.DeleteCheckpointRequest{SandboxId: a.Id, CheckpointId: ck2}}))
		})
		wg.Wait()
		if delErr != nil || (rbErr != nil && connect.CodeOf(rbErr) != connect.CodeNotFound) {
			t.Fatalf("rollback %v, delete %v", rbErr, delErr)
		}
		n.sh(t, a.Id, "true")
	})

	t.Run("freeze refuses execs until thaw; job freeze", func(t *testing.T) {
		b := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage, Labels: map[string]string{"job": "j1"}})
		other := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage, Labels: map[string]string{"job": "j2"}})
		resp, err := n.client.FreezeJobOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeListRequest{Caller: admin, Labels: map[string]string{"job": "j1"}}))
		if err != nil {
			t.Fatal(err)
		}
		frozen := map[string]bool{}
		for _, r := range resp.Msg.Results {
			if r.Error != nil {
				t.Fatalf("freeze %s: %v", r.Id, r.Error)
			}
			frozen[r.Id] = true
		}
		if !frozen[a.Id] || !frozen[b.Id] || frozen[other.Id] {
			t.Fatalf("job freeze froze %v; want %s and %s only", frozen, a.Id, b.Id)
		}
		for _, id := range []string{a.Id, b.Id} {
			_, err := n.exec(t, admin, id, &dsecv1.ExecRequest{Shell: "true"})
			wantCode(t, err, connect.CodeFailedPrecondition, "frozen")
			if got, _ := n.get(t, admin, id); got.GetState() != string(edge.StateFrozen) {
				t.Errorf("%s state %q, want frozen", id, got.GetState())
			}
		}
		n.sh(t, other.Id, "true")
		if _, err := n.client.ThawJobOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeListRequest{Caller: admin, Labels: map[string]string{"job": "j1"}})); err != nil {
			t.Fatal(err)
		}
		n.sh(t, a.Id, "true")
		n.sh(t, b.Id, "true")
		_, err = n.client.FreezeJobOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeListRequest{Caller: admin}))
		wantCode(t, err, connect.CodeInvalidArgument, "label")
	})

	t.Run("checkpoint layers go with their sandbox", func(t *testing.T) {
		held, _ := filepath.Glob(filepath.Join(dataDir, "checkpoints", "dirs", "layers", "*"))
		if len(held) == 0 {
			t.Fatal("no checkpoint layer is held while the sandbox runs on its first checkpoint")
		}
		if err := n.destroy(t, admin, a.Id); err != nil {
			t.Fatal(err)
		}
		left, err := filepath.Glob(filepath.Join(dataDir, "checkpoints", "dirs", "*", "*"))
		if err != nil {
			t.Fatal(err)
		}
		if len(left) != 0 {
			t.Fatalf("checkpoint layers left after their sandbox was destroyed: %v", left)
		}
		if _, err := os.Stat(filepath.Join(dataDir, "checkpoints")); err != nil {
			t.Fatal(err)
		}
	})
}

// TestIdleFreeze checks that an idle timeout whose action is freeze
// freezes the sandbox instead of destroying it, and that a thaw resumes it.
func TestIdleFreeze(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "if1", nil)
	sb := n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage,
		IdleTimeout: durationpb.New(300 * time.Millisecond), IdleAction: edge.IdleFreeze})
	n.sh(t, sb.Id, "echo kept > /root/kept")
	n.waitState(t, sb.Id, string(edge.StateFrozen))
	_, err := n.exec(t, admin, sb.Id, &dsecv1.ExecRequest{Shell: "true"})
	wantCode(t, err, connect.CodeFailedPrecondition, "frozen")
	if _, err := n.client.ThawOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: admin, SandboxId: sb.Id})); err != nil {
		t.Fatal(err)
	}
	if got := n.sh(t, sb.Id, "cat /root/kept"); got != "kept\n" {
		t.Fatalf("after thaw: %q", got)
	}
	_, err = n.create(t, admin, &dsecv1.SandboxSpec{Image: baseImage, IdleAction: "sleep"})
	wantCode(t, err, connect.CodeInvalidArgument, "idle_action")
}
