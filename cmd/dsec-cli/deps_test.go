package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/testutil"
)

// allowedDeps are the packages outside the standard library that dsec-cli may
// link (a prefix ending in "/" allows a tree). Every package's init runs on
// every CLI call, page faults included, so the client stays thin: daemon
// code (edge, control plane, runtimes, pools, Prometheus, cgroups,
// seccomp, image libraries) belongs in dsecd. internal/trajectory is here
// because `trajectory verify`, `sandbox log` and `replay` read exported
// JSONL files locally; it and internal/blobstore need only the standard
// library.
var allowedDeps = []string{
	"github.com/dsec-dev/dsec/cmd/dsec-cli",
	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval",
	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff",
	"github.com/dsec-dev/dsec/cmd/dsec/cli",
	"github.com/dsec-dev/dsec/sdk/go/dsec",
	"github.com/dsec-dev/dsec/api/dsec/v1",
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect",
	"github.com/dsec-dev/dsec/internal/ids",
	"github.com/dsec-dev/dsec/internal/blobstore",
	"github.com/dsec-dev/dsec/internal/trajectory",
	"connectrpc.com/connect",
	"connectrpc.com/connect/internal/",
	"google.golang.org/protobuf/",
	"github.com/spf13/cobra",
	"github.com/spf13/pflag",
	"golang.org/x/sys/unix",
	"golang.org/x/term",
}

func allowed(pkg string) bool {
	return slices.ContainsFunc(allowedDeps, func(a string) bool {
		return pkg == a || strings.HasSuffix(a, "/") && strings.HasPrefix(pkg, a)
	})
}

// TestClientStaysThin fails when dsec-cli links a package not in allowedDeps,
// naming a package that imports it.
func TestClientStaysThin(t *testing.T) {
	cmd := exec.Command("go", "list", "-deps", "-f", `{{if not .Standard}}{{.ImportPath}} {{join .Imports " "}}{{end}}`, "./cmd/dsec-cli")
	cmd.Dir = testutil.RepoRoot(t)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/dsec-cli: %v", err)
	}
	importers := map[string]string{}
	var deps []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		deps = append(deps, f[0])
		for _, imp := range f[1:] {
			if _, ok := importers[imp]; !ok {
				importers[imp] = f[0]
			}
		}
	}
	if !slices.Contains(deps, "github.com/dsec-dev/dsec/sdk/go/dsec") {
		t.Fatalf("go list -deps ./cmd/dsec-cli lists no SDK; the listing is wrong:\n%s", out)
	}
	for _, d := range deps {
		if !allowed(d) {
			t.Errorf("dsec-cli links %s (imported by %s): its init would run on every CLI call; "+
				"keep daemon code in cmd/dsecd, or add it to allowedDeps if the client truly needs it", d, importers[d])
		}
	}
}
