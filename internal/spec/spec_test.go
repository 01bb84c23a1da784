package spec

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

func TestValidate(t *testing.T) {
	ok := func(mod func(s *dsecv1.SandboxSpec)) *dsecv1.SandboxSpec {
		s := &dsecv1.SandboxSpec{Image: "busybox:1"}
		if mod != nil {
			mod(s)
		}
		return s
	}
	for _, tc := range []struct {
		name  string
		spec  *dsecv1.SandboxSpec
		field string // "" = valid
	}{
		{"minimal", ok(nil), ""},
		{"nil", nil, "spec"},
		{"unknown backend", ok(func(s *dsecv1.SandboxSpec) { s.Backend = "docker" }), "spec.backend"},
		{"no image", ok(func(s *dsecv1.SandboxSpec) { s.Image = "" }), "spec.image"},
		{"bad image", ok(func(s *dsecv1.SandboxSpec) { s.Image = "Busy Box" }), "spec.image"},
		{"bad workspace", ok(func(s *dsecv1.SandboxSpec) { s.Workspace = "a@b" }), "spec.workspace"},
		{"bad toolkit", ok(func(s *dsecv1.SandboxSpec) { s.Toolkits = []string{"ok:1", ":"} }), "spec.toolkits[1]"},
		{"negative cpu", ok(func(s *dsecv1.SandboxSpec) { s.Resources = &dsecv1.Resources{MilliCpu: -1} }), "spec.resources.milli_cpu"},
		{"huge memory", ok(func(s *dsecv1.SandboxSpec) { s.Resources = &dsecv1.Resources{MemoryBytes: 1 << 62} }), "spec.resources.memory_bytes"},
		{"negative pids", ok(func(s *dsecv1.SandboxSpec) { s.Resources = &dsecv1.Resources{Pids: -5} }), "spec.resources.pids"},
		{"negative disk", ok(func(s *dsecv1.SandboxSpec) { s.Resources = &dsecv1.Resources{DiskBytes: -1} }), "spec.resources.disk_bytes"},
		{"largest accepted", ok(func(s *dsecv1.SandboxSpec) {
			s.Resources = &dsecv1.Resources{MilliCpu: MaxMilliCPU, MemoryBytes: MaxMemoryBytes, Pids: MaxPids, DiskBytes: MaxDiskBytes}
		}), ""},
		{"negative ttl", ok(func(s *dsecv1.SandboxSpec) { s.Ttl = durationpb.New(-1) }), "spec.ttl"},
		{"bad idle timeout", ok(func(s *dsecv1.SandboxSpec) { s.IdleTimeout = &durationpb.Duration{Seconds: 1, Nanos: -1} }), "spec.idle_timeout"},
		{"idle action", ok(func(s *dsecv1.SandboxSpec) { s.IdleAction = "sleep" }), "spec.idle_action"},
		{"env without =", ok(func(s *dsecv1.SandboxSpec) { s.Env = []string{"A=1", "B"} }), "spec.env[1]"},
		{"env with NUL", ok(func(s *dsecv1.SandboxSpec) { s.Env = []string{"A=\x00"} }), "spec.env[0]"},
		{"label with =", ok(func(s *dsecv1.SandboxSpec) { s.Labels = map[string]string{"a=b": "c"} }), "spec.labels"},
		{"empty label key", ok(func(s *dsecv1.SandboxSpec) { s.Labels = map[string]string{"": "c"} }), "spec.labels"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Validate(tc.spec)
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				if got.Backend != string(Container) {
					t.Errorf("backend %q, want %q by default", got.Backend, Container)
				}
				return
			}
			var fe *FieldError
			if !errors.As(err, &fe) || !errors.Is(err, ErrInvalid) || fe.Field != tc.field {
				t.Fatalf("Validate = %v, want a FieldError for %s", err, tc.field)
			}
			if !strings.HasPrefix(err.Error(), tc.field+": ") {
				t.Errorf("error %q does not start with the field", err)
			}
		})
	}
}

func TestValidateCopies(t *testing.T) {
	in := &dsecv1.SandboxSpec{Image: "busybox:1"}
	out, err := Validate(in)
	if err != nil {
		t.Fatal(err)
	}
	Resolve(out, Builtin)
	if in.Backend != "" || in.Resources != nil || out.Resources != nil {
		t.Fatalf("Validate or Resolve changed a spec: %v, %v", in, out)
	}
}

// TestResolve: explicit values beat the tenant's defaults, which beat the
// node's; every limit is filled and each is filled independently; the
// requests are the explicit values alone (0 where the spec says nothing).
func TestResolve(t *testing.T) {
	tenant := Resources{MilliCPU: 500, MemoryBytes: 256 << 20}
	node, err := NodeDefaults(Resources{MilliCPU: 2000, Pids: 64})
	if err != nil {
		t.Fatal(err)
	}
	if want := (Resources{MilliCPU: 2000, MemoryBytes: Builtin.MemoryBytes, Pids: 64, DiskBytes: Builtin.DiskBytes}); node != want {
		t.Fatalf("NodeDefaults = %+v, want %+v (Builtin for what is not configured)", node, want)
	}
	for _, tc := range []struct {
		name     string
		explicit *dsecv1.Resources
		want     Resources
	}{
		{"nothing given", nil, Resources{MilliCPU: 500, MemoryBytes: 256 << 20, Pids: 64, DiskBytes: Builtin.DiskBytes}},
		{"explicit cpu and disk", &dsecv1.Resources{MilliCpu: 100, DiskBytes: 1 << 30}, Resources{MilliCPU: 100, MemoryBytes: 256 << 20, Pids: 64, DiskBytes: 1 << 30}},
		{"all explicit", &dsecv1.Resources{MilliCpu: 1, MemoryBytes: 2, Pids: 3, DiskBytes: 4}, Resources{1, 2, 3, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &dsecv1.SandboxSpec{Image: "x:1", Resources: tc.explicit}
			req, got := Resolve(s, tenant, node)
			if got != tc.want {
				t.Fatalf("Resolve limits = %+v, want %+v", got, tc.want)
			}
			if want := FromProto(tc.explicit); req != want {
				t.Fatalf("Resolve requests = %+v, want the explicit %+v", req, want)
			}
			if FromProto(s.Resources) != FromProto(tc.explicit) {
				t.Fatalf("Resolve changed the spec's resources to %v", s.Resources)
			}
			if !got.Complete() {
				t.Errorf("%+v is not complete", got)
			}
		})
	}
	if _, err := NodeDefaults(Resources{Pids: -1}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "defaults.pids") {
		t.Errorf("NodeDefaults(pids -1) = %v, want an error naming defaults.pids", err)
	}
}

// BenchmarkValidate is the contract's cost on every create (server and
// edge each pay it once).
func BenchmarkValidate(b *testing.B) {
	in := &dsecv1.SandboxSpec{
		Image: "dsec/lang:bookworm", Workspace: "ws/task-17:v3", Toolkits: []string{"tools/py:1"},
		Resources: &dsecv1.Resources{MilliCpu: 2000, MemoryBytes: 4 << 30},
		Labels:    map[string]string{"job": "rl-7", "rollout": "123"}, Env: []string{"A=1", "B=2"},
	}
	for b.Loop() {
		s, err := Validate(in)
		if err != nil {
			b.Fatal(err)
		}
		Resolve(s, Resources{}, Builtin)
	}
}

// TestStateLive: what counts against a quota and holds a node.
func TestStateLive(t *testing.T) {
	for s, live := range map[State]bool{StateCreating: true, StateRunning: true, StateFrozen: true, StateLost: false, StateDestroyed: false, StateFailed: false} {
		if s.Live() != live {
			t.Errorf("%s.Live() = %v, want %v", s, s.Live(), live)
		}
	}
}
