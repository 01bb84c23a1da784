package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

// sandbox ls against a scripted server: the CPU and MEM columns of each
// sandbox's measured use. The figures themselves are checked against a
// real edge in internal/edge (TestSandboxUsage) and the Python SDK's live
// tests (test_usage.py).

// fakeSandboxes lists a fixed set.
type fakeSandboxes struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	sbs []*dsecv1.Sandbox
}

func (f *fakeSandboxes) List(context.Context, *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	return connect.NewResponse(&dsecv1.ListSandboxesResponse{Sandboxes: f.sbs}), nil
}

// fakeServer serves handlers over HTTP/1.1 and h2c (the CLI speaks h2c
// to http:// endpoints).
func fakeServer(t *testing.T, handlers ...func() (string, http.Handler)) string {
	mux := http.NewServeMux()
	for _, h := range handlers {
		mux.Handle(h())
	}
	hs := httptest.NewUnstartedServer(mux)
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	return hs.URL
}

func TestSandboxLsUsage(t *testing.T) {
	now := time.Now()
	f := &fakeSandboxes{sbs: []*dsecv1.Sandbox{{
		Id: "n1-a", Node: "n1", State: "running", Spec: &dsecv1.SandboxSpec{Image: "busybox:latest"}, CreatedAt: timestamppb.New(now),
		Usage: &dsecv1.SandboxUsage{MilliCpu: 1250, MemoryBytes: 48 << 20, MeasuredAt: timestamppb.New(now), Window: durationpb.New(5 * time.Second)},
	}, {
		// Measured once: memory known, CPU not yet.
		Id: "n1-b", Node: "n1", State: "running", Spec: &dsecv1.SandboxSpec{Image: "busybox:latest"}, CreatedAt: timestamppb.New(now.Add(time.Millisecond)),
		Usage: &dsecv1.SandboxUsage{MemoryBytes: 3 << 20, MeasuredAt: timestamppb.New(now)},
	}, {
		Id: "n1-c", Node: "n1", State: "creating", Spec: &dsecv1.SandboxSpec{Image: "busybox:latest"}, CreatedAt: timestamppb.New(now.Add(2 * time.Millisecond)),
	}}}
	url := fakeServer(t, func() (string, http.Handler) { return dsecv1connect.NewSandboxServiceHandler(f) })
	out, msg, code := runCLIStdio(t, "", "--endpoint", url, "--token", "t", "sandbox", "ls")
	rows := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if code != 0 || len(rows) != 4 {
		t.Fatalf("sandbox ls: exit %d: %q %s", code, out, msg)
	}
	for i, want := range []string{
		"ID NODE STATE IMAGE CPU MEM",
		"n1-a n1 running busybox:latest 1.25 48.0MiB",
		"n1-b n1 running busybox:latest - 3.0MiB",
		"n1-c n1 creating busybox:latest - -",
	} {
		if got := strings.Join(strings.Fields(rows[i])[:6], " "); got != want {
			t.Errorf("row %d: got %q, want %q", i, got, want)
		}
	}
	out, _, code = runCLIStdio(t, "", "--endpoint", url, "--token", "t", "sandbox", "ls", "--json")
	var js []sandboxJSON
	if err := json.Unmarshal([]byte(out), &js); code != 0 || err != nil || len(js) != 3 {
		t.Fatalf("sandbox ls --json: exit %d, %v: %s", code, err, out)
	}
	if u := js[0].Usage; u == nil || u.MilliCPU != 1250 || u.MemoryBytes != 48<<20 || u.Window != "5s" || u.MeasuredAt == nil {
		t.Errorf("sandbox ls --json usage: %+v", u)
	}
	if js[2].Usage != nil {
		t.Errorf("unmeasured sandbox has usage %+v", js[2].Usage)
	}
}
