package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

const (
	cgroupRoot = dsecup.CgroupRoot
	// cgroupPrefix starts the name of every cgroup the harness (or its OCI
	// worker) makes; the harness's pid ends it.
	cgroupPrefix = "statebench-"
)

// jobLabels select the job's sandboxes.
var jobLabels = map[string]string{"job": "bench"}

// jobPhase creates K sandboxes labelled job=bench, then each repetition
// times FreezeJob and ThawJob of all of them, the cgroup-freezer floor
// (FROZEN/THAWED written to K freezer cgroups, one after another) and the
// OCI runtime's pause and resume of P containers, one after another.
// Every FreezeJob/ThawJob must report exactly the K sandboxes, none with
// an error; in the first repetition an exec on a frozen sandbox must be
// refused and one after thawing must run.
func (h *harness) jobPhase(ctx context.Context) (err error) {
	cfg := h.cfg
	var ids []string
	defer func() {
		t0 := time.Now()
		err = errors.Join(err, h.api.destroy(ctx, cfg.Batch, ids...))
		slog.Info("job sandboxes destroyed", "n", len(ids), "took", time.Since(t0).Round(time.Millisecond))
	}()
	t0 := time.Now()
	for len(ids) < cfg.K {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := min(cfg.Batch, cfg.K-len(ids))
		cctx, cancel := context.WithTimeout(ctx, opTimeout)
		sbs, err := h.api.c.CreateMany(cctx, dsec.Spec{Image: busybox, Labels: jobLabels}, n)
		cancel()
		for _, sb := range sbs {
			ids = append(ids, sb.ID)
		}
		if err != nil {
			return fmt.Errorf("create the job's sandboxes (%d of %d made): %w", len(ids), cfg.K, err)
		}
	}
	slog.Info("job sandboxes created", "n", len(ids), "took", time.Since(t0).Round(time.Millisecond))
	h.rep.JobCreateSeconds = time.Since(t0).Seconds()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}

	var floor *freezerFloor
	if freezerV1() {
		floor, err = newFreezerFloor(ctx, cfg.K)
		defer func() {
			if floor != nil {
				err = errors.Join(err, floor.close())
			}
		}()
		if err != nil {
			return err
		}
	} else {
		h.rep.Skipped = append(h.rep.Skipped, "job / cgroup freezer floor: no cgroup v1 freezer hierarchy on this host")
	}
	var oci *ociPeer
	if cfg.Runtime != "" {
		oci, err = startOCI(ctx, cfg.Runtime, filepath.Join(h.work, "oci"), h.rootfs, cfg.Peers)
		defer func() {
			if oci != nil {
				err = errors.Join(err, oci.close())
			}
		}()
		if err != nil {
			return err
		}
	}

	var dsecFreeze, dsecThaw, floorFreeze, floorThaw, ociPause, ociResume []time.Duration
	// What was measured is reported also when the phase stops early.
	defer func() {
		h.rep.addRow(figFreeze, "dsec FreezeJob", true, dsecFreeze, cfg.K,
			"API round trip; the node freezes the job's sandboxes 16 at a time (cgroup freezer)")
		h.rep.addRow(figThaw, "dsec ThawJob", true, dsecThaw, cfg.K, "API round trip")
		h.rep.addRow(figFreeze, "cgroup freezer floor", false, floorFreeze, cfg.K,
			"floor: FROZEN written to each of K v1 freezer.state files (one sleep in each), one after another, each polled until it reads FROZEN")
		h.rep.addRow(figThaw, "cgroup freezer floor", false, floorThaw, cfg.K,
			"floor: THAWED written to each of the K freezer.state files, one after another")
		if oci != nil {
			for _, x := range []struct {
				fig, op string
				ds      []time.Duration
			}{{figFreeze, "pause", ociPause}, {figThaw, "resume", ociResume}} {
				h.rep.addRow(x.fig, cfg.Runtime+" "+x.op, false, x.ds, cfg.Peers,
					fmt.Sprintf("`%s %s` of %d detached busybox `sleep` containers, one after another (a process per container)", cfg.Runtime, x.op, cfg.Peers))
			}
		}
	}()
	probe := h.api.c.Sandbox(ids[0], dsec.Unnumbered())
	for i := 1; i <= cfg.Reps; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		for _, freeze := range []bool{true, false} {
			t0 := time.Now()
			res, err := h.api.job(ctx, freeze, jobLabels)
			d := time.Since(t0)
			if err != nil {
				return err
			}
			if err := checkJob(res, want); err != nil {
				return fmt.Errorf("%s job, repetition %d: %w", freezeWord(freeze), i, err)
			}
			if freeze {
				dsecFreeze = append(dsecFreeze, d)
			} else {
				dsecThaw = append(dsecThaw, d)
			}
			if i > 1 {
				continue
			}
			_, err = sh(ctx, probe, "true")
			switch {
			case freeze && !dsec.IsFailedPrecondition(err):
				return fmt.Errorf("exec on frozen sandbox %s: got %v, want FailedPrecondition", probe.ID, err)
			case !freeze && err != nil:
				return fmt.Errorf("exec on thawed sandbox %s: %w", probe.ID, err)
			}
		}
		if floor != nil {
			for _, freeze := range []bool{true, false} {
				d, err := floor.pass(ctx, freeze)
				if err != nil {
					return err
				}
				if freeze {
					floorFreeze = append(floorFreeze, d)
				} else {
					floorThaw = append(floorThaw, d)
				}
			}
		}
		if oci != nil {
			for _, op := range []string{"pause", "resume"} {
				d, err := oci.pass(ctx, op)
				if err != nil {
					return err
				}
				if op == "pause" {
					ociPause = append(ociPause, d)
				} else {
					ociResume = append(ociResume, d)
				}
			}
		}
		slog.Info("job repetition", "rep", i, "freeze_ms", dsecup.Ms(dsecFreeze[i-1]), "thaw_ms", dsecup.Ms(dsecThaw[i-1]))
	}
	return nil
}

// checkJob checks that a job call acted on exactly the sandboxes in want,
// without error.
func checkJob(res []*dsecv1.JobResult, want map[string]bool) error {
	seen := map[string]bool{}
	var errs []error
	for _, r := range res {
		switch {
		case r.GetError() != nil:
			if len(errs) < 5 {
				errs = append(errs, fmt.Errorf("%s: %s: %s", r.GetId(), r.GetError().GetCode(), r.GetError().GetMessage()))
			}
		case !want[r.GetId()]:
			errs = append(errs, fmt.Errorf("%s is not one of the job's sandboxes", r.GetId()))
		case seen[r.GetId()]:
			errs = append(errs, fmt.Errorf("%s reported twice", r.GetId()))
		}
		seen[r.GetId()] = true
	}
	if len(res) != len(want) {
		errs = append([]error{fmt.Errorf("%d results, want %d", len(res), len(want))}, errs...)
	}
	return errors.Join(errs...)
}

// freezerFloor is K v1 freezer cgroups the harness makes, each holding
// one `sleep`.
type freezerFloor struct {
	parent string
	dirs   []string
	cmds   []*exec.Cmd
}

func freezerDir() string { return filepath.Join(cgroupRoot, "freezer") }

func freezerV1() bool { return dsecup.IsCgroupFS(freezerDir()) }

func newFreezerFloor(ctx context.Context, k int) (*freezerFloor, error) {
	f := &freezerFloor{parent: filepath.Join(freezerDir(), fmt.Sprintf("%sfloor-%d", cgroupPrefix, os.Getpid()))}
	if err := os.Mkdir(f.parent, 0o755); err != nil {
		return nil, fmt.Errorf("freezer floor: %w", err)
	}
	t0 := time.Now()
	for i := 0; i < k; i++ {
		if err := ctx.Err(); err != nil {
			return f, err
		}
		d := filepath.Join(f.parent, fmt.Sprintf("c%d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			return f, fmt.Errorf("freezer floor: %w", err)
		}
		f.dirs = append(f.dirs, d)
		cmd := exec.Command("sleep", "1000000")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			return f, fmt.Errorf("freezer floor: %w", err)
		}
		f.cmds = append(f.cmds, cmd)
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
			return f, fmt.Errorf("freezer floor: move %d into %s: %w", cmd.Process.Pid, d, err)
		}
	}
	slog.Info("freezer floor ready", "cgroups", k, "took", time.Since(t0).Round(time.Millisecond))
	return f, nil
}

// pass freezes (or thaws) every cgroup, one after another; a freeze waits
// for each cgroup to read FROZEN (the kernel freezes asynchronously).
func (f *freezerFloor) pass(ctx context.Context, freeze bool) (time.Duration, error) {
	state := "THAWED"
	if freeze {
		state = "FROZEN"
	}
	t0 := time.Now()
	for _, d := range f.dirs {
		p := filepath.Join(d, "freezer.state")
		if err := os.WriteFile(p, []byte(state), 0o644); err != nil {
			return 0, fmt.Errorf("freezer floor: %w", err)
		}
		if !freeze {
			continue
		}
		for deadline := time.Now().Add(10 * time.Second); ; {
			b, err := os.ReadFile(p)
			if err != nil {
				return 0, fmt.Errorf("freezer floor: %w", err)
			}
			if strings.TrimSpace(string(b)) == "FROZEN" {
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return 0, fmt.Errorf("freezer floor: %s still %s", d, strings.TrimSpace(string(b)))
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	d := time.Since(t0)
	if !freeze {
		for _, dir := range f.dirs {
			if frozen, err := cgroupFrozen(strings.TrimPrefix(dir, freezerDir()+"/")); err != nil || frozen {
				return 0, fmt.Errorf("freezer floor: %s still frozen after thaw (%v)", dir, err)
			}
		}
	}
	return d, nil
}

// close thaws the cgroups, kills and reaps the sleeps and removes the
// cgroups.
func (f *freezerFloor) close() error {
	for _, d := range f.dirs {
		_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte("THAWED"), 0o644)
	}
	for _, c := range f.cmds {
		_ = c.Process.Kill()
	}
	for _, c := range f.cmds {
		_ = c.Wait()
	}
	return dsecup.RemoveCgroups([]string{f.parent})
}

// cgroupFrozen reports whether the cgroup rel (relative to a hierarchy
// root) is frozen: v1 freezer.state, or v2 cgroup.events.
func cgroupFrozen(rel string) (bool, error) {
	if b, err := os.ReadFile(filepath.Join(freezerDir(), rel, "freezer.state")); err == nil {
		return strings.TrimSpace(string(b)) == "FROZEN", nil
	}
	b, err := os.ReadFile(filepath.Join(cgroupRoot, rel, "cgroup.events"))
	if err != nil {
		return false, fmt.Errorf("freezer state of cgroup %s: %w", rel, err)
	}
	return strings.Contains(string(b), "frozen 1"), nil
}

// hybridCgroups reports the v1 + cgroup2 layout (v1 controllers, an
// empty cgroup2 at /sys/fs/cgroup/unified).
func hybridCgroups() bool {
	return !dsecup.IsCgroupFS(cgroupRoot) && dsecup.IsCgroupFS(filepath.Join(cgroupRoot, "unified"))
}

func cgroupLayout() string {
	switch {
	case dsecup.IsCgroupFS(cgroupRoot):
		return "v2"
	case hybridCgroups():
		return "v1 (hybrid)"
	}
	return "v1"
}
