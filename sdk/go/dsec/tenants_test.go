package dsec_test

import (
	"testing"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// TestLiveDefaults: dsec up's --default-* flags are what a sandbox that
// says nothing gets; a tenant's defaults (set and changed through the SDK)
// win over them and an explicit value over both; Tenants().Get shows the
// charge.
func TestLiveDefaults(t *testing.T) {
	c := startUp(t, "--default-cpu", "0.5", "--default-memory", "128m", "--default-pids", "200", "--default-disk", "1g")
	ctx := t.Context()
	node := dsec.Resources{MilliCPU: 500, MemoryBytes: 128 << 20, Pids: 200, DiskBytes: 1 << 30}

	sb, err := c.Create(ctx, dsec.Spec{Image: "busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Spec.Resources != node {
		t.Fatalf("a sandbox without resources got %+v, want dsec up's defaults %+v", sb.Spec.Resources, node)
	}
	if err := sb.Destroy(ctx); err != nil {
		t.Fatal(err)
	}

	tok, err := c.Tenants().CreateWithDefaults(ctx, "alice", dsec.Quota{MaxMilliCPU: 1000}, dsec.Resources{MilliCPU: 250})
	if err != nil {
		t.Fatal(err)
	}
	alice := dsec.New(c.Endpoint(), tok)
	a, err := alice.Create(ctx, dsec.Spec{Image: "busybox:latest", Resources: dsec.Resources{Pids: 50}})
	if err != nil {
		t.Fatal(err)
	}
	if want := (dsec.Resources{MilliCPU: 250, MemoryBytes: 128 << 20, Pids: 50, DiskBytes: 1 << 30}); a.Spec.Resources != want {
		t.Fatalf("alice's sandbox got %+v, want %+v (tenant cpu, explicit pids, node memory and disk)", a.Spec.Resources, want)
	}
	me, err := alice.Tenants().Get(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if me.Usage != (dsec.Usage{Sandboxes: 1, MilliCPU: 250, MemoryBytes: 128 << 20}) {
		t.Fatalf("alice's usage %+v", me.Usage)
	}

	cpu := int64(600)
	up, err := c.Tenants().Update(ctx, "alice", dsec.TenantUpdate{DefaultMilliCPU: &cpu})
	if err != nil {
		t.Fatal(err)
	}
	if up.Defaults.MilliCPU != 600 || up.Quota.MaxMilliCPU != 1000 {
		t.Fatalf("after update: %+v", up)
	}
	// 250 in use + 600 fits 1000; another 600 does not.
	if _, err := alice.Create(ctx, dsec.Spec{Image: "busybox:latest"}); err != nil {
		t.Fatal(err)
	}
	if _, err := alice.Create(ctx, dsec.Spec{Image: "busybox:latest"}); !dsec.IsResourceExhausted(err) {
		t.Fatalf("a third sandbox past max_milli_cpu: %v, want ResourceExhausted", err)
	}
	list, err := c.Tenants().List(ctx)
	if err != nil || len(list) != 1 || list[0].Name != "alice" || list[0].Usage.MilliCPU != 850 {
		t.Fatalf("tenant list %+v, %v", list, err)
	}
}
