// Command trajbench measures what the trajectory log costs an exec: the
// round trip of `/bin/true` with many sandboxes executing at once, on a
// real `dsec up` with the log on (`--trajectory`, the default) and off
// (`--trajectory=false`), in one run on one machine, read as ratios. The
// target (issue 4) is an overhead of at most 10% with 200 sandboxes.
//
// Rounds alternate off, on, off, on... so that machine noise hits both
// modes alike. Each round starts its own `dsec up` on a fresh data dir and
// port, creates the sandboxes, releases all of them at once to run their
// execs back to back (one goroutine per sandbox), destroys them and stops
// the process. The "on" rounds use numbered handles (steps 1, 2, 3... as a
// trainer's client sends them), the "off" rounds unnumbered ones (an edge
// without a log refuses numbered operations).
//
// Usage (as root, from the repository root):
//
//	go run ./bench/trajbench [-sandboxes 200] [-execs 20] [-rounds 2] [-json] [-keep]
package main

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// config is what one run measures.
type config struct {
	Sandboxes int `json:"sandboxes"`
	Execs     int `json:"execs_per_sandbox"`
	Rounds    int `json:"rounds_per_mode"`
	Batch     int `json:"create_batch"`
}

// Modes, in the order each pair of rounds runs them.
const (
	modeOff = "off"
	modeOn  = "on"
)

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if err := mainErr(); err != nil {
		fmt.Fprintln(os.Stderr, "trajbench:", err)
		os.Exit(1)
	}
}

func mainErr() error {
	var (
		sandboxes = flag.Int("sandboxes", 200, "sandboxes executing at once")
		execs     = flag.Int("execs", 20, "execs of /bin/true each sandbox runs back to back")
		rounds    = flag.Int("rounds", 2, "rounds per mode, interleaved off, on, off, on...")
		batch     = flag.Int("batch", 50, "sandboxes per CreateMany call")
		asJSON    = flag.Bool("json", false, "print results as JSON instead of a table")
		keep      = flag.Bool("keep", false, "keep the work dir (data dirs, dsec up logs) for debugging")
		dsecBin   = flag.String("dsec", "", "use this dsec binary instead of building ./cmd/dsec (copied into the work dir)")
		agentBin  = flag.String("agent", "", "use this dsec-agent binary instead of building ./cmd/dsec-agent (copied into the work dir)")
	)
	flag.Parse()
	for name, v := range map[string]int{"sandboxes": *sandboxes, "execs": *execs, "rounds": *rounds, "batch": *batch} {
		if v < 1 {
			return fmt.Errorf("-%s must be at least 1, got %d", name, v)
		}
	}
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root (dsec up makes namespaces, mounts and cgroups)")
	}
	cfg := config{Sandboxes: *sandboxes, Execs: *execs, Rounds: *rounds, Batch: *batch}

	// The first signal cancels ctx: the round in flight stops sending
	// execs, destroys its sandboxes and stops its dsec up. Signals stay
	// caught until the end so that cleanup itself is not cut short.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	root, err := repoRoot()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "trajbench-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	defer func() {
		if *keep {
			slog.Info("kept the work dir (-keep)", "dir", work)
			return
		}
		if err := removeDir(work); err != nil {
			slog.Error("cleanup", "err", err)
		}
	}()

	started := time.Now()
	bins, err := binariesFor(ctx, root, filepath.Join(work, "bin"), *dsecBin, *agentBin)
	if err != nil {
		return err
	}
	rootfs := filepath.Join(work, "rootfs")
	if err := buildRootfs(ctx, root, rootfs); err != nil {
		return err
	}

	rep := &Report{Config: cfg, Host: hostLine()}
	var errs []error
rounds:
	for i := 1; i <= cfg.Rounds && ctx.Err() == nil; i++ {
		for _, mode := range []string{modeOff, modeOn} {
			if ctx.Err() != nil {
				break
			}
			slog.Info("round", "round", i, "mode", mode, "sandboxes", cfg.Sandboxes, "execs", cfg.Execs)
			r := runRound(ctx, cfg, bins, rootfs, filepath.Join(work, fmt.Sprintf("%d-%s", i, mode)), i, mode, *keep)
			rep.Rounds = append(rep.Rounds, r)
			if r.Err != "" {
				errs = append(errs, fmt.Errorf("round %d %s: %s", i, mode, r.Err))
				slog.Error("round failed", "round", i, "mode", mode, "err", r.Err)
				if !r.complete(cfg) {
					// The next rounds would fail alike; what was measured
					// is still reported.
					break rounds
				}
			} else {
				slog.Info("round done", "round", i, "mode", mode, "wall_s", fmt.Sprintf("%.2f", r.WallSeconds),
					"median_ms", fmt.Sprintf("%.2f", r.MedianMs), "p99_ms", fmt.Sprintf("%.2f", r.P99Ms))
			}
		}
	}
	rep.summarize()
	rep.WallSeconds = time.Since(started).Seconds()
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}

	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		fmt.Printf("trajbench %s\n", strings.Join(os.Args[1:], " "))
		rep.print(os.Stdout)
	}
	return errors.Join(errs...)
}

// repoRoot finds the DSec module root from the working directory up.
func repoRoot() (string, error) {
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

// binaries are the dsec and dsec-agent executables this run measures.
type binaries struct{ dsec, agent, dir string }

// binariesFor puts dsec and dsec-agent into dir: built from the working
// tree, statically, as the e2e tests do, or copied from the given paths.
// Either way every process started from dir is this run's, which the leak
// check relies on (a shared bin/ may be running other people's dsec).
func binariesFor(ctx context.Context, root, dir, dsecBin, agentBin string) (binaries, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return binaries{}, err
	}
	b := binaries{dsec: filepath.Join(dir, "dsec"), agent: filepath.Join(dir, "dsec-agent"), dir: dir}
	var pkgs []string
	for _, x := range []struct{ from, to, pkg string }{{dsecBin, b.dsec, "./cmd/dsec"}, {agentBin, b.agent, "./cmd/dsec-agent"}} {
		if x.from == "" {
			pkgs = append(pkgs, x.pkg)
			continue
		}
		if err := copyFile(x.from, x.to); err != nil {
			return binaries{}, err
		}
	}
	if len(pkgs) > 0 {
		args := append([]string{"build", "-trimpath", "-o", dir + "/"}, pkgs...)
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		t0 := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			return binaries{}, fmt.Errorf("go %s (or pass prebuilt binaries with -dsec and -agent): %v\n%s", strings.Join(args, " "), err, out)
		}
		slog.Info("built", "packages", pkgs, "dir", dir, "took", time.Since(t0).Round(time.Millisecond))
	}
	if err := requireStatic(b.agent); err != nil {
		if agentBin != "" {
			return binaries{}, fmt.Errorf("-agent %s: %w", agentBin, err)
		}
		return binaries{}, err
	}
	// The "off" rounds need the --trajectory flag (issue 4).
	out, err := exec.CommandContext(ctx, b.dsec, "up", "--help").CombinedOutput()
	if err != nil {
		return binaries{}, fmt.Errorf("%s up --help: %v\n%s", b.dsec, err, out)
	}
	if !bytes.Contains(out, []byte("--trajectory")) {
		return binaries{}, errors.New("this dsec has no `up --trajectory` flag: too old to measure the log's overhead")
	}
	return b, nil
}

// requireStatic refuses a dynamically linked dsec-agent: it cannot lock
// down a sandbox (it must be built with CGO_ENABLED=0).
func requireStatic(path string) error {
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

func copyFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", from, err)
	}
	return out.Close()
}

// buildRootfs makes the busybox tree `make up` imports, with the repo's
// script (it needs a static busybox on PATH: Debian's busybox-static).
func buildRootfs(ctx context.Context, root, dir string) error {
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "scripts", "busybox-rootfs.sh"), dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("scripts/busybox-rootfs.sh: %v\n%s", err, out)
	}
	return nil
}
