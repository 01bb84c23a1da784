// Command containerbench measures DSec's container backend side by side
// with crun, runc, bubblewrap and Docker, in the same run and on the same
// busybox rootfs, and prints each peer's figures with DSec's ratio against
// it. Ratios from one run on one machine are the only fair comparison on
// shared, noisy VMs; absolute numbers from different runs are not.
//
// Three figures per system: (a) sequential create -> /bin/true -> destroy
// latency, (b) creates per second with C in flight, (c) memory per idle
// sandbox with K alive. Two floor rows (a bare os/exec and a bare
// namespaced spawn) show what process creation alone costs here. The
// "dsec-pool" row takes its sandboxes from a warm pool and hands them back
// to be reset in place; it also reports what that deferred (pool figures).
// The "dsec-rebase" row gives every cycle a spec of its own and rebases a
// handed-back sandbox onto it (rt.Rebaser), as the edge does across specs.
//
// Each system runs in its own worker process (this binary re-executed with
// -worker), so one system's heap, zombies or crash cannot skew or stop
// another's, and so a system can get its own mount namespace (overlays
// never touch the host mount table; crun gets the cgroup v1-only view it
// needs on this hybrid host).
//
// Usage (as root):
//
//	go run ./bench/containerbench [-n 100] [-total 300] [-c 16,64] [-idle 1000] \
//	    [-systems host-exec,ns-spawn,dsec,dsec-cold,dsec-pool,dsec-rebase,crun,runc,bwrap,docker-nonet,docker] [-json]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// config is what one worker measures.
type config struct {
	n, warmup, total, idle, poolSize int
	resources                        string
	cs                               []int
	phases                           map[string]bool
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == cgexecFlag {
		err := cgexecMain(os.Args[2:])
		fmt.Fprintln(os.Stderr, "containerbench -cgexec:", err)
		os.Exit(127)
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if err := mainErr(); err != nil {
		fmt.Fprintln(os.Stderr, "containerbench:", err)
		os.Exit(1)
	}
}

func mainErr() error {
	var (
		systems   = flag.String("systems", "host-exec,ns-spawn,dsec,dsec-cold,dsec-pool,dsec-rebase,crun,runc,bwrap,docker-nonet,docker", "comma-separated systems to measure, in order")
		n         = flag.Int("n", 100, "sequential: timed create->true->destroy cycles")
		warmup    = flag.Int("warmup", 10, "sequential: untimed cycles first")
		total     = flag.Int("total", 300, "concurrent: cycles per concurrency level")
		cList     = flag.String("c", "16,64", "concurrent: comma-separated numbers of cycles in flight")
		idle      = flag.Int("idle", 1000, "idle: sandboxes held at once for dsec and the floor rows")
		peerIdle  = flag.Int("peer-idle", 300, "idle: sandboxes held at once for crun, runc and bwrap")
		slowN     = flag.Int("slow-n", 15, "sequential cycles for the slow peers (docker)")
		slowTotal = flag.Int("slow-total", 30, "concurrent cycles per level for the slow peers (docker)")
		slowIdle  = flag.Int("slow-idle", 50, "idle sandboxes for the slow peers (docker)")
		phaseList = flag.String("phases", "seq,conc,idle", "which figures to measure: seq, conc, idle")
		baseline  = flag.String("baseline", "dsec", "system the ratios are computed against")
		asJSON    = flag.Bool("json", false, "print results as JSON instead of a table")
		poolSize  = flag.Int("pool-size", defaultPoolSize, "dsec-pool: sandboxes its warm pool keeps ready")
		resources = flag.String("resources", "", "limits of every sandbox, e.g. cpu=1,mem=1g,pids=1024,disk=1g (DSec's spec; crun's and runc's linux.resources)")

		// Worker mode: internal, set by the parent when it re-executes itself.
		worker      = flag.String("worker", "", "internal: measure this one system and print its Result as JSON")
		workDir     = flag.String("workdir", "", "internal: worker's scratch dir")
		rootfs      = flag.String("rootfs", "", "internal: busybox rootfs dir")
		erofs       = flag.String("erofs", "", "internal: busybox rootfs EROFS image")
		hideCgroup2 = flag.Bool("hide-cgroup2", false, "internal: unmount /sys/fs/cgroup/unified in this (private) mount namespace")
	)
	flag.Parse()

	cs, err := parseInts(*cList)
	if err != nil {
		return fmt.Errorf("-c: %w", err)
	}
	phases := map[string]bool{}
	for _, p := range strings.Split(*phaseList, ",") {
		switch p = strings.TrimSpace(p); p {
		case "seq", "conc", "idle":
			phases[p] = true
		default:
			return fmt.Errorf("-phases: unknown phase %q (want seq, conc, idle)", p)
		}
	}
	for name, v := range map[string]int{"pool-size": *poolSize, "n": *n, "total": *total, "idle": *idle, "peer-idle": *peerIdle, "slow-n": *slowN, "slow-total": *slowTotal, "slow-idle": *slowIdle} {
		if v < 1 {
			return fmt.Errorf("-%s must be at least 1, got %d", name, v)
		}
	}
	if benchResources, err = parseResources(*resources); err != nil {
		return err
	}
	if *warmup < 0 {
		return fmt.Errorf("-warmup must not be negative, got %d", *warmup)
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root (namespaces, mounts, cgroups, runtimes)")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	if *worker != "" {
		cfg := config{n: *n, warmup: *warmup, total: *total, idle: *idle, poolSize: *poolSize, cs: cs, phases: phases, resources: *resources}
		env := Env{Rootfs: *rootfs, RootfsEROFS: *erofs, WorkDir: *workDir, PoolSize: *poolSize}
		res := runWorker(ctx, *worker, env, cfg, *hideCgroup2)
		return json.NewEncoder(os.Stdout).Encode(res)
	}

	var entries []entry
	for _, name := range strings.Split(*systems, ",") {
		e, err := lookup(strings.TrimSpace(name))
		if err != nil {
			return err
		}
		entries = append(entries, e)
	}

	base, err := os.MkdirTemp("", "dsecbench-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	defer func() {
		if err := removeWorkDir(base); err != nil {
			slog.Error("cleanup", "err", err)
		}
	}()
	rootDir := filepath.Join(base, "rootfs")
	if err := buildRootfs(ctx, rootDir); err != nil {
		return err
	}
	img := filepath.Join(base, "rootfs.erofs")
	if err := buildEROFS(ctx, rootDir, img); err != nil {
		slog.Warn("no EROFS image of the rootfs; systems that need one will fail", "err", err)
		img = ""
	}

	started := time.Now()
	var results []Result
	for _, e := range entries {
		if ctx.Err() != nil {
			break
		}
		cfg := config{n: *n, warmup: *warmup, total: *total, idle: *idle, poolSize: *poolSize, cs: cs, phases: phases, resources: *resources}
		switch {
		case strings.HasPrefix(e.name, "docker"):
			cfg.n, cfg.total, cfg.idle = *slowN, *slowTotal, *slowIdle
		case e.peer:
			cfg.idle = *peerIdle
		}
		slog.Info("measuring", "system", e.name, "n", cfg.n, "total", cfg.total, "c", cfg.cs, "idle", cfg.idle)
		t0 := time.Now()
		res := runInWorker(ctx, e, base, rootDir, img, cfg)
		slog.Info("measured", "system", e.name, "took", time.Since(t0).Round(time.Second), "error", res.Err)
		results = append(results, res)
	}

	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(results)
	}
	fmt.Printf("containerbench %s\n", strings.Join(os.Args[1:], " "))
	printHost(ctx, entries)
	fmt.Printf("total wall time %s\n\n", time.Since(started).Round(time.Second))
	printTable(os.Stdout, results)
	fmt.Println()
	printRatios(os.Stdout, results, *baseline)
	// The targets compare a create with crun's: with a pool, a
	// create is a take, so the pooled row gets its own ratios too.
	if *baseline != "dsec-pool" && slices.ContainsFunc(results, func(r Result) bool { return r.System == "dsec-pool" }) {
		fmt.Println()
		printRatios(os.Stdout, results, "dsec-pool")
	}
	printPools(os.Stdout, results)
	return ctx.Err()
}

// runInWorker re-executes this binary to measure one system and decodes
// the Result it prints. The worker gets SIGTERM when ctx ends so it can
// still tear down; WaitDelay bounds how long that may take.
func runInWorker(ctx context.Context, e entry, base, rootDir, img string, cfg config) Result {
	fail := func(err error) Result { return Result{System: e.name, Err: err.Error()} }
	wd := filepath.Join(base, e.name)
	if err := os.Mkdir(wd, 0o700); err != nil {
		return fail(fmt.Errorf("worker dir: %w", err))
	}
	defer func() {
		if err := removeWorkDir(wd); err != nil {
			slog.Error("cleanup", "system", e.name, "err", err)
		}
	}()
	self, err := os.Executable()
	if err != nil {
		return fail(fmt.Errorf("find own executable: %w", err))
	}
	phases := make([]string, 0, len(cfg.phases))
	for p := range cfg.phases {
		phases = append(phases, p)
	}
	args := []string{"-worker", e.name, "-workdir", wd, "-rootfs", rootDir, "-erofs", img,
		"-n", strconv.Itoa(cfg.n), "-warmup", strconv.Itoa(cfg.warmup), "-total", strconv.Itoa(cfg.total),
		"-c", joinInts(cfg.cs), "-idle", strconv.Itoa(cfg.idle), "-phases", strings.Join(phases, ","),
		"-pool-size", strconv.Itoa(cfg.poolSize), "-resources", cfg.resources}
	if e.hideCgroup2 {
		args = append(args, "-hide-cgroup2")
	}
	cmd := exec.CommandContext(ctx, self, args...)
	cmd.Stderr = os.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Minute
	if e.privateMounts {
		// Go makes / recursively private in the child when it unshares
		// the mount namespace, so nothing propagates back to the host.
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	}
	out, err := cmd.Output()
	var res Result
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		return fail(fmt.Errorf("worker %s: %w (output %q)", e.name, errors.Join(err, jerr), out))
	}
	return res
}

// runWorker measures one system in this process and always tears it down.
func runWorker(ctx context.Context, name string, env Env, cfg config, hideCgroup2 bool) Result {
	res := Result{System: name}
	e, err := lookup(name)
	if err != nil {
		res.Err = err.Error()
		return res
	}
	if hideCgroup2 {
		if err := peer.HideUnifiedCgroup("dsecbench-no-cgroup2"); err != nil {
			res.Err = err.Error()
			return res
		}
	}
	exe, err := os.Executable()
	if err != nil {
		res.Err = err.Error()
		return res
	}
	env.SelfExe = exe
	s := e.new()
	var errs []error
	if err := s.Setup(ctx, env); err != nil {
		errs = append(errs, fmt.Errorf("setup: %w", err))
	} else {
		errs = append(errs, measureAll(ctx, s, cfg, e.noIdle, &res))
	}
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	if err := s.Teardown(tctx); err != nil {
		errs = append(errs, fmt.Errorf("teardown: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		res.Err = err.Error()
	}
	return res
}

// measureAll runs the selected phases in order and stops at the first
// failure, keeping the figures already measured.
func measureAll(ctx context.Context, s System, cfg config, noIdle string, res *Result) error {
	pooled, _ := s.(Pooled)
	var before PoolCounters
	// settled records a pooled system's deferred work after a phase, and
	// starts the next phase from a settled pool.
	settled := func(phase string) (PoolPhase, error) {
		pp, err := poolPhase(ctx, pooled, phase, before)
		res.Pool = append(res.Pool, pp)
		before = pooled.PoolCounters()
		if err != nil {
			return pp, fmt.Errorf("%s: %w", phase, err)
		}
		slog.Info("pool", "system", s.Name(), "phase", phase, "hits", pp.Hits, "misses", pp.Misses,
			"resets", pp.Resets, "reset_median_ms", pp.ResetMedianMs, "settle_s", pp.SettleSeconds)
		return pp, nil
	}
	if pooled != nil {
		before = pooled.PoolCounters()
		res.PoolSize = cfg.poolSize
	}
	if cfg.phases["seq"] {
		seq, err := measureSequential(ctx, s, cfg.warmup, cfg.n)
		if err != nil {
			return err
		}
		res.Seq = seq
		slog.Info("sequential", "system", s.Name(), "median_ms", seq.MedianMs, "p90_ms", seq.P90Ms)
		if pooled != nil {
			if _, err := settled("seq"); err != nil {
				return err
			}
		}
	}
	if cfg.phases["conc"] {
		for _, c := range cfg.cs {
			cr, err := measureConcurrent(ctx, s, c, cfg.total)
			if err != nil {
				return err
			}
			res.Conc = append(res.Conc, cr)
			slog.Info("concurrent", "system", s.Name(), "c", c, "per_sec", cr.PerSec)
			if pooled != nil {
				pp, err := settled(fmt.Sprintf("C=%d", c))
				if err != nil {
					return err
				}
				res.Pool[len(res.Pool)-1].SettledPerSec = float64(cr.Total) / (cr.Seconds + pp.SettleSeconds)
			}
		}
	}
	if cfg.phases["idle"] && noIdle != "" {
		res.IdleNA = noIdle
	} else if cfg.phases["idle"] {
		idle, err := measureIdle(ctx, s, cfg.idle)
		if idle != nil {
			res.Idle = idle
		}
		if err != nil {
			return err
		}
		slog.Info("idle", "system", s.Name(), "k", idle.K, "host_bytes_per_sandbox", idle.HostPerSandbox)
	}
	return nil
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}

func joinInts(vs []int) string {
	ss := make([]string, len(vs))
	for i, v := range vs {
		ss[i] = strconv.Itoa(v)
	}
	return strings.Join(ss, ",")
}
