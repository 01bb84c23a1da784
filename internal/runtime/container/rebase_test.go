package container_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/layer"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// buildLayer makes a layer of files (path -> content) for specs stacked on
// the busybox layer.
func (e *env) buildLayer(t *testing.T, files map[string]string) rt.Layer {
	t.Helper()
	dir := t.TempDir()
	for p, c := range files {
		f := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	desc, err := layer.Build(context.Background(), e.store, dir)
	if err != nil {
		t.Fatal(err)
	}
	path, err := e.store.Path(desc.Digest)
	if err != nil {
		t.Fatal(err)
	}
	return rt.Layer{Digest: desc.Digest, Path: path}
}

// TestRebase: a sandbox rebased onto another spec keeps its runtime ID and
// agent, and is in every way the new spec's: its layers' files, none of
// the previous user's files or processes, the new hostname, exec
// defaults and memory limit; a later Reset keeps the new layers; Destroy
// releases the layers it holds then.
func TestRebase(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	a := e.spec(t)
	sb, err := e.backend.Create(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	agentPid, _ := e.backend.AgentPID(sb.ID())
	sh(t, sb, "echo secret > /root/secret && mkdir /var/left && echo x > /dev/shm/x && "+
		"(setsid sleep 1000 </dev/null >/dev/null 2>&1 &)")

	ws := e.buildLayer(t, map[string]string{"task/marker": "B\n"})
	b := rt.Spec{
		ID:        "rebased-" + strings.Repeat("x", 70), // hostnames stop at 63
		Layers:    []rt.Layer{e.layer, ws},
		Env:       []string{"TASKVAR=b"},
		Workdir:   "/task",
		Resources: rt.Resources{MemoryBytes: 128 << 20},
	}
	if err := sb.(rt.Rebaser).Rebase(ctx, b); err != nil {
		t.Fatal(err)
	}
	if sb.ID() != a.ID {
		t.Errorf("runtime ID after Rebase: %s, want %s kept", sb.ID(), a.ID)
	}
	if pid, _ := e.backend.AgentPID(sb.ID()); pid != agentPid {
		t.Errorf("agent PID %d after Rebase, was %d: the agent should be kept", pid, agentPid)
	}
	if got := sh(t, sb, "cat marker; echo $TASKVAR; echo ${DSEC_TEST:-unset}; hostname"); got != "B\nb\nunset\n"+b.ID[:63]+"\n" {
		t.Errorf("after Rebase: marker, $TASKVAR, $DSEC_TEST, hostname =\n%s", got)
	}
	if out := sh(t, sb, "ls -a /root /dev/shm; ls -d /var/left 2>&1; ps"); strings.Contains(out, "secret") ||
		strings.Contains(out, "x\n") || !strings.Contains(out, "No such file") || strings.Contains(out, "sleep 1000") {
		t.Errorf("the previous user's files or processes survive Rebase:\n%s", out)
	}
	if got := testutil.MemoryLimit(t, agentPid); got != strconv.Itoa(128<<20) {
		t.Errorf("memory limit after Rebase: %s, want %d", got, 128<<20)
	}
	container.WaitBackground(sb) // the old layers go with the old root
	if e.mounts.Refs(ws.Digest) != 1 || e.mounts.Refs(e.layer.Digest) != 1 {
		t.Errorf("layer refs after Rebase: workspace %d, base %d; want 1 and 1",
			e.mounts.Refs(ws.Digest), e.mounts.Refs(e.layer.Digest))
	}

	// A Reset, both when the root is kept and when a new one is built,
	// stays on the new layers.
	reset(t, sb)
	sh(t, sb, "echo dirty > /tmp/dirty")
	reset(t, sb)
	if got := sh(t, sb, "cat /task/marker; ls /tmp"); got != "B\n" {
		t.Errorf("after Resets of the rebased sandbox: %q, want the marker and an empty /tmp", got)
	}

	if err := sb.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if e.mounts.Refs(ws.Digest) != 0 || e.mounts.Refs(e.layer.Digest) != 0 {
		t.Errorf("layer refs after Destroy: workspace %d, base %d", e.mounts.Refs(ws.Digest), e.mounts.Refs(e.layer.Digest))
	}
	if entries, _ := os.ReadDir(e.backend.StateDir()); len(entries) != 0 {
		t.Errorf("state dir holds %v after Destroy", entries)
	}
}

// TestRebaseRefused: a spec Rebase cannot take is refused before anything
// changes, with an error naming the problem, and the sandbox goes on as it
// was.
func TestRebaseRefused(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	sb := e.create(t)
	sh(t, sb, "echo kept > /root/kept")
	for _, c := range []struct {
		name string
		spec rt.Spec
		want string
	}{
		{"user namespace", rt.Spec{ID: "r1", Layers: []rt.Layer{e.layer}, UserNamespace: true}, "user_namespace"},
		{"no layers", rt.Spec{ID: "r2"}, "at least one layer"},
		{"missing layer file", rt.Spec{ID: "r3", Layers: []rt.Layer{{Digest: "sha256:00", Path: "/nonexistent/layer"}}}, "/nonexistent/layer"},
		{"bad id", rt.Spec{ID: "a/b", Layers: []rt.Layer{e.layer}}, "id"},
	} {
		err := sb.(rt.Rebaser).Rebase(ctx, c.spec)
		if !errors.Is(err, rt.ErrInvalidSpec) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Rebase error %v, want ErrInvalidSpec naming %q", c.name, err, c.want)
		}
	}
	if got := sh(t, sb, "cat /root/kept; echo $DSEC_TEST"); got != "kept\n1\n" {
		t.Errorf("after refused Rebases the sandbox changed: %q", got)
	}
	if e.mounts.Refs(e.layer.Digest) != 1 {
		t.Errorf("layer refs after refused Rebases: %d, want 1", e.mounts.Refs(e.layer.Digest))
	}
}

// TestQuiesce: Quiesce ends every process of the user and leaves the root
// file system alone; a Rebase after it works.
func TestQuiesce(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	sb := e.create(t)
	sh(t, sb, "echo kept > /root/kept && (setsid sleep 1000 </dev/null >/dev/null 2>&1 &)")
	if err := sb.(rt.Rebaser).Quiesce(ctx); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, sb, "ps; cat /root/kept"); strings.Contains(out, "sleep") || !strings.Contains(out, "kept") {
		t.Errorf("after Quiesce (want no sleep, /root/kept still there):\n%s", out)
	}
	if err := sb.(rt.Rebaser).Rebase(ctx, e.spec(t)); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, sb, "ls /root"); strings.Contains(out, "kept") {
		t.Errorf("after Rebase /root holds %q", out)
	}
}

// TestRebaseSameLayers: a Rebase onto a spec with the sandbox's layers
// keeps the root when nobody wrote to it (the upper directory stays; only
// hostname and exec defaults change), and builds a new one when somebody
// did (the writes are gone).
func TestRebaseSameLayers(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	sb := e.create(t)
	upper := sb.(rt.Differ).UpperDir()
	b := rt.Spec{ID: "same-b", Layers: []rt.Layer{e.layer}, Env: []string{"NEW=b"}}
	if err := sb.(rt.Rebaser).Rebase(ctx, b); err != nil {
		t.Fatal(err)
	}
	if got := sb.(rt.Differ).UpperDir(); got != upper {
		t.Errorf("a Rebase onto the same layers of an untouched sandbox built a new root: %s, was %s", got, upper)
	}
	if got := sh(t, sb, "hostname; echo $NEW ${DSEC_TEST:-unset}"); got != "same-b\nb unset\n" {
		t.Errorf("after a Rebase keeping the root: hostname and env %q", got)
	}
	sh(t, sb, "echo left > /root/left")
	c := rt.Spec{ID: "same-c", Layers: []rt.Layer{e.layer}}
	if err := sb.(rt.Rebaser).Rebase(ctx, c); err != nil {
		t.Fatal(err)
	}
	if got := sb.(rt.Differ).UpperDir(); got == upper {
		t.Errorf("a Rebase of a written sandbox kept its root %s", got)
	}
	if got := sh(t, sb, "hostname; ls /root"); got != "same-c\n" {
		t.Errorf("after a Rebase of a written sandbox: %q, want the new hostname and an empty /root", got)
	}
}

// TestResetManyLayers: a sandbox of several layers gets its new overlays
// (Reset's full path, Rebase) although their list is longer than the 256
// bytes fsconfig takes in one string (each layer's directory is ~100
// bytes here, as under a node's data directory).
func TestResetManyLayers(t *testing.T) {
	e := newEnv(t, 0)
	ctx := context.Background()
	var layers []rt.Layer
	layers = append(layers, e.layer)
	for i := range 4 {
		layers = append(layers, e.buildLayer(t, map[string]string{"layer" + strconv.Itoa(i): strconv.Itoa(i)}))
	}
	spec := e.newSpec()
	spec.Layers = layers
	sb, err := e.backend.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(ctx) })
	sh(t, sb, "echo left > /root/left")
	reset(t, sb)
	if got := sh(t, sb, "cat /layer0 /layer3; ls /root"); got != "03" {
		t.Errorf("after a full Reset of a 5-layer sandbox: %q, want the layers' files and an empty /root", got)
	}
	b := e.newSpec()
	b.Layers = append([]rt.Layer{e.layer}, layers[3:]...)
	if err := sb.(rt.Rebaser).Rebase(ctx, b); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, sb, "cat /layer1 /layer3 2>/dev/null; true"); got != "3" {
		t.Errorf("after a Rebase onto 3 of the layers: %q, want layer3's file only", got)
	}
}
