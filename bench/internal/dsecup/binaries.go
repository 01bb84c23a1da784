package dsecup

// What a run needs before dsec up starts: the repository, the binaries and
// the busybox rootfs.

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// RepoRoot finds the DSec module root from the working directory up.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.HasPrefix(b, []byte("module github.com/dsec-dev/dsec\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run from inside the DSec repository (no go.mod of github.com/dsec-dev/dsec above the working directory)")
		}
		dir = parent
	}
}

// Binaries are the dsec, dsec-cli, dsecd and dsec-agent executables a run
// measures, all in Dir (the dsec front hands its daemon commands over to
// the dsecd next to it, and its other commands to the dsec-cli there).
type Binaries struct{ Dsec, DsecCLI, Dsecd, Agent, Dir string }

// BuildBinaries puts dsec, dsec-cli, dsecd and dsec-agent into dir: built
// from the working tree at root, statically, as the e2e tests do, or copied
// from the given paths (when not ""; dsec-cli and dsecd are copied from
// next to dsecBin). Either
// way every process started from dir is this run's, which the leak check
// relies on (a shared bin/ may be running other people's dsec). The caller
// checks the agent with RequireStatic.
func BuildBinaries(ctx context.Context, root, dir, dsecBin, agentBin string) (Binaries, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Binaries{}, err
	}
	b := Binaries{Dsec: filepath.Join(dir, "dsec"), DsecCLI: filepath.Join(dir, "dsec-cli"), Dsecd: filepath.Join(dir, "dsecd"),
		Agent: filepath.Join(dir, "dsec-agent"), Dir: dir}
	dsecdBin, cliBin := "", ""
	if dsecBin != "" {
		dsecdBin = filepath.Join(filepath.Dir(dsecBin), "dsecd")
		cliBin = filepath.Join(filepath.Dir(dsecBin), "dsec-cli")
		for _, p := range []string{dsecdBin, cliBin} {
			if _, err := os.Stat(p); err != nil {
				return Binaries{}, fmt.Errorf("-dsec %s: %s must be next to it (make build puts them all in bin/): %w", dsecBin, filepath.Base(p), err)
			}
		}
	}
	var pkgs []string
	for _, x := range []struct{ from, to, pkg string }{
		{dsecBin, b.Dsec, "./cmd/dsec"}, {cliBin, b.DsecCLI, "./cmd/dsec-cli"}, {dsecdBin, b.Dsecd, "./cmd/dsecd"}, {agentBin, b.Agent, "./cmd/dsec-agent"},
	} {
		if x.from == "" {
			pkgs = append(pkgs, x.pkg)
			continue
		}
		if err := copyFile(x.from, x.to, 0o755); err != nil {
			return Binaries{}, err
		}
	}
	if len(pkgs) > 0 {
		args := append([]string{"build", "-trimpath", "-o", dir + "/"}, pkgs...)
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		t0 := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			return Binaries{}, fmt.Errorf("go %s (or pass prebuilt binaries with -dsec and -agent): %v\n%s", strings.Join(args, " "), err, out)
		}
		slog.Info("built", "packages", pkgs, "dir", dir, "took", time.Since(t0).Round(time.Millisecond))
	}
	return b, nil
}

// RequireStatic refuses a dynamically linked dsec-agent: it cannot lock
// down a sandbox (it must be built with CGO_ENABLED=0).
func RequireStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("dsec-agent %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errors.New("dsec-agent is dynamically linked; build it with CGO_ENABLED=0")
		}
	}
	return nil
}

func copyFile(from, to string, mode os.FileMode) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", from, err)
	}
	return out.Close()
}

// BuildRootfs makes the busybox tree `make up` imports in dir, with the
// repo's script (it needs a static busybox on PATH: Debian's
// busybox-static).
func BuildRootfs(ctx context.Context, root, dir string) error {
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "scripts", "busybox-rootfs.sh"), dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("scripts/busybox-rootfs.sh: %v\n%s", err, out)
	}
	return nil
}
