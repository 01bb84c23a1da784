package edge_test

import (
	"strings"
	"testing"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
)

// TestRecycling: with Config.AutoPool, a destroyed sandbox of a hot spec is
// reset and serves the next create of that spec by the same tenant, clean;
// a cold spec's sandbox is torn down, and another tenant never gets a
// recycled one.
func TestRecycling(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "ap1", func(c *edge.Config) { c.AutoPool = 4 })
	spec := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"R=1"}}
	hostname := func(id string) string {
		return strings.TrimSpace(n.sh(t, id, "cat /proc/sys/kernel/hostname"))
	}

	// First create of the spec: not hot, so its destroy tears it down.
	a := n.mustCreate(t, tenant("a"), spec)
	ha := hostname(a.Id)
	if err := n.destroy(t, tenant("a"), a.Id); err != nil {
		t.Fatal(err)
	}
	b := n.mustCreate(t, tenant("a"), spec)
	hb := hostname(b.Id)
	if hb == ha {
		t.Fatalf("a cold spec's sandbox was recycled (hostname %s)", hb)
	}
	// The spec is hot now: b is recycled when destroyed.
	n.sh(t, b.Id, "echo secret > /root/secret; (setsid sleep 1000 >/dev/null 2>&1 &); true")
	if err := n.destroy(t, tenant("a"), b.Id); err != nil {
		t.Fatal(err)
	}
	c := n.mustCreate(t, tenant("a"), spec)
	if hc := hostname(c.Id); hc != hb {
		t.Fatalf("the next create of a hot spec got hostname %s, not the recycled %s", hc, hb)
	}
	out := n.sh(t, c.Id, "cat /root/secret 2>&1; ps -o args | grep -c '[s]leep 1000'; echo $R; true")
	if strings.Contains(out, "secret\n") || !strings.HasSuffix(out, "0\n1\n") {
		t.Fatalf("a recycled sandbox shows its previous user's state:\n%s", out)
	}
	if got, err := n.get(t, tenant("a"), c.Id); err != nil || got.State != "running" {
		t.Fatalf("recycled sandbox: %v, %v", got, err)
	}

	// Another tenant with the same spec gets a fresh sandbox, even with
	// one recycled and ready.
	if err := n.destroy(t, tenant("a"), c.Id); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if recycledReady(n) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the recycled sandbox never became ready")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for range 2 {
		o := n.mustCreate(t, tenant("b"), spec)
		if h := hostname(o.Id); h == hb {
			t.Fatalf("tenant b got tenant a's recycled sandbox (hostname %s)", h)
		}
	}
	if recycledReady(n) != 1 {
		t.Fatalf("tenant b's creates took tenant a's recycled sandbox")
	}
}

// recycledReady counts ready sandboxes of the node's automatic pools, as its
// heartbeat reports them.
func recycledReady(n *node) int {
	ready := 0
	for _, p := range n.edge.PoolSummaries() {
		if strings.HasPrefix(p.Id, "auto-") {
			ready += int(p.Ready)
		}
	}
	return ready
}
