package container_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/audit/caps"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/layer"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/container/scratchfs"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// env is a real node in miniature: a blob store holding a busybox EROFS
// layer, the shared layer mount cache, and the container backend.
type env struct {
	backend *container.Backend
	// scratch is the writable layers' file system (nil with
	// DSEC_TEST_SCRATCH=off: plain directories, no disk limits).
	scratch *scratchfs.FS
	layer   rt.Layer
	root    string
	store   *blobstore.Dir
	mounts  *layer.Mounts
	n       atomic.Int64
}

func newEnv(t testing.TB, warm int) *env {
	t.Helper()
	testutil.RequireRoot(t)
	return newEnvRootfs(t, warm, testsuite.BusyboxRootfs(t))
}

// newEnvRootfs is newEnv over a layer made of the directory rootfs; opts
// change the backend's options.
func newEnvRootfs(t testing.TB, warm int, rootfs string, opts ...func(*container.Options)) *env {
	t.Helper()
	testutil.RequireRoot(t)
	agentBin := testutil.BuildBinary(t, "./cmd/dsec-agent")
	// Not t.TempDir: the state lives on the same file system as a real
	// node's, and its removal is checked by the leak snapshot, not by the
	// testing package.
	root, err := os.MkdirTemp("", "dsec-container-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	store, err := blobstore.NewDir(filepath.Join(root, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	desc, err := layer.Build(ctx, store, rootfs)
	if err != nil {
		t.Fatal(err)
	}
	path, err := store.Path(desc.Digest)
	if err != nil {
		t.Fatal(err)
	}
	// The linger the edge runs with: sandboxes of one image reuse its mount.
	mounts, err := layer.NewMounts(filepath.Join(root, "layers"), layer.WithLinger(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mounts.Close() })
	// The writable layers' file system, as the edge makes it (closed after
	// the backend and every sandbox: cleanups run last first).
	// DSEC_TEST_SCRATCH=off runs without (benchmarks compare the two).
	var scratch *scratchfs.FS
	if os.Getenv("DSEC_TEST_SCRATCH") != "off" {
		if scratch, err = scratchfs.Open(scratchfs.Options{Image: filepath.Join(root, "scratch.img"),
			Dir: filepath.Join(root, "sandboxes"), Size: 2 << 30}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { scratch.Close() })
	}
	o := container.Options{
		StateDir:     filepath.Join(root, "sandboxes"),
		Scratch:      scratch,
		AgentPath:    agentBin,
		Layers:       mounts,
		CgroupParent: "dsec-test-" + filepath.Base(root),
		Warm:         warm,
	}
	for _, f := range opts {
		f(&o)
	}
	b, err := container.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		b.Close()
		for _, d := range b.CgroupDirs() {
			os.Remove(d)
		}
	})
	return &env{backend: b, scratch: scratch, layer: rt.Layer{Digest: desc.Digest, Path: path}, root: root, store: store, mounts: mounts}
}

func (e *env) spec(t *testing.T) rt.Spec { return e.newSpec() }

// lacks is what the suite must skip for this env.
func (e *env) lacks() map[testsuite.Capability]string {
	m := map[testsuite.Capability]string{
		testsuite.DiskStatfs: "btrfs (scratchfs) reports the whole scratch file system to statfs, not a subvolume's qgroup limit",
	}
	if e.scratch == nil {
		m[testsuite.DiskLimit] = "DSEC_TEST_SCRATCH=off: no scratch file system"
	}
	return m
}

// create creates a sandbox of a new spec, destroyed when the test or
// benchmark ends.
func (e *env) create(t testing.TB) rt.Sandbox {
	t.Helper()
	ctx := context.Background()
	sb, err := e.backend.Create(ctx, e.newSpec())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	return sb
}

// newSpec is spec for benchmarks too.
func (e *env) newSpec() rt.Spec {
	return rt.Spec{
		ID:     fmt.Sprintf("t%d", e.n.Add(1)),
		Layers: []rt.Layer{e.layer},
		Env:    []string{"DSEC_TEST=1"},
	}
}

func TestConformance(t *testing.T) {
	e := newEnv(t, 0)
	testsuite.Run(t, testsuite.Harness{
		Backend: e.backend,
		NewSpec: e.spec,
		Leaks: testsuite.HostLeaks(e.backend.CgroupDirs(),
			[]string{e.backend.StateDir(), filepath.Join(e.root, "layers")}),
		AgentName: "dsec-agent",
		Lacks:     e.lacks(),
	})
}

// TestConformanceWarm runs the suite with sandboxes built from pre-started
// agents, the path creates take on a busy edge. The leak checks need a
// quiet backend (the pool refills in the background), so they run above.
func TestConformanceWarm(t *testing.T) {
	e := newEnv(t, 4)
	testsuite.Run(t, testsuite.Harness{
		Backend:    e.backend,
		NewSpec:    e.spec,
		AgentName:  "dsec-agent",
		LeakCycles: 10,
		Lacks:      e.lacks(),
	})
}

// TestWarmPoolCleanup checks that Close removes the pre-started agents:
// their processes, cgroups and directories.
func TestWarmPoolCleanup(t *testing.T) {
	e := newEnv(t, 3)
	leaks := testsuite.HostLeaks(e.backend.CgroupDirs(), []string{e.backend.StateDir()})
	// The pool fills in the background: wait until its three agents are up
	// (one directory and one process each).
	deadline := time.Now().Add(time.Minute)
	for {
		entries, _ := os.ReadDir(e.backend.StateDir())
		if len(entries) == 3 && len(leaks(t).Processes) >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("warm pool did not start 3 agents: %d state entries", len(entries))
		}
		time.Sleep(10 * time.Millisecond)
	}
	before := leaks(t)
	ctx := context.Background()
	// A create takes a warm agent when one is ready; either way it works.
	sb, err := e.backend.Create(ctx, e.spec(t))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := sb.Exec(ctx, rt.ExecRequest{Shell: "echo warm"}, nil); err != nil || string(res.Stdout) != "warm\n" {
		t.Fatalf("exec: %v %q", err, res.Stdout)
	}
	if err := sb.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.backend.Close(); err != nil {
		t.Fatal(err)
	}
	after := leaks(t)
	if len(after.Processes) != 0 || len(after.Cgroups) != 0 {
		t.Fatalf("after Close: processes %v cgroups %v (before: %v)", after.Processes, after.Cgroups, before.Processes)
	}
	entries, _ := os.ReadDir(e.backend.StateDir())
	if len(entries) != 0 {
		t.Fatalf("after Close the state dir holds %d entries", len(entries))
	}
}

// TestSecurityProfile checks what every command in a sandbox runs with:
// Docker's capability set minus CAP_MKNOD (bounding, permitted, effective),
// no_new_privs, and the seccomp filter. The agent gives the bounding set to
// its spawner thread only, so this is what proves the processes it forks
// inherit it.
func TestSecurityProfile(t *testing.T) {
	e := newEnv(t, 1)
	ctx := context.Background()
	sb := e.create(t)
	want := fmt.Sprintf("%016x", uint64(caps.DockerDefault()))
	for _, user := range []string{"", "65534"} {
		res, err := sb.Exec(ctx, rt.ExecRequest{Argv: []string{"cat", "/proc/self/status"}, User: user}, nil)
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("cat status: %v %s", err, res.Stderr)
		}
		fields := map[string]string{}
		for _, line := range strings.Split(string(res.Stdout), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok {
				fields[k] = strings.TrimSpace(v)
			}
		}
		if fields["CapBnd"] != want {
			t.Errorf("user %q: CapBnd %s, want %s", user, fields["CapBnd"], want)
		}
		if user == "" && (fields["CapEff"] != want || fields["CapPrm"] != want) {
			t.Errorf("root: CapEff %s CapPrm %s, want %s", fields["CapEff"], fields["CapPrm"], want)
		}
		if fields["NoNewPrivs"] != "1" || fields["Seccomp"] != "2" {
			t.Errorf("user %q: NoNewPrivs %s Seccomp %s, want 1 and 2", user, fields["NoNewPrivs"], fields["Seccomp"])
		}
	}
	// mknod is refused even to root (CAP_MKNOD dropped), and mount by seccomp.
	res, err := sb.Exec(ctx, rt.ExecRequest{Shell: "mknod /tmp/null c 1 3 || echo mknod-denied; mount -t tmpfs x /mnt || echo mount-denied"}, nil)
	if err != nil || !strings.Contains(string(res.Stdout), "mknod-denied") || !strings.Contains(string(res.Stdout), "mount-denied") {
		t.Fatalf("mknod/mount inside the sandbox were not denied: %v %q %q", err, res.Stdout, res.Stderr)
	}
}

// TestSetupTooSlowIsBusy: a sandbox that does not come up within the init
// timeout (a node whose CPU other sandboxes saturate) is a refusal the
// caller may place again (rt.ErrBusy), not a failure of the platform, and
// leaves nothing behind.
func TestSetupTooSlowIsBusy(t *testing.T) {
	e := newEnvRootfs(t, 0, testsuite.BusyboxRootfs(t), func(o *container.Options) { o.InitTimeout = time.Microsecond })
	leaks := testsuite.HostLeaks(e.backend.CgroupDirs(), []string{e.backend.StateDir()})
	before := leaks(t)
	sb, err := e.backend.Create(context.Background(), e.newSpec())
	if err == nil {
		sb.Destroy(context.Background())
		t.Fatal("a sandbox came up within a microsecond")
	}
	if !errors.Is(err, rt.ErrBusy) {
		t.Fatalf("create past the init timeout: %v; want rt.ErrBusy", err)
	}
	if leaked := leaks(t).Leaked(before); len(leaked) > 0 {
		t.Fatalf("the refused create left %v", leaked)
	}
}

// TestSetupFailsInAgent: a sandbox the agent cannot build (here a seccomp
// program it cannot load, carried in the Init) fails the create with the
// agent's own reason, is not taken for a busy node, and leaves nothing
// behind.
func TestSetupFailsInAgent(t *testing.T) {
	e := newEnvRootfs(t, 0, testsuite.BusyboxRootfs(t), func(o *container.Options) { o.Seccomp = []byte{1, 2, 3} })
	leaks := testsuite.HostLeaks(e.backend.CgroupDirs(), []string{e.backend.StateDir()})
	before := leaks(t)
	sb, err := e.backend.Create(context.Background(), e.newSpec())
	if err == nil {
		sb.Destroy(context.Background())
		t.Fatal("a sandbox came up with a 3-byte seccomp program")
	}
	if errors.Is(err, rt.ErrBusy) || !strings.Contains(err.Error(), "sandbox setup:") || !strings.Contains(err.Error(), "program is 3 bytes") {
		t.Fatalf("create: %v; want the agent's reason for the failed setup", err)
	}
	if leaked := leaks(t).Leaked(before); len(leaked) > 0 {
		t.Fatalf("the failed create left %v", leaked)
	}
}
