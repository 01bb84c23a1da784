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
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
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
		fl        dsecup.Flags
	)
	fl.Register()
	flag.Parse()
	if err := dsecup.CheckFlags(map[string]int{"sandboxes": *sandboxes, "execs": *execs, "rounds": *rounds, "batch": *batch}); err != nil {
		return err
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

	root, err := dsecup.RepoRoot()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "trajbench-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	defer func() {
		if fl.Keep {
			slog.Info("kept the work dir (-keep)", "dir", work)
			return
		}
		if err := dsecup.RemoveDir(work); err != nil {
			slog.Error("cleanup", "err", err)
		}
	}()

	started := time.Now()
	bins, rootfs, err := dsecup.Prepare(ctx, root, work, fl)
	if err != nil {
		return err
	}
	if err := checkTrajectoryFlag(ctx, bins); err != nil {
		return err
	}

	rep := &Report{Config: cfg, Host: dsecup.HostLine()}
	var errs []error
rounds:
	for i := 1; i <= cfg.Rounds && ctx.Err() == nil; i++ {
		for _, mode := range []string{modeOff, modeOn} {
			if ctx.Err() != nil {
				break
			}
			slog.Info("round", "round", i, "mode", mode, "sandboxes", cfg.Sandboxes, "execs", cfg.Execs)
			r := runRound(ctx, cfg, bins, rootfs, filepath.Join(work, fmt.Sprintf("%d-%s", i, mode)), i, mode, fl.Keep)
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

	if err := dsecup.PrintReport(fl.JSON, "trajbench", rep, rep.print); err != nil {
		return err
	}
	return errors.Join(errs...)
}

// checkTrajectoryFlag checks that the binaries can be measured: the "off"
// rounds need dsec up's --trajectory flag (issue 4).
func checkTrajectoryFlag(ctx context.Context, b dsecup.Binaries) error {
	out, err := exec.CommandContext(ctx, b.Dsec, "up", "--help").CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s up --help: %v\n%s", b.Dsec, err, out)
	}
	if !bytes.Contains(out, []byte("--trajectory")) {
		return errors.New("this dsec has no `up --trajectory` flag: too old to measure the log's overhead")
	}
	return nil
}
