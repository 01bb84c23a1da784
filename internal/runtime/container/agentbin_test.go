package container

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/testutil"
)

// TestAgentBuiltWithCgoRefused: an agent built with cgo is refused (New
// calls checkAgentBinary), naming the cause, instead of failing every create.
func TestAgentBuiltWithCgoRefused(t *testing.T) {
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("no C compiler: cannot build a cgo agent")
	}
	root := testutil.RepoRoot(t)
	dir := t.TempDir()
	cgo := filepath.Join(dir, "dsec-agent")
	cmd := exec.Command("go", "build", "-o", cgo, "./cmd/dsec-agent")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build with cgo: %v\n%s", err, out)
	}
	err := checkAgentBinary(cgo)
	if err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
		t.Fatalf("checkAgentBinary(cgo agent) = %v, want an error naming CGO_ENABLED=0", err)
	}
	static := testutil.BuildBinary(t, "./cmd/dsec-agent")
	if err := checkAgentBinary(static); err != nil {
		t.Fatalf("checkAgentBinary(static agent) = %v", err)
	}
}
