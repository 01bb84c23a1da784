package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDeps keeps the agent lean: it runs in every sandbox, so each package
// it links costs start-up time (package init) and memory per sandbox. The
// packages below are ones it once pulled in or easily could: the protobuf
// runtime (the agent has its own codec, internal/agent/wire.go), JSON (its
// init configuration is protobuf now), slog and net/http, and the runtime
// packages of the edge (internal/agent must not depend on them; only the
// backends' in-sandbox halves, sandboxinit and microvm's guestinit, belong in the agent).
func TestDeps(t *testing.T) {
	// go test puts its own toolchain first in PATH.
	cmd := exec.Command("go", "list", "-deps", ".")
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0") // as the agent is built
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 {
		t.Fatalf("go list gave %d packages: %q", len(deps), deps)
	}
	forbidden := func(p string) bool {
		switch p {
		case "net/http", "encoding/json", "log/slog", "log", "os/exec", "net", "crypto/tls",
			"github.com/dsec-dev/dsec/internal/runtime":
			return true
		}
		return strings.HasPrefix(p, "google.golang.org/protobuf/") ||
			(strings.HasPrefix(p, "github.com/dsec-dev/dsec/internal/runtime/") &&
				p != "github.com/dsec-dev/dsec/internal/runtime/container/sandboxinit" &&
				p != "github.com/dsec-dev/dsec/internal/runtime/microvm/guestinit")
	}
	for _, p := range deps {
		if forbidden(p) {
			t.Errorf("dsec-agent links %s", p)
		}
	}
}
