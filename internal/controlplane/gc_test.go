package controlplane

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// TestGarbageCollect: GC frees an unreferenced snapshot and keeps a
// referenced one, and a sandbox running on an image whose tag was deleted
// keeps its layers (its node holds them) until it is gone.
func TestGarbageCollect(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 8}, placement.Share{})
	base, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t))
	if err != nil {
		t.Fatal(err)
	}
	baseLayer := base.GetLayers()[0]

	sh := func(id, script string) string {
		t.Helper()
		res, err := c.exec(c.admin, id, "sh", "-c", script)
		if err != nil {
			t.Fatal(err)
		}
		if res.GetExitCode() != 0 {
			t.Fatalf("%q: exit %d: %s%s", script, res.GetExitCode(), res.GetStdout(), res.GetStderr())
		}
		return string(res.GetStdout())
	}
	create := func(image string) string {
		t.Helper()
		sb, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: image})
		if err != nil {
			t.Fatalf("create from %s: %v", image, err)
		}
		return sb.GetId()
	}
	snapshot := func(id, ref string) *dsecv1.Image {
		t.Helper()
		resp, err := c.clients.sb.Snapshot(ctx, req(c.admin, &dsecv1.SnapshotRequest{SandboxId: id, Ref: ref}))
		if err != nil {
			t.Fatalf("snapshot %s as %s: %v", id, ref, err)
		}
		return resp.Msg.GetImage()
	}
	deleteTag := func(ref string) {
		t.Helper()
		if _, err := c.clients.img.Delete(ctx, req(c.admin, &dsecv1.DeleteImageRequest{Ref: ref})); err != nil {
			t.Fatal(err)
		}
	}
	// destroy also waits for the sandbox's trajectory to be shipped with
	// its destroy record: a collection with no grace period while a ship is
	// in flight could free the new trajectory blob before its ref is set
	// (which it would report as a broken ref).
	destroy := func(id string) {
		t.Helper()
		if err := c.destroy(c.admin, id); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			// The blob may be a pack: only id's lines are its trajectory.
			if lines, _, err := trajectory.ReadShipped(ctx, c.store, id); err == nil && strings.Contains(string(lines[len(lines)-1]), `"kind":"destroy"`) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the trajectory of %s was not shipped", id)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	gc := func(r *dsecv1.GarbageCollectRequest) *dsecv1.GarbageCollectResponse {
		t.Helper()
		resp, err := c.clients.img.GarbageCollect(ctx, req(c.admin, r))
		if err != nil {
			t.Fatal(err)
		}
		m := resp.Msg
		if m.GetKeptBlobs()+m.GetFreedBlobs() != m.GetScannedBlobs() || int64(len(m.GetFreed())) != m.GetFreedBlobs() ||
			m.GetReferencedBlobs()+m.GetHeldBlobs()+m.GetYoungBlobs() != m.GetKeptBlobs() || len(m.GetBrokenRefs()) != 0 {
			t.Fatalf("inconsistent report %v", m)
		}
		return m
	}
	now := durationpb.New(0)
	exists := func(digest string) bool {
		t.Helper()
		_, err := c.store.Stat(ctx, digest)
		return err == nil
	}
	wantKept := func(what string, digests ...string) {
		t.Helper()
		for _, d := range digests {
			if !exists(d) {
				t.Fatalf("%s: blob %s was freed", what, d)
			}
		}
	}
	wantFreed := func(what string, resp *dsecv1.GarbageCollectResponse, digests ...string) {
		t.Helper()
		for _, d := range digests {
			if !slices.Contains(resp.GetFreed(), d) {
				t.Fatalf("%s: blob %s not reported freed in %v", what, d, resp.GetFreed())
			}
			if exists(d) && !resp.GetDryRun() {
				t.Fatalf("%s: blob %s still stored", what, d)
			}
		}
	}
	holds := func(layer string) bool { return slices.Contains(c.srv.reg.heldLayers(), layer) }

	// Two snapshots of one sandbox, the second after a further change.
	src := create("busybox:1")
	sh(src, "echo a > /a")
	snapA := snapshot(src, "snapa:1")
	sh(src, "echo b > /b")
	snapB := snapshot(src, "snapb:1")
	layerA, layerB := snapA.GetLayers()[1], snapB.GetLayers()[1]
	if len(snapA.GetLayers()) != 2 || len(snapB.GetLayers()) != 2 || snapA.GetLayers()[0] != baseLayer || layerA == layerB {
		t.Fatalf("snapshots %v and %v: want the base layer and one layer of their own", snapA.GetLayers(), snapB.GetLayers())
	}
	destroy(src)
	deleteTag("snapa:1")

	t.Run("admin only", func(t *testing.T) {
		tok := c.createTenant("gcuser", nil)
		_, err := c.clients.img.GarbageCollect(ctx, req(tok, &dsecv1.GarbageCollectRequest{DryRun: true}))
		wantCode(t, err, connect.CodePermissionDenied, "admin")
		_, err = c.clients.img.GarbageCollect(ctx, req(c.admin, &dsecv1.GarbageCollectRequest{Grace: durationpb.New(-1)}))
		wantCode(t, err, connect.CodeInvalidArgument, "grace")
	})

	t.Run("frees an unreferenced snapshot, keeps a referenced one", func(t *testing.T) {
		// With the default grace period the new snapshot is too recent.
		r := gc(&dsecv1.GarbageCollectRequest{})
		if slices.Contains(r.GetFreed(), layerA) || r.GetYoungBlobs() == 0 {
			t.Fatalf("default grace: %v", r)
		}
		wantKept("default grace", layerA, snapA.GetDigest())

		r = gc(&dsecv1.GarbageCollectRequest{DryRun: true, Grace: now})
		if !r.GetDryRun() {
			t.Fatalf("dry run reported %v", r)
		}
		wantFreed("dry run", r, layerA, snapA.GetDigest())
		wantKept("dry run", layerA, snapA.GetDigest())

		r = gc(&dsecv1.GarbageCollectRequest{Grace: now})
		wantFreed("snapa deleted", r, layerA, snapA.GetDigest())
		wantKept("snapa deleted", layerB, snapB.GetDigest(), baseLayer, base.GetDigest())
		if r.GetFreedBlobs() == 0 || r.GetFreedBytes() <= 0 || r.GetReferencedBlobs() < 4 {
			t.Fatalf("report %v", r)
		}
		// snapb:1 still restores, on a fresh sandbox.
		sb := create("snapb:1")
		if got := sh(sb, "cat /a /b"); got != "a\nb\n" {
			t.Fatalf("restored snapb:1: %q", got)
		}
		destroy(sb)
	})

	t.Run("a running sandbox keeps its deleted image's layers", func(t *testing.T) {
		sb := create("snapb:1")
		c.waitFor("the node to report snapb's layer", func() bool { return holds(layerB) })
		deleteTag("snapb:1")
		r := gc(&dsecv1.GarbageCollectRequest{Grace: now})
		wantKept("held", layerB, baseLayer)
		wantFreed("held", r, snapB.GetDigest()) // the manifest: no sandbox needs it
		if r.GetHeldBlobs() < 1 {
			t.Fatalf("report %v: want layerB held", r)
		}
		// The sandbox works, and can still be snapshotted: its image is its
		// layers plus a new one, all in the store.
		if got := sh(sb, "cat /a /b && echo c > /c"); got != "a\nb\n" {
			t.Fatalf("sandbox on a deleted image: %q", got)
		}
		snapC := snapshot(sb, "snapc:1")
		if !slices.Contains(snapC.GetLayers(), layerB) {
			t.Fatalf("snapshot %v lacks %s", snapC.GetLayers(), layerB)
		}
		restored := create("snapc:1")
		if got := sh(restored, "cat /a /b /c"); got != "a\nb\nc\n" {
			t.Fatalf("restored snapc:1: %q", got)
		}

		// Once no sandbox runs on them and no tag names them, they go.
		destroy(sb)
		destroy(restored)
		c.waitFor("the node to drop snapb's layer", func() bool { return !holds(layerB) })
		gc(&dsecv1.GarbageCollectRequest{Grace: now})
		wantKept("snapc:1 tagged", layerB, snapC.GetDigest())
		deleteTag("snapc:1")
		r = gc(&dsecv1.GarbageCollectRequest{Grace: now})
		wantFreed("all deleted", r, layerB, snapC.GetDigest(), snapC.GetLayers()[len(snapC.GetLayers())-1])
		wantKept("all deleted", baseLayer, base.GetDigest())
	})
}
