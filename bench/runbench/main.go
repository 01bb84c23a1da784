// Command runbench measures `dsec run -- /bin/true` against a real
// one-node `dsec up`, beside bubblewrap running the same command on the
// same rootfs, in one run (issue 3: `dsec run` within 1.5x of `bwrap
// --unshare-all`). It also times the floor of any Go CLI (a static hello
// world), `dsec --help` (the front handing over to dsec-cli), and the same
// run through dsec-cli (the full client, which the front falls back to).
//
// Each round runs every row once, in order, timed as Go os/exec Run()
// (fork, exec, wait); -warmup untimed rounds come first. The machine must
// be quiet: before starting, the harness waits (up to -quiet-wait) until
// the 1-minute load average is below 1 and no other `go test` or benchmark
// runs, and it reports the load at the start and the end.
//
// Usage (as root, from the repository root):
//
//	go run ./bench/runbench [-n 30] [-warmup 5] [-dsec bin/dsec -agent bin/dsec-agent] [-compare OLD/dsec] [-json]
//
// With -dsec, dsecd and dsec-cli are taken from next to it (make build
// puts all three in bin/); without, the three are built from the working
// tree.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// Row is one command timed in every round.
type Row struct {
	Name     string   `json:"name"`
	Argv     []string `json:"argv"`
	MedianMs float64  `json:"median_ms"`
	P90Ms    float64  `json:"p90_ms"`
	Runs     int      `json:"runs"`

	samples []time.Duration
	env     []string
}

// Report is one run's result.
type Report struct {
	Host       string  `json:"host"`
	Date       string  `json:"date"`
	Rounds     int     `json:"rounds"`
	Warmup     int     `json:"warmup"`
	LoadStart  float64 `json:"load_start"`
	LoadEnd    float64 `json:"load_end"`
	Rows       []*Row  `json:"rows"`
	RunVsBwrap float64 `json:"ratio_run_bwrap"`
	CLIVsBwrap float64 `json:"ratio_cli_run_bwrap"`
}

func main() {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if err := mainErr(); err != nil {
		fmt.Fprintln(os.Stderr, "runbench:", err)
		os.Exit(1)
	}
}

func mainErr() error {
	var (
		n         = flag.Int("n", 30, "timed rounds")
		warmup    = flag.Int("warmup", 5, "untimed rounds first")
		quietWait = flag.Duration("quiet-wait", 10*time.Minute, "how long to wait for a quiet machine (load < 1, no other go test or benchmark); 0 to not check")
		autoPool  = flag.Int("auto-pool", -1, "dsec up --auto-pool (-1: dsec up's default)")
		compare   = flag.String("compare", "", "also time this other dsec client binary (say, one built from an older commit) against the same server: its --help and its run")
		fl        dsecup.Flags
	)
	fl.Register()
	flag.Parse()
	if err := dsecup.CheckFlags(map[string]int{"n": *n, "warmup": *warmup + 1}); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root (dsec up makes namespaces, mounts and cgroups; bwrap --unshare-all)")
	}
	bwrap, err := exec.LookPath("bwrap")
	if err != nil {
		return errors.New("bwrap not found: apt-get install bubblewrap")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	root, err := dsecup.RepoRoot()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "runbench-")
	if err != nil {
		return err
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
	bins, rootfs, err := dsecup.Prepare(ctx, root, work, fl)
	if err != nil {
		return err
	}
	cli, hello, err := buildExtras(ctx, root, bins.Dir, fl.Dsec)
	if err != nil {
		return err
	}

	var args []string
	if *autoPool >= 0 {
		args = append(args, "--auto-pool", strconv.Itoa(*autoPool))
	}
	up, err := dsecup.Start(ctx, dsecup.Options{Bins: bins, DataDir: filepath.Join(work, "data"), Rootfs: rootfs, NodeID: "runbench", Args: args})
	if up != nil {
		defer func() {
			if err := up.Stop(); err != nil {
				slog.Error("stop dsec up", "err", err)
			}
		}()
	}
	if err != nil {
		return err
	}
	env := append(os.Environ(), "DSEC_ENDPOINT="+up.Endpoint, "DSEC_TOKEN="+up.Token)
	run := []string{"run", "--image", "busybox:latest", "--", "/bin/true"}
	rows := []*Row{
		{Name: "hello (static Go)", Argv: []string{hello}},
		{Name: "dsec --help", Argv: []string{bins.Dsec, "--help"}},
		{Name: "dsec run /bin/true", Argv: append([]string{bins.Dsec}, run...), env: env},
		{Name: "dsec-cli run /bin/true (full client)", Argv: append([]string{cli}, run...), env: env},
		{Name: "bwrap --unshare-all /bin/true", Argv: []string{bwrap, "--unshare-all", "--die-with-parent",
			"--ro-bind", rootfs, "/", "--proc", "/proc", "--dev", "/dev", "/bin/true"}},
	}
	if *compare != "" {
		rows = append(rows,
			&Row{Name: "-compare --help", Argv: []string{*compare, "--help"}},
			&Row{Name: "-compare run /bin/true", Argv: append([]string{*compare}, run...), env: env})
	}

	if *quietWait > 0 {
		if err := waitQuiet(ctx, *quietWait); err != nil {
			return err
		}
	}
	rep := &Report{Host: dsecup.HostLine(), Date: time.Now().UTC().Format(time.RFC3339), Rounds: *n, Warmup: *warmup, LoadStart: load()}
	for i := 0; i < *warmup+*n; i++ {
		for _, r := range rows {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			d, err := timeRun(ctx, r)
			if err != nil {
				return err
			}
			if i >= *warmup {
				r.samples = append(r.samples, d)
			}
		}
	}
	rep.LoadEnd = load()
	for _, r := range rows {
		s := dsecup.Summarize(r.samples)
		r.MedianMs, r.P90Ms, r.Runs = dsecup.Ms(s.Median), dsecup.Ms(s.P90), len(r.samples)
	}
	rep.Rows = rows
	rep.RunVsBwrap = rows[2].MedianMs / rows[4].MedianMs
	rep.CLIVsBwrap = rows[3].MedianMs / rows[4].MedianMs
	return dsecup.PrintReport(fl.JSON, "runbench", rep, rep.print)
}

func (rep *Report) print(w io.Writer) {
	fmt.Fprintf(w, "%s, %s, load %.2f -> %.2f; median and p90 of %d rounds after %d warm-up\n",
		rep.Host, rep.Date, rep.LoadStart, rep.LoadEnd, rep.Rounds, rep.Warmup)
	for _, r := range rep.Rows {
		fmt.Fprintf(w, "  %-40s median %9s  p90 %9s\n", r.Name, dsecup.FmtMs(r.MedianMs), dsecup.FmtMs(r.P90Ms))
	}
	fmt.Fprintf(w, "ratio dsec run / bwrap: %s (target <= 1.5x); full client: %s\n", dsecup.FmtX(rep.RunVsBwrap), dsecup.FmtX(rep.CLIVsBwrap))
}

// timeRun runs one row once and returns its wall time. A row that fails
// fails the run: a fast error is not a measurement.
func timeRun(ctx context.Context, r *Row) (time.Duration, error) {
	cmd := exec.CommandContext(ctx, r.Argv[0], r.Argv[1:]...)
	cmd.Env = r.env
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = io.Discard, &out
	t0 := time.Now()
	err := cmd.Run()
	d := time.Since(t0)
	if err != nil {
		return 0, fmt.Errorf("%s: %v\n%s", strings.Join(r.Argv, " "), err, out.String())
	}
	return d, nil
}

// buildExtras provides dsec-cli next to dsec (copied from next to -dsec,
// or built) and builds the hello-world floor.
func buildExtras(ctx context.Context, root, dir, dsecBin string) (cli, hello string, err error) {
	cli = filepath.Join(dir, "dsec-cli")
	if dsecBin != "" {
		b, err := os.ReadFile(filepath.Join(filepath.Dir(dsecBin), "dsec-cli"))
		if err != nil {
			return "", "", fmt.Errorf("-dsec %s: the full client dsec-cli must be next to it (make build puts both in bin/): %w", dsecBin, err)
		}
		if err := os.WriteFile(cli, b, 0o755); err != nil {
			return "", "", err
		}
	} else if err := goBuild(ctx, root, cli, "./cmd/dsec-cli"); err != nil {
		return "", "", err
	}
	src := filepath.Join(dir, "hello")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(filepath.Join(src, "main.go"), []byte("package main\n\nimport \"os\"\n\nfunc main() { os.Stdout.WriteString(\"hello\\n\") }\n"), 0o644); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte("module hello\n\ngo 1.26\n"), 0o644); err != nil {
		return "", "", err
	}
	hello = filepath.Join(dir, "hello-bin")
	return cli, hello, goBuild(ctx, src, hello, ".")
}

func goBuild(ctx context.Context, dir, out, pkg string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
	}
	return nil
}

// load is the 1-minute load average.
func load() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f, _ := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	return f
}

// busy names another go test or benchmark process running, if any.
func busy() string {
	ents, _ := os.ReadDir("/proc")
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == os.Getppid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		cmd := strings.ReplaceAll(strings.TrimRight(string(b), "\x00"), "\x00", " ")
		if strings.Contains(cmd, "go test") || strings.Contains(cmd, "bench") && !strings.Contains(cmd, "runbench") {
			return fmt.Sprintf("pid %d: %s", pid, cmd)
		}
	}
	return ""
}

// waitQuiet waits until the machine is quiet, for at most max.
func waitQuiet(ctx context.Context, max time.Duration) error {
	deadline := time.Now().Add(max)
	for {
		l, b := load(), busy()
		if l < 1 && b == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("machine not quiet after %v (load %.2f; %s): measure later or pass -quiet-wait 0", max, l, b)
		}
		slog.Info("waiting for a quiet machine", "load", l, "busy", b)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(15 * time.Second):
		}
	}
}
