// Command fnbench measures fncall (issue 6) on a real `dsec up`: the
// stateless call `print(1)` in Python, next to its peers in the same run on
// the same machine, read as ratios:
//
//   - host: `/usr/bin/python3 -c 'print(1)'` run directly on the host, the
//     floor (no sandbox at all);
//   - fncall: FnService.RunCode through the Go SDK (Connect), language
//     python, code `print(1)`: a clean sandbox from the edge's warm pool,
//     reset after the call off the caller's path;
//   - run_code: the same call as SandboxFusion's `POST /run_code` (JSON
//     over HTTP/1.1), what SandboxFusion clients send;
//   - fresh: the same program through a fresh container each time via the
//     same service: create a sandbox of the language image, exec
//     `/usr/bin/python3 -c 'print(1)'`, destroy it.
//
// Each row gets a sequential phase (one call at a time: p50, p90) and a
// concurrent one (C callers, default 64: calls/s). Rounds (default 3)
// measure every row in turn, so that noise from other work on a shared
// machine hits every row alike; the summary pools the rounds and the
// ratios are given per round too. Targets: fncall p50 within 1.5x of the
// host's, and at least 200 calls/s with 64 concurrent callers.
//
// The language image is the rootfs scripts/langimage.sh builds (cached in
// /var/cache/dsec/lang-rootfs); the harness imports that directory by its
// server path (nothing is uploaded) as the language table's image
// (dsec/lang:bookworm), and never builds it.
//
// Usage (as root, from the repository root):
//
//	go run ./bench/fnbench [-rounds 3] [-n 50] [-total 320] [-c 64] [-rows host,fncall,run_code,fresh] [-json] [-keep]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
)

// DefaultLangRootfs is where scripts/langimage.sh caches the language
// rootfs on the machines DSec's tests run on.
const DefaultLangRootfs = "/var/cache/dsec/lang-rootfs"

// nodeID names the edge; sandbox IDs start with it.
const nodeID = "fnbench"

// Rows, in the order they are measured.
const (
	rowHost    = "host"
	rowFncall  = "fncall"
	rowRunCode = "run_code"
	rowFresh   = "fresh"
)

var allRows = []string{rowHost, rowFncall, rowRunCode, rowFresh}

// config is what one run measures.
type config struct {
	N       int      `json:"sequential_n"`
	Rounds  int      `json:"rounds"`
	Warmup  int      `json:"warmup"`
	Total   int      `json:"concurrent_total"`
	C       int      `json:"concurrency"`
	Rows    []string `json:"rows"`
	Rootfs  string   `json:"lang_rootfs"`
	Image   string   `json:"image"`
	FnWarm  int      `json:"fn_warm"`
	FnMax   int      `json:"fn_max"`
	FnQueue int      `json:"fn_queue"`
}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if err := mainErr(); err != nil {
		fmt.Fprintln(os.Stderr, "fnbench:", err)
		os.Exit(1)
	}
}

func mainErr() error {
	var (
		n       = flag.Int("n", 50, "sequential: timed calls per row and round (after -warmup untimed ones)")
		rounds  = flag.Int("rounds", 3, "rounds: each measures every row in turn, so that machine noise hits every row alike")
		warmup  = flag.Int("warmup", 5, "sequential: untimed calls first, per row")
		total   = flag.Int("total", 320, "concurrent: calls per row and round")
		c       = flag.Int("c", 64, "concurrent: callers in flight")
		rows    = flag.String("rows", strings.Join(allRows, ","), "rows to measure, in order: "+strings.Join(allRows, ", "))
		rootfs  = flag.String("rootfs", DefaultLangRootfs, "the language rootfs (scripts/langimage.sh's output), imported by server path")
		fnWarm  = flag.Int("fn-warm", edge.DefaultFnWarm, "dsec up --fn-warm: clean sandboxes the fncall pool keeps ready")
		fnMax   = flag.Int("fn-max", edge.DefaultFnMax, "dsec up --fn-max: most sandboxes of the fncall pool")
		fnQueue = flag.Int("fn-queue", edge.DefaultFnQueue, "dsec up --fn-queue: most calls waiting for a sandbox")
		fl      dsecup.Flags
	)
	fl.Register()
	flag.Parse()
	if err := dsecup.CheckFlags(map[string]int{"n": *n, "rounds": *rounds, "total": *total, "c": *c, "fn-max": *fnMax, "fn-queue": *fnQueue}); err != nil {
		return err
	}
	if *warmup < 0 || *fnWarm < 0 || *fnWarm > *fnMax {
		return fmt.Errorf("-warmup %d, -fn-warm %d: want warmup >= 0 and 0 <= fn-warm <= fn-max (%d)", *warmup, *fnWarm, *fnMax)
	}
	sel, err := dsecup.ParseList("rows", *rows, allRows)
	if err != nil {
		return err
	}
	lang, err := fncall.Lookup("python")
	if err != nil {
		return err
	}
	cfg := config{N: *n, Rounds: *rounds, Warmup: *warmup, Total: *total, C: *c, Rows: sel, Rootfs: *rootfs, Image: lang.Image,
		FnWarm: *fnWarm, FnMax: *fnMax, FnQueue: *fnQueue}
	if err := checkRootfs(cfg.Rootfs); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root (dsec up makes namespaces, mounts and cgroups)")
	}

	// The first signal cancels ctx: the row in flight stops, the sandboxes
	// are destroyed, dsec up is stopped, and what was measured is
	// reported. Signals stay caught until the end so that cleanup itself
	// is not cut short.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	root, err := dsecup.RepoRoot()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "fnbench-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	started := time.Now()
	rep := &Report{Config: cfg, Host: dsecup.HostLine()}
	var errs []error
	fail := func(err error) {
		if err != nil {
			errs = append(errs, err)
			slog.Error("failed", "err", err)
		}
	}

	func() {
		// dsec up always seeds busybox:latest; nothing here uses it.
		bins, busybox, err := dsecup.Prepare(ctx, root, work, fl)
		if err != nil {
			fail(err)
			return
		}
		dataDir := filepath.Join(work, "data")
		up, err := dsecup.Start(ctx, dsecup.Options{Bins: bins, DataDir: dataDir, Rootfs: busybox, NodeID: nodeID,
			Args: []string{"--fn-warm", strconv.Itoa(cfg.FnWarm), "--fn-max", strconv.Itoa(cfg.FnMax), "--fn-queue", strconv.Itoa(cfg.FnQueue)}})
		if up != nil {
			rep.UpPID = up.PID()
			defer func() {
				if err := up.Stop(); err != nil {
					fail(err)
				}
				leaks, err := dsecup.Reclaim(bins, up.PID(), dataDir)
				if err != nil {
					fail(fmt.Errorf("cleanup: %w", err))
				}
				if !leaks.Empty() {
					rep.Leaks = &leaks
					fail(fmt.Errorf("dsec up left %s (removed)", leaks))
				}
				if fl.Keep {
					if err := os.WriteFile(filepath.Join(work, "dsec-up.log"), []byte(up.Log()), 0o644); err != nil {
						fail(err)
					}
				}
			}()
		}
		if err != nil {
			fail(err)
			return
		}
		cl := newClients(up.Endpoint, up.Token, cfg.C)
		defer cl.close()
		if slices.ContainsFunc(sel, func(r string) bool { return r != rowHost }) {
			t0 := time.Now()
			im, err := cl.sdk.Images().ImportServerPath(ctx, cfg.Image, cfg.Rootfs)
			if err != nil {
				fail(fmt.Errorf("import %s as %s: %w", cfg.Rootfs, cfg.Image, err))
				return
			}
			rep.ImportSeconds = time.Since(t0).Seconds()
			rep.ImageBytes = im.Size
			slog.Info("imported the language image", "ref", cfg.Image, "took", time.Since(t0).Round(time.Millisecond))
			// The import wrote ~1 GB; its writeback would otherwise run
			// under the first rows (it doubled the host row's p50 here).
			t0 = time.Now()
			unix.Sync()
			slog.Info("flushed the import to disk", "took", time.Since(t0).Round(time.Millisecond))
		}
	rounds:
		for round := 1; round <= cfg.Rounds; round++ {
			for _, name := range sel {
				if ctx.Err() != nil {
					break rounds
				}
				slog.Info("row", "round", round, "row", name, "n", cfg.N, "total", cfg.Total, "c", cfg.C)
				row := measureRow(ctx, cfg, round, name, cl.call(name, cfg.Image))
				rep.Rows = append(rep.Rows, row)
				if row.Err != "" {
					// The next rounds would fail alike; what was measured
					// is still reported.
					fail(fmt.Errorf("round %d %s: %s", round, name, row.Err))
					break rounds
				}
				slog.Info("row done", "round", round, "row", name, "p50_ms", row.Seq.MedianMs, "per_sec", row.Conc.PerSec)
			}
		}
	}()

	if fl.Keep {
		slog.Info("kept the work dir (-keep)", "dir", work)
	} else if err := dsecup.RemoveDir(work); err != nil {
		fail(fmt.Errorf("remove work dir: %w", err))
	}
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	rep.WallSeconds = time.Since(started).Seconds()
	rep.summarize()
	for _, e := range errs {
		rep.Errors = append(rep.Errors, e.Error())
	}
	if err := dsecup.PrintReport(fl.JSON, "fnbench", rep, rep.print); err != nil {
		return err
	}
	return errors.Join(errs...)
}

// checkRootfs refuses a language rootfs that is missing or not a
// directory, saying how to build one.
func checkRootfs(dir string) error {
	fi, err := os.Stat(dir)
	if err == nil && !fi.IsDir() {
		err = errors.New("not a directory")
	}
	if err != nil {
		return fmt.Errorf("-rootfs %s: %v (build it with `sudo scripts/langimage.sh %s`)", dir, err, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "usr", "bin", "python3")); err != nil {
		return fmt.Errorf("-rootfs %s has no usr/bin/python3: not a language rootfs (build it with `sudo scripts/langimage.sh DIR`)", dir)
	}
	return nil
}
