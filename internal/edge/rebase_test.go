package edge_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/pool"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// TestRebase: with Config.AutoPool, a destroyed sandbox of a spec nobody
// recycles (created once) is kept, quiesced, for its tenant, and the
// tenant's next create of another spec (other layers, env and resources)
// takes it and rebases it: the same agent, but in every way the new spec's
// sandbox, with none of its previous user's files or processes. Another
// tenant never gets it, and a rebased sandbox destroyed is rebased again.
func TestRebase(t *testing.T) {
	w := newWorld(t)
	w.importWorkspace(t, "ws-a:1", map[string]string{"work/a.txt": "from a\n"})
	w.importWorkspace(t, "ws-b:1", map[string]string{"work/b.txt": "from b\n"})
	n := w.startNode(t, "rb1", func(c *edge.Config) { c.AutoPool = 4 })
	specA := &dsecv1.SandboxSpec{Image: baseImage, Workspace: "ws-a:1", Env: []string{"TASK=a"}}
	specB := &dsecv1.SandboxSpec{Image: baseImage, Workspace: "ws-b:1", Env: []string{"TASK=b"},
		Resources: &dsecv1.Resources{MemoryBytes: 96 << 20}}
	specC := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=c"}}

	a := n.mustCreate(t, tenant("a"), specA)
	agent := agentPID(t, w.backend, a.Id)
	if got := n.sh(t, a.Id, "cat /work/a.txt"); got != "from a\n" {
		t.Fatalf("sandbox of spec A: /work/a.txt is %q", got)
	}
	n.sh(t, a.Id, "echo secret > /root/secret; (setsid sleep 1000 >/dev/null 2>&1 &); true")
	if err := n.destroy(t, tenant("a"), a.Id); err != nil {
		t.Fatal(err)
	}
	waitRebaseReady(t, n, "a", 1)

	// Tenant a creates spec B: A's sandbox, rebased.
	b := n.mustCreate(t, tenant("a"), specB)
	wantCreates(t, n, 1, 1)
	if pid, ok := w.backend.AgentPID(a.Id); !ok || pid != agent {
		t.Fatalf("the create of spec B started agent %d (%v); want A's agent %d, rebased", pid, ok, agent)
	}
	if h := hostnameOf(t, n, b.Id); h != b.Id[:min(len(b.Id), 63)] {
		t.Fatalf("rebased sandbox %s has hostname %s", b.Id, h)
	}
	out := n.sh(t, b.Id, "cat /work/b.txt; test -e /work/a.txt && echo A-files; cat /root/secret 2>/dev/null; ps -o args | grep -c '[s]leep 1000'; echo $TASK; true")
	if out != "from b\n0\nb\n" {
		t.Fatalf("rebased sandbox of spec B, want B's files and env and nothing of A's:\n%s", out)
	}
	if got := testutil.MemoryLimit(t, agent); got != strconv.Itoa(96<<20) {
		t.Fatalf("rebased sandbox's memory limit is %s, want spec B's %d", got, 96<<20)
	}
	if got, err := n.get(t, tenant("a"), b.Id); err != nil || got.State != string(edge.StateRunning) || len(got.Layers) != 2 {
		t.Fatalf("rebased sandbox: %v, %v", got, err)
	}
	if st := onlyRebasePool(t, n, "a"); st.InUse != 0 || st.Ready != 0 || st.Detached != 1 {
		t.Fatalf("after the take the rebase pool still accounts for the sandbox: %+v", st)
	}

	// B (created once: not hot) goes back to the rebase pool when
	// destroyed. Another tenant's creates never get it.
	if err := n.destroy(t, tenant("a"), b.Id); err != nil {
		t.Fatal(err)
	}
	waitRebaseReady(t, n, "a", 1)
	o := n.mustCreate(t, tenant("b"), specC)
	wantCreates(t, n, 2, 1)
	if _, ok := w.backend.AgentPID(o.Id); !ok {
		t.Fatalf("tenant b's sandbox %s has no agent of its own: it took tenant a's", o.Id)
	}
	if st := onlyRebasePool(t, n, "a"); st.Ready != 1 {
		t.Fatalf("tenant b's create took from tenant a's rebase pool: %+v", st)
	}

	// Tenant a again, spec C: the same agent, rebased a second time.
	c := n.mustCreate(t, tenant("a"), specC)
	wantCreates(t, n, 2, 2)
	if pid, ok := w.backend.AgentPID(a.Id); !ok || pid != agent {
		t.Fatalf("the create of spec C started agent %d (%v); want A's agent %d, rebased again", pid, ok, agent)
	}
	out = n.sh(t, c.Id, "cat /proc/sys/kernel/hostname; ls /work 2>&1 | grep -c txt; echo $TASK; true")
	if want := c.Id[:min(len(c.Id), 63)] + "\n0\nc\n"; out != want {
		t.Fatalf("sandbox rebased onto spec C: got\n%s\nwant\n%s", out, want)
	}
	if got := testutil.MemoryLimit(t, agent); got == strconv.Itoa(96<<20) {
		t.Fatalf("spec C sets no memory limit, but the rebased sandbox keeps spec B's %s", got)
	}
	// A rollback re-creates the sandbox under its runtime ID (A's) but
	// keeps its own hostname.
	ck, err := n.client.CheckpointOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeCheckpointRequest{Caller: tenant("a"),
		Request: &dsecv1.CheckpointRequest{SandboxId: c.Id}}))
	if err != nil {
		t.Fatal(err)
	}
	n.sh(t, c.Id, "echo later > /root/later")
	if _, err := n.client.RollbackOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeRollbackRequest{Caller: tenant("a"),
		Request: &dsecv1.RollbackRequest{SandboxId: c.Id, CheckpointId: ck.Msg.CheckpointId}})); err != nil {
		t.Fatal(err)
	}
	out = n.sh(t, c.Id, "cat /proc/sys/kernel/hostname; cat /root/later 2>&1; echo $TASK; true")
	if want := c.Id[:min(len(c.Id), 63)] + "\ncat: can't open '/root/later': No such file or directory\nc\n"; out != want {
		t.Fatalf("rebased sandbox rolled back: got\n%s\nwant\n%s", out, want)
	}
	for _, id := range []string{c.Id, o.Id} {
		if err := n.destroy(t, admin, id); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRebaseFailure: a create whose rebase fails gets a fresh sandbox.
// Refused before anything changed (runtime.ErrInvalidSpec), the quiesced
// sandbox goes back to the rebase pool; failed part way, it is destroyed
// and leaves nothing behind. Faults are injected into real rebases by a
// backend that adds a bad layer to the spec they are given.
func TestRebaseFailure(t *testing.T) {
	w := newWorld(t)
	fb := &faultyBackend{Backend: w.backend}
	n := w.startNode(t, "rb2", func(c *edge.Config) {
		c.AutoPool = 4
		c.Backends = map[runtime.Kind]runtime.Backend{runtime.KindContainer: fb}
	})
	spec := func(task string) *dsecv1.SandboxSpec {
		return &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=" + task}}
	}
	a := n.mustCreate(t, tenant("a"), spec("a"))
	agent := agentPID(t, w.backend, a.Id)
	if err := n.destroy(t, tenant("a"), a.Id); err != nil {
		t.Fatal(err)
	}
	waitRebaseReady(t, n, "a", 1)

	// A layer file that does not exist: refused up front.
	fake := "sha256:" + strings.Repeat("0", 64)
	fb.bad.Store(&runtime.Layer{Digest: fake, Path: filepath.Join(t.TempDir(), "missing")})
	b := n.mustCreate(t, tenant("a"), spec("b"))
	wantCreates(t, n, 2, 0)
	if got := n.sh(t, b.Id, "echo $TASK"); got != "b\n" {
		t.Fatalf("fresh sandbox after a refused rebase: TASK=%q", got)
	}
	waitRebaseReady(t, n, "a", 1)
	if pid, ok := w.backend.AgentPID(a.Id); !ok || pid != agent {
		t.Fatalf("after a refused rebase the quiesced sandbox is gone (agent %d, %v)", pid, ok)
	}

	// A layer file that is no EROFS image: the rebase fails part way.
	empty := filepath.Join(t.TempDir(), "empty.erofs")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fb.bad.Store(&runtime.Layer{Digest: fake, Path: empty})
	c := n.mustCreate(t, tenant("a"), spec("c"))
	wantCreates(t, n, 3, 0)
	if got := n.sh(t, c.Id, "echo $TASK"); got != "c\n" {
		t.Fatalf("fresh sandbox after a failed rebase: TASK=%q", got)
	}
	if st := onlyRebasePool(t, n, "a"); st.Alive() != 0 {
		t.Fatalf("the sandbox whose rebase failed is still in the rebase pool: %+v", st)
	}
	if pid, ok := w.backend.AgentPID(a.Id); ok {
		t.Fatalf("the sandbox whose rebase failed still has its agent %d", pid)
	}
	if _, err := os.Stat(filepath.Join(w.stateDir, a.Id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the sandbox whose rebase failed left its state directory: %v", err)
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{a.Id, strings.TrimPrefix(fake, "sha256:")} {
		if strings.Contains(string(mounts), s) {
			t.Fatalf("a mount naming %s is left after the failed rebase", s)
		}
	}
	fb.bad.Store(nil)
	for _, id := range []string{b.Id, c.Id} {
		if err := n.destroy(t, admin, id); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRebaseOff: AutoPool 0 turns rebasing off with recycling: a destroyed
// sandbox is torn down and the next create of another spec is fresh.
func TestRebaseOff(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "rb3", nil) // AutoPool 0
	a := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=a"}})
	if err := n.destroy(t, tenant("a"), a.Id); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(w.stateDir, a.Id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("with AutoPool 0 a destroyed sandbox was kept: %v", err)
	}
	b := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=b"}})
	wantCreates(t, n, 2, 0)
	if sts := n.edge.RebasePoolStats("a"); len(sts) != 0 {
		t.Fatalf("with AutoPool 0 the node made rebase pools: %+v", sts)
	}
	if err := n.destroy(t, tenant("a"), b.Id); err != nil {
		t.Fatal(err)
	}
}

// TestRebasePoolEmpties: a rebase pool whose tenant has not created for
// autoPoolIdle destroys its quiesced sandboxes and goes away.
func TestRebasePoolEmpties(t *testing.T) {
	t.Cleanup(edge.SetAutoPoolIdle(time.Second)) // after the node closes
	w := newWorld(t)
	n := w.startNode(t, "rb4", func(c *edge.Config) { c.AutoPool = 4 })
	a := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage})
	if err := n.destroy(t, tenant("a"), a.Id); err != nil {
		t.Fatal(err)
	}
	waitRebaseReady(t, n, "a", 1)
	deadline := time.Now().Add(30 * time.Second)
	for len(n.edge.RebasePoolStats("a")) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("an idle rebase pool stayed: %+v", n.edge.RebasePoolStats("a"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := os.Stat(filepath.Join(w.stateDir, a.Id)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sandbox %s of an idle rebase pool left state behind: %v", a.Id, err)
	}
	if _, ok := w.backend.AgentPID(a.Id); ok {
		t.Fatalf("sandbox %s of an idle rebase pool still has its agent", a.Id)
	}
}

// faultyBackend is the real container backend whose sandboxes rebase onto
// the spec they are given plus the layer in bad, when it is set: a real
// rebase, failing in the real backend on a bad layer.
type faultyBackend struct {
	*container.Backend
	bad atomic.Pointer[runtime.Layer]
}

func (b *faultyBackend) Create(ctx context.Context, spec runtime.Spec) (runtime.Sandbox, error) {
	s, err := b.Backend.Create(ctx, spec)
	if err != nil {
		return nil, err
	}
	return &faultySandbox{Sandbox: s, b: b}, nil
}

type faultySandbox struct {
	runtime.Sandbox
	b *faultyBackend
}

func (s *faultySandbox) Reset(ctx context.Context) error {
	return s.Sandbox.(runtime.Resetter).Reset(ctx)
}

func (s *faultySandbox) Quiesce(ctx context.Context) error {
	return s.Sandbox.(runtime.Rebaser).Quiesce(ctx)
}

func (s *faultySandbox) Rebase(ctx context.Context, spec runtime.Spec) error {
	if l := s.b.bad.Load(); l != nil {
		spec.Layers = append(slices.Clone(spec.Layers), *l)
	}
	return s.Sandbox.(runtime.Rebaser).Rebase(ctx, spec)
}

// importWorkspace stores a one-layer image ref holding files (relative
// path to content).
func (w *world) importWorkspace(t *testing.T, ref string, files map[string]string) {
	t.Helper()
	dir := t.TempDir()
	for p, content := range files {
		p = filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := layer.Import(t.Context(), w.store, image.NewStore(w.store, w.store.Refs()), ref, dir, nil); err != nil {
		t.Fatal(err)
	}
}

// wantCreates checks the creates metric's fresh and rebased counts.
func wantCreates(t *testing.T, n *node, fresh, rebased float64) {
	t.Helper()
	f := metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "fresh")
	r := metricValue(t, n.reg, "dsec_edge_sandbox_creates_total", "source", "rebased")
	if f != fresh || r != rebased {
		t.Fatalf("creates by source: fresh %v, rebased %v; want %v and %v", f, r, fresh, rebased)
	}
}

// onlyRebasePool returns the counters of tenant's one rebase pool.
func onlyRebasePool(t *testing.T, n *node, tenant string) pool.Stats {
	t.Helper()
	return onlyPool(t, "rebase", tenant, n.edge.RebasePoolStats(tenant))
}

// waitRebaseReady waits until tenant's rebase pool has ready sandboxes
// ready and nothing being quiesced; the deadline only bounds a broken test.
func waitRebaseReady(t *testing.T, n *node, tenant string, ready int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if sts := n.edge.RebasePoolStats(tenant); len(sts) == 1 && sts[0].Ready == ready && sts[0].Resetting == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("tenant %s's rebase pool never had %d ready: %+v", tenant, ready, n.edge.RebasePoolStats(tenant))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRebasePoolFollowsDemand: a rebase pool's cap grows past
// Config.AutoPool to the most container sandboxes its tenant has had on
// the node at once, so that what a burst hands back is kept for the next
// burst rather than torn down; it stops at what the node's capacity holds.
func TestRebasePoolFollowsDemand(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "rb5", func(c *edge.Config) { c.AutoPool = 2 })
	var ids []string
	for i := range 5 {
		sb := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=" + strconv.Itoa(i)}})
		ids = append(ids, sb.Id)
	}
	for _, id := range ids {
		if err := n.destroy(t, tenant("a"), id); err != nil {
			t.Fatal(err)
		}
	}
	waitRebaseReady(t, n, "a", 5)
	if st := onlyRebasePool(t, n, "a"); st.Size != 5 || st.Destroyed != 0 {
		t.Fatalf("rebase pool after 5 sandboxes came back with AutoPool 2: %+v; want a cap of 5, none torn down", st)
	}
	if got := poolGauge(t, n, "rebase", "ready"); got != 5 {
		t.Fatalf("dsec_edge_pool_sandboxes{kind=rebase,state=ready} = %v, want 5", got)
	}
	wantCreates(t, n, 5, 0)
	for i := range 5 {
		n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=x" + strconv.Itoa(i)}})
	}
	wantCreates(t, n, 5, 5)
	if got := poolGauge(t, n, "rebase", "ready"); got != 0 {
		t.Fatalf("dsec_edge_pool_sandboxes{kind=rebase,state=ready} = %v after the takes, want 0", got)
	}
}

// poolGauge is dsec_edge_pool_sandboxes{kind, state} on n.
func poolGauge(t *testing.T, n *node, kind, state string) float64 {
	t.Helper()
	fams, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "dsec_edge_pool_sandboxes" {
			continue
		}
		for _, m := range f.Metric {
			have := map[string]string{}
			for _, l := range m.Label {
				have[l.GetName()] = l.GetValue()
			}
			if have["kind"] == kind && have["state"] == state {
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("no dsec_edge_pool_sandboxes{kind=%q,state=%q}", kind, state)
	return 0
}

// TestRebaseFromAutoPool: when the tenant's rebase pool has nothing ready,
// a create of a new spec takes a ready sandbox of one of the tenant's
// automatic pools (a spec that was hot) and rebases it, instead of leaving
// it idle until the pool empties and starting a new agent.
func TestRebaseFromAutoPool(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "rb6", func(c *edge.Config) { c.AutoPool = 2 })
	hot := &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=hot"}}
	a := n.mustCreate(t, tenant("a"), hot)
	b := n.mustCreate(t, tenant("a"), hot) // the spec is hot now
	for _, id := range []string{a.Id, b.Id} {
		if err := n.destroy(t, tenant("a"), id); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if sts := n.edge.AutoPoolStats("a"); len(sts) == 1 && sts[0].Ready == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the hot spec's automatic pool never had 2 ready: %+v", n.edge.AutoPoolStats("a"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if sts := n.edge.RebasePoolStats("a"); len(sts) != 0 && sts[0].Ready != 0 {
		t.Fatalf("tenant a has a rebase pool with ready sandboxes: %+v", sts)
	}
	// Heartbeats tell servers that tenant a has 2 to rebase here.
	rebasable := func() int32 {
		for _, s := range n.edge.PoolSummaries() {
			if s.GetTenant() == "a" && s.GetKey() == edge.RebaseKey(false) {
				return s.GetReady()
			}
		}
		return 0
	}
	if got := rebasable(); got != 2 {
		t.Fatalf("heartbeat: tenant a has %d ready to rebase, want 2 (its automatic pool's)", got)
	}
	c := n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=cold"}})
	wantCreates(t, n, 2, 1) // a and b fresh, c rebased
	if got := n.sh(t, c.Id, "echo $TASK; hostname"); got != "cold\n"+c.Id[:min(len(c.Id), 63)]+"\n" {
		t.Fatalf("sandbox rebased from the automatic pool: %q", got)
	}
	if st := onlyAutoPool(t, n, "a"); st.Ready != 1 || st.Detached != 1 {
		t.Fatalf("automatic pool after the rebase: %+v; want one ready, one detached", st)
	}
	if got := rebasable(); got != 1 {
		t.Fatalf("heartbeat after the rebase: tenant a has %d ready to rebase, want 1", got)
	}
	// Another tenant never takes from a's automatic pool.
	n.mustCreate(t, tenant("b"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=b"}})
	if st := onlyAutoPool(t, n, "a"); st.Ready != 1 {
		t.Fatalf("tenant b's create took from tenant a's automatic pool: %+v", st)
	}
}

// TestIdleBoundedByCapacity: the sandboxes kept idle in automatic and
// rebase pools count, with the live ones, against the node's sandbox
// capacity (which the open-file limit bounds): a destroy that would take
// the sum past it tears the sandbox down instead of keeping it.
func TestIdleBoundedByCapacity(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "rb7", func(c *edge.Config) {
		c.AutoPool = 4
		c.Capacity = map[runtime.Kind]placement.Capacity{runtime.KindContainer: {MilliCPU: 8000, MemoryBytes: 16 << 30, Sandboxes: 3}}
	})
	var ids []string
	for i := range 3 {
		ids = append(ids, n.mustCreate(t, tenant("a"), &dsecv1.SandboxSpec{Image: baseImage, Env: []string{"TASK=" + strconv.Itoa(i)}}).Id)
	}
	for _, id := range ids {
		if err := n.destroy(t, tenant("a"), id); err != nil {
			t.Fatal(err)
		}
	}
	waitRebaseReady(t, n, "a", 3) // 0 live + 3 idle: within capacity 3
	// Tenant b cannot use a's idle sandboxes: its create is fresh, and
	// destroying it would make 1 live + 3 idle, past capacity.
	bsb := n.mustCreate(t, tenant("b"), &dsecv1.SandboxSpec{Image: baseImage})
	pid := agentPID(t, w.backend, bsb.Id)
	n.edge.ForgetIdleSum() // a's last hand-back may be younger than the sum
	if err := n.destroy(t, tenant("b"), bsb.Id); err != nil {
		t.Fatal(err)
	}
	if sts := n.edge.RebasePoolStats("b"); len(sts) != 0 {
		t.Fatalf("tenant b's sandbox was kept past the node's capacity: %+v", sts)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("tenant b's agent %d still exists after its destroy (%v): not torn down", pid, err)
	}
}
