// Command densitybench measures issue 14's density targets on one node, each
// beside its peer in the same run, read as ratios:
//
//   - idle: N idle sandboxes, each created with cpu 4 / 8 GiB limits, held
//     at once by a real `dsec up`, every one answering an exec; host memory
//     per sandbox (MemAvailable drop / count), creation rate, exec p50/p99,
//     where creating stopped and why. Peer: as many idle crun containers
//     with the same limits (`crun run --detach`).
//   - wave: R rollouts started at once through the Python SDK, each with a
//     workspace image of its own over the busybox base and cpu 2 / 4 GiB,
//     3-10 steps with 1-10 s of think time before each (seeded); peak
//     alive, wall time against the ideal, step p50/p99 against an empty
//     node's, infra errors, failures. Peer: the same wave on Docker
//     (`docker run -d --cpus 2 --memory 4g`, steps as `docker exec`), with a
//     private dockerd the harness starts and removes.
//   - pressure: more sandboxes than a node bounded to -node-memory could
//     hold if each touched its whole limit, a subset then touching memory
//     within their limits: OOM kills, what went to swap, step latency under
//     pressure against before. It needs `dsec up --memory` to be a real
//     cgroup bound and a swap flag; without them it says so and skips.
//
// Each phase starts its own `dsec up` on a fresh data dir and port and
// removes everything it made. Usage (as root, from the repository root):
//
//	go run ./bench/densitybench -phases idle -n 3000
//	go run ./bench/densitybench -phases wave -r 1000
//	go run ./bench/densitybench -phases pressure -node-memory 2g -swap 1g
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
)

// Phases, in the order they run.
const (
	phaseIdle     = "idle"
	phaseWave     = "wave"
	phasePressure = "pressure"
)

// cgroupPrefix names the harness's own cgroups (the crun peer's parent):
// densitybench-<what>-<harness pid>, found and removed at the end.
const cgroupPrefix = "densitybench-"

// config is what one run measures.
type config struct {
	Phases []string `json:"phases"`
	// UpArgs are added to every dsec up command line (request shares,
	// --max-sandboxes...).
	UpArgs []string `json:"up_args,omitempty"`

	Idle     idleConfig     `json:"idle"`
	Wave     waveConfig     `json:"wave"`
	Pressure pressureConfig `json:"pressure"`
}

type idleConfig struct {
	N          int     `json:"n"`
	MilliCPU   int64   `json:"milli_cpu"`
	MemBytes   int64   `json:"mem_bytes"`
	CreateC    int     `json:"create_concurrency"`
	CreateWait float64 `json:"create_wait_s"`
	ExecC      int     `json:"exec_concurrency"`
	Peer       string  `json:"peer"`
	PeerN      int     `json:"peer_n"`
}

type waveConfig struct {
	R          int     `json:"r"`
	StepsMin   int     `json:"steps_min"`
	StepsMax   int     `json:"steps_max"`
	ThinkMin   float64 `json:"think_min_s"`
	ThinkMax   float64 `json:"think_max_s"`
	Seed       int64   `json:"seed"`
	CPU        float64 `json:"cpu"`
	MemMB      int64   `json:"mem_mb"`
	Empty      int     `json:"empty_rollouts"`
	EmptySteps int     `json:"empty_steps"`
	Peer       string  `json:"peer"`
	DockerR    int     `json:"docker_r"`
	TimeoutS   float64 `json:"timeout_s"`
	ImportC    int     `json:"import_concurrency"`
}

type pressureConfig struct {
	NodeMemory string  `json:"node_memory"`
	Swap       string  `json:"swap"`
	SwapFlag   string  `json:"swap_flag"`
	N          int     `json:"n"`
	MemBytes   int64   `json:"mem_bytes"`
	Touchers   int     `json:"touchers"`
	TouchBytes int64   `json:"touch_bytes"`
	HoldS      float64 `json:"hold_s"`
	Steps      int     `json:"steps"`
	// AllowUnbounded runs the touching part on a node that is not bounded
	// by a cgroup: the harness's own test, at sizes the host shrugs off.
	AllowUnbounded bool `json:"allow_unbounded,omitempty"`
}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if len(os.Args) > 1 && os.Args[1] == ociWorkerFlag {
		// The crun peer, re-executed in a private mount namespace.
		if err := ociWorkerMain(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "densitybench worker:", err)
			os.Exit(1)
		}
		return
	}
	if err := mainErr(); err != nil {
		fmt.Fprintln(os.Stderr, "densitybench:", err)
		os.Exit(1)
	}
}

func mainErr() error {
	var (
		phases = flag.String("phases", "idle,wave", "phases to run, in order: idle, wave, pressure")
		settle = flag.Float64("settle", 0, "before each phase, wait (at most 10 min) until the 1-minute load average is below this (0: do not wait); MemAvailable figures need a quiet machine")
		upArgs = flag.String("up-args", "", "extra dsec up arguments for every phase, space-separated (e.g. \"--request-share-memory 0.01 --max-sandboxes 3500\")")

		n          = flag.Int("n", 1000, "idle: sandboxes to hold (target 3000)")
		cpu        = flag.String("cpu", "4", "idle: CPU limit of each sandbox, cores")
		mem        = flag.String("mem", "8g", "idle: memory limit of each sandbox")
		createC    = flag.Int("create-c", 8, "idle: creates in flight")
		createWait = flag.Duration("create-wait", 10*time.Second, "idle: how long one create may wait for room before it counts as refused (the node is then full)")
		execC      = flag.Int("exec-c", 4, "idle: execs in flight over the held sandboxes (peer too); the p50 includes waiting behind the others in flight")
		peer       = flag.String("peer", "crun", "idle: peer, crun or none")
		peerN      = flag.Int("peer-n", 0, "idle: idle crun containers (0: -n, the target, whatever DSec held)")

		r          = flag.Int("r", 200, "wave: rollouts started at once (target 1000)")
		steps      = flag.String("steps", "3-10", "wave: steps per rollout, MIN-MAX (uniform)")
		think      = flag.String("think", "1s-10s", "wave: think time before each step, MIN-MAX (uniform)")
		seed       = flag.Int64("seed", 1, "wave: seed of the steps and think times")
		waveCPU    = flag.Float64("wave-cpu", 2, "wave: CPU limit of each rollout's sandbox, cores")
		waveMem    = flag.Int64("wave-mem-mb", 4096, "wave: memory limit of each rollout's sandbox, MiB")
		empty      = flag.Int("empty", 3, "wave: rollouts run alone first (create, steps back to back, destroy): the empty node's figures")
		emptySteps = flag.Int("empty-steps", 10, "wave: steps of each empty-node rollout")
		wavePeer   = flag.String("wave-peer", "docker", "wave: peer, docker or none")
		dockerR    = flag.Int("docker-r", 0, "wave: rollouts of the Docker wave (0: -r)")
		waveTO     = flag.Duration("wave-timeout", 2*time.Hour, "wave: give up on the wave (and each system's run) after this long")
		importC    = flag.Int("import-c", 4, "wave: workspace imports in flight (untimed)")

		nodeMem   = flag.String("node-memory", "2g", "pressure: memory bound of the node (dsec up --memory)")
		swap      = flag.String("swap", "1g", "pressure: swap the edge sets up (passed as SWAP-FLAG VALUE)")
		swapFlag  = flag.String("swap-flag", "--swap", "pressure: dsec up's flag for it")
		pn        = flag.Int("pressure-n", 16, "pressure: sandboxes")
		pmem      = flag.String("pressure-mem", "512m", "pressure: memory limit of each")
		touchers  = flag.Int("touchers", 6, "pressure: sandboxes that touch memory")
		touch     = flag.String("touch", "384m", "pressure: memory each toucher holds (within its limit)")
		hold      = flag.Duration("hold", 20*time.Second, "pressure: how long the touchers hold it")
		psteps    = flag.Int("pressure-steps", 5, "pressure: steps each other sandbox runs before and under pressure")
		unbounded = flag.Bool("allow-unbounded", false, "pressure: touch memory even when the node bound is not a cgroup (presses on the whole host: for testing the harness with a small -touch)")
		fl        dsecup.Flags
	)
	fl.Register()
	flag.Parse()
	if err := dsecup.CheckFlags(map[string]int{"n": *n, "create-c": *createC, "exec-c": *execC, "r": *r,
		"empty": *empty, "empty-steps": *emptySteps, "import-c": *importC, "pressure-n": *pn, "touchers": *touchers,
		"pressure-steps": *psteps}); err != nil {
		return err
	}
	sel, err := dsecup.ParseList("phases", *phases, []string{phaseIdle, phaseWave, phasePressure})
	if err != nil {
		return err
	}
	cfg := config{Phases: sel, UpArgs: strings.Fields(*upArgs)}
	cfg.Idle = idleConfig{N: *n, CreateC: *createC, CreateWait: createWait.Seconds(), ExecC: *execC, Peer: *peer, PeerN: *peerN}
	if cfg.Idle.PeerN <= 0 {
		cfg.Idle.PeerN = *n
	}
	if cfg.Idle.MilliCPU, err = flagval.ParseCPU("cpu", *cpu); err != nil {
		return err
	}
	if cfg.Idle.MemBytes, err = flagval.ParseSize("mem", *mem); err != nil {
		return err
	}
	if *peer != "crun" && *peer != "none" {
		return fmt.Errorf("-peer %q: want crun or none", *peer)
	}
	cfg.Wave = waveConfig{R: *r, Seed: *seed, CPU: *waveCPU, MemMB: *waveMem, Empty: *empty, EmptySteps: *emptySteps,
		Peer: *wavePeer, DockerR: *dockerR, TimeoutS: waveTO.Seconds(), ImportC: *importC}
	if cfg.Wave.DockerR <= 0 {
		cfg.Wave.DockerR = *r
	}
	if *wavePeer != "docker" && *wavePeer != "none" {
		return fmt.Errorf("-wave-peer %q: want docker or none", *wavePeer)
	}
	if cfg.Wave.StepsMin, cfg.Wave.StepsMax, err = parseIntRange("steps", *steps); err != nil {
		return err
	}
	if cfg.Wave.ThinkMin, cfg.Wave.ThinkMax, err = parseDurRange("think", *think); err != nil {
		return err
	}
	cfg.Pressure = pressureConfig{NodeMemory: *nodeMem, Swap: *swap, SwapFlag: *swapFlag, N: *pn, Touchers: *touchers,
		HoldS: hold.Seconds(), Steps: *psteps, AllowUnbounded: *unbounded}
	if cfg.Pressure.MemBytes, err = flagval.ParseSize("pressure-mem", *pmem); err != nil {
		return err
	}
	if cfg.Pressure.TouchBytes, err = flagval.ParseSize("touch", *touch); err != nil {
		return err
	}
	if cfg.Pressure.TouchBytes >= cfg.Pressure.MemBytes {
		return fmt.Errorf("-touch %s must stay within -pressure-mem %s (the touchers stay within their limits)", *touch, *pmem)
	}
	if cfg.Pressure.Touchers >= cfg.Pressure.N {
		return fmt.Errorf("-touchers %d must be fewer than -pressure-n %d (the others' steps are measured)", *touchers, *pn)
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root (dsec up and crun make namespaces, mounts and cgroups)")
	}

	// The first signal cancels ctx: the phase in flight stops, destroys
	// what it made and reports what it measured. Signals stay caught until
	// the end so that cleanup itself is not cut short.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	root, err := dsecup.RepoRoot()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "densitybench-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	rn := &run{cfg: cfg, root: root, work: work, keep: fl.Keep}
	var errs []error
	defer func() {
		leaks, err := dsecup.ReclaimHarness(cgroupPrefix, work)
		if err != nil {
			slog.Error("cleanup", "err", err)
		}
		if !leaks.Empty() {
			slog.Error("the harness left (removed)", "leaks", leaks.String())
		}
		if fl.Keep {
			slog.Info("kept the work dir (-keep)", "dir", work)
			return
		}
		if err := dsecup.RemoveDir(work); err != nil {
			slog.Error("cleanup", "err", err)
		}
	}()

	started := time.Now()
	rep := &Report{Config: cfg, Host: dsecup.HostLine(), Started: started.UTC().Format(time.RFC3339)}
	if rn.bins, rn.rootfs, err = dsecup.Prepare(ctx, root, work, fl); err != nil {
		return err
	}
	for _, p := range sel {
		if ctx.Err() != nil {
			break
		}
		if *settle > 0 {
			waitLoad(ctx, *settle, 10*time.Minute)
		}
		rep.PhaseLoads = append(rep.PhaseLoads, PhaseLoad{p, load1()})
		slog.Info("phase", "phase", p, "load", load1())
		var err error
		switch p {
		case phaseIdle:
			rep.Idle, err = rn.idle(ctx)
		case phaseWave:
			rep.Wave, err = rn.wave(ctx)
		case phasePressure:
			rep.Pressure, err = rn.pressure(ctx)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p, err))
			slog.Error("phase failed", "phase", p, "err", err)
		}
	}
	rep.UpPIDs = rn.upPIDs
	rep.WallSeconds = time.Since(started).Seconds()
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	if err := dsecup.PrintReport(fl.JSON, "densitybench", rep, rep.print); err != nil {
		return err
	}
	return errors.Join(errs...)
}

// run is what every phase shares.
type run struct {
	cfg    config
	root   string // repository
	work   string // $TMPDIR/densitybench-*
	keep   bool
	bins   dsecup.Binaries
	rootfs string
	upPIDs []int
}

func parseIntRange(name, s string) (int, int, error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok {
		b = a
	}
	var lo, hi int
	if _, err := fmt.Sscan(a, &lo); err != nil {
		return 0, 0, fmt.Errorf("-%s %q: want MIN-MAX: %w", name, s, err)
	}
	if _, err := fmt.Sscan(b, &hi); err != nil {
		return 0, 0, fmt.Errorf("-%s %q: want MIN-MAX: %w", name, s, err)
	}
	if lo < 1 || hi < lo {
		return 0, 0, fmt.Errorf("-%s %q: want 1 <= MIN <= MAX", name, s)
	}
	return lo, hi, nil
}

func parseDurRange(name, s string) (float64, float64, error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok {
		b = a
	}
	lo, err := time.ParseDuration(a)
	if err != nil {
		return 0, 0, fmt.Errorf("-%s %q: want MIN-MAX durations: %w", name, s, err)
	}
	hi, err := time.ParseDuration(b)
	if err != nil {
		return 0, 0, fmt.Errorf("-%s %q: want MIN-MAX durations: %w", name, s, err)
	}
	if lo < 0 || hi < lo {
		return 0, 0, fmt.Errorf("-%s %q: want 0 <= MIN <= MAX", name, s)
	}
	return lo.Seconds(), hi.Seconds(), nil
}

// load1 is the 1-minute load average.
func load1() float64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 0
	}
	return float64(si.Loads[0]) / (1 << 16) // SI_LOAD_SHIFT
}

// waitLoad waits until the 1-minute load average is below limit, for at
// most bound; it goes on anyway after that (the report has the load).
func waitLoad(ctx context.Context, limit float64, bound time.Duration) {
	deadline := time.Now().Add(bound)
	for l := load1(); l >= limit; l = load1() {
		if time.Now().After(deadline) {
			slog.Warn("machine still busy; measuring anyway", "load", l, "waited", bound)
			return
		}
		slog.Info("waiting for the load to drop", "load", l, "below", limit)
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Second):
		}
	}
}
