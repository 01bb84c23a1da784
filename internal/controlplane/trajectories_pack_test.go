package controlplane

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// A sandbox whose node is gone (or forgot it) is read from the trajectory
// its node shipped, which is a pack holding other sandboxes' records too:
// a caller gets that sandbox's records only, page by page, and another
// tenant gets NotFound. A ref naming a blob without the sandbox's records
// is DataLoss, never someone else's records. No edge runs: the server
// answers from the blob store alone.
func TestGetShippedTrajectoryFromPack(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	store, err := blobstore.NewDir(filepath.Join(root, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv, err := New(Config{DataDir: root, Store: store, ClusterToken: clusterToken, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	srv.Mount(mux)
	hs := httptest.NewServer(mux)
	t.Cleanup(hs.Close)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); srv.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	raw, err := os.ReadFile(filepath.Join(root, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	admin := strings.TrimSpace(string(raw))
	sb := dsecv1connect.NewSandboxServiceClient(http.DefaultClient, hs.URL)
	tenants := dsecv1connect.NewTenantServiceClient(http.DefaultClient, hs.URL)
	token := func(name string) string {
		resp, err := tenants.Create(ctx, req(admin, &dsecv1.CreateTenantRequest{Name: name}))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg.GetToken()
	}
	alice, bob := token("alice"), token("bob")

	// The node: a real trajectory log shipping to the shared store. Each
	// sandbox runs a few execs; one prints more than the log keeps inline.
	l, err := trajectory.Open(trajectory.Options{Dir: filepath.Join(root, "wal"), Store: store, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	t0 := time.Now()
	want := map[string][]string{}
	var all []string
	run := func(tenant string, execs int) string {
		id := ids.NewSandbox("gone-node")
		env := &trajectory.Environment{Tenant: tenant, Backend: "container", Image: "busybox:latest", Layers: []string{blobstore.Digest(nil)}}
		if err := l.Create(ctx, id, env, t0, t0); err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= execs; i++ {
			rec := &trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Argv: []string{"echo", strconv.Itoa(i)}}}
			op, _, err := l.Begin(ctx, id, 0, rec)
			if err != nil {
				t.Fatal(err)
			}
			out := []byte(id + " " + strconv.Itoa(i))
			if i == 2 {
				out = bytes.Repeat([]byte("big "), trajectory.DefaultInlineMax)
			}
			rec.Start, rec.End = trajectory.Timestamp(t0), trajectory.Timestamp(t0)
			rec.Exec.Outcome, rec.Exec.Stdout, rec.Exec.Stderr = "exited", trajectory.NewData(out), trajectory.NewData(nil)
			if err := op.Commit(ctx, rec); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.End(ctx, id, trajectory.KindDestroy, "destroyed on request"); err != nil {
			t.Fatal(err)
		}
		lines, _, _, err := l.Page(ctx, id, 0, 100, false)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range lines {
			want[id] = append(want[id], string(line))
		}
		all = append(all, id)
		return id
	}
	a1, b1, a2, a3, b2 := run("alice", 5), run("bob", 2), run("alice", 3), run("alice", 2), run("bob", 1)
	if err := l.ShipBatch(ctx, all); err != nil {
		t.Fatal(err)
	}
	for _, id := range all {
		if err := l.Forget(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	pack := func(id string) string {
		d, err := store.Refs().Get(ctx, trajectory.ShipRef(id))
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if pack(a1) != pack(a2) || pack(a1) != pack(a3) || pack(b1) != pack(b2) || pack(a1) == pack(b1) {
		t.Fatal("the sandboxes were not shipped in one pack per tenant")
	}

	get := func(token, id string, size int32, page string, withData bool) (*dsecv1.GetTrajectoryResponse, error) {
		resp, err := sb.GetTrajectory(ctx, req(token, &dsecv1.GetTrajectoryRequest{SandboxId: id, PageSize: size, PageToken: page, IncludeData: withData}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	readAll := func(token, id string, withData bool) []string {
		t.Helper()
		var out []string
		page := ""
		for {
			resp, err := get(token, id, 3, page, withData)
			if err != nil {
				t.Fatalf("GetTrajectory %s page %q: %v", id, page, err)
			}
			if resp.GetNextSeq() == 0 {
				t.Fatalf("GetTrajectory %s: next_seq 0", id)
			}
			out = append(out, resp.GetRecords()...)
			if page = resp.GetNextPageToken(); page == "" {
				return out
			}
			if len(resp.GetRecords()) != 3 {
				t.Fatalf("GetTrajectory %s: a page of %d records before the last", id, len(resp.GetRecords()))
			}
		}
	}
	for id, token := range map[string]string{a1: alice, a2: alice, a3: alice, b1: bob, b2: bob} {
		got := readAll(token, id, false)
		if !slices.Equal(got, want[id]) {
			t.Fatalf("shipped trajectory of %s:\n%s\nwant:\n%s", id, strings.Join(got, "\n"), strings.Join(want[id], "\n"))
		}
		if got := readAll(admin, id, false); !slices.Equal(got, want[id]) {
			t.Fatalf("the admin reads another trajectory of %s", id)
		}
		resp, err := get(token, id, 100, "", false)
		if err != nil {
			t.Fatal(err)
		}
		if n := uint64(len(want[id]) - 1); resp.GetNextSeq() != n {
			t.Fatalf("next_seq of %s: %d, want %d", id, resp.GetNextSeq(), n)
		}
	}
	// With data: the output kept in the store comes back inline.
	withData := readAll(alice, a1, true)
	if len(withData) != len(want[a1]) || !strings.Contains(withData[2], `"inline":`) || strings.Contains(want[a1][2], `"inline":`) {
		t.Fatalf("include_data did not inline the stored output:\n%s", withData[2])
	}
	for _, line := range withData {
		if rec, err := trajectory.Parse([]byte(line)); err != nil || rec.Sandbox != a1 {
			t.Fatalf("a record of another sandbox, or none: %v %s", err, line)
		}
	}

	// Another tenant's sandboxes are not there, whichever pack they share.
	for _, tc := range []struct{ token, id string }{{bob, a1}, {alice, b2}} {
		_, err := get(tc.token, tc.id, 0, "", false)
		wantCode(t, err, connect.CodeNotFound, tc.id)
	}
	// A page past the end is refused, naming the count of the sandbox's
	// own records, not the pack's.
	_, err = get(alice, a3, 0, strconv.Itoa(len(want[a3])+1), false)
	wantCode(t, err, connect.CodeInvalidArgument, fmt.Sprintf("trajectory's %d records", len(want[a3])))

	// A ref naming a pack that does not hold the sandbox: DataLoss, and
	// none of the pack's records.
	stray := ids.NewSandbox("gone-node")
	if err := store.Refs().Set(ctx, trajectory.ShipRef(stray), pack(b1)); err != nil {
		t.Fatal(err)
	}
	_, err = get(admin, stray, 0, "", false)
	wantCode(t, err, connect.CodeDataLoss, "holds no record")
	if strings.Contains(err.Error(), b1) || strings.Contains(err.Error(), b2) {
		t.Fatalf("the error shows the pack's records: %v", err)
	}
}
