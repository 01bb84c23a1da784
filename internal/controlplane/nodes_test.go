package controlplane

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// TestListNodes: the operators' view. ListNodes describes both real edges
// from their heartbeats (capacity, charge, requests, measured state, and
// sandboxes counted by backend and state), refuses a tenant's token, the
// same figures are gauges per node, List shows each sandbox's own use,
// and a node that stops heartbeating turns dead with its sandboxes lost.
func TestListNodes(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	// n1 reserves requests (a share of 1), n2 charges measured use only.
	c.addEdge("n1", placement.Capacity{MilliCPU: 4000, MemoryBytes: 8 << 30, Sandboxes: 4}, placement.Share{CPU: 1, Memory: 1})
	c.addEdge("n2", placement.Capacity{MilliCPU: 3000, MemoryBytes: 4 << 30, Sandboxes: 4}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	alice := c.createTenant("alice", nil)
	cluster := dsecv1connect.NewClusterServiceClient(http.DefaultClient, c.url)
	list := func(token string) ([]*dsecv1.Node, error) {
		resp, err := cluster.ListNodes(ctx, req(token, &dsecv1.ListNodesRequest{}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetNodes(), nil
	}

	// Tenants do not see the nodes; nobody does without a token.
	_, err := list(alice)
	wantCode(t, err, connect.CodePermissionDenied, "admin")
	_, err = cluster.ListNodes(ctx, connect.NewRequest(&dsecv1.ListNodesRequest{}))
	wantCode(t, err, connect.CodeUnauthenticated, "")

	// Six sandboxes of 0.5 core and 64 MiB: both nodes get some (four
	// slots each); one is frozen.
	spec := &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 500, MemoryBytes: 64 << 20}}
	var sbs []*dsecv1.Sandbox
	perNode := map[string]int64{}
	for range 6 {
		sb, err := c.create(alice, spec)
		if err != nil {
			t.Fatal(err)
		}
		sbs = append(sbs, sb)
		perNode[sb.GetNode()]++
	}
	if perNode["n1"] == 0 || perNode["n2"] == 0 {
		t.Fatalf("sandboxes per node %v, want both nodes", perNode)
	}
	frozen := sbs[0]
	if _, err := c.clients.sb.Freeze(ctx, req(alice, &dsecv1.FreezeRequest{SandboxId: frozen.GetId()})); err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]int64{"n1": {}, "n2": {}}
	for _, sb := range sbs {
		st := "running"
		if sb.GetId() == frozen.GetId() {
			st = "frozen"
		}
		want[sb.GetNode()]["container/"+st]++
	}
	counts := func(n *dsecv1.Node) map[string]int64 {
		out := map[string]int64{}
		for _, sc := range n.GetSandboxes() {
			out[sc.GetBackend()+"/"+sc.GetState()] += sc.GetCount()
		}
		return out
	}
	same := func(a, b map[string]int64) bool { return fmt.Sprint(a) == fmt.Sprint(b) }
	var nodes []*dsecv1.Node
	c.waitFor("heartbeats reporting every sandbox in its state", func() bool {
		nodes = c.srv.reg.nodeList()
		return len(nodes) == 2 && same(counts(nodes[0]), want["n1"]) && same(counts(nodes[1]), want["n2"])
	})
	nodes, err = list(c.admin)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 2 || nodes[0].GetId() != "n1" || nodes[1].GetId() != "n2" {
		t.Fatalf("nodes %v, want n1 and n2 in order", nodes)
	}
	for _, n := range nodes {
		id := n.GetId()
		if !n.GetAlive() || n.GetLastHeartbeatAt() == nil || n.GetUrl() != c.edges[id].hs.URL || n.GetFull() != "" {
			t.Errorf("%s: alive %v, heartbeat %v, url %q (want %q), full %q", id, n.GetAlive(), n.GetLastHeartbeatAt(), n.GetUrl(), c.edges[id].hs.URL, n.GetFull())
		}
		if !same(counts(n), want[id]) {
			t.Errorf("%s: sandboxes %v, want %v", id, counts(n), want[id])
		}
		if len(n.GetBackends()) != 1 {
			t.Fatalf("%s: backends %v", id, n.GetBackends())
		}
		b, k := n.GetBackends()[0], perNode[id]
		if b.GetBackend() != "container" || b.GetChargedSandboxes() != k || b.GetRequestedMilliCpu() != 500*k || b.GetRequestedMemoryBytes() != k*64<<20 {
			t.Errorf("%s: backend %v, want %d sandboxes requesting 0.5 core and 64 MiB each", id, b, k)
		}
		// Each node charges requests by its own share: all of them on n1,
		// none on n2 (memory: what its sandboxes measure, a few MiB).
		switch id {
		case "n1":
			if b.GetMilliCpu() != 4000 || b.GetSandboxes() != 4 || b.GetRequestShareCpu() != 1 ||
				b.GetChargedMilliCpu() != 500*k || b.GetChargedMemoryBytes() < k*64<<20 {
				t.Errorf("n1: backend %v", b)
			}
		case "n2":
			if b.GetMilliCpu() != 3000 || b.GetMemoryBytes() != 4<<30 || b.GetRequestShareCpu() != 0 ||
				b.GetChargedMilliCpu() != 0 || b.GetChargedMemoryBytes() >= k*64<<20 {
				t.Errorf("n2: backend %v", b)
			}
		}
		if b.GetUsedMemoryBytes() <= 0 {
			t.Errorf("%s: the sandboxes' measured memory %d", id, b.GetUsedMemoryBytes())
		}
		m := n.GetMeasured()
		if m.GetMemoryTotalBytes() <= 0 || m.GetMemoryUsedBytes() <= 0 || m.GetMemoryAvailableBytes() <= 0 ||
			m.GetOpenFiles() <= 0 || m.GetMaxOpenFiles() < m.GetOpenFiles() || m.GetThreads() <= 0 || m.GetMaxThreads() < m.GetThreads() ||
			m.GetSwapUsedBytes() > m.GetSwapTotalBytes() {
			t.Errorf("%s: measured %v", id, m)
		}
	}

	// Each sandbox's own use, through List: one holds 32 MiB.
	holder := sbs[1]
	if res, err := c.exec(alice, holder.GetId(), "sh", "-c", "head -c 32m /dev/zero > /dev/shm/hold"); err != nil || res.GetExitCode() != 0 {
		t.Fatalf("fill /dev/shm: %v %v", res, err)
	}
	c.waitFor("List showing what the sandbox holds", func() bool {
		return byID(c.list(alice, nil))[holder.GetId()].GetUsage().GetMemoryBytes() >= 32<<20
	})
	for id, sb := range byID(c.list(alice, nil)) {
		if sb.GetUsage().GetMemoryBytes() <= 0 || sb.GetUsage().GetMeasuredAt() == nil {
			t.Errorf("sandbox %s: usage %v", id, sb.GetUsage())
		}
	}

	// The same figures as gauges per node.
	for _, id := range []string{"n1", "n2"} {
		for key, n := range want[id] {
			backend, state, _ := strings.Cut(key, "/")
			if got := c.metric("dsec_server_node_sandboxes", map[string]string{"node": id, "backend": backend, "state": state}); got != float64(n) {
				t.Errorf("dsec_server_node_sandboxes{node=%s,state=%s} = %v, want %d", id, state, got, n)
			}
		}
		for _, m := range []struct {
			name   string
			labels map[string]string
		}{
			{"dsec_server_node_alive", nil},
			{"dsec_server_node_memory_bytes", map[string]string{"backend": "", "kind": "total"}},
			{"dsec_server_node_memory_bytes", map[string]string{"backend": "container", "kind": "sandboxes"}},
			{"dsec_server_node_cpu_millis", map[string]string{"backend": "container", "kind": "capacity"}},
			{"dsec_server_node_sandbox_slots", map[string]string{"backend": "container", "kind": "charged"}},
			{"dsec_server_node_limit", map[string]string{"resource": "open_files", "kind": "max"}},
		} {
			labels := map[string]string{"node": id}
			for k, v := range m.labels {
				labels[k] = v
			}
			if got := c.metric(m.name, labels); got <= 0 {
				t.Errorf("%s%v = %v, want > 0", m.name, labels, got)
			}
		}
	}
	if got := c.metric("dsec_server_node_full", map[string]string{"node": "n1"}); got != 0 {
		t.Errorf("dsec_server_node_full{node=n1} = %v", got)
	}
	// The server learns of use from heartbeats, which may lag List (the
	// edge's own figure) by one.
	c.waitFor("dsec_server_tenant_memory_bytes{tenant=alice} at least the 32 MiB one sandbox holds", func() bool {
		return c.metric("dsec_server_tenant_memory_bytes", map[string]string{"tenant": "alice", "kind": "used"}) >= 32<<20
	})

	// n2 stops heartbeating: past the node timeout it is dead, with its
	// sandboxes lost.
	c.edges["n2"].stop()
	c.offset.Add(int64(2 * c.srv.cfg.NodeTimeout))
	// (A heartbeat n2 sent before it stopped may be handled after the
	// clock moved: then n2 dies a node timeout later.)
	c.waitFor("n1 alive again and n2 dead", func() bool {
		r1, _ := c.srv.reg.route("n1-0000000000000000")
		r2, _ := c.srv.reg.route("n2-0000000000000000")
		return r1.alive && !r2.alive
	})
	nodes, err = list(c.admin)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 2 || !nodes[0].GetAlive() || nodes[1].GetAlive() {
		t.Fatalf("after n2 stopped: %v", nodes)
	}
	if got, want := counts(nodes[1]), map[string]int64{"container/lost": perNode["n2"]}; !same(got, want) {
		t.Errorf("dead n2's sandboxes %v, want %v", got, want)
	}
	if got := c.metric("dsec_server_node_alive", map[string]string{"node": "n2"}); got != 0 {
		t.Errorf("dsec_server_node_alive{node=n2} = %v, want 0", got)
	}
	if got := c.metric("dsec_server_node_memory_bytes", map[string]string{"node": "n2"}); got != 0 {
		t.Errorf("a dead node's measured memory is still exported: %v", got)
	}
}
