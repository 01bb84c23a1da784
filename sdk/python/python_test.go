// Package python_test runs the Python SDK's pytest suite from `go test`, so
// `make test` covers libdsec against a live `dsec up` like every other part.
package python_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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

// TestPipInstall installs the SDK the way the README says, into a fresh
// virtual environment that sees Debian's packages, with no package index
// (PyPI is not reachable here, and must not be needed), and imports it from
// outside the checkout.
func TestPipInstall(t *testing.T) {
	if err := exec.Command(python, "-c", "import venv, setuptools, wheel, httpx").Run(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s lacks venv, setuptools, wheel or httpx (scripts/deps.sh installs python3-venv python3-setuptools python3-wheel python3-httpx): %v", python, err)
		}
		t.Skipf("%s lacks venv, setuptools, wheel or httpx: %v", python, err)
	}
	root := testutil.RepoRoot(t)
	tmp := t.TempDir()
	// A copy, so the build's scratch directories stay out of the checkout.
	src := filepath.Join(tmp, "src")
	if out, err := exec.Command("cp", "-r", filepath.Join(root, "sdk", "python"), src).CombinedOutput(); err != nil {
		t.Fatalf("copy sdk/python: %v\n%s", err, out)
	}
	venv := filepath.Join(tmp, "venv")
	run := func(dir string, name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(t.Context(), name, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "PIP_NO_INDEX=1", "PIP_DISABLE_PIP_VERSION_CHECK=1", "PYTHONDONTWRITEBYTECODE=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
		return string(out)
	}
	run(tmp, python, "-m", "venv", "--system-site-packages", venv)
	run(tmp, filepath.Join(venv, "bin", "pip"), "install", "--no-build-isolation", src)
	got := run(tmp, filepath.Join(venv, "bin", "python"), "-c",
		"import libdsec, os; print(libdsec.DSecClient.__name__, os.path.dirname(libdsec.__file__))")
	if want := filepath.Join(venv, "lib"); !strings.Contains(got, "DSecClient "+want) {
		t.Fatalf("libdsec imported from the wrong place or without DSecClient: %q (want under %s)", got, want)
	}
}
