package controlplane

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/spec"
)

func (c *cluster) getTenant(token, name string) *dsecv1.Tenant {
	c.t.Helper()
	resp, err := c.clients.tenant.Get(context.Background(), req(token, &dsecv1.GetTenantRequest{Name: name}))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Msg.GetTenant()
}

func (c *cluster) createTenantWith(name string, q *dsecv1.Quota, d *dsecv1.Resources) string {
	c.t.Helper()
	resp, err := c.clients.tenant.Create(context.Background(), req(c.admin, &dsecv1.CreateTenantRequest{Name: name, Quota: q, Defaults: d}))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Msg.GetToken()
}

func wantResources(t *testing.T, what string, got *dsecv1.Resources, want spec.Resources) {
	t.Helper()
	if g := spec.FromProto(got); g != want {
		t.Fatalf("%s: resources %+v, want %+v", what, g, want)
	}
}

func wantUsage(t *testing.T, tn *dsecv1.Tenant, sandboxes, milliCPU, mem int64) {
	t.Helper()
	u := tn.GetUsage()
	if u.GetSandboxes() != sandboxes || u.GetMilliCpu() != milliCPU || u.GetMemoryBytes() != mem {
		t.Fatalf("tenant %s usage %v, want %d sandboxes, %d milli-CPU, %d bytes", tn.GetName(), u, sandboxes, milliCPU, mem)
	}
}

// cgroupLimits lists the values of file (memory.limit_in_bytes, pids.max)
// in every cgroup below an edge's cgroup parent, on cgroup v1 (controller
// hierarchy ctrl) or v2.
func cgroupLimits(t *testing.T, c *cluster, node, ctrl, file string) []string {
	t.Helper()
	parent := "dsec-cp-test-" + filepath.Base(c.root) + "-" + node
	root := filepath.Join("/sys/fs/cgroup", ctrl, parent)
	if _, err := os.Stat(root); err != nil {
		root = filepath.Join("/sys/fs/cgroup", parent)
	}
	var out []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() == file && filepath.Dir(p) != root {
			if b, err := os.ReadFile(p); err == nil {
				out = append(out, strings.TrimSpace(string(b)))
			}
		}
		return nil
	})
	return out
}

// TestDefaultsChargedToQuota is issue 13's quota bypass: sandboxes created
// without resources got no limits and were charged nothing, so a tenant
// with --max-cpu 1 --max-memory 1g held three unlimited sandboxes with "0
// in use". Now a spec's omitted resources take the tenant's defaults, else
// the node's (as heartbeats report them, else built in), the sandbox gets
// them as kernel limits and its tenant's quota is charged for them; an
// explicit value beats any default.
func TestDefaultsChargedToQuota(t *testing.T) {
	c := newCluster(t)
	// The node's defaults: CPU and pids set, memory and disk built in.
	c.defaults = spec.Resources{MilliCPU: 1000, Pids: 100}
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 64}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	node := spec.Resources{MilliCPU: 1000, MemoryBytes: spec.Builtin.MemoryBytes, Pids: 100, DiskBytes: spec.Builtin.DiskBytes}
	bare := &dsecv1.SandboxSpec{Image: "busybox:1"}

	t.Run("node defaults, charged", func(t *testing.T) {
		tok := c.createTenant("capped", &dsecv1.Quota{MaxMilliCpu: 1000, MaxMemoryBytes: 1 << 30})
		sb, err := c.create(tok, bare)
		if err != nil {
			t.Fatal(err)
		}
		wantResources(t, "a sandbox without resources", sb.GetSpec().GetResources(), node)
		wantUsage(t, c.getTenant(tok, ""), 1, 1000, 1<<30)
		for i := 2; i <= 3; i++ {
			_, err := c.create(tok, bare)
			wantCode(t, err, connect.CodeResourceExhausted, "max_milli_cpu")
		}
		// What the heartbeat reports, once it has, is the same.
		c.waitFor("the sandbox in a heartbeat", func() bool {
			for _, s := range c.srv.reg.liveSummaries("n1") {
				if s.GetId() == sb.GetId() {
					return true
				}
			}
			return false
		})
		wantUsage(t, c.getTenant(c.admin, "capped"), 1, 1000, 1<<30)
		if err := c.destroy(tok, sb.GetId()); err != nil {
			t.Fatal(err)
		}
		wantUsage(t, c.getTenant(tok, "capped"), 0, 0, 0)
	})

	t.Run("tenant defaults win, explicit beats both", func(t *testing.T) {
		tok := c.createTenantWith("small", &dsecv1.Quota{MaxMilliCpu: 1000, MaxMemoryBytes: 1 << 30},
			&dsecv1.Resources{MilliCpu: 300, MemoryBytes: 256 << 20})
		small := spec.Resources{MilliCPU: 300, MemoryBytes: 256 << 20, Pids: 100, DiskBytes: spec.Builtin.DiskBytes}
		var ids []string
		for range 3 {
			sb, err := c.create(tok, bare)
			if err != nil {
				t.Fatal(err)
			}
			wantResources(t, "a sandbox of a tenant with defaults", sb.GetSpec().GetResources(), small)
			ids = append(ids, sb.GetId())
		}
		wantUsage(t, c.getTenant(tok, ""), 3, 900, 768<<20)
		_, err := c.create(tok, bare)
		wantCode(t, err, connect.CodeResourceExhausted, "max_milli_cpu")
		// The defaults are the kernel's limits.
		if lim := cgroupLimits(t, c, "n1", "memory", "memory.limit_in_bytes"); !containsString(lim, strconv.Itoa(256<<20)) {
			t.Errorf("no sandbox cgroup of n1 has the tenant's default memory limit: %v", lim)
		}
		if lim := cgroupLimits(t, c, "n1", "pids", "pids.max"); !containsString(lim, "100") {
			t.Errorf("no sandbox cgroup of n1 has the node's default pids limit: %v", lim)
		}
		for _, id := range ids[1:] {
			if err := c.destroy(tok, id); err != nil {
				t.Fatal(err)
			}
		}
		sb, err := c.create(tok, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MemoryBytes: 128 << 20, Pids: 50}})
		if err != nil {
			t.Fatal(err)
		}
		wantResources(t, "explicit memory and pids", sb.GetSpec().GetResources(),
			spec.Resources{MilliCPU: 300, MemoryBytes: 128 << 20, Pids: 50, DiskBytes: spec.Builtin.DiskBytes})
		wantUsage(t, c.getTenant(tok, ""), 2, 600, 384<<20)
	})

	t.Run("the admin gets the node's", func(t *testing.T) {
		sb, err := c.create(c.admin, bare)
		if err != nil {
			t.Fatal(err)
		}
		wantResources(t, "the admin's sandbox", sb.GetSpec().GetResources(), node)
	})

	t.Run("out of bounds", func(t *testing.T) {
		_, err := c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MemoryBytes: 1 << 62}})
		wantCode(t, err, connect.CodeInvalidArgument, "spec.resources.memory_bytes")
		_, err = c.create(c.admin, &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{DiskBytes: -1}})
		wantCode(t, err, connect.CodeInvalidArgument, "spec.resources.disk_bytes")
	})
}

func containsString(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// TestUpdateTenant: the admin changes a tenant's quota and defaults (the
// fields it sets, nothing else); the next create gets the new defaults;
// nobody else may, and a tenant sees only itself.
func TestUpdateTenant(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 64}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tok := c.createTenantWith("alice", &dsecv1.Quota{MaxSandboxes: 5, MaxMilliCpu: 1000}, &dsecv1.Resources{MilliCpu: 500})
	other := c.createTenant("bob", nil)
	i64 := func(v int64) *int64 { return &v }

	resp, err := c.clients.tenant.Update(ctx, req(c.admin, &dsecv1.UpdateTenantRequest{
		Name: "alice", MaxMilliCpu: i64(4000), DefaultMilliCpu: i64(2000), DefaultMemoryBytes: i64(64 << 20),
		DefaultDiskBytes: i64(1 << 30), MaxImportBytes: i64(1 << 20),
	}))
	if err != nil {
		t.Fatal(err)
	}
	got := resp.Msg.GetTenant()
	if q := got.GetQuota(); q.GetMaxSandboxes() != 5 || q.GetMaxMilliCpu() != 4000 || q.GetMaxImportBytes() != 1<<20 {
		t.Fatalf("quota after update %v: max_sandboxes must stay 5, max_milli_cpu 4000, max_import_bytes 1 MiB", q)
	}
	wantResources(t, "defaults after update", got.GetDefaults(), spec.Resources{MilliCPU: 2000, MemoryBytes: 64 << 20, DiskBytes: 1 << 30})
	if g := c.getTenant(tok, ""); spec.FromProto(g.GetDefaults()) != spec.FromProto(got.GetDefaults()) {
		t.Fatalf("the tenant reads defaults %v, the update returned %v", g.GetDefaults(), got.GetDefaults())
	}
	sb, err := c.create(tok, &dsecv1.SandboxSpec{Image: "busybox:1"})
	if err != nil {
		t.Fatal(err)
	}
	wantResources(t, "a create after the update", sb.GetSpec().GetResources(),
		spec.Resources{MilliCPU: 2000, MemoryBytes: 64 << 20, Pids: spec.Builtin.Pids, DiskBytes: 1 << 30})

	// 0 puts a default back to the node's.
	if _, err := c.clients.tenant.Update(ctx, req(c.admin, &dsecv1.UpdateTenantRequest{Name: "alice", DefaultMilliCpu: i64(0)})); err != nil {
		t.Fatal(err)
	}
	if d := c.getTenant(c.admin, "alice").GetDefaults(); d.GetMilliCpu() != 0 || d.GetMemoryBytes() != 64<<20 {
		t.Fatalf("defaults %v: milli_cpu back to 0, memory kept", d)
	}

	_, err = c.clients.tenant.Update(ctx, req(tok, &dsecv1.UpdateTenantRequest{Name: "alice", MaxMilliCpu: i64(0)}))
	wantCode(t, err, connect.CodePermissionDenied, "admin")
	_, err = c.clients.tenant.Update(ctx, req(c.admin, &dsecv1.UpdateTenantRequest{Name: "nobody", MaxMilliCpu: i64(1)}))
	wantCode(t, err, connect.CodeNotFound, "nobody")
	_, err = c.clients.tenant.Update(ctx, req(c.admin, &dsecv1.UpdateTenantRequest{Name: "alice", DefaultPids: i64(-1)}))
	wantCode(t, err, connect.CodeInvalidArgument, "defaults.pids")
	_, err = c.clients.tenant.Update(ctx, req(c.admin, &dsecv1.UpdateTenantRequest{Name: "alice", MaxSandboxes: i64(-1)}))
	wantCode(t, err, connect.CodeInvalidArgument, "max_sandboxes")
	_, err = c.clients.tenant.Get(ctx, req(other, &dsecv1.GetTenantRequest{Name: "alice"}))
	wantCode(t, err, connect.CodeNotFound, "alice")
	_, err = c.clients.tenant.List(ctx, req(other, &dsecv1.ListTenantsRequest{}))
	wantCode(t, err, connect.CodePermissionDenied, "admin")
	list, err := c.clients.tenant.List(ctx, req(c.admin, &dsecv1.ListTenantsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if ts := list.Msg.GetTenants(); len(ts) != 2 || ts[0].GetName() != "alice" || ts[1].GetName() != "bob" || ts[0].GetUsage().GetSandboxes() != 1 {
		t.Fatalf("tenant list %v: want alice (1 sandbox) and bob", ts)
	}
}

// TestPoolsCountAgainstQuota: a pool a tenant creates holds its size in
// ready sandboxes besides those taken from it, so its quota is charged
// for the whole size while the pool lives; a pool keyed by resources
// spelled out serves creates that leave the same values to the defaults.
func TestPoolsCountAgainstQuota(t *testing.T) {
	c := newCluster(t)
	c.addEdge("n1", placement.Capacity{MilliCPU: 1_000_000, Sandboxes: 64}, placement.Share{})
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tok := c.createTenant("alice", &dsecv1.Quota{MaxSandboxes: 3})
	pools := dsecv1connect.NewPoolServiceClient(http.DefaultClient, c.url)
	explicit := &dsecv1.SandboxSpec{Image: "busybox:1", Resources: spec.Builtin.Proto()}

	_, err := pools.Create(ctx, req(tok, &dsecv1.CreatePoolRequest{Spec: explicit, Size: 4}))
	wantCode(t, err, connect.CodeResourceExhausted, "max_sandboxes")
	created, err := pools.Create(ctx, req(tok, &dsecv1.CreatePoolRequest{Spec: explicit, Size: 2}))
	if err != nil {
		t.Fatal(err)
	}
	pool := created.Msg.GetPool()
	one := spec.Builtin
	wantUsage(t, c.getTenant(tok, ""), 2, 2*one.MilliCPU, 2*one.MemoryBytes)
	c.waitFor("the pool to fill and be heartbeated", func() bool {
		return len(c.srv.reg.warmNodes(mustPrepare(t, c, &dsecv1.SandboxSpec{Image: "busybox:1"}).key, "alice")) == 1
	})
	wantUsage(t, c.getTenant(tok, ""), 2, 2*one.MilliCPU, 2*one.MemoryBytes)

	// A create that leaves resources to the defaults takes a sandbox of
	// the pool keyed by the same values spelled out.
	sb, err := c.create(tok, &dsecv1.SandboxSpec{Image: "busybox:1"})
	if err != nil {
		t.Fatal(err)
	}
	listed, err := pools.List(ctx, req(tok, &dsecv1.ListPoolsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if ps := listed.Msg.GetPools(); len(ps) != 1 || ps[0].GetHits() != 1 {
		t.Fatalf("pools %v: want one with a hit (the defaulted create)", ps)
	}
	wantUsage(t, c.getTenant(tok, ""), 3, 3*one.MilliCPU, 3*one.MemoryBytes)
	_, err = c.create(tok, &dsecv1.SandboxSpec{Image: "busybox:1"})
	wantCode(t, err, connect.CodeResourceExhausted, "max_sandboxes")

	// Deleting the pool frees its charge at once.
	if _, err := pools.Delete(ctx, req(tok, &dsecv1.DeletePoolRequest{Id: pool.GetId()})); err != nil {
		t.Fatal(err)
	}
	wantUsage(t, c.getTenant(tok, ""), 1, one.MilliCPU, one.MemoryBytes)
	if _, err := c.create(tok, &dsecv1.SandboxSpec{Image: "busybox:1"}); err != nil {
		t.Fatal(err)
	}
	_ = sb
}

// gzipTar is a gzip'd tar of one file of size zero bytes.
func gzipTar(t *testing.T, size int64) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	tw := tar.NewWriter(zw)
	if err := tw.WriteHeader(&tar.Header{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
		t.Fatal(err)
	}
	if err := tw.WriteHeader(&tar.Header{Name: "bin/zero", Typeflag: tar.TypeReg, Mode: 0o644, Size: size}); err != nil {
		t.Fatal(err)
	}
	zero := make([]byte, 1<<20)
	for left := size; left > 0; left -= int64(len(zero)) {
		if _, err := tw.Write(zero[:min(left, int64(len(zero)))]); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// countFiles counts the regular files under dir.
func countFiles(dir string) int {
	n := 0
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			n++
		}
		return nil
	})
	return n
}

// TestImportSizeLimit is issue 13's import bomb (a 261 KB gzip tar became a
// 256 MiB image): an import is bounded after decompression by the tenant's
// max_import_bytes, else the server's limit, and refused with
// ResourceExhausted naming the limit, leaving no image, blob or temporary
// file behind.
func TestImportSizeLimit(t *testing.T) {
	c := newCluster(t)
	tok := c.createTenant("alice", &dsecv1.Quota{MaxImportBytes: 16 << 20})
	bomb := gzipTar(t, 256<<20)
	if len(bomb) > 1<<20 {
		t.Fatalf("bomb is %d bytes compressed; want a small one", len(bomb))
	}
	blobDir, tmpDir := filepath.Join(c.root, "blobs", "blobs"), filepath.Join(c.root, "blobs", "tmp")
	blobs := countFiles(blobDir)
	leftovers := func() {
		t.Helper()
		if n := countFiles(blobDir); n != blobs {
			t.Errorf("the refused import left %d blobs in the store (had %d)", n, blobs)
		}
		if ents, _ := os.ReadDir(tmpDir); len(ents) != 0 {
			t.Errorf("the refused import left %d entries in the store's temp dir", len(ents))
		}
	}
	_, err := c.upload(tok, "bomb:1", false, bomb)
	wantCode(t, err, connect.CodeResourceExhausted, "max_import_bytes")
	if !strings.Contains(err.Error(), strconv.Itoa(16<<20)) {
		t.Errorf("error %q does not name the limit (%d bytes)", err, 16<<20)
	}
	leftovers()
	if _, err := c.clients.img.Get(context.Background(), req(tok, &dsecv1.GetImageRequest{Ref: "bomb:1"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("image bomb:1 after the refused import: %v, want NotFound", err)
	}
	// Under the limit it imports.
	if _, err := c.upload(tok, "small:1", false, gzipTar(t, 8<<20)); err != nil {
		t.Fatalf("an 8 MiB image under a 16 MiB limit: %v", err)
	}
	bob := c.createTenant("bob", nil)
	blobs = countFiles(blobDir)
	// A tenant without a limit of its own gets the server's, as does the
	// admin.
	c.srv.cfg.MaxImportBytes = 4 << 20
	_, err = c.upload(bob, "bomb:1", false, bomb)
	wantCode(t, err, connect.CodeResourceExhausted, "--max-import-size")
	_, err = c.upload(c.admin, "bomb:1", true, bomb)
	wantCode(t, err, connect.CodeResourceExhausted, "--max-import-size")
	// An upload larger than the limit is refused as it arrives.
	_, err = c.upload(bob, "big:1", false, bytes.Repeat([]byte{1}, 8<<20))
	wantCode(t, err, connect.CodeResourceExhausted, "uploaded")
	leftovers()
}

// TestDefaultsReserveNoCapacity: defaults are limits, not requests. A
// sandbox created without resources gets the defaults as its kernel limits
// and is charged them to its tenant's quota, but reserves none of its
// node's CPU or memory, in placement and at the edge's admission alike:
// with defaults charged as requests, a node of 2 cores at a CPU request share of 1/4
// held 8 such sandboxes (issue 13's density regression; before defaults
// it held as many as its sandbox slots). Explicit values are requests:
// cpu=1 sandboxes still stop at 8 there.
func TestDefaultsReserveNoCapacity(t *testing.T) {
	c := newCluster(t)
	c.defaults = spec.Resources{Pids: 77}
	oc := placement.Share{CPU: 0.25, Memory: 1}
	c.addEdge("n1", placement.Capacity{MilliCPU: 2000, MemoryBytes: 24 << 30, Sandboxes: 64}, oc)
	if _, err := c.importPath(c.admin, "busybox:1", testsuite.BusyboxRootfs(t)); err != nil {
		t.Fatal(err)
	}
	tok := c.createTenant("many", &dsecv1.Quota{MaxMilliCpu: 100_000})
	limits := spec.Resources{MilliCPU: spec.Builtin.MilliCPU, MemoryBytes: spec.Builtin.MemoryBytes, Pids: 77, DiskBytes: spec.Builtin.DiskBytes}

	const defaulted = 20
	resp, err := c.clients.sb.BatchCreate(context.Background(), req(tok, &dsecv1.BatchCreateSandboxesRequest{
		Spec: &dsecv1.SandboxSpec{Image: "busybox:1"}, Count: defaulted,
	}))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Msg.GetResults() {
		if r.GetError() != nil {
			t.Fatalf("sandbox %d of %d created without resources: %v", i+1, defaulted, r.GetError())
		}
		wantResources(t, "a sandbox created without resources", r.GetSandbox().GetSpec().GetResources(), limits)
	}
	got, err := c.clients.sb.Get(context.Background(), req(tok, &dsecv1.GetSandboxRequest{Id: resp.Msg.GetResults()[0].GetSandbox().GetId()}))
	if err != nil {
		t.Fatal(err)
	}
	wantResources(t, "Get of a sandbox created without resources", got.Msg.GetSandbox().GetSpec().GetResources(), limits)
	n := 0
	for _, l := range cgroupLimits(t, c, "n1", "pids", "pids.max") {
		if l == "77" {
			n++
		}
	}
	if n < defaulted {
		t.Errorf("%d sandbox cgroups have the default pids limit, want %d", n, defaulted)
	}
	// The quota counts the limits.
	wantUsage(t, c.getTenant(tok, ""), defaulted, defaulted*spec.Builtin.MilliCPU, defaulted*spec.Builtin.MemoryBytes)

	// Explicit CPU is a request: 8 cores' worth fit (2 x 4), the 9th not.
	explicit := &dsecv1.SandboxSpec{Image: "busybox:1", Resources: &dsecv1.Resources{MilliCpu: 1000}}
	resp, err = c.clients.sb.BatchCreate(context.Background(), req(tok, &dsecv1.BatchCreateSandboxesRequest{Spec: explicit, Count: 8}))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Msg.GetResults() {
		if r.GetError() != nil {
			t.Fatalf("explicit cpu=1 sandbox %d of 8: %v", i+1, r.GetError())
		}
	}
	// The node is charged a quarter of the explicit requests' CPU (its
	// share) and the sandboxes' measured memory (a few MiB each).
	c.waitFor("a heartbeat with all 28 sandboxes", func() bool { return len(c.srv.reg.liveSummaries("n1")) == defaulted+8 })
	c.srv.reg.mu.Lock()
	used := c.srv.reg.nodes["n1"].usage[runtime.KindContainer]
	c.srv.reg.mu.Unlock()
	if used.MilliCPU != 2000 || used.MemoryBytes > (defaulted+8)*(16<<20) || used.Sandboxes != defaulted+8 {
		t.Errorf("n1 reports %+v used, want 2000 milli-CPU, a few MiB a sandbox, %d sandboxes", used, defaulted+8)
	}
	p := iam.Principal{Tenant: "many"}
	prep, err := c.srv.prepare(context.Background(), p, explicit)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.srv.place(p, nil, prep, nil); !errors.Is(err, placement.ErrNoCapacity) {
		t.Fatalf("placing a 9th cpu=1 sandbox: %v, want no capacity", err)
	}
	// The edge refuses it too, on its own books.
	id := ids.NewSandbox("n1")
	_, err = c.srv.edges.get(c.edges["n1"].hs.URL).CreateOnEdge(context.Background(), connect.NewRequest(&dsecv1.EdgeCreateRequest{
		Caller: &dsecv1.Caller{Tenant: "many"}, SandboxId: id, Spec: explicit,
	}))
	wantCode(t, err, connect.CodeResourceExhausted, "milli_cpu")
	// A defaulted one still fits.
	prep, err = c.srv.prepare(context.Background(), p, &dsecv1.SandboxSpec{Image: "busybox:1"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.srv.place(p, nil, prep, nil)
	if err != nil {
		t.Fatalf("placing one more sandbox without resources: %v", err)
	}
	c.srv.reg.release(res.id)
}
