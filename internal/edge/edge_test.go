package edge_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	edgespec "github.com/dsec-dev/dsec/internal/spec"
	dsectest "github.com/dsec-dev/dsec/internal/testutil"
)

const (
	token     = "test-cluster-token"
	baseImage = "busybox:latest"
)

// world is a real node in miniature shared by the tests: a blob store with
// a busybox image, the layer mount cache and the container backend.
type world struct {
	store    *blobstore.Dir
	backend  *container.Backend
	layer    string
	stateDir string
}

func newWorld(t *testing.T) *world {
	t.Helper()
	dsectest.RequireRoot(t)
	agentBin := dsectest.BuildBinary(t, "./cmd/dsec-agent")
	root, err := os.MkdirTemp("", "dsec-edge-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	store, err := blobstore.NewDir(filepath.Join(root, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := layer.Import(t.Context(), store, image.NewStore(store, store.Refs()), baseImage, testsuite.BusyboxRootfs(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	mounts, err := layer.NewMounts(filepath.Join(root, "layers"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mounts.Close() })
	stateDir := filepath.Join(root, "sandboxes")
	b, err := container.New(container.Options{
		StateDir:     stateDir,
		AgentPath:    agentBin,
		Layers:       mounts,
		CgroupParent: "dsec-edge-test-" + filepath.Base(root),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, d := range b.CgroupDirs() {
			os.Remove(d)
		}
	})
	return &world{store: store, backend: b, layer: m.Layers[0].Digest, stateDir: stateDir}
}

// node is one running Edge behind an HTTP server, with a client for it.
type node struct {
	edge   *edge.Edge
	id     string
	url    string
	client dsecv1connect.EdgeServiceClient
	reg    *prometheus.Registry
}

func (w *world) startNode(t *testing.T, id string, mod func(*edge.Config)) *node {
	t.Helper()
	mux := http.NewServeMux()
	srv := httptest.NewServer(mux)
	reg := prometheus.NewRegistry()
	cfg := edge.Config{
		NodeID:            id,
		DataDir:           t.TempDir(),
		Store:             w.store,
		Backends:          map[runtime.Kind]runtime.Backend{runtime.KindContainer: w.backend},
		AdvertiseURL:      srv.URL,
		ClusterToken:      token,
		HeartbeatInterval: 50 * time.Millisecond,
		Registry:          reg,
		// Room for the many sandboxes of these tests (those that state
		// resources are charged them), which measure other things than
		// capacity unless they set their own.
		Capacity: map[runtime.Kind]placement.Capacity{runtime.KindContainer: {MilliCPU: 1 << 20, MemoryBytes: 1 << 40}},
	}
	if mod != nil {
		mod(&cfg)
	}
	e, err := edge.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.Mount(mux)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if err := e.Close(context.Background()); err != nil {
			t.Errorf("close edge %s: %v", id, err)
		}
		srv.Close()
	})
	return &node{
		edge:   e,
		id:     id,
		url:    srv.URL,
		client: dsecv1connect.NewEdgeServiceClient(srv.Client(), srv.URL, connect.WithInterceptors(edge.ClusterAuth(token))),
		reg:    reg,
	}
}

func tenant(name string) *dsecv1.Caller { return &dsecv1.Caller{Tenant: name} }

var admin = &dsecv1.Caller{Admin: true}

func (n *node) create(t *testing.T, caller *dsecv1.Caller, spec *dsecv1.SandboxSpec) (*dsecv1.Sandbox, error) {
	t.Helper()
	resp, err := n.client.CreateOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreateRequest{
		Caller: caller, SandboxId: ids.NewSandbox(n.id), Spec: spec,
	}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Sandbox, nil
}

func (n *node) mustCreate(t *testing.T, caller *dsecv1.Caller, spec *dsecv1.SandboxSpec) *dsecv1.Sandbox {
	t.Helper()
	sb, err := n.create(t, caller, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	return sb
}

func (n *node) exec(t *testing.T, caller *dsecv1.Caller, id string, req *dsecv1.ExecRequest) (*dsecv1.ExecResult, error) {
	t.Helper()
	req.SandboxId = id
	resp, err := n.client.ExecOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeExecRequest{Caller: caller, Request: req}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Result, nil
}

func (n *node) get(t *testing.T, caller *dsecv1.Caller, id string) (*dsecv1.Sandbox, error) {
	t.Helper()
	resp, err := n.client.GetOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: caller, SandboxId: id}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Sandbox, nil
}

func (n *node) destroy(t *testing.T, caller *dsecv1.Caller, id string) error {
	t.Helper()
	_, err := n.client.DestroyOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: caller, SandboxId: id}))
	return err
}

// waitState polls Get until the sandbox reaches state; the deadline only
// bounds a broken test, it is not what the test measures.
func (n *node) waitState(t *testing.T, id, state string) *dsecv1.Sandbox {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		sb, err := n.get(t, admin, id)
		if err != nil {
			t.Fatalf("get %s: %v", id, err)
		}
		if sb.State == state {
			return sb
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s is %q (reason %q), want %q", id, sb.State, sb.Reason, state)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func wantCode(t *testing.T, err error, code connect.Code, mention string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %v mentioning %q", code, mention)
	}
	if connect.CodeOf(err) != code || !strings.Contains(err.Error(), mention) {
		t.Fatalf("got %v (%v), want %v mentioning %q", connect.CodeOf(err), err, code, mention)
	}
}

func TestEdge(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "n1", nil)
	spec := func() *dsecv1.SandboxSpec { return &dsecv1.SandboxSpec{Image: baseImage} }

	t.Run("lifecycle", func(t *testing.T) {
		s := spec()
		s.Labels = map[string]string{"job": "lifecycle"}
		s.Env = []string{"GREETING=hello"}
		sb := n.mustCreate(t, tenant("a"), s)
		if sb.State != string(edge.StateRunning) || sb.Node != "n1" || sb.Tenant != "a" || sb.Spec.Backend != "container" {
			t.Fatalf("created sandbox: %v", sb)
		}
		if len(sb.Layers) != 1 || sb.Layers[0] != w.layer {
			t.Fatalf("layers %v, want [%s]", sb.Layers, w.layer)
		}

		res, err := n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Shell: "echo $GREETING; cat /etc/dsec-base"})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != string(edge.OutcomeOK) || res.ExitCode != 0 || string(res.Stdout) != "hello\n"+testsuite.BaseMarkerContent {
			t.Fatalf("echo: %v", res)
		}
		res, err = n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"sh", "-c", "echo oops >&2; exit 3"}})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != string(edge.OutcomeFailed) || res.ExitCode != 3 || string(res.Stderr) != "oops\n" {
			t.Fatalf("exit 3: %v", res)
		}
		res, err = n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"sleep", "60"}, Timeout: durationpb.New(100 * time.Millisecond)})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != string(edge.OutcomeTimeout) || !res.TimedOut {
			t.Fatalf("sleep past timeout: %v", res)
		}

		data := []byte("line one\nline two\n")
		if _, err := n.client.WriteFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeWriteFileRequest{
			Caller: tenant("a"), Request: &dsecv1.WriteFileRequest{SandboxId: sb.Id, Path: "/tmp/f.txt", Data: data},
		})); err != nil {
			t.Fatal(err)
		}
		rf, err := n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{
			Caller: tenant("a"), Request: &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/tmp/f.txt"},
		}))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(rf.Msg.Data, data) {
			t.Fatalf("read back %q, want %q", rf.Msg.Data, data)
		}
		res, err = n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"stat", "-c", "%a", "/tmp/f.txt"}})
		if err != nil || strings.TrimSpace(string(res.Stdout)) != "644" {
			t.Fatalf("mode of written file: %v %v", res, err)
		}
		_, err = n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{
			Caller: tenant("a"), Request: &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/no/such/file"},
		}))
		wantCode(t, err, connect.CodeNotFound, "/no/such/file")

		stream, err := n.client.ExecStreamOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeExecRequest{
			Caller: tenant("a"), Request: &dsecv1.ExecRequest{SandboxId: sb.Id, Shell: "echo out; echo err >&2; exit 4"},
		}))
		if err != nil {
			t.Fatal(err)
		}
		var out, errOut bytes.Buffer
		var final *dsecv1.ExecResult
		for stream.Receive() {
			switch ev := stream.Msg().Event.(type) {
			case *dsecv1.ExecStreamResponse_Stdout:
				out.Write(ev.Stdout)
			case *dsecv1.ExecStreamResponse_Stderr:
				errOut.Write(ev.Stderr)
			case *dsecv1.ExecStreamResponse_Result:
				final = ev.Result
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if out.String() != "out\n" || errOut.String() != "err\n" || final == nil || final.ExitCode != 4 || final.Outcome != string(edge.OutcomeFailed) {
			t.Fatalf("stream: stdout %q stderr %q result %v", out.String(), errOut.String(), final)
		}

		list, err := n.client.ListOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeListRequest{
			Caller: tenant("a"), Labels: map[string]string{"job": "lifecycle"},
		}))
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Msg.Sandboxes) != 1 || list.Msg.Sandboxes[0].Id != sb.Id {
			t.Fatalf("list by label: %v", list.Msg.Sandboxes)
		}
		list, err = n.client.ListOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeListRequest{
			Caller: tenant("a"), Labels: map[string]string{"job": "other"},
		}))
		if err != nil || len(list.Msg.Sandboxes) != 0 {
			t.Fatalf("list by non-matching label: %v %v", list, err)
		}

		got, err := n.get(t, tenant("a"), sb.Id)
		if err != nil {
			t.Fatal(err)
		}
		if !got.LastActiveAt.AsTime().After(sb.LastActiveAt.AsTime()) {
			t.Errorf("last_active_at %v did not move past %v after operations", got.LastActiveAt.AsTime(), sb.LastActiveAt.AsTime())
		}

		if err := n.destroy(t, tenant("a"), sb.Id); err != nil {
			t.Fatal(err)
		}
		if got := n.waitState(t, sb.Id, string(edge.StateDestroyed)); got.Id != sb.Id {
			t.Fatal(got)
		}
		if _, err := os.Stat(filepath.Join(w.stateDir, sb.Id)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("sandbox state dir after destroy: %v", err)
		}
		_, err = n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}})
		wantCode(t, err, connect.CodeFailedPrecondition, "destroyed")
		if err := n.destroy(t, tenant("a"), sb.Id); err != nil {
			t.Errorf("second destroy: %v", err)
		}
		if v := metricValue(t, n.reg, "dsec_edge_sandbox_destroys_total", "reason", "request"); v < 1 {
			t.Errorf("destroys{reason=request} = %v", v)
		}
	})

	t.Run("invalid", func(t *testing.T) {
		cases := []struct {
			name    string
			spec    *dsecv1.SandboxSpec
			code    connect.Code
			mention string
		}{
			{"no image", &dsecv1.SandboxSpec{}, connect.CodeInvalidArgument, "spec.image"},
			{"bad image ref", &dsecv1.SandboxSpec{Image: "Not A Ref"}, connect.CodeInvalidArgument, "spec.image"},
			{"bad toolkit", &dsecv1.SandboxSpec{Image: baseImage, Toolkits: []string{"ok:1", "BAD!"}}, connect.CodeInvalidArgument, "spec.toolkits[1]"},
			{"negative cpu", &dsecv1.SandboxSpec{Image: baseImage, Resources: &dsecv1.Resources{MilliCpu: -1}}, connect.CodeInvalidArgument, "spec.resources.milli_cpu"},
			{"negative memory", &dsecv1.SandboxSpec{Image: baseImage, Resources: &dsecv1.Resources{MemoryBytes: -5}}, connect.CodeInvalidArgument, "spec.resources.memory_bytes"},
			{"negative ttl", &dsecv1.SandboxSpec{Image: baseImage, Ttl: durationpb.New(-time.Second)}, connect.CodeInvalidArgument, "spec.ttl"},
			{"bad env", &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"NOEQUALS"}}, connect.CodeInvalidArgument, "spec.env[0]"},
			{"unknown backend", &dsecv1.SandboxSpec{Image: baseImage, Backend: "microvm"}, connect.CodeInvalidArgument, "spec.backend"},
			{"missing image", &dsecv1.SandboxSpec{Image: "nosuch:v1"}, connect.CodeNotFound, "nosuch:v1"},
			{"missing toolkit", &dsecv1.SandboxSpec{Image: baseImage, Toolkits: []string{"tk:9"}}, connect.CodeNotFound, "tk:9"},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				_, err := n.create(t, tenant("a"), c.spec)
				wantCode(t, err, c.code, c.mention)
			})
		}
		_, err := n.client.CreateOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCreateRequest{
			Caller: tenant("a"), SandboxId: ids.NewSandbox("n2"), Spec: spec(),
		}))
		wantCode(t, err, connect.CodeInvalidArgument, "sandbox_id")

		sb := n.mustCreate(t, tenant("a"), spec())
		defer n.destroy(t, admin, sb.Id)
		_, err = n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{})
		wantCode(t, err, connect.CodeInvalidArgument, "request.argv")
		_, err = n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: durationpb.New(-time.Second)})
		wantCode(t, err, connect.CodeInvalidArgument, "request.timeout")
	})

	t.Run("cluster-token", func(t *testing.T) {
		for _, tc := range []struct {
			header string
			code   connect.Code
		}{{"", connect.CodeUnauthenticated}, {"Bearer wrong", connect.CodePermissionDenied}} {
			c := dsecv1connect.NewEdgeServiceClient(http.DefaultClient, n.url)
			req := connect.NewRequest(&dsecv1.EdgeListRequest{Caller: admin})
			if tc.header != "" {
				req.Header().Set("Authorization", tc.header)
			}
			_, err := c.ListOnEdge(t.Context(), req)
			if connect.CodeOf(err) != tc.code {
				t.Errorf("Authorization %q: got %v, want %v", tc.header, err, tc.code)
			}
		}
	})

	t.Run("tenant-isolation", func(t *testing.T) {
		sb := n.mustCreate(t, tenant("a"), spec())
		defer n.destroy(t, admin, sb.Id)
		b := tenant("b")
		_, err := n.get(t, b, sb.Id)
		wantCode(t, err, connect.CodeNotFound, sb.Id)
		_, err = n.exec(t, b, sb.Id, &dsecv1.ExecRequest{Argv: []string{"true"}})
		wantCode(t, err, connect.CodeNotFound, sb.Id)
		_, err = n.client.WriteFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeWriteFileRequest{
			Caller: b, Request: &dsecv1.WriteFileRequest{SandboxId: sb.Id, Path: "/tmp/x", Data: []byte("x")},
		}))
		wantCode(t, err, connect.CodeNotFound, sb.Id)
		_, err = n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{
			Caller: b, Request: &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/etc/passwd"},
		}))
		wantCode(t, err, connect.CodeNotFound, sb.Id)
		err = n.destroy(t, b, sb.Id)
		wantCode(t, err, connect.CodeNotFound, sb.Id)
		// The error for another tenant's sandbox is the one for no sandbox.
		_, errNone := n.get(t, b, ids.NewSandbox("n1"))
		if connect.CodeOf(errNone) != connect.CodeNotFound {
			t.Fatalf("get of an unknown id: %v", errNone)
		}
		list, err := n.client.ListOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeListRequest{Caller: b}))
		if err != nil || len(list.Msg.Sandboxes) != 0 {
			t.Fatalf("tenant b lists %v (%v)", list.Msg.GetSandboxes(), err)
		}
		if got, err := n.get(t, tenant("a"), sb.Id); err != nil || got.State != string(edge.StateRunning) {
			t.Fatalf("owner's get after b's attempts: %v %v", got, err)
		}
		if _, err := n.get(t, admin, sb.Id); err != nil {
			t.Fatalf("admin get: %v", err)
		}
	})

	t.Run("admission", func(t *testing.T) {
		small := w.startNode(t, "small", func(c *edge.Config) {
			c.Capacity = map[runtime.Kind]placement.Capacity{runtime.KindContainer: {MilliCPU: 1000, MemoryBytes: 256 << 20, Sandboxes: 2}}
			c.RequestShare = map[runtime.Kind]placement.Share{runtime.KindContainer: {CPU: 1, Memory: 1}}
			// What a spec without resources gets, and is charged.
			c.Defaults = edgespec.Resources{MilliCPU: 100, MemoryBytes: 64 << 20}
		})
		big := spec()
		big.Resources = &dsecv1.Resources{MemoryBytes: 512 << 20}
		_, err := small.create(t, tenant("a"), big)
		wantCode(t, err, connect.CodeResourceExhausted, "memory_bytes")

		half := func() *dsecv1.SandboxSpec {
			s := spec()
			s.Resources = &dsecv1.Resources{MilliCpu: 600}
			return s
		}
		first := small.mustCreate(t, tenant("a"), half())
		_, err = small.create(t, tenant("a"), half())
		wantCode(t, err, connect.CodeResourceExhausted, "milli_cpu")
		second := small.mustCreate(t, tenant("a"), spec())
		// A spec without resources gets the node's defaults, charged
		// to its capacity like explicit ones.
		if got, want := edgespec.FromProto(second.Spec.GetResources()), (edgespec.Resources{MilliCPU: 100, MemoryBytes: 64 << 20, Pids: edgespec.Builtin.Pids, DiskBytes: edgespec.Builtin.DiskBytes}); got != want {
			t.Errorf("a spec without resources got %+v, want the node's defaults %+v", got, want)
		}
		_, err = small.create(t, tenant("a"), spec())
		wantCode(t, err, connect.CodeResourceExhausted, "sandboxes")

		if err := small.destroy(t, admin, first.Id); err != nil {
			t.Fatal(err)
		}
		third := small.mustCreate(t, tenant("a"), half())
		for _, id := range []string{second.Id, third.Id} {
			if err := small.destroy(t, admin, id); err != nil {
				t.Fatal(err)
			}
		}
		if v := metricValue(t, small.reg, "dsec_edge_sandbox_failures_total", "reason", "admission"); v != 3 {
			t.Errorf("failures{reason=admission} = %v, want 3", v)
		}
	})

	t.Run("ttl", func(t *testing.T) {
		s := spec()
		s.Ttl = durationpb.New(200 * time.Millisecond)
		sb := n.mustCreate(t, tenant("a"), s)
		got := n.waitState(t, sb.Id, string(edge.StateDestroyed))
		if !strings.Contains(got.Reason, "ttl") {
			t.Errorf("reason %q does not mention the ttl", got.Reason)
		}
		if _, err := os.Stat(filepath.Join(w.stateDir, sb.Id)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("sandbox state dir after ttl: %v", err)
		}
	})

	t.Run("idle-timeout", func(t *testing.T) {
		s := spec()
		s.IdleTimeout = durationpb.New(300 * time.Millisecond)
		sb := n.mustCreate(t, tenant("a"), s)
		// An exec that runs longer than the idle timeout keeps the sandbox
		// busy: it must finish normally, not be cut off by the reaper.
		res, err := n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Shell: "sleep 1; echo done"})
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != string(edge.OutcomeOK) || string(res.Stdout) != "done\n" {
			t.Fatalf("long exec in a sandbox with a short idle timeout: %v", res)
		}
		got := n.waitState(t, sb.Id, string(edge.StateDestroyed))
		if !strings.Contains(got.Reason, "idle") {
			t.Errorf("reason %q does not mention idleness", got.Reason)
		}
		if v := metricValue(t, n.reg, "dsec_edge_sandbox_destroys_total", "reason", "idle"); v != 1 {
			t.Errorf("destroys{reason=idle} = %v, want 1", v)
		}
	})

	t.Run("agent-killed", func(t *testing.T) {
		sb := n.mustCreate(t, tenant("a"), spec())
		pid := agentPID(t, w.backend, sb.Id)
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		res, err := n.exec(t, tenant("a"), sb.Id, &dsecv1.ExecRequest{Argv: []string{"echo", "hi"}})
		if err != nil {
			t.Fatalf("exec in a sandbox whose agent died: %v; want an infra_error result", err)
		}
		if res.Outcome != string(edge.OutcomeInfraError) || res.InfraError == "" {
			t.Fatalf("exec result %v, want outcome infra_error with a reason", res)
		}
		got := n.waitState(t, sb.Id, string(edge.StateLost))
		if got.Reason == "" {
			t.Error("lost sandbox has no reason")
		}
		// Everything it held is released once it is known lost.
		deadline := time.Now().Add(30 * time.Second)
		for {
			_, err := os.Stat(filepath.Join(w.stateDir, sb.Id))
			if errors.Is(err, os.ErrNotExist) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("state dir of lost sandbox still there: %v", err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		_, err = n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{
			Caller: tenant("a"), Request: &dsecv1.ReadFileRequest{SandboxId: sb.Id, Path: "/etc/passwd"},
		}))
		wantCode(t, err, connect.CodeFailedPrecondition, "lost")
		if err := n.destroy(t, tenant("a"), sb.Id); err != nil {
			t.Fatal(err)
		}
		n.waitState(t, sb.Id, string(edge.StateDestroyed))
	})

	t.Run("close-destroys-all", func(t *testing.T) {
		tmp := w.startNode(t, "tmp", nil)
		a := tmp.mustCreate(t, tenant("a"), spec())
		b := tmp.mustCreate(t, tenant("b"), spec())
		if err := tmp.edge.Close(t.Context()); err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{a.Id, b.Id} {
			if _, err := os.Stat(filepath.Join(w.stateDir, id)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("sandbox %s state dir after Close: %v", id, err)
			}
		}
		_, err := tmp.create(t, tenant("a"), spec())
		wantCode(t, err, connect.CodeUnavailable, "shutting down")
	})
}

// recorder is a real NodeService that keeps what edges send.
type recorder struct {
	mu    sync.Mutex
	beats []*dsecv1.HeartbeatRequest
	got   chan struct{}
}

func (r *recorder) Heartbeat(_ context.Context, req *connect.Request[dsecv1.HeartbeatRequest]) (*connect.Response[dsecv1.HeartbeatResponse], error) {
	r.mu.Lock()
	r.beats = append(r.beats, req.Msg)
	r.mu.Unlock()
	select {
	case r.got <- struct{}{}:
	default:
	}
	return connect.NewResponse(&dsecv1.HeartbeatResponse{IntervalSeconds: 1}), nil
}

// waitFor returns the first heartbeat (oldest first) that ok accepts.
func (r *recorder) waitFor(t *testing.T, ok func(*dsecv1.HeartbeatRequest) bool) *dsecv1.HeartbeatRequest {
	t.Helper()
	timeout := time.After(30 * time.Second)
	seen := 0
	for {
		r.mu.Lock()
		beats := r.beats[seen:]
		seen = len(r.beats)
		r.mu.Unlock()
		for _, b := range beats {
			if ok(b) {
				return b
			}
		}
		select {
		case <-r.got:
		case <-timeout:
			t.Fatalf("no matching heartbeat among %d received", seen)
		}
	}
}

func startRecorder(t *testing.T) (*recorder, string) {
	r := &recorder{got: make(chan struct{}, 1)}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewNodeServiceHandler(r))
	srv := httptest.NewServer(edge.RequireClusterToken(token, mux))
	t.Cleanup(srv.Close)
	return r, srv.URL
}

// cachedStore is the world's store on a node whose chunk cache holds a
// layer it has not mounted (what lazyfs.Store reports).
type cachedStore struct {
	*blobstore.Dir
	cached []string
}

func (c cachedStore) CachedLayers() []string { return c.cached }

// Heartbeats report the layers a node's chunk cache holds beside the
// mounted ones, so that placement's locality counts them.
func TestHeartbeatReportsCachedLayers(t *testing.T) {
	w := newWorld(t)
	rec, url := startRecorder(t)
	other := "sha256:" + strings.Repeat("ab", 32)
	w.startNode(t, "hbc", func(c *edge.Config) {
		c.Servers = []string{url}
		c.Store = cachedStore{Dir: w.store, cached: []string{other}}
	})
	beat := rec.waitFor(t, func(b *dsecv1.HeartbeatRequest) bool { return len(b.Layers) > 0 })
	if len(beat.Layers) != 1 || beat.Layers[0] != other {
		t.Fatalf("layers %v, want the cached %s", beat.Layers, other)
	}
}

func TestHeartbeats(t *testing.T) {
	w := newWorld(t)
	rec1, url1 := startRecorder(t)
	rec2, url2 := startRecorder(t)
	n := w.startNode(t, "hb", func(c *edge.Config) {
		c.Servers = []string{url1, url2}
		c.Capacity = map[runtime.Kind]placement.Capacity{runtime.KindContainer: {MilliCPU: 8000, MemoryBytes: 16 << 30, Sandboxes: 100}}
	})
	s := &dsecv1.SandboxSpec{Image: baseImage, Labels: map[string]string{"k": "v"}, Resources: &dsecv1.Resources{MilliCpu: 500, MemoryBytes: 64 << 20}}
	sb := n.mustCreate(t, tenant("a"), s)

	for i, rec := range []*recorder{rec1, rec2} {
		// Measured memory lags by up to a sample interval.
		beat := rec.waitFor(t, func(b *dsecv1.HeartbeatRequest) bool {
			return len(b.Sandboxes) == 1 && b.Sandboxes[0].State == string(edge.StateRunning) &&
				len(b.Capacity) == 1 && b.Capacity[0].UsedMemoryBytes > 0
		})
		if beat.NodeId != "hb" || beat.Url != n.url || beat.BootId == "" {
			t.Errorf("server %d: heartbeat identity %q %q %q", i, beat.NodeId, beat.Url, beat.BootId)
		}
		if len(beat.Capacity) != 1 {
			t.Fatalf("server %d: capacity %v", i, beat.Capacity)
		}
		if d := edgespec.FromProto(beat.GetDefaults()); d != edgespec.Builtin {
			t.Errorf("server %d: heartbeat defaults %+v, want the built-in %+v", i, d, edgespec.Builtin)
		}
		// The default share charges measured use only: no CPU, the
		// sandboxes' measured memory (an idle agent's few MiB), and
		// the requests are reported beside it.
		c := beat.Capacity[0]
		if c.Backend != "container" || c.MilliCpu != 8000 || c.MemoryBytes != 16<<30 || c.Sandboxes != 100 ||
			c.UsedMilliCpu != 0 || c.UsedMemoryBytes <= 0 || c.UsedMemoryBytes >= 64<<20 || c.UsedSandboxes != 1 ||
			c.RequestedMilliCpu != 500 || c.RequestedMemoryBytes != 64<<20 || c.RequestShareCpu != 0 || c.RequestShareMemory != 0 {
			t.Errorf("server %d: capacity %v", i, c)
		}
		if st := beat.GetStatus(); st.GetMemoryTotalBytes() <= 0 || st.GetMaxOpenFiles() <= 0 || st.GetOpenFiles() <= 0 ||
			st.GetThreads() <= 0 || st.GetMaxThreads() <= 0 || st.GetFull() != "" {
			t.Errorf("server %d: node status %v", i, st)
		}
		if len(beat.Layers) != 1 || beat.Layers[0] != w.layer {
			t.Errorf("server %d: layers %v, want [%s]", i, beat.Layers, w.layer)
		}
		got := beat.Sandboxes[0]
		if got.Id != sb.Id || got.Tenant != "a" || got.State != string(edge.StateRunning) || got.Labels["k"] != "v" ||
			got.MilliCpu != 500 || got.MemoryBytes != 64<<20 || got.Backend != "container" {
			t.Errorf("server %d: summary %v", i, got)
		}
	}

	// The same state as metrics.
	fams, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.Metric {
			key := f.GetName()
			for _, l := range m.Label {
				key += "," + l.GetName() + "=" + l.GetValue()
			}
			seen[key] = m.GetGauge().GetValue()
		}
	}
	for _, k := range []string{"dsec_edge_node_limit,kind=max,resource=open_files", "dsec_edge_node_memory_bytes,backend=container,kind=sandboxes", "dsec_edge_node_memory_bytes,backend=,kind=available"} {
		if seen[k] <= 0 {
			t.Errorf("metric %s = %v, want > 0", k, seen[k])
		}
	}
	if v, ok := seen["dsec_edge_node_full"]; !ok || v != 0 {
		t.Errorf("dsec_edge_node_full = %v (present %v), want 0", v, ok)
	}
	if v := metricValue(t, n.reg, "dsec_edge_sandboxes", "state", string(edge.StateRunning)); v != 1 {
		t.Errorf("sandboxes{state=running} = %v, want 1", v)
	}
	// A create leaves creating where it was (it once went -1 per create).
	if v := metricValue(t, n.reg, "dsec_edge_sandboxes", "state", string(edge.StateCreating)); v != 0 {
		t.Errorf("sandboxes{state=creating} after a create = %v, want 0", v)
	}
	if err := n.destroy(t, tenant("a"), sb.Id); err != nil {
		t.Fatal(err)
	}
	if v := metricValue(t, n.reg, "dsec_edge_sandboxes", "state", string(edge.StateRunning)); v != 0 {
		t.Errorf("sandboxes{state=running} after destroy = %v, want 0", v)
	}
	beat := rec1.waitFor(t, func(b *dsecv1.HeartbeatRequest) bool { return len(b.Sandboxes) == 0 })
	if c := beat.Capacity[0]; c.UsedSandboxes != 0 || c.UsedMilliCpu != 0 || len(beat.Layers) != 0 {
		t.Errorf("after destroy: capacity %v layers %v", c, beat.Layers)
	}
	if v := metricValue(t, n.reg, "dsec_edge_heartbeats_total", "result", "ok"); v < 2 {
		t.Errorf("heartbeats{result=ok} = %v", v)
	}
}

// metricValue sums the counters or gauges of family name whose label has value.
func metricValue(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var total float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.Metric {
			for _, l := range m.Label {
				if l.GetName() == label && l.GetValue() == value {
					total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
				}
			}
		}
	}
	return total
}

// agentPID finds PID 1 of sandbox id's PID namespace (the dsec-agent) from
// the sandbox's cgroup.
func agentPID(t *testing.T, b *container.Backend, id string) int {
	t.Helper()
	pid, ok := b.AgentPID(id)
	if !ok {
		t.Fatalf("no agent process for sandbox %s", id)
	}
	return pid
}
