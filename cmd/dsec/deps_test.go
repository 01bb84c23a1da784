package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/testutil"
)

// frontDeps are the only packages outside the standard library the front
// may link, and frontForbidden standard packages it must not: their
// initialisation (and the page faults it costs) would run on every
// `dsec run`, which is the point of the front. Anything that needs them
// belongs in dsec-cli.
var (
	frontDeps = []string{
		"github.com/dsec-dev/dsec/cmd/dsec",
		"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval",
		"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff",
	}
	frontForbidden = []string{"net", "net/http", "crypto/tls", "encoding/json", "os/exec", "text/template", "log/slog"}
)

func TestFrontStaysLean(t *testing.T) {
	cmd := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}} {{.Standard}}`, "./cmd/dsec")
	cmd.Dir = testutil.RepoRoot(t)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/dsec: %v", err)
	}
	var n int
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, std, _ := strings.Cut(line, " ")
		n++
		switch {
		case std == "true" && slices.Contains(frontForbidden, pkg):
			t.Errorf("the front dsec links %s: its initialisation would run on every dsec run; move what needs it to dsec-cli", pkg)
		case std != "true" && !slices.Contains(frontDeps, pkg):
			t.Errorf("the front dsec links %s, outside the standard library: add it to frontDeps only if `dsec run` cannot do without it", pkg)
		}
	}
	if n < 10 {
		t.Fatalf("go list -deps ./cmd/dsec listed %d packages; the listing is wrong:\n%s", n, out)
	}
}
