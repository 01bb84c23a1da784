package edge_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/image"
)

// TestResolvedImages: an edge given the images a server resolved mounts
// exactly those layers and reads no tag. The spec names ws:1, whose tag
// has moved to another image since the server resolved it: the sandbox
// runs what the server placed (the old workspace), not what the tag says
// now. Bad resolved layers are the caller's error, named.
func TestResolvedImages(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "rv", nil)
	w.importWorkspace(t, "ws:1", map[string]string{"which": "old"})
	st := image.NewStore(w.store, w.store.Refs())
	old, err := st.Resolve(t.Context(), baseImage, "ws:1")
	if err != nil {
		t.Fatal(err)
	}
	w.importWorkspace(t, "ws:1", map[string]string{"which": "new"})
	sent := &dsecv1.ResolvedImages{Manifests: old.Manifests}
	for _, l := range old.Layers {
		sent.Layers = append(sent.Layers, &dsecv1.ResolvedLayer{Digest: l.Digest, Size: l.Size})
	}
	spec := &dsecv1.SandboxSpec{Image: baseImage, Workspace: "ws:1"}
	create := func(r *dsecv1.ResolvedImages) (*dsecv1.Sandbox, error) {
		resp, err := n.client.CreateOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreateRequest{
			Caller: tenant("a"), SandboxId: ids.NewSandbox(n.id), Spec: spec, Resolved: r,
		}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.Sandbox, nil
	}
	which := func(sb *dsecv1.Sandbox) string {
		res, err := n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"cat", "/which"}})
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(res.Stdout))
	}

	sb, err := create(sent)
	if err != nil {
		t.Fatal(err)
	}
	if got := which(sb); got != "old" {
		t.Fatalf("sandbox created from the resolved images has /which %q, want the resolved workspace's \"old\"", got)
	}
	// Without them (a caller other than a server) the edge reads the tag.
	sb, err = create(nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := which(sb); got != "new" {
		t.Fatalf("sandbox created without resolved images has /which %q, want the tag's \"new\"", got)
	}

	_, err = create(&dsecv1.ResolvedImages{})
	wantCode(t, err, connect.CodeInvalidArgument, "no layers")
	_, err = create(&dsecv1.ResolvedImages{Layers: []*dsecv1.ResolvedLayer{{Digest: "sha256:../../etc"}}})
	wantCode(t, err, connect.CodeInvalidArgument, "resolved.layers[0]")
	_, err = create(&dsecv1.ResolvedImages{Layers: []*dsecv1.ResolvedLayer{{Digest: "sha256:" + strings.Repeat("ab", 32)}}})
	wantCode(t, err, connect.CodeNotFound, "layer")
}
