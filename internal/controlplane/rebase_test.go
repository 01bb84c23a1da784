package controlplane

import (
	"testing"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// TestRebaseRouting: a node whose heartbeat reports a ready sandbox in a
// tenant's rebase pool (edge.RebaseKey) gets that tenant's next create of
// any container spec, although another node is less loaded; the sandbox is
// taken from the pool (its ready count drops), and another tenant's create
// goes by load as before.
func TestRebaseRouting(t *testing.T) {
	c := newCluster(t)
	c.autoPool = 4
	// n1 is small: one sandbox there weighs more than holding the image
	// (placement's locality weight) against an empty n2.
	// Memory is plenty on both: every sandbox gets a default of 1 GiB,
	// which must not weigh in the comparison.
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, MemoryBytes: 1 << 40, Sandboxes: 8}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	alice := c.createTenant("alice", nil)
	bob := c.createTenant("bob", nil)
	var onN1 []*dsecv1.Sandbox
	for _, env := range []string{"A=1", "A=2"} {
		sb, err := c.create(alice, &dsecv1.SandboxSpec{Image: "busybox:1", Env: []string{env}})
		if err != nil {
			t.Fatal(err)
		}
		onN1 = append(onN1, sb)
	}
	// n2 joins empty: by load every create goes there from now on.
	c.addEdge("n2", placement.Capacity{MilliCPU: 1_000_000, MemoryBytes: 1 << 40, Sandboxes: 64}, placement.Share{})
	if err := c.destroy(alice, onN1[0].GetId()); err != nil {
		t.Fatal(err)
	}
	key := edge.RebaseKey(false)
	c.waitFor("n1 to report alice's quiesced sandbox", func() bool {
		w := c.srv.reg.warmNodes(key, "alice")
		return len(w) == 1 && w[0] == "n1"
	})
	if w := c.srv.reg.warmNodes(key, "bob"); len(w) != 0 {
		t.Fatalf("bob is offered alice's rebase pool on %v", w)
	}

	sb, err := c.create(alice, &dsecv1.SandboxSpec{Image: "busybox:1", Env: []string{"A=3"}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.GetNode() != "n1" {
		t.Fatalf("alice's create went to %s, not n1 where a sandbox of hers waits to be rebased", sb.GetNode())
	}
	if res, err := c.exec(alice, sb.GetId(), "sh", "-c", "echo $A; hostname"); err != nil ||
		string(res.GetStdout()) != "3\n"+sb.GetId()[:min(63, len(sb.GetId()))]+"\n" {
		t.Fatalf("rebased sandbox: %v, %v", res, err)
	}
	c.waitFor("n1's rebase pool to be reported empty", func() bool {
		return len(c.srv.reg.warmNodes(key, "alice")) == 0
	})

	// bob has no rebase pool anywhere: his create goes by load, to n2.
	other, err := c.create(bob, &dsecv1.SandboxSpec{Image: "busybox:1"})
	if err != nil {
		t.Fatal(err)
	}
	if other.GetNode() != "n2" {
		t.Errorf("bob's create went to %s, want the less loaded n2", other.GetNode())
	}
}
