package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/trajectory"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// A sandbox's trajectory is the durable, hash-chained log of its operations
// (see internal/trajectory). These commands read it from the API (by
// sandbox ID) or from a JSONL export (a file), verify it, and replay it.

func newTrajectoryCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "trajectory", Aliases: []string{"traj"}, Short: "Export and verify sandbox trajectories"}
	cmd.AddCommand(newTrajectoryExportCmd(g), newTrajectoryVerifyCmd(g))
	return cmd
}

func newTrajectoryExportCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "export ID",
		Short: "Print a sandbox's trajectory as JSONL, one record per line, data inlined",
		Long: `Print sandbox ID's trajectory on stdout as JSONL: one canonical record per
line, in log order, with every output and file content inlined (the format
trainers ingest, and what "trajectory verify" and "replay" accept as FILE).
Works after the sandbox is destroyed.`,
		Args: cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			tr, err := c.Trajectory(cmd.Context(), args[0], true)
			if err != nil {
				return err
			}
			w := bufio.NewWriter(cmd.OutOrStdout())
			for _, line := range tr.Records {
				w.WriteString(line)
				w.WriteByte('\n')
			}
			return w.Flush()
		},
	}
}

func newTrajectoryVerifyCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "verify ID|FILE",
		Short: "Check a trajectory's hash chain; exit 1 naming the first bad record",
		Long: `Check the hash chain of a trajectory: every record's hash matches its
content (and inline data its digest), each record names the one before it,
the trajectory starts with its creation record and no seq appears twice.
Prints "ok: N records", or names the first record that fails (its line and
seq) and exits 1.

The argument is read as a JSONL file when a file exists at that path, and
as a sandbox ID otherwise.`,
		Args: cli.ExactArgs(1, "ID or FILE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, err := loadTrajectory(cmd.Context(), g, args[0], true)
			if err != nil {
				return err
			}
			n, err := src.verify()
			if err != nil {
				return &cli.ExitCodeError{Code: cli.ExitError, Msg: err.Error()}
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ok: %d records\n", n)
			return nil
		},
	}
}

// trajectorySource is a trajectory as JSONL lines, from the API or a file.
type trajectorySource struct {
	// what names the source in messages: "sandbox ID" or "file PATH".
	what  string
	lines []string
}

// loadTrajectory reads arg as a JSONL file when a file exists at that
// path, else fetches the trajectory of sandbox arg (with its data inlined
// when withData).
func loadTrajectory(ctx context.Context, g *globals, arg string, withData bool) (*trajectorySource, error) {
	info, err := os.Stat(arg)
	switch {
	case err == nil && info.IsDir():
		return nil, cli.Usagef("%s is a directory, not a trajectory file or a sandbox ID", arg)
	case err == nil:
		b, err := os.ReadFile(arg)
		if err != nil {
			return nil, err
		}
		src := &trajectorySource{what: "file " + arg}
		if s := strings.TrimSuffix(string(b), "\n"); s != "" {
			src.lines = strings.Split(s, "\n")
		}
		return src, nil
	case !errors.Is(err, fs.ErrNotExist):
		return nil, err
	}
	if _, err := ids.NodeOf(arg); err != nil {
		return nil, cli.Usagef("%s: no such file, and not a sandbox ID (<node>-<16 hex digits>)", arg)
	}
	c, err := g.client()
	if err != nil {
		return nil, err
	}
	tr, err := c.Trajectory(ctx, arg, withData)
	if err != nil {
		return nil, err
	}
	return &trajectorySource{what: "sandbox " + arg, lines: tr.Records}, nil
}

func (s *trajectorySource) reader() io.Reader {
	if len(s.lines) == 0 {
		return strings.NewReader("")
	}
	return strings.NewReader(strings.Join(s.lines, "\n") + "\n")
}

// verify checks the hash chain and returns the number of records.
func (s *trajectorySource) verify() (int, error) {
	n, err := trajectory.Verify(s.reader())
	if err != nil {
		return n, fmt.Errorf("trajectory of %s does not verify: %w", s.what, err)
	}
	if n == 0 {
		return 0, fmt.Errorf("%s holds no trajectory records", s.what)
	}
	return n, nil
}

// records parses the lines; they must be one sandbox's trajectory.
func (s *trajectorySource) records() ([]*trajectory.Record, error) {
	recs, err := trajectory.ReadAll(s.reader())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", s.what, err)
	}
	if len(recs) == 0 {
		return nil, fmt.Errorf("%s holds no trajectory records", s.what)
	}
	for i, r := range recs {
		if r.Sandbox != recs[0].Sandbox {
			return nil, fmt.Errorf("%s holds the trajectories of more than one sandbox (%s at line 1, %s at line %d); split it by sandbox first",
				s.what, recs[0].Sandbox, r.Sandbox, i+1)
		}
	}
	return recs, nil
}

func newSandboxLogCmd(g *globals) *cobra.Command {
	var (
		asJSON bool
		step   uint64
	)
	cmd := &cobra.Command{
		Use:   "log ID|FILE [--json] [--step N]",
		Short: "Show a sandbox's trajectory, or one record with its provenance",
		Long: `Show the trajectory of a sandbox (or of a JSONL export FILE): one line per
record with its seq, kind, start time, duration and a summary.

--json prints the canonical records as JSONL. --step N prints record N
with its provenance: its hash and the hash before it, whether the chain
verifies, and the environment of the creation record (backend, images,
resources and the ordered layer digests the sandbox was built from).`,
		Args: cli.ExactArgs(1, "ID or FILE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			withStep := cmd.Flags().Changed("step")
			// The records as the node keeps them: small data inline, large
			// data by digest (export inlines everything).
			src, err := loadTrajectory(cmd.Context(), g, args[0], false)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON && !withStep {
				w := bufio.NewWriter(out)
				for _, l := range src.lines {
					w.WriteString(l)
					w.WriteByte('\n')
				}
				return w.Flush()
			}
			recs, err := src.records()
			if err != nil {
				return err
			}
			if !withStep {
				return printLog(out, recs)
			}
			// Events carry the seq of the step they follow: the step
			// itself is the record that is not an event.
			i := -1
			for j, r := range recs {
				if r.Seq == step && (i < 0 || trajectory.IsEvent(recs[i].Kind) && !trajectory.IsEvent(r.Kind)) {
					i = j
				}
			}
			if i < 0 {
				return fmt.Errorf("seq %d is not in the trajectory of %s (%d records)", step, src.what, len(recs))
			}
			if asJSON {
				_, err := fmt.Fprintln(out, src.lines[i])
				return err
			}
			return printStep(out, src, recs, i)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the canonical records as JSONL")
	cmd.Flags().Uint64Var(&step, "step", 0, "show only the record with this seq, with its provenance")
	return cmd
}

// printLog prints the trajectory as a table.
func printLog(w io.Writer, recs []*trajectory.Record) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tKIND\tSTART\tDURATION\tSUMMARY")
	for _, r := range recs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\n", r.Seq, r.Kind, recordTime(r.Start), recordDuration(r), summary(r))
	}
	return tw.Flush()
}

func recordTime(s string) string {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return s
	}
	return t.Local().Format("2006-01-02 15:04:05.000")
}

func recordDuration(r *trajectory.Record) string {
	start, err1 := time.Parse(time.RFC3339Nano, r.Start)
	end, err2 := time.Parse(time.RFC3339Nano, r.End)
	if err1 != nil || err2 != nil {
		return "-"
	}
	d := end.Sub(start)
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond).String()
	}
	return d.Round(time.Microsecond).String()
}

// summary is one line saying what a record did.
func summary(r *trajectory.Record) string {
	var s string
	switch r.Kind {
	case trajectory.KindCreate:
		if e := r.Environment; e != nil {
			s = fmt.Sprintf("%s (%s, %s)", e.Image, e.Backend, plural(len(e.Layers), "layer"))
		}
	case trajectory.KindExec, trajectory.KindVerify:
		if x := r.Exec; x != nil {
			s = "`" + clipText(trajectory.Command(x), 50) + "`"
			if r.Error == nil {
				s += ": " + execOutcome(x) + ", stdout " + dataSize(x.Stdout)
				if x.Stderr != nil && x.Stderr.Size > 0 {
					s += ", stderr " + dataSize(x.Stderr)
				}
			}
			if v := r.Verify; v != nil {
				s += " (verifier with " + plural(len(v.Artifacts), "artifact") + ")"
			}
		}
	case trajectory.KindWriteFile, trajectory.KindReadFile:
		if f := r.File; f != nil {
			s = f.Path
			if f.Data != nil {
				s += " " + dataSize(f.Data)
			}
		}
	case trajectory.KindReward:
		if rw := r.Reward; rw != nil {
			s = strconv.FormatFloat(rw.Value, 'g', -1, 64)
			if len(rw.Metadata) > 0 {
				s += " " + formatLabels(rw.Metadata)
			}
		}
	case trajectory.KindEgress:
		s = egressSummary(r.Egress)
	default:
		s = r.Reason
	}
	if r.Error != nil {
		if s != "" {
			s += ": "
		}
		s += "error " + r.Error.Code + ": " + clipText(r.Error.Message, 80)
	}
	return s
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func execOutcome(x *trajectory.Exec) string {
	switch {
	case x.Outcome == dsec.OutcomeInfraError:
		return "infra_error: " + clipText(x.InfraError, 60)
	case x.TimedOut || x.Outcome == dsec.OutcomeTimeout:
		return "timed out"
	case x.OOMKilled:
		return fmt.Sprintf("OOM-killed (signal %d)", x.Signal)
	case x.Signal != 0:
		return fmt.Sprintf("signal %d", x.Signal)
	}
	return fmt.Sprintf("exit %d", x.ExitCode)
}

func dataSize(d *trajectory.Data) string {
	if d == nil {
		return "0B"
	}
	return humanBytes(d.Size)
}

func clipText(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", `\n`)
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-3]) + "..."
}

// printStep prints recs[i] with its provenance.
func printStep(w io.Writer, src *trajectorySource, recs []*trajectory.Record, i int) error {
	r := recs[i]
	var pretty bytes.Buffer
	if err := json.Indent(&pretty, []byte(src.lines[i]), "", "  "); err != nil {
		return fmt.Errorf("record %d: %w", r.Seq, err)
	}
	pretty.WriteByte('\n')
	if _, err := pretty.WriteTo(w); err != nil {
		return err
	}
	if x := r.Exec; x != nil {
		printData(w, "stdin", x.Stdin)
		printData(w, "stdout", x.Stdout)
		printData(w, "stderr", x.Stderr)
	}
	if r.File != nil {
		printData(w, "data", r.File.Data)
	}

	fmt.Fprintln(w, "\nprovenance:")
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(tw, "  %s:\t%s\n", k, v)
		}
	}
	row("sandbox", r.Sandbox)
	row("step", fmt.Sprintf("seq %d, %s", r.Seq, r.Title()))
	row("hash", r.Hash)
	prev := r.Prev
	if prev == "" {
		prev = "(none: first record)"
	}
	row("prev", prev)
	if n, err := src.verify(); err != nil {
		row("chain", "BROKEN: "+err.Error())
	} else {
		row("chain", fmt.Sprintf("verified (%d records)", n))
	}
	create := recs[0]
	if create.Kind != trajectory.KindCreate || create.Environment == nil {
		row("environment", "unknown: the trajectory does not start with its creation record")
		return tw.Flush()
	}
	e := create.Environment
	row("created", fmt.Sprintf("%s (creation record %s)", recordTime(create.Start), create.Hash))
	row("tenant", e.Tenant)
	row("backend", e.Backend)
	row("image", e.Image)
	row("workspace", e.Workspace)
	row("toolkits", strings.Join(e.Toolkits, ", "))
	var res []string
	if e.MilliCPU != 0 {
		res = append(res, "cpu "+cpuString(e.MilliCPU))
	}
	if e.MemoryBytes != 0 {
		res = append(res, "memory "+memString(e.MemoryBytes))
	}
	if e.Pids != 0 {
		res = append(res, fmt.Sprintf("pids %d", e.Pids))
	}
	if e.DiskBytes != 0 {
		res = append(res, "disk "+memString(e.DiskBytes))
	}
	row("resources", strings.Join(res, ", "))
	row("env", strings.Join(e.Env, " "))
	row("labels", formatLabels(e.Labels))
	row("ttl", e.TTL)
	row("idle_timeout", e.IdleTimeout)
	if len(e.Layers) == 0 {
		row("layers", "(none recorded)")
	}
	for j, l := range e.Layers {
		k := ""
		if j == 0 {
			k = "layers:"
		}
		fmt.Fprintf(tw, "  %s\t%d. %s\n", k, j+1, l)
	}
	return tw.Flush()
}

// printData shows a data field's bytes when they are text at hand.
func printData(w io.Writer, name string, d *trajectory.Data) {
	if d == nil || d.Size == 0 {
		return
	}
	switch {
	case d.Inline == nil:
		fmt.Fprintf(w, "%s: %s, kept in the blob store as %s\n", name, humanBytes(d.Size), d.Digest)
	case !utf8.Valid(d.Inline) || bytes.IndexByte(d.Inline, 0) >= 0:
		fmt.Fprintf(w, "%s: %s of binary data\n", name, humanBytes(d.Size))
	default:
		const max = 4 << 10
		text, more := d.Inline, ""
		if len(text) > max {
			text, more = text[:max], fmt.Sprintf("\n  ... (%s more)", humanBytes(int64(len(d.Inline)-max)))
		}
		fmt.Fprintf(w, "%s:\n  %s%s\n", name, strings.ReplaceAll(strings.TrimSuffix(string(text), "\n"), "\n", "\n  "), more)
	}
}

func newReplayCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "replay ID|FILE",
		Short: "Re-run a trajectory in a fresh sandbox and report where it diverges",
		Long: `Rebuild a sandbox from a trajectory's creation record (the same images,
resources, environment and labels, on the same backend), re-run its execs,
file writes and file reads in seq order with the recorded requests, and
compare each result with the recorded one: exit code, signal, timeout,
stdout and stderr (by sha256), data read, and errors. Prints one line per
step and a summary, destroys the replay sandbox, and exits 0 when nothing
diverged, 1 when a step did (or on error).

The trajectory's hash chain is verified first: a broken one is not
replayed. Step 0 compares the new sandbox's layers with the recorded ones
(an image tag that moved since). Rewards are not re-run; execs recorded
with an infra_error outcome, and operations replay cannot perform yet
(snapshots, checkpoints, rollbacks), are reported as skipped.

The replay sandbox is labelled dsec.replay-of=<the replayed sandbox's ID>
and has an idle timeout of 10 minutes, in case the replay is killed before
it destroys it.

The argument is read as a JSONL export when a file exists at that path
(export it with "dsec trajectory export"), and as a sandbox ID otherwise.`,
		Args: cli.ExactArgs(1, "ID or FILE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return replay(cmd, g, args[0])
		},
	}
}

// replay implements `dsec replay`; see its help.
func replay(cmd *cobra.Command, g *globals, arg string) error {
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	src, err := loadTrajectory(ctx, g, arg, true)
	if err != nil {
		return err
	}
	if _, err := src.verify(); err != nil {
		return fmt.Errorf("refusing to replay: %w", err)
	}
	recs, err := src.records()
	if err != nil {
		return err
	}
	create := recs[0]
	env := create.Environment
	if create.Kind != trajectory.KindCreate || env == nil {
		return fmt.Errorf("%s: the first record is not a creation record with an environment", src.what)
	}
	steps := trajectory.ReplayOrder(recs)
	for _, r := range steps {
		if m := trajectory.Missing(r); len(m) > 0 {
			return fmt.Errorf("%s: seq %d (%s) lacks its %s: replay needs the data inline (dsec trajectory export inlines it)",
				src.what, r.Seq, r.Title(), strings.Join(m, " and "))
		}
	}

	c, err := g.client()
	if err != nil {
		return err
	}
	spec := dsec.Spec{
		Backend:   env.Backend,
		Image:     env.Image,
		Workspace: env.Workspace,
		Toolkits:  env.Toolkits,
		Resources: dsec.Resources{MilliCPU: env.MilliCPU, MemoryBytes: env.MemoryBytes, Pids: env.Pids, DiskBytes: env.DiskBytes},
		Env:       env.Env,
		Labels:    map[string]string{},
		// A backstop: a replay killed before it destroys its sandbox does
		// not leave it running for ever. A running operation is not idle.
		IdleTimeout: replayIdleTimeout,
	}
	for k, v := range env.Labels {
		spec.Labels[k] = v
	}
	spec.Labels[replayLabel] = create.Sandbox
	// The handle numbers its operations from 1: the replay sandbox's own
	// trajectory records the replay.
	sb, err := c.Create(ctx, spec)
	if err != nil {
		return fmt.Errorf("create the replay sandbox: %w", err)
	}
	// Destroy even when interrupted: the command's context may be
	// cancelled already, so the cleanup gets its own deadline.
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := sb.Destroy(dctx); err != nil {
			fmt.Fprintln(cmd.ErrOrStderr(), "dsec: warning: replay sandbox not destroyed:", err)
		}
	}()
	fmt.Fprintf(out, "replaying %s (%s) in new sandbox %s\n", src.what, plural(len(steps), "operation"), sb.ID)

	var same, skipped int
	var diverged []string
	report := func(seq uint64, title string, diffs []string) {
		if len(diffs) == 0 {
			same++
			fmt.Fprintf(out, "step %d %s: same\n", seq, title)
			return
		}
		diverged = append(diverged, strconv.FormatUint(seq, 10))
		fmt.Fprintf(out, "step %d %s: DIVERGED: %s\n", seq, title, strings.Join(diffs, "; "))
	}
	var layerDiffs []string
	if d := trajectory.CompareLayers(env.Layers, sb.Layers); d != "" {
		layerDiffs = append(layerDiffs, d)
	}
	report(0, create.Title(), layerDiffs)
	for _, r := range steps {
		if reason := trajectory.SkipReason(r); reason != "" {
			skipped++
			fmt.Fprintf(out, "step %d %s: skipped (%s)\n", r.Seq, r.Title(), reason)
			continue
		}
		now, err := rerun(ctx, sb, r)
		if ctx.Err() != nil {
			return fmt.Errorf("replay interrupted at step %d: %w", r.Seq, context.Cause(ctx))
		}
		if err != nil {
			return fmt.Errorf("replay step %d: %w", r.Seq, err)
		}
		report(r.Seq, r.Title(), trajectory.Compare(r, now))
	}
	fmt.Fprintf(out, "%d steps: %d same, %d diverged, %d skipped\n", same+len(diverged)+skipped, same, len(diverged), skipped)
	if len(diverged) > 0 {
		return &cli.ExitCodeError{Code: cli.ExitError, Msg: fmt.Sprintf("replay of %s diverged at seq %s", src.what, strings.Join(diverged, ", "))}
	}
	return nil
}

// replayLabel marks a replay sandbox with the sandbox it replays.
const replayLabel = "dsec.replay-of"

// replayIdleTimeout reclaims the sandbox of a replay that was killed.
const replayIdleTimeout = 10 * time.Minute

// rerun runs a recorded operation again in sb and returns its outcome as a
// record to compare. An error the operation failed with is part of the
// outcome; the returned error is for requests that cannot be sent at all.
func rerun(ctx context.Context, sb *dsec.Sandbox, r *trajectory.Record) (*trajectory.Record, error) {
	now := &trajectory.Record{Kind: r.Kind}
	var opErr error
	switch r.Kind {
	case trajectory.KindExec:
		x := r.Exec
		if x == nil {
			return nil, fmt.Errorf("exec record without its request")
		}
		opts := dsec.ExecOptions{Argv: x.Argv, Shell: x.Shell, Env: x.Env, Cwd: x.Cwd, User: x.User, MaxOutputBytes: x.MaxOutputBytes}
		if x.Timeout != "" {
			d, err := time.ParseDuration(x.Timeout)
			if err != nil {
				return nil, fmt.Errorf("recorded timeout %q: %w", x.Timeout, err)
			}
			opts.Timeout = d
		}
		if x.Stdin != nil {
			opts.Stdin = x.Stdin.Inline
		}
		res, err := sb.ExecWith(ctx, opts)
		if err == nil {
			now.Exec = &trajectory.Exec{
				Outcome: res.Outcome, ExitCode: int32(res.ExitCode), Signal: int32(res.Signal),
				Stdout: trajectory.NewData(res.Stdout), Stderr: trajectory.NewData(res.Stderr),
				StdoutTruncated: res.StdoutTruncated, StderrTruncated: res.StderrTruncated,
				TimedOut: res.TimedOut, OOMKilled: res.OOMKilled, InfraError: res.InfraError,
			}
		}
		opErr = err
	case trajectory.KindWriteFile:
		f := r.File
		if f == nil {
			return nil, fmt.Errorf("write_file record without its request")
		}
		var data []byte
		if f.Data != nil {
			data = f.Data.Inline
		}
		opErr = sb.WriteFile(ctx, f.Path, data, f.Mode)
		now.File = &trajectory.File{Path: f.Path}
	case trajectory.KindReadFile:
		f := r.File
		if f == nil {
			return nil, fmt.Errorf("read_file record without its request")
		}
		data, err := sb.ReadFile(ctx, f.Path, f.MaxBytes)
		now.File = &trajectory.File{Path: f.Path}
		if err == nil {
			now.File.Data = trajectory.NewData(data)
		}
		opErr = err
	default:
		return nil, fmt.Errorf("%s records are not replayed", r.Kind)
	}
	if opErr != nil {
		now.Error = &trajectory.Error{Code: dsec.Code(opErr).String(), Message: opErr.Error()}
	}
	return now, nil
}
