package edge_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/pool"
)

// TestRecycling: with Config.AutoPool, a destroyed sandbox of a hot spec is
// reset and serves the next create of that spec by the same tenant, clean;
// a cold spec's sandbox goes to no automatic pool (but to the rebase pool:
// see TestRebase), and another tenant never gets a recycled one.
func TestRecycling(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "ap1", func(c *edge.Config) { c.AutoPool = 4 })
	spec := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"R=1"}}
	hostname := func(id string) string {
		return strings.TrimSpace(n.sh(t, id, "cat /proc/sys/kernel/hostname"))
	}

	// First create of the spec: not hot, so its destroy hands it to no
	// automatic pool. It goes to the rebase pool, and the next create
	// (waiting until it is there, for a deterministic count) rebases it:
	// the hostname is the new sandbox's, not the recycled one's.
	a := n.mustCreate(t, tenant("a"), spec)
	ha := hostname(a.Id)
	if err := n.destroy(t, tenant("a"), a.Id); err != nil {
		t.Fatal(err)
	}
	waitRebaseReady(t, n, "a", 1)
	b := n.mustCreate(t, tenant("a"), spec)
	hb := hostname(b.Id)
	if hb == ha || recycledReady(n) != 0 || len(n.edge.AutoPoolStats("a")) != 0 {
		t.Fatalf("a cold spec's sandbox was recycled (hostname %s) or pooled: %+v", hb, n.edge.AutoPoolStats("a"))
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
	// The creates metric tells the recycled create from the others.
	if f, rb, r := metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "fresh"),
		metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "rebased"),
		metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "recycled"); f != 1 || rb != 1 || r != 1 {
		t.Fatalf("creates by source: fresh %v, rebased %v, recycled %v; want 1, 1 and 1", f, rb, r)
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

// TestRecyclingFollowsDemand: an automatic pool keeps as many as its spec
// had alive at once, not only Config.AutoPool. With more sandboxes of one
// hot spec than the floor created, all destroyed and created again, every
// destroyed one is reset and kept (none torn down) and the second wave is
// all recycled (none created fresh). A fixed cap of AutoPool tore down all
// but AutoPool of them.
func TestRecyclingFollowsDemand(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "ap2", func(c *edge.Config) { c.AutoPool = edge.DefaultAutoPool })
	spec := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"WAVE=1"}}
	const k = edge.DefaultAutoPool + 16

	first := createWave(t, n, tenant("a"), spec, k)
	hosts := map[string]bool{}
	for _, id := range first {
		hosts[hostnameOf(t, n, id)] = true
	}
	destroyWave(t, n, tenant("a"), first)
	st := settledAutoPool(t, n, "a")
	if st.Ready != k || st.Destroyed != 0 || st.Size < k {
		t.Fatalf("after %d of a hot spec were destroyed, its pool has %d ready and tore down %d (cap %d); want all %d kept", k, st.Ready, st.Destroyed, st.Size, k)
	}

	second := createWave(t, n, tenant("a"), spec, k)
	after := onlyAutoPool(t, n, "a")
	if hits := after.Hits - st.Hits; hits != k || after.Misses != st.Misses {
		t.Fatalf("second wave of %d: %d took a recycled sandbox, %d more missed; want all recycled", k, hits, after.Misses-st.Misses)
	}
	for _, id := range second {
		if h := hostnameOf(t, n, id); !hosts[h] {
			t.Fatalf("second-wave sandbox %s has hostname %s, not one of the first wave's: created fresh", id, h)
		}
	}
	destroyWave(t, n, tenant("a"), second)
	if st := settledAutoPool(t, n, "a"); st.Ready != k || st.Destroyed != 0 {
		t.Fatalf("after the second wave: %d ready, %d torn down; want %d, 0", st.Ready, st.Destroyed, k)
	}
}

// TestRecyclingCapFollowsDemandDown: once a spec's demand falls, its pool's
// cap comes back to the floor within two autoPoolIdle windows and the extra
// ready sandboxes are destroyed.
func TestRecyclingCapFollowsDemandDown(t *testing.T) {
	t.Cleanup(edge.SetAutoPoolIdle(2 * time.Second)) // after the node closes
	w := newWorld(t)
	const floor, k = 2, 6
	n := w.startNode(t, "ap3", func(c *edge.Config) { c.AutoPool = floor })
	spec := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"WAVE=2"}}

	destroyWave(t, n, tenant("a"), createWave(t, n, tenant("a"), spec, k))
	if st := settledAutoPool(t, n, "a"); st.Ready != k || st.Size != k {
		t.Fatalf("after a wave of %d: %d ready, cap %d; want %d, %d", k, st.Ready, st.Size, k, k)
	}
	// One at a time from now on: the demand is 1, so the cap falls to the
	// floor once the wave's peak is two windows old.
	deadline := time.Now().Add(30 * time.Second)
	for onlyAutoPool(t, n, "a").Size != floor {
		if time.Now().After(deadline) {
			t.Fatalf("the cap stayed %d with one sandbox in use at a time; want %d", onlyAutoPool(t, n, "a").Size, floor)
		}
		sb := n.mustCreate(t, tenant("a"), spec)
		if err := n.destroy(t, tenant("a"), sb.Id); err != nil {
			t.Fatal(err)
		}
	}
	if st := settledAutoPool(t, n, "a"); st.Ready > floor || st.Destroyed < k-floor {
		t.Fatalf("cap back at %d: %d ready, %d destroyed; want at most %d ready", floor, st.Ready, st.Destroyed, floor)
	}
}

// TestRecyclingColdSpecEmpties: a pool grown to a wave's demand still
// destroys every ready sandbox and goes away once its spec has not been
// created for autoPoolIdle.
func TestRecyclingColdSpecEmpties(t *testing.T) {
	t.Cleanup(edge.SetAutoPoolIdle(2 * time.Second)) // after the node closes
	w := newWorld(t)
	const k = 5
	n := w.startNode(t, "ap4", func(c *edge.Config) { c.AutoPool = 2 })
	spec := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"WAVE=3"}}

	ids := createWave(t, n, tenant("a"), spec, k)
	destroyWave(t, n, tenant("a"), ids)
	if st := settledAutoPool(t, n, "a"); st.Ready != k {
		t.Fatalf("after a wave of %d: %d ready; want all", k, st.Ready)
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(n.edge.AutoPoolStats("a")) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("a cold spec's pool stayed: %+v", n.edge.AutoPoolStats("a"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, id := range ids {
		if _, err := os.Stat(filepath.Join(w.stateDir, id)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("sandbox %s of a cold spec's closed pool left state behind: %v", id, err)
		}
	}
}

// createWave creates k sandboxes of spec for caller, a few at a time, and
// returns their IDs.
func createWave(t *testing.T, n *node, caller *dsecv1.Caller, spec *dsecv1.SandboxSpec, k int) []string {
	t.Helper()
	ids := make([]string, k)
	errs := make([]error, k)
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for i := range k {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			sb, err := n.create(t, caller, spec)
			if err == nil {
				ids[i] = sb.Id
			}
			errs[i] = err
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, id := range ids {
			if id != "" {
				n.destroy(t, caller, id)
			}
		}
		t.Fatalf("create wave: %v", err)
	}
	return ids
}

// destroyWave destroys the sandboxes ids of caller.
func destroyWave(t *testing.T, n *node, caller *dsecv1.Caller, ids []string) {
	t.Helper()
	for _, id := range ids {
		if err := n.destroy(t, caller, id); err != nil {
			t.Fatal(err)
		}
	}
}

func hostnameOf(t *testing.T, n *node, id string) string {
	t.Helper()
	return strings.TrimSpace(n.sh(t, id, "cat /proc/sys/kernel/hostname"))
}

// onlyAutoPool returns the counters of tenant's one automatic pool.
func onlyAutoPool(t *testing.T, n *node, tenant string) pool.Stats {
	t.Helper()
	return onlyPool(t, "automatic", tenant, n.edge.AutoPoolStats(tenant))
}

// onlyPool returns the one pool of sts, tenant's pools of one kind.
func onlyPool(t *testing.T, kind, tenant string, sts []pool.Stats) pool.Stats {
	t.Helper()
	if len(sts) != 1 {
		t.Fatalf("tenant %s has %d %s pools, want 1", tenant, len(sts), kind)
	}
	return sts[0]
}

// settledAutoPool waits until tenant's one automatic pool has nothing in
// use, being reset or being destroyed, and returns its counters; the
// deadline only bounds a broken test.
func settledAutoPool(t *testing.T, n *node, tenant string) pool.Stats {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st := onlyAutoPool(t, n, tenant)
		if st.InUse == 0 && st.Resetting == 0 && st.Destroying == 0 {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("tenant %s's automatic pool never settled: %+v", tenant, st)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
