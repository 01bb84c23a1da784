package controlplane

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/placement"
)

// peerEdge is an EdgeService that answers GetOnEdge with the address the
// call came from, in the sandbox's node field.
type peerEdge struct {
	dsecv1connect.UnimplementedEdgeServiceHandler
}

func (peerEdge) GetOnEdge(_ context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.GetSandboxResponse], error) {
	return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: &dsecv1.Sandbox{Id: req.Msg.GetSandboxId(), Node: req.Peer().Addr}}), nil
}

// An edge in Config.LocalEdges is called in process, behind the same
// cluster token check as over the network; other edges over the network.
func TestLocalEdges(t *testing.T) {
	path, h := dsecv1connect.NewEdgeServiceHandler(peerEdge{})
	mux := http.NewServeMux()
	mux.Handle(path, edge.RequireClusterToken(clusterToken, h))
	remote := httptest.NewServer(mux)
	defer remote.Close()
	const local = "http://127.0.0.1:1" // nothing listens there
	for _, tc := range []struct {
		name, token, url string
		wantCode         connect.Code
		wantPeer         string
	}{
		{"local", clusterToken, local, 0, "127.0.0.1:0"},
		{"local, wrong token", "not-the-token", local, connect.CodePermissionDenied, ""},
		{"remote", clusterToken, remote.URL, 0, "127.0.0.1:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store, err := blobstore.NewDir(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			srv, err := New(Config{AdminToken: "admin", Store: store, ClusterToken: tc.token, LocalEdges: map[string]http.Handler{local: mux}})
			if err != nil {
				t.Fatal(err)
			}
			resp, err := srv.edges.get(tc.url).GetOnEdge(context.Background(), connect.NewRequest(&dsecv1.EdgeSandboxRequest{SandboxId: "n1-1"}))
			if tc.wantCode != 0 {
				if connect.CodeOf(err) != tc.wantCode {
					t.Fatalf("GetOnEdge: %v, want %v", err, tc.wantCode)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if peer := resp.Msg.GetSandbox().GetNode(); !strings.HasPrefix(peer, tc.wantPeer) || (tc.url != local && peer == "127.0.0.1:0") {
				t.Errorf("the edge saw the call come from %q, want %q...", peer, tc.wantPeer)
			}
			want := int64(0)
			if tc.url == local {
				want = 1
			}
			if got := srv.edges.local.Served(); got != want {
				t.Errorf("%d calls served in process, want %d", got, want)
			}
		})
	}
}

// A bad LocalEdges URL is refused by New, naming it, before New creates
// anything.
func TestLocalEdgesRefused(t *testing.T) {
	dir := t.TempDir()
	store, err := blobstore.NewDir(filepath.Join(dir, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(Config{DataDir: dir, Store: store, ClusterToken: clusterToken,
		LocalEdges: map[string]http.Handler{"127.0.0.1:7110": http.NotFoundHandler()}})
	if err == nil || !strings.Contains(err.Error(), "LocalEdges") || !strings.Contains(err.Error(), `"127.0.0.1:7110"`) {
		t.Fatalf("New: %v, want an error naming LocalEdges and the URL", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "admin.token")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("admin.token made by a New that failed (%v)", err)
	}
}

// BenchmarkEdgeCall is one cheap unary call (ListOnEdge) from a server to
// a real edge (the test cluster's), over loopback HTTP and in process. Run
// as root:
//
//	go test -run XXX -bench EdgeCall ./internal/controlplane
func BenchmarkEdgeCall(b *testing.B) {
	c := newCluster(b)
	c.addEdge("bench", placement.Capacity{Sandboxes: 10}, placement.Share{})
	te := c.edges["bench"]
	quiet := slog.New(slog.DiscardHandler)
	for _, bc := range []struct {
		name  string
		local map[string]http.Handler
	}{
		{"loopback", nil},
		{"inproc", map[string]http.Handler{te.hs.URL: te.hs.Config.Handler}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			srv, err := New(Config{AdminToken: "admin", Store: c.store, ClusterToken: clusterToken, Logger: quiet, LocalEdges: bc.local})
			if err != nil {
				b.Fatal(err)
			}
			client := srv.edges.get(te.hs.URL)
			caller := &dsecv1.Caller{Admin: true}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := client.ListOnEdge(context.Background(), connect.NewRequest(&dsecv1.EdgeListRequest{Caller: caller})); err != nil {
					b.Fatal(err)
				}
			}
			if bc.local != nil && srv.edges.local.Served() == 0 {
				b.Fatal("no call was served in process")
			}
		})
	}
}
