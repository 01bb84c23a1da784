// Command statebench measures issue 5's state operations on a real
// `dsec up`, each next to a peer measured in the same run on the same
// machine and bytes, and reports the ratios:
//
//   - pack_diff: Snapshot of a sandbox whose writable layer holds 10 MiB,
//     against packing the same 10 MiB on the host with `tar -cf` (and
//     mkfs.erofs, the packer DSec runs, as a floor; mksquashfs if
//     installed). Target: at most 100 ms.
//   - checkpoint and rollback of a sandbox with a ~3 MiB writable layer,
//     the content verified after every rollback, against `cp -a` of the
//     same files on the host (a naive copy snapshot) and against destroy +
//     create of a sandbox through the same API (what a user does without
//     rollback). Targets: at most 20 ms and 50 ms.
//   - job-wide freeze and thaw (FreezeJob/ThawJob) of K sandboxes labelled
//     job=bench, against `crun pause`/`crun resume` (or runc) of P
//     detached busybox containers one after another, per container and
//     extrapolated to K, and against the cgroup-freezer floor: writing
//     FROZEN/THAWED to K v1 freezer cgroups the harness makes itself.
//     Target: at most 2 s each for K = 1000.
//
// Usage (as root, from the repository root):
//
//	go run ./bench/statebench [-k 1000] [-peers 100] [-reps 10] [-json]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// config is what one run measures.
type config struct {
	K       int `json:"k"`
	Peers   int `json:"peers"`
	Reps    int `json:"reps"`
	Batch   int `json:"create_batch"`
	PackMiB int `json:"pack_mib"`
	CkptMiB int `json:"checkpoint_mib"`
	// Runtime is the OCI runtime of the pause/resume peer ("" if none).
	Runtime string   `json:"runtime,omitempty"`
	Phases  []string `json:"phases"`
}

// Upper sizes the targets are stated for.
const (
	packMiB = 10 // "pack_diff of a 10 MB upper"
	ckptMiB = 3  // "an upper of a few MB"
)

// nodeID names the edge; sandbox IDs start with it.
const nodeID = "statebench"

// Phases, in the order they run.
var allPhases = []string{"pack", "checkpoint", "job"}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if len(os.Args) > 1 && os.Args[1] == ociWorkerArg {
		if err := ociWorkerMain(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "statebench oci worker:", err)
			os.Exit(1)
		}
		return
	}
	if err := mainErr(); err != nil {
		fmt.Fprintln(os.Stderr, "statebench:", err)
		os.Exit(1)
	}
}

func mainErr() error {
	var (
		k       = flag.Int("k", 1000, "sandboxes in the job that FreezeJob/ThawJob act on (and freezer cgroups of the floor)")
		peers   = flag.Int("peers", 100, "containers the crun/runc pause/resume peer pauses one after another")
		reps    = flag.Int("reps", 10, "repetitions of every timed operation (snapshot, checkpoint, rollback, job freeze and thaw)")
		batch   = flag.Int("batch", 100, "sandboxes per CreateMany call")
		phases  = flag.String("phases", strings.Join(allPhases, ","), "phases to run: pack, checkpoint, job")
		runtime = flag.String("runtime", "", "OCI runtime of the pause/resume peer: crun or runc (default: crun if installed, else runc, else the row is skipped)")
		fl      dsecup.Flags
	)
	fl.Register()
	flag.Parse()
	if err := dsecup.CheckFlags(map[string]int{"k": *k, "peers": *peers, "reps": *reps, "batch": *batch}); err != nil {
		return err
	}
	sel, err := dsecup.ParseList("phases", *phases, allPhases)
	if err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root (dsec up and the peers make namespaces, mounts and cgroups)")
	}
	cfg := config{K: *k, Peers: *peers, Reps: *reps, Batch: *batch, PackMiB: packMiB, CkptMiB: ckptMiB, Phases: sel}
	rt, rtSkip := pickRuntime(*runtime)
	if *runtime != "" && rt == "" {
		return errors.New(rtSkip)
	}
	cfg.Runtime = rt

	// The first signal cancels ctx: the phase in flight stops, everything
	// it made is removed, dsec up is stopped, and what was measured is
	// reported. Signals stay caught until the end so that cleanup itself
	// is not cut short.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	root, err := dsecup.RepoRoot()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "statebench-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	started := time.Now()
	rep := &Report{Config: cfg, Host: hostLine(), Tools: toolVersions(rt), HarnessPID: os.Getpid()}
	if rtSkip != "" {
		rep.Skipped = append(rep.Skipped, rtSkip)
	}
	var errs []error
	fail := func(err error) {
		if err != nil {
			errs = append(errs, err)
			slog.Error("failed", "err", err)
		}
	}

	func() {
		// Everything the run makes lives under work; its teardown runs
		// whatever happened, Ctrl-C included.
		// The OCI peer's containers run on the same rootfs.
		bins, rootfs, err := dsecup.Prepare(ctx, root, work, fl)
		if err != nil {
			fail(err)
			return
		}
		h := &harness{cfg: cfg, work: work, rootfs: rootfs, bins: bins, rep: rep}
		dataDir := filepath.Join(work, "data")
		up, err := dsecup.Start(ctx, dsecup.Options{Bins: bins, DataDir: dataDir, Rootfs: rootfs, NodeID: nodeID})
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
				rep.addLeaks(leaks)
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
		h.up = up
		h.api = newAPI(up.Endpoint, up.Token)
		for _, p := range sel {
			if ctx.Err() != nil {
				break
			}
			slog.Info("phase", "phase", p)
			t0 := time.Now()
			var err error
			switch p {
			case "pack":
				err = h.packPhase(ctx)
			case "checkpoint":
				err = h.checkpointPhase(ctx)
			case "job":
				err = h.jobPhase(ctx)
			}
			if err != nil {
				fail(fmt.Errorf("%s: %w", p, err))
			} else {
				slog.Info("phase done", "phase", p, "took", time.Since(t0).Round(time.Millisecond))
			}
		}
	}()

	// What the harness itself made (peer cgroups and processes, mounts
	// under the work dir) is checked after everything was torn down.
	leaks, err := dsecup.ReclaimHarness(cgroupPrefix, work)
	if err != nil {
		fail(fmt.Errorf("cleanup: %w", err))
	}
	rep.addLeaks(leaks)
	if rep.Leaks != nil {
		fail(fmt.Errorf("leaked %s (removed)", rep.Leaks))
	}
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
	if err := dsecup.PrintReport(fl.JSON, "statebench", rep, rep.print); err != nil {
		return err
	}
	return errors.Join(errs...)
}

// harness is what the phases share.
type harness struct {
	cfg    config
	work   string
	rootfs string
	bins   dsecup.Binaries
	up     *dsecup.Up
	api    *api
	rep    *Report
}

// pickRuntime chooses the OCI runtime of the pause/resume peer; when none
// can be used it returns "" and why.
func pickRuntime(want string) (string, string) {
	cands := []string{"crun", "runc"}
	if want != "" {
		if !slices.Contains(cands, want) {
			return "", fmt.Sprintf("-runtime %q: want crun or runc", want)
		}
		cands = []string{want}
	}
	for _, c := range cands {
		if _, err := exec.LookPath(c); err == nil {
			return c, ""
		}
	}
	return "", fmt.Sprintf("pause/resume peer skipped: %s not installed (apt-get install -y crun)", strings.Join(cands, " nor "))
}
