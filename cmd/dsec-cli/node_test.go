package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/cmd/dsec/cli"
)

// node ls against a scripted server: what it prints. The figures
// themselves are checked against real edges in internal/controlplane
// (TestListNodes) and the Python SDK's live tests (test_nodes.py).

// fakeCluster answers ListNodes to the token "admin" only.
type fakeCluster struct {
	dsecv1connect.UnimplementedClusterServiceHandler
	nodes []*dsecv1.Node
}

func (f *fakeCluster) ListNodes(_ context.Context, r *connect.Request[dsecv1.ListNodesRequest]) (*connect.Response[dsecv1.ListNodesResponse], error) {
	if r.Header().Get("Authorization") != "Bearer admin" {
		return nil, connect.NewError(connect.CodePermissionDenied, errors.New("listing nodes needs the admin token"))
	}
	return connect.NewResponse(&dsecv1.ListNodesResponse{Nodes: f.nodes}), nil
}

func TestNodeLs(t *testing.T) {
	seen := timestamppb.New(time.Now().Add(-3*time.Hour - time.Minute))
	f := &fakeCluster{nodes: []*dsecv1.Node{{
		Id: "n1", Alive: true, LastHeartbeatAt: seen, Url: "http://10.0.0.1:7111", Load: 0.5, Queued: 2, Pools: 1,
		Backends: []*dsecv1.NodeBackend{{
			Backend: "container", MilliCpu: 2000, MemoryBytes: 24 << 30, Sandboxes: 4096,
			ChargedMilliCpu: 0, ChargedMemoryBytes: 12 << 20, ChargedSandboxes: 3,
			RequestedMilliCpu: 12000, RequestedMemoryBytes: 24 << 30, UsedMilliCpu: 250, UsedMemoryBytes: 12 << 20,
		}},
		Measured: &dsecv1.NodeMeasurement{
			MilliCpu: 300, MemoryTotalBytes: 24 << 30, MemoryUsedBytes: 3 << 29, MemoryAvailableBytes: 45 << 29,
			SwapTotalBytes: 1 << 30, SwapUsedBytes: 1 << 20, PsiMemorySome: 1.5, PsiMemoryFull: 0.25, PsiCpuSome: 40,
			OpenFiles: 84, MaxOpenFiles: 20000, Threads: 512, MaxThreads: 32768,
		},
		Full: "memory (under pressure)",
		Sandboxes: []*dsecv1.SandboxCount{
			{Backend: "container", State: "frozen", Count: 1}, {Backend: "container", State: "running", Count: 2},
		},
	}, {
		Id: "n2", LastHeartbeatAt: seen, Url: "http://10.0.0.2:7111",
		Backends:  []*dsecv1.NodeBackend{{Backend: "container", MilliCpu: 4000, Sandboxes: 10, ChargedSandboxes: 1, RequestedMilliCpu: 500, RequestedMemoryBytes: 64 << 20}},
		Measured:  &dsecv1.NodeMeasurement{MilliCpu: 100, MemoryTotalBytes: 1 << 30, PsiMemorySome: -1, PsiMemoryFull: -1},
		Sandboxes: []*dsecv1.SandboxCount{{Backend: "container", State: "lost", Count: 1}},
	}}}
	url := fakeServer(t, func() (string, http.Handler) { return dsecv1connect.NewClusterServiceHandler(f) })
	run := func(token string, args ...string) (string, string, int) {
		return runCLIStdio(t, "", append([]string{"--endpoint", url, "--token", token, "node"}, args...)...)
	}

	out, msg, code := run("admin", "ls")
	rows := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if code != 0 || len(rows) != 3 {
		t.Fatalf("node ls: exit %d: %q %s", code, out, msg)
	}
	if got := strings.Join(strings.Fields(rows[0]), " "); got != "NODE ALIVE SEEN SANDBOXES CPU MEMORY SWAP PSI CHARGED REQUESTED FILES THREADS STATES BACKENDS FULL" {
		t.Fatalf("header %q", got)
	}
	// One line per node, sizes human-readable; a dead node shows no
	// measured figures, only what it requested and its lost sandboxes.
	if got, want := strings.Join(strings.Fields(rows[1]), " "),
		"n1 yes 3h ago 3/4096 0.3/2 1.5GiB/24.0GiB 1.0MiB/1.0GiB 1.50/0.25 0,12.0MiB 12,24.0GiB 84/20000 512/32768 frozen=1,running=2 container=3 memory (under pressure)"; got != want {
		t.Errorf("n1 row:\n got %q\nwant %q", got, want)
	}
	if got, want := strings.Join(strings.Fields(rows[2]), " "),
		"n2 no 3h ago 1/10 - - - - - 0.5,64.0MiB - - lost=1 container=1 -"; got != want {
		t.Errorf("n2 row:\n got %q\nwant %q", got, want)
	}

	out, msg, code = run("admin", "ls", "--json")
	var js []nodeJSON
	if err := json.Unmarshal([]byte(out), &js); code != 0 || err != nil || len(js) != 2 {
		t.Fatalf("node ls --json: exit %d, %v: %s %s", code, err, out, msg)
	}
	n := js[0]
	if n.ID != "n1" || !n.Alive || n.URL != "http://10.0.0.1:7111" || n.Queued != 2 || n.Pools != 1 || n.Full == "" ||
		len(n.Backends) != 1 || n.Backends[0].RequestedMilliCPU != 12000 || n.Backends[0].UsedMilliCPU != 250 ||
		n.Measured.PSIMemoryFull != 0.25 || n.Measured.MaxOpenFiles != 20000 || n.Measured.SwapUsedBytes != 1<<20 ||
		len(n.Sandboxes) != 2 || n.Sandboxes[1] != (sandboxCountJSON{"container", "running", 2}) {
		t.Errorf("node ls --json n1: %+v", n)
	}
	if js[1].Alive || js[1].Measured.PSIMemorySome != -1 {
		t.Errorf("node ls --json n2: %+v", js[1])
	}

	// A tenant's token is refused (exit 1, the server's message).
	if _, msg, code := run("tenant", "ls"); code != cli.ExitError || !strings.Contains(msg, "admin token") {
		t.Errorf("node ls as a tenant: exit %d: %s", code, msg)
	}
	if _, _, code := run("admin", "ls", "extra"); code != cli.ExitUsage {
		t.Errorf("node ls extra: exit %d, want %d", code, cli.ExitUsage)
	}
}
