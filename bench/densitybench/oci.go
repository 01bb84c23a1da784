package main

// The idle phase's peer: as many idle crun containers as DSec was asked
// for, with the same cpu and memory limits, each answering `crun exec`.
// It runs in a worker process (this binary re-executed) in a private
// mount namespace, as containerbench's crun row does: crun 1.8 refuses
// this hybrid cgroup layout unless /sys/fs/cgroup/unified is replaced by
// an empty tmpfs, and the containers' overlay mounts then never enter the
// host's mount table and vanish with the worker even if it is killed.

import (
	"bytes"
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
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/bench/internal/peer"
)

// ociWorkerFlag, as the first argument, runs the binary as the crun worker.
const ociWorkerFlag = "-oci-worker"

// ociStartConcurrency only shortens the wall time of filling the node.
const ociStartConcurrency = 8

// idleCrun runs the crun worker and returns its row.
func (rn *run) idleCrun(ctx context.Context) IdleRow {
	cfg := rn.cfg.Idle
	row := IdleRow{System: "crun", Requested: cfg.PeerN}
	if _, err := exec.LookPath("crun"); err != nil {
		row.Err = fmt.Sprintf("crun not installed (apt-get install -y crun, or DSEC_BENCH_DEPS=1 scripts/deps.sh): %v", err)
		return row
	}
	wd := filepath.Join(rn.work, "crun")
	if err := os.MkdirAll(wd, 0o700); err != nil {
		row.Err = err.Error()
		return row
	}
	defer func() {
		if err := dsecup.RemoveDir(wd); err != nil {
			row.Err = strings.TrimSpace(row.Err + "; cleanup: " + err.Error())
		}
	}()
	self, err := os.Executable()
	if err != nil {
		row.Err = err.Error()
		return row
	}
	cmd := exec.CommandContext(ctx, self, ociWorkerFlag, "-work", wd, "-rootfs", rn.rootfs,
		"-n", strconv.Itoa(cfg.PeerN), "-milli-cpu", strconv.FormatInt(cfg.MilliCPU, 10),
		"-mem", strconv.FormatInt(cfg.MemBytes, 10), "-exec-c", strconv.Itoa(cfg.ExecC),
		"-cgroup", fmt.Sprintf("%scrun-%d", cgroupPrefix, os.Getpid()))
	cmd.Stderr = os.Stderr
	// SIGTERM on ctx's end: the worker stops starting containers, removes
	// the ones it has and still reports.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Minute
	// Go makes / recursively private in the child when it unshares the
	// mount namespace, so nothing propagates back to the host.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGTERM}
	out, err := cmd.Output()
	if jerr := json.Unmarshal(out, &row); jerr != nil {
		row.Err = fmt.Sprintf("crun worker: %v (output %q)", errors.Join(err, jerr), out)
	} else if err != nil && row.Err == "" {
		row.Err = fmt.Sprintf("crun worker: %v", err)
	}
	return row
}

// ociWorkerMain is the worker: it prints its IdleRow as JSON on stdout.
func ociWorkerMain(args []string) error {
	fs := flag.NewFlagSet("oci-worker", flag.ContinueOnError)
	var (
		work   = fs.String("work", "", "scratch dir")
		rootfs = fs.String("rootfs", "", "busybox tree")
		n      = fs.Int("n", 0, "containers")
		milli  = fs.Int64("milli-cpu", 0, "cpu limit, millicores")
		mem    = fs.Int64("mem", 0, "memory limit, bytes")
		execC  = fs.Int("exec-c", 16, "execs in flight")
		cg     = fs.String("cgroup", "", "cgroup parent")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	o := &ociIdle{bin: "crun", rootfs: *rootfs, work: *work, state: filepath.Join(*work, "state"), cgroup: *cg,
		milliCPU: *milli, mem: *mem, pids: map[string]int{}}
	row := IdleRow{System: "crun", Requested: *n}
	err := o.measure(ctx, *n, *execC, &row)
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
	defer cancel()
	t0 := time.Now()
	err = errors.Join(err, o.teardown(tctx))
	row.DestroySeconds = time.Since(t0).Seconds()
	if o.avail1 > 0 && row.Held > 0 {
		if avail2, aerr := memAvailable(); aerr == nil {
			row.HostReleasedMiBPerSandbox = toMiB(avail2-o.avail1) / float64(row.Held)
		}
	}
	if err != nil {
		row.Err = err.Error()
	}
	return json.NewEncoder(os.Stdout).Encode(row)
}

// ociIdle holds the worker's containers.
type ociIdle struct {
	bin, rootfs, work, state, cgroup string
	milliCPU, mem                    int64
	avail1                           int64 // MemAvailable with every container held

	mu   sync.Mutex
	pids map[string]int // id -> init pid, alive
	ids  []string       // in start order
}

func (o *ociIdle) measure(ctx context.Context, n, execC int, row *IdleRow) error {
	if err := peer.HideUnifiedCgroup("densitybench-no-cgroup2"); err != nil {
		return err
	}
	// Detached containers are orphaned when `run --detach` returns; as
	// subreaper the worker inherits their inits and can reap them.
	if err := peer.BecomeSubreaper(); err != nil {
		return err
	}
	if err := os.MkdirAll(o.state, 0o700); err != nil {
		return fmt.Errorf("crun state dir: %w", err)
	}
	debug.FreeOSMemory()
	avail0, err := memAvailable()
	if err != nil {
		return err
	}

	var (
		next    atomic.Int64
		stopped atomic.Bool
		wg      sync.WaitGroup
		errMu   sync.Mutex
		first   error
	)
	t0 := time.Now()
	for range ociStartConcurrency {
		wg.Go(func() {
			for !stopped.Load() && ctx.Err() == nil {
				i := int(next.Add(1))
				if i > n {
					return
				}
				if err := o.start(ctx, fmt.Sprintf("idle%d", i)); err != nil {
					if ctx.Err() != nil {
						return
					}
					stopped.Store(true)
					errMu.Lock()
					if first == nil {
						first = err
					}
					errMu.Unlock()
					return
				}
				if h := o.held(); h%100 == 0 {
					slog.Info("idle crun containers held", "n", h, "elapsed", time.Since(t0).Round(time.Millisecond))
				}
			}
		})
	}
	wg.Wait()
	row.CreateSeconds = time.Since(t0).Seconds()
	row.Held = o.held()
	if row.CreateSeconds > 0 {
		row.CreatesPerSec = float64(row.Held) / row.CreateSeconds
	}
	if first != nil {
		row.StopReason = first.Error()
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted after %d containers: %w", row.Held, ctx.Err())
	}

	lats, failed, firstErr := o.execAll(ctx, execC)
	row.ExecOK, row.ExecFailed = len(lats), failed
	st := dsecup.Summarize(lats)
	row.ExecP50Ms, row.ExecP99Ms, row.ExecMaxMs = dsecup.Ms(st.Median), dsecup.Ms(st.P99), dsecup.Ms(st.Max)

	debug.FreeOSMemory()
	if o.avail1, err = memAvailable(); err != nil {
		return err
	}
	if row.Held > 0 {
		row.HostMiBPerSandbox = toMiB(avail0-o.avail1) / float64(row.Held)
		if u, err := cgroupUsage(filepath.Join(memoryHierarchy(), o.cgroup)); err == nil {
			v := toMiB(u) / float64(row.Held)
			row.CgroupMiBPerSandbox = &v
		}
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted during the exec sweep: %w", ctx.Err())
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d containers failed their exec; first: %w", failed, row.Held, firstErr)
	}
	return nil
}

func (o *ociIdle) held() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.pids)
}

// start makes the bundle of container id (an overlay of the shared rootfs
// with a private upper dir) and runs `sleep` in it detached.
func (o *ociIdle) start(ctx context.Context, id string) error {
	dir := filepath.Join(o.work, "b", id)
	upper, wk, merged := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "rootfs")
	for _, d := range []string{upper, wk, merged} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("bundle %s: %w", id, err)
		}
	}
	opts := "lowerdir=" + o.rootfs + ",upperdir=" + upper + ",workdir=" + wk
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		return fmt.Errorf("overlay for %s: %w", id, err)
	}
	cfg, err := json.Marshal(o.spec(id))
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644)
	}
	if err != nil {
		return fmt.Errorf("config.json for %s: %w", id, err)
	}
	pid, err := peer.RunDetached(ctx, o.bin, o.state, dir, id)
	if err != nil {
		return err
	}
	o.mu.Lock()
	o.pids[id] = pid
	o.ids = append(o.ids, id)
	o.mu.Unlock()
	return nil
}

// execAll runs `crun exec ID echo ok` once in every container.
func (o *ociIdle) execAll(ctx context.Context, c int) (lats []time.Duration, failed int, firstErr error) {
	o.mu.Lock()
	ids := append([]string(nil), o.ids...)
	o.mu.Unlock()
	var (
		mu   sync.Mutex
		next atomic.Int64
		wg   sync.WaitGroup
	)
	for range c {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(ids) {
					return
				}
				var stdout, stderr bytes.Buffer
				cmd := exec.CommandContext(ctx, o.bin, "--root", o.state, "exec", ids[i], "echo", "ok")
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
				t := time.Now()
				err := cmd.Run()
				d := time.Since(t)
				if err == nil && stdout.String() != "ok\n" {
					err = fmt.Errorf("stdout %q", stdout.String())
				}
				mu.Lock()
				if err != nil {
					failed++
					if firstErr == nil {
						firstErr = fmt.Errorf("crun exec %s: %w: %s", ids[i], err, strings.TrimSpace(stderr.String()))
					}
				} else {
					lats = append(lats, d)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return lats, failed, firstErr
}

// teardown kills and reaps every init before asking crun to delete its
// container (crun would wait forever on our zombie), then removes
// whatever crun still lists, the bundles' mounts and the cgroup parent.
func (o *ociIdle) teardown(ctx context.Context) error {
	o.mu.Lock()
	left := o.pids
	o.pids = map[string]int{}
	o.mu.Unlock()
	for _, pid := range left {
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	peer.ReapOrphans()
	var errs []error
	if out, err := exec.CommandContext(ctx, o.bin, "--root", o.state, "list", "--quiet").Output(); err == nil {
		ids := strings.Fields(string(out))
		var wg sync.WaitGroup
		var mu sync.Mutex
		sem := make(chan struct{}, ociStartConcurrency)
		for _, id := range ids {
			if id == "ID" || id == "NAME" {
				continue // a header some versions print even with --quiet
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				if out, err := exec.CommandContext(ctx, o.bin, "--root", o.state, "delete", "--force", id).CombinedOutput(); err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("crun delete %s: %w: %s", id, err, strings.TrimSpace(string(out))))
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	} else if _, serr := os.Stat(o.state); serr == nil {
		errs = append(errs, fmt.Errorf("crun list: %w", err))
	}
	peer.ReapOrphans()
	if mps, err := dsecup.MountsUnder(o.work); err != nil {
		errs = append(errs, err)
	} else {
		for _, m := range mps {
			if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
			}
		}
	}
	if o.cgroup != "" {
		cgs, err := dsecup.GlobCgroups(o.cgroup)
		if err == nil {
			err = dsecup.RemoveCgroups(cgs)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 3 {
		errs = append(errs[:3], fmt.Errorf("and %d more teardown errors", len(errs)-3))
	}
	return errors.Join(errs...)
}

// spec is the config `runc spec` generates, as containerbench's, with the
// idle phase's cpu and memory limits (CFS period 100 ms, as DSec's).
func (o *ociIdle) spec(id string) *specs.Spec {
	res := &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}}}
	if o.milliCPU > 0 {
		period := uint64(100000)
		quota := o.milliCPU * 100
		res.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	if o.mem > 0 {
		m := o.mem
		res.Memory = &specs.LinuxMemory{Limit: &m}
	}
	return peer.OCISpec(id, []string{"/bin/sleep", "1000000"}, specs.Root{Path: "rootfs"}, "/"+o.cgroup+"/"+id, res)
}
