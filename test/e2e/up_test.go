package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// TestUp drives a `dsec up` process with the CLI and the Go SDK.
func TestUp(t *testing.T) {
	bins := build(t)
	c, _ := startUp(t, bins)
	rootfs := busyboxRootfs(t)

	// A directory is tarred on the fly and streamed.
	out := c.ok(t, "image", "import", "busybox:latest", rootfs)
	if !strings.HasPrefix(out, "busybox:latest sha256:") {
		t.Fatalf("image import printed %q", out)
	}
	var images []struct{ Ref string }
	if err := json.Unmarshal([]byte(c.ok(t, "image", "ls", "--json")), &images); err != nil {
		t.Fatal(err)
	}
	if len(images) != 1 || images[0].Ref != "busybox:latest" {
		t.Fatalf("image ls = %+v", images)
	}

	t.Run("run", func(t *testing.T) {
		if got := c.ok(t, "run", "--image", "busybox:latest", "--", "echo", "hello"); got != "hello" {
			t.Fatalf("run echo hello printed %q", got)
		}
		r := c.run(t, nil, "run", "--image", "busybox:latest", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
		if r.code != 3 || r.stdout != "out\n" || !strings.Contains(r.stderr, "err\n") {
			t.Fatalf("run exit 3: %+v", r)
		}
		r = c.run(t, nil, "run", "--image", "busybox:latest", "--timeout", "500ms", "--", "sleep", "30")
		if r.code != 124 {
			t.Fatalf("run with timeout: exit %d, want 124: %+v", r.code, r)
		}
		r = c.run(t, nil, "run", "--image", "nosuch:1", "--", "true")
		if r.code != 125 || !strings.Contains(r.stderr, "nosuch:1") {
			t.Fatalf("run of a missing image: %+v", r)
		}
		// run leaves nothing behind.
		if got := c.ok(t, "sandbox", "ls", "--json"); got != "[]" {
			t.Fatalf("sandboxes left after run: %s", got)
		}
	})

	t.Run("sandbox", func(t *testing.T) {
		id := c.ok(t, "sandbox", "create", "--image", "busybox:latest", "--label", "job=e2e",
			"--label", "turn=1", "--cpu", "0.5", "--memory", "256m", "--ttl", "10m")
		if !strings.HasPrefix(id, "solo-") {
			t.Fatalf("sandbox create printed %q, want an ID on node solo", id)
		}
		// exec: env, cwd and the exit code.
		r := c.run(t, nil, "sandbox", "exec", "--env", "GREETING=hi", "--cwd", "/tmp", id, "--",
			"sh", "-c", `echo "$GREETING from $(pwd)"; exit 42`)
		if r.code != 42 || r.stdout != "hi from /tmp\n" {
			t.Fatalf("exec: %+v", r)
		}

		// cp in both directions, a file and stdin/stdout.
		local := filepath.Join(t.TempDir(), "in.txt")
		if err := os.WriteFile(local, []byte("payload\n"), 0o640); err != nil {
			t.Fatal(err)
		}
		c.ok(t, "sandbox", "cp", local, id+":/tmp/")
		if got := c.ok(t, "sandbox", "exec", id, "--", "cat", "/tmp/in.txt"); got != "payload" {
			t.Fatalf("file copied in reads %q", got)
		}
		if got := c.ok(t, "sandbox", "exec", id, "--", "stat", "-c", "%a", "/tmp/in.txt"); got != "640" {
			t.Fatalf("copied file mode %s, want 640", got)
		}
		if r := c.run(t, strings.NewReader("from stdin"), "sandbox", "cp", "-", id+":/tmp/stdin.txt"); r.code != 0 {
			t.Fatalf("cp from stdin: %+v", r)
		}
		if got := c.ok(t, "sandbox", "cp", id+":/tmp/stdin.txt", "-"); got != "from stdin" {
			t.Fatalf("cp to stdout printed %q", got)
		}
		outDir := t.TempDir()
		c.ok(t, "sandbox", "cp", id+":/etc/passwd", outDir)
		if b, err := os.ReadFile(filepath.Join(outDir, "passwd")); err != nil || !strings.HasPrefix(string(b), "root:") {
			t.Fatalf("cp out of the sandbox: %q, %v", b, err)
		}
		// A file over one ReadFile's bound and one request's chunk goes
		// through exec's stdin and output stream, both ways.
		big := make([]byte, 40<<20+12345)
		for i := range big {
			big[i] = byte(i * 7 / 5)
		}
		bigPath := filepath.Join(t.TempDir(), "big.bin")
		if err := os.WriteFile(bigPath, big, 0o600); err != nil {
			t.Fatal(err)
		}
		c.ok(t, "sandbox", "cp", bigPath, id+":/tmp/big.bin")
		c.ok(t, "sandbox", "cp", id+":/tmp/big.bin", outDir)
		if b, err := os.ReadFile(filepath.Join(outDir, "big.bin")); err != nil || !bytes.Equal(b, big) {
			t.Fatalf("40 MiB cp round trip: %d bytes back of %d, %v", len(b), len(big), err)
		}

		// ls and get with labels, state and resources.
		var list []struct {
			ID, State, Node string
			Labels          map[string]string
			MilliCPU        int64 `json:"milli_cpu"`
			MemoryBytes     int64 `json:"memory_bytes"`
		}
		if err := json.Unmarshal([]byte(c.ok(t, "sandbox", "ls", "--label", "job=e2e", "--json")), &list); err != nil {
			t.Fatal(err)
		}
		if len(list) != 1 || list[0].ID != id || list[0].State != "running" || list[0].Node != "solo" ||
			list[0].Labels["turn"] != "1" || list[0].MilliCPU != 500 || list[0].MemoryBytes != 256<<20 {
			t.Fatalf("sandbox ls = %+v", list)
		}
		if got := c.ok(t, "sandbox", "ls", "--label", "job=other", "--json"); got != "[]" {
			t.Fatalf("ls with a non-matching label: %s", got)
		}
		if got := c.ok(t, "sandbox", "get", id); !strings.Contains(got, "state:") || !strings.Contains(got, "running") {
			t.Fatalf("sandbox get: %s", got)
		}

		c.ok(t, "sandbox", "rm", id)
		var got struct{ State string }
		if err := json.Unmarshal([]byte(c.ok(t, "sandbox", "get", "--json", id)), &got); err != nil {
			t.Fatal(err)
		}
		if got.State != "destroyed" {
			t.Fatalf("state after rm = %q, want destroyed", got.State)
		}
		if r := c.run(t, nil, "sandbox", "exec", id, "--", "true"); r.code != 125 {
			t.Fatalf("exec in a destroyed sandbox: %+v, want exit 125", r)
		}
		if r := c.run(t, nil, "sandbox", "get", "solo-0123456789abcdef"); r.code != 1 || !strings.Contains(r.stderr, "not_found") {
			t.Fatalf("get of an unknown sandbox: %+v", r)
		}
	})

	t.Run("sdk", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cl := dsec.New(c.endpoint, c.token)
		sbs, err := cl.CreateMany(ctx, dsec.Spec{Image: "busybox:latest", Labels: map[string]string{"sdk": "1"}}, 3)
		if err != nil || len(sbs) != 3 {
			t.Fatalf("CreateMany: %d sandboxes, %v", len(sbs), err)
		}
		ids := []string{sbs[0].ID, sbs[1].ID, sbs[2].ID}
		defer cl.DestroyMany(context.WithoutCancel(ctx), ids...)
		var stdout, stderr strings.Builder
		res, err := sbs[0].ExecStream(ctx, dsec.ExecOptions{Shell: "echo a; echo b >&2; exit 5"}, &stdout, &stderr)
		if err != nil || res.ExitCode != 5 || res.Outcome != dsec.OutcomeFailed || stdout.String() != "a\n" || stderr.String() != "b\n" {
			t.Fatalf("ExecStream: %+v, %v, stdout %q stderr %q", res, err, stdout.String(), stderr.String())
		}
		if err := sbs[1].WriteFile(ctx, "/tmp/x", []byte("xyz"), 0o600); err != nil {
			t.Fatal(err)
		}
		if b, err := sbs[1].ReadFile(ctx, "/tmp/x", 0); err != nil || string(b) != "xyz" {
			t.Fatalf("ReadFile = %q, %v", b, err)
		}
		// Sandboxes do not share files.
		if res, err := sbs[2].Exec(ctx, "test", "-e", "/tmp/x"); err != nil || res.ExitCode != 1 {
			t.Fatalf("file visible in another sandbox: %+v, %v", res, err)
		}
		list, err := cl.List(ctx, map[string]string{"sdk": "1"})
		if err != nil || len(list) != 3 {
			t.Fatalf("List = %d, %v", len(list), err)
		}
		if err := cl.DestroyMany(ctx, ids...); err != nil {
			t.Fatal(err)
		}
		if _, err := cl.Get(ctx, "solo-ffffffffffffffff"); !dsec.IsNotFound(err) {
			t.Fatalf("Get of an unknown sandbox: %v, want NotFound", err)
		}
		if _, err := cl.Create(ctx, dsec.Spec{Image: "busybox:latest", Resources: dsec.Resources{MilliCPU: -1}}); !dsec.IsInvalidArgument(err) {
			t.Fatalf("Create with negative cpu: %v, want InvalidArgument", err)
		}
		if _, err := dsec.New(c.endpoint, "wrong").List(ctx, nil); !dsec.IsUnauthenticated(err) {
			t.Fatalf("List with a bad token: %v, want Unauthenticated", err)
		}
	})

	t.Run("tenants", func(t *testing.T) { testTenants(t, c) })
}

// testTenants checks isolation and quotas between two tenants created with
// the CLI and driven with the SDK.
func testTenants(t *testing.T, admin cli) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	aliceTok := admin.ok(t, "tenant", "create", "alice", "--max-sandboxes", "1")
	bobTok := admin.ok(t, "tenant", "create", "bob", "--max-memory", "256m", "--max-cpu", "1")
	if aliceTok == "" || bobTok == "" || aliceTok == bobTok {
		t.Fatalf("tenant tokens %q and %q", aliceTok, bobTok)
	}
	alice := dsec.New(admin.endpoint, aliceTok)
	bob := dsec.New(admin.endpoint, bobTok)

	sb, err := alice.Create(ctx, dsec.Spec{Image: "busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	defer alice.Destroy(context.WithoutCancel(ctx), sb.ID)
	if sb.Tenant != "alice" {
		t.Errorf("sandbox tenant = %q, want alice", sb.Tenant)
	}

	// Quota: alice may hold one sandbox.
	if _, err := alice.Create(ctx, dsec.Spec{Image: "busybox:latest"}); !dsec.IsResourceExhausted(err) {
		t.Fatalf("alice's second sandbox: %v, want ResourceExhausted", err)
	}
	// Quota: bob may use 256 MiB.
	if _, err := bob.Create(ctx, dsec.Spec{Image: "busybox:latest", Resources: dsec.Resources{MemoryBytes: 512 << 20}}); !dsec.IsResourceExhausted(err) {
		t.Fatalf("bob's 512m sandbox: %v, want ResourceExhausted", err)
	}

	// Isolation: bob sees nothing of alice's sandbox, not even that it exists.
	if _, err := bob.Get(ctx, sb.ID); !dsec.IsNotFound(err) {
		t.Fatalf("bob Get alice's sandbox: %v, want NotFound", err)
	}
	if _, err := bob.Sandbox(sb.ID).Exec(ctx, "true"); !dsec.IsNotFound(err) {
		t.Fatalf("bob Exec in alice's sandbox: %v, want NotFound", err)
	}
	if _, err := bob.Sandbox(sb.ID).ReadFile(ctx, "/etc/passwd", 0); !dsec.IsNotFound(err) {
		t.Fatalf("bob ReadFile in alice's sandbox: %v, want NotFound", err)
	}
	if err := bob.Destroy(ctx, sb.ID); !dsec.IsNotFound(err) {
		t.Fatalf("bob Destroy alice's sandbox: %v, want NotFound", err)
	}
	if list, err := bob.List(ctx, nil); err != nil || len(list) != 0 {
		t.Fatalf("bob List = %d sandboxes, %v; want none", len(list), err)
	}
	if res, err := sb.Exec(ctx, "echo", "still here"); err != nil || string(res.Stdout) != "still here\n" {
		t.Fatalf("alice's sandbox after bob's attempts: %+v, %v", res, err)
	}

	// Private images: bob's import is his alone.
	r := admin.run(t, nil, "--token", bobTok, "image", "import", "mine:1", busyboxRootfs(t))
	if r.code != 0 {
		t.Fatalf("bob image import: %+v", r)
	}
	if _, err := bob.Images().Get(ctx, "mine:1"); err != nil {
		t.Fatalf("bob Get his image: %v", err)
	}
	if _, err := alice.Images().Get(ctx, "mine:1"); !dsec.IsNotFound(err) {
		t.Fatalf("alice Get bob's image: %v, want NotFound", err)
	}
	if _, err := alice.Create(ctx, dsec.Spec{Image: "mine:1"}); err == nil {
		t.Fatal("alice created a sandbox from bob's private image")
	}
	// Only the admin creates tenants.
	if _, err := alice.Tenants().Create(ctx, "mallory", dsec.Quota{}); !dsec.IsPermissionDenied(err) {
		t.Fatalf("alice creating a tenant: %v, want PermissionDenied", err)
	}
	testDefaults(t, admin)
}

// fields parses "key:  value" lines.
func fields(out string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// testDefaults is issue 13's quota bypass, through the CLI: a tenant with
// --max-cpu 1 --max-memory 1g created three sandboxes without --cpu or
// --memory, all unlimited, with "0 in use". Now each gets the node's
// defaults (1 core, 1 GiB here) and is charged for them.
func testDefaults(t *testing.T, admin cli) {
	tok := admin.ok(t, "tenant", "create", "carol", "--max-cpu", "1", "--max-memory", "1g")
	carol := cli{bin: admin.bin, endpoint: admin.endpoint, token: tok}
	first := carol.ok(t, "sandbox", "create", "--image", "busybox:latest")
	for i := 2; i <= 3; i++ {
		r := carol.run(t, nil, "sandbox", "create", "--image", "busybox:latest")
		if r.code == 0 || !strings.Contains(r.stderr, "max_milli_cpu") {
			t.Fatalf("carol's sandbox %d without resources: %+v, want refused by max_milli_cpu", i, r)
		}
	}
	if got := carol.ok(t, "tenant", "get"); !strings.Contains(got, "1 in use of 1") || !strings.Contains(got, "1.0GiB in use of 1.0GiB") {
		t.Fatalf("tenant get:\n%s\nwant 1 core and 1 GiB in use", got)
	}
	// The Go SDK reads the same.
	if tn, err := dsec.New(admin.endpoint, tok).Tenants().Get(context.Background(), ""); err != nil ||
		tn.Usage != (dsec.Usage{Sandboxes: 1, MilliCPU: 1000, MemoryBytes: 1 << 30}) || tn.Quota.MaxMilliCPU != 1000 {
		t.Fatalf("SDK Tenants().Get: %+v, %v", tn, err)
	}
	got := fields(carol.ok(t, "sandbox", "get", first))
	for k, want := range map[string]string{"cpu": "1", "memory": "1.0GiB", "pids": "1024", "disk": "10.0GiB"} {
		if got[k] != want {
			t.Errorf("sandbox get: %s %q, want %q (the node's default)", k, got[k], want)
		}
	}
	carol.ok(t, "sandbox", "rm", first)

	// Tenant defaults, then an explicit value over them.
	admin.ok(t, "tenant", "update", "carol", "--default-cpu", "0.25", "--default-memory", "256m")
	var ids []string
	for range 4 {
		ids = append(ids, carol.ok(t, "sandbox", "create", "--image", "busybox:latest"))
	}
	if r := carol.run(t, nil, "sandbox", "create", "--image", "busybox:latest"); r.code == 0 {
		t.Fatalf("a fifth sandbox of 0.25 cores under --max-cpu 1 was created")
	}
	carol.ok(t, "sandbox", "rm", ids[0])
	id := carol.ok(t, "sandbox", "create", "--image", "busybox:latest", "--memory", "128m", "--disk-size", "2g")
	got = fields(carol.ok(t, "sandbox", "get", id))
	for k, want := range map[string]string{"cpu": "0.25", "memory": "128.0MiB", "disk": "2.0GiB"} {
		if got[k] != want {
			t.Errorf("sandbox get: %s %q, want %q", k, got[k], want)
		}
	}
	carol.ok(t, append([]string{"sandbox", "rm", id}, ids[1:]...)...)
	if r := carol.run(t, nil, "tenant", "update", "carol", "--max-cpu", "8"); r.code == 0 || !strings.Contains(r.stderr, "admin") {
		t.Fatalf("carol updating her own quota: %+v, want refused (admin only)", r)
	}
}
