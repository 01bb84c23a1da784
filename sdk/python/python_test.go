// Package python_test runs the Python SDK's pytest suite from `go test`, so
// `make test` covers libdsec against a live `dsec up` like every other part.
package python_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/dsec-dev/dsec/internal/testutil"
)

// python is Debian's interpreter: the one python3-httpx and python3-pytest
// install into (the python3 on PATH may be a pyenv build without them).
const python = "/usr/bin/python3"

func TestPythonSDK(t *testing.T) {
	testutil.RequireRoot(t)
	if err := exec.Command(python, "-c", "import httpx, pytest").Run(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s lacks httpx or pytest (scripts/deps.sh installs python3-httpx and python3-pytest): %v", python, err)
		}
		t.Skipf("%s lacks httpx or pytest (apt-get install python3-httpx python3-pytest): %v", python, err)
	}
	dsec := testutil.BuildBinary(t, "./cmd/dsec")
	agent := testutil.BuildBinary(t, "./cmd/dsec-agent")

	root := testutil.RepoRoot(t)
	cmd := exec.CommandContext(t.Context(), python, "-m", "pytest", "-q", "-p", "no:cacheprovider", filepath.Join("sdk", "python", "tests"))
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "DSEC_BIN="+dsec, "DSEC_AGENT_BIN="+agent, "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	t.Logf("pytest output:\n%s", out)
	if err != nil {
		t.Fatalf("pytest sdk/python/tests: %v", err)
	}
}
