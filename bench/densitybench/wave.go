package main

// The wave phase: R rollouts started at once through the Python SDK, each
// with a workspace of its own, beside the same wave on Docker. The Go side
// prepares (workspaces imported as images, dockerd started) and cleans
// up; wave.py drives the rollouts and reports.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
	"github.com/dsec-dev/dsec/bench/internal/peer"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// python is Debian's interpreter, which has python3-httpx (the python3 on
// PATH here is a pyenv build without it, and PyPI is not reachable).
const python = "/usr/bin/python3"

// EmptyFigures are one system's rollouts run alone.
type EmptyFigures struct {
	Rollouts     int     `json:"rollouts"`
	Steps        int     `json:"steps"`
	CreateP50Ms  float64 `json:"create_p50_ms"`
	StepP50Ms    float64 `json:"step_p50_ms"`
	StepP99Ms    float64 `json:"step_p99_ms"`
	DestroyP50Ms float64 `json:"destroy_p50_ms"`
}

// WaveRow is one system's wave, as wave.py reports it, plus the untimed
// preparation.
type WaveRow struct {
	Backend        string       `json:"backend"`
	R              int          `json:"r"`
	Seed           int64        `json:"seed"`
	Empty          EmptyFigures `json:"empty"`
	PeakAlive      int          `json:"peak_alive"`
	Created        int          `json:"created"`
	Completed      int          `json:"completed"`
	FailedRollouts int          `json:"failed_rollouts"`
	WallS          float64      `json:"wall_s"`
	IdealS         float64      `json:"ideal_s"`
	WallOverIdeal  float64      `json:"wall_over_ideal"`
	RolloutsPerS   float64      `json:"rollouts_per_s"`
	StepsPlanned   int          `json:"steps_planned"`
	StepsRun       int          `json:"steps_run"`
	ThinkTotalS    float64      `json:"think_total_s"`
	StepP50Ms      float64      `json:"step_p50_ms"`
	StepP99Ms      float64      `json:"step_p99_ms"`
	StepMaxMs      float64      `json:"step_max_ms"`
	// Steady*: the steps that started after the last create returned
	// (LastCreateS into the wave), apart from the creation burst.
	SteadySteps      int            `json:"steady_steps"`
	SteadyStepP50Ms  float64        `json:"steady_step_p50_ms"`
	SteadyStepP99Ms  float64        `json:"steady_step_p99_ms"`
	LastCreateS      float64        `json:"last_create_s"`
	StepP50OverEmpty float64        `json:"step_p50_over_empty"`
	StepP99OverEmpty float64        `json:"step_p99_over_empty"`
	CreateP50Ms      float64        `json:"create_p50_ms"`
	CreateP99Ms      float64        `json:"create_p99_ms"`
	CreateMaxMs      float64        `json:"create_max_ms"`
	DestroyP50Ms     float64        `json:"destroy_p50_ms"`
	CreateRefusals   int            `json:"create_refusals"`
	InfraErrors      int            `json:"infra_errors"`
	InfraErrorKinds  map[string]int `json:"infra_error_kinds,omitempty"`
	Failures         int            `json:"failures"`
	FailureKinds     map[string]int `json:"failure_kinds,omitempty"`
	// PrepareSeconds is the untimed set-up: importing the workspaces
	// (DSec) or making their directories (Docker).
	PrepareSeconds float64 `json:"prepare_seconds"`
	Err            string  `json:"error,omitempty"`
}

// WaveReport is the wave phase: DSec and Docker, same plan.
type WaveReport struct {
	UpPID  int           `json:"dsec_up_pid"`
	DSec   *WaveRow      `json:"dsec,omitempty"`
	Docker *WaveRow      `json:"docker,omitempty"`
	Leaks  *dsecup.Leaks `json:"leaks,omitempty"`
}

func (rn *run) wave(ctx context.Context) (*WaveReport, error) {
	cfg := rn.cfg.Wave
	rep := &WaveReport{}
	var errs []error
	row := &WaveRow{Backend: "dsec", R: cfg.R}
	rep.DSec = row
	leaks, err := rn.withUp(ctx, "wave", nil, func(up *dsecup.Up) error {
		rep.UpPID = up.PID()
		return rn.waveDSec(ctx, up, row)
	})
	rep.Leaks = leaks
	if err != nil {
		row.Err = err.Error()
		errs = append(errs, fmt.Errorf("dsec: %w", err))
	}
	if cfg.Peer == "docker" && ctx.Err() == nil {
		drow := &WaveRow{Backend: "docker", R: cfg.DockerR}
		rep.Docker = drow
		if err := rn.waveDocker(ctx, drow); err != nil {
			drow.Err = err.Error()
			errs = append(errs, fmt.Errorf("docker: %w", err))
		}
	}
	return rep, errors.Join(errs...)
}

// waveDSec imports the workspaces (untimed) and runs wave.py against up.
func (rn *run) waveDSec(ctx context.Context, up *dsecup.Up, row *WaveRow) error {
	cfg := rn.cfg.Wave
	wsDir := filepath.Join(rn.work, "wave-ws")
	defer os.RemoveAll(wsDir)
	t0 := time.Now()
	if err := makeWorkspaces(wsDir, cfg.R); err != nil {
		return err
	}
	c := dsec.New(up.Endpoint, up.Token)
	if err := importWorkspaces(ctx, c, wsDir, cfg.R, cfg.ImportC); err != nil {
		return err
	}
	row.PrepareSeconds = time.Since(t0).Seconds()
	slog.Info("workspaces imported", "n", cfg.R+1, "took", time.Since(t0).Round(time.Millisecond))
	return rn.runWavePy(ctx, row, cfg.R, "--backend", "dsec", "--endpoint", up.Endpoint, "--token", up.Token,
		"--workspace-prefix", "ws/r")
}

// waveDocker runs the same plan on a private dockerd.
func (rn *run) waveDocker(ctx context.Context, row *WaveRow) (err error) {
	cfg := rn.cfg.Wave
	if why := peer.DockerMissing(); why != "" {
		return errors.New(why)
	}
	dir := filepath.Join(rn.work, "docker")
	d, err := startDockerd(ctx, dir, rn.rootfs)
	if d != nil {
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
			defer cancel()
			if serr := d.Stop(sctx); serr != nil {
				err = errors.Join(err, fmt.Errorf("docker cleanup: %w", serr))
			}
			if rn.keep {
				return
			}
			if rerr := dsecup.RemoveDir(dir); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}()
	}
	if err != nil {
		return err
	}
	t0 := time.Now()
	wsDir := filepath.Join(dir, "ws")
	if err := makeWorkspaces(wsDir, cfg.DockerR); err != nil {
		return err
	}
	row.PrepareSeconds = time.Since(t0).Seconds()
	return rn.runWavePy(ctx, row, cfg.DockerR, "--backend", "docker", "--socket", d.Sock, "--image", dockerImage,
		"--workspace-dir", wsDir)
}

// runWavePy runs wave.py for r rollouts with the phase's plan and decodes
// its report into row.
func (rn *run) runWavePy(ctx context.Context, row *WaveRow, r int, args ...string) error {
	cfg := rn.cfg.Wave
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	argv := append([]string{filepath.Join(rn.root, "bench", "densitybench", "wave.py"),
		"--r", strconv.Itoa(r), "--steps-min", strconv.Itoa(cfg.StepsMin), "--steps-max", strconv.Itoa(cfg.StepsMax),
		"--think-min", f(cfg.ThinkMin), "--think-max", f(cfg.ThinkMax), "--seed", strconv.FormatInt(cfg.Seed, 10),
		"--cpu", f(cfg.CPU), "--mem-mb", strconv.FormatInt(cfg.MemMB, 10), "--empty", strconv.Itoa(cfg.Empty),
		"--empty-steps", strconv.Itoa(cfg.EmptySteps), "--timeout", f(cfg.TimeoutS)}, args...)
	cmd := exec.CommandContext(ctx, python, argv...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	// Its own process group: a Ctrl-C on the terminal reaches only the
	// harness, which then stops the wave in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	slog.Info("wave", "backend", row.Backend, "r", r)
	err := cmd.Run()
	if ctx.Err() != nil {
		return fmt.Errorf("wave interrupted: %w", ctx.Err())
	}
	if err != nil {
		return fmt.Errorf("wave.py: %w", err)
	}
	prep := row.PrepareSeconds
	if err := json.Unmarshal(stdout.Bytes(), row); err != nil {
		return fmt.Errorf("wave.py output: %w: %q", err, tail(stdout.String(), 400))
	}
	row.PrepareSeconds = prep
	if row.InfraErrors > 0 || row.Failures > 0 || row.Completed != r {
		return fmt.Errorf("%d of %d rollouts completed, %d infra errors, %d failures", row.Completed, r, row.InfraErrors, row.Failures)
	}
	return nil
}

// makeWorkspaces writes the workspace of each rollout i in [0, r) to
// dir/<i>/work and the empty node's to dir/empty/work: app.sh (the
// rollout's name and the step the last edit set), test.sh (checks that
// edit and prints "ok NAME STEP") and 16 KiB of random data, so that every
// workspace is a layer of its own (no two have the same digest).
func makeWorkspaces(dir string, r int) error {
	write := func(key, name string) error {
		w := filepath.Join(dir, key, "work")
		if err := os.MkdirAll(w, 0o755); err != nil {
			return err
		}
		data := make([]byte, 16<<10)
		_, _ = rand.Read(data)
		files := map[string][]byte{
			"app.sh":   []byte("ID=" + name + "\nSTEP=0\n"),
			"test.sh":  []byte(testScript),
			"data.bin": data,
		}
		for f, b := range files {
			if err := os.WriteFile(filepath.Join(w, f), b, 0o644); err != nil {
				return fmt.Errorf("workspace %s: %w", key, err)
			}
		}
		return nil
	}
	if err := write("empty", "rempty"); err != nil {
		return err
	}
	for i := range r {
		if err := write(strconv.Itoa(i), "r"+strconv.Itoa(i)); err != nil {
			return err
		}
	}
	return nil
}

// testScript is a step's test: the edit took, the log grew, the answer.
const testScript = `. ./app.sh
[ "$STEP" = "$1" ] || { echo "app.sh has STEP=$STEP, want $1" >&2; exit 1; }
[ "$(wc -l <log.txt)" -ge 1 ] || { echo "log.txt is empty" >&2; exit 1; }
echo "ok $ID $1"
`

// importWorkspaces imports dir/<i> as ws/r<i>:latest and dir/empty as
// ws/rempty:latest, c at a time, from the server's file system.
func importWorkspaces(ctx context.Context, c *dsec.Client, dir string, r, conc int) error {
	keys := []string{"empty"}
	for i := range r {
		keys = append(keys, strconv.Itoa(i))
	}
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for range conc {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(keys) {
					return
				}
				ref := "ws/r" + keys[i] + ":latest"
				if _, err := c.Images().ImportServerPath(ctx, ref, filepath.Join(dir, keys[i])); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if first != nil {
		return fmt.Errorf("import workspaces: %w", first)
	}
	return ctx.Err()
}
