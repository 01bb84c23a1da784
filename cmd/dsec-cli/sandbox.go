package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

func newSandboxCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "sandbox", Aliases: []string{"sb"}, Short: "Manage sandboxes"}
	cmd.AddCommand(
		newSandboxCreateCmd(g),
		newSandboxExecCmd(g),
		newSandboxCpCmd(g),
		newSandboxLsCmd(g),
		newSandboxGetCmd(g),
		newSandboxRmCmd(g),
		newSandboxLogCmd(g),
		newSandboxSnapshotCmd(g),
		newSandboxCheckpointCmd(g),
		newSandboxRollbackCmd(g),
		newSandboxFreezeCmd(g),
		newSandboxThawCmd(g),
		newSandboxScreenshotCmd(g),
		newSandboxInputCmd(g),
		newSandboxNetworkCmd(g),
		newSandboxEventsCmd(g),
		newSandboxVerifyCmd(g),
	)
	return cmd
}

// createFlags are the flags of `sandbox create`, shared with `run`.
type createFlags struct {
	image, workspace, backend string
	toolkits, labels, env     []string
	netAllow, netDeny         []string
	cpu, memory, idleAction   string
	disk                      string
	ttl, idle                 time.Duration
}

func (f *createFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.image, "image", "", "base image NAME:TAG (required)")
	fl.StringVar(&f.workspace, "workspace", "", "workspace image NAME:TAG layered over the base")
	fl.StringArrayVar(&f.toolkits, "toolkit", nil, "toolkit image NAME:TAG layered on top (repeatable; last on top)")
	fl.StringVar(&f.backend, "backend", "container", "backend: container, microvm or fullvm (the node must offer it)")
	fl.StringVar(&f.cpu, "cpu", "", "CPU limit in cores, e.g. 1 or 0.5 (default: the tenant's, else the node's)")
	fl.StringVar(&f.memory, "memory", "", "memory limit, e.g. 512m, 1g, 1GiB or bytes (default: the tenant's, else the node's)")
	fl.StringVar(&f.disk, "disk-size", "", "writable-layer size (what the sandbox may write over its image), e.g. 2g (default: the tenant's, else the node's)")
	fl.StringArrayVar(&f.labels, "label", nil, "label KEY=VALUE (repeatable)")
	fl.StringArrayVar(&f.env, "sandbox-env", nil, "environment KEY=VALUE for every exec in the sandbox (repeatable)")
	fl.StringArrayVar(&f.netAllow, "net-allow", nil, "let the sandbox reach NAME|HOST through its proxy: a named rule (pypi, npm, crates, goproxy, debian, ubuntu, github, huggingface), a host (example.org, *.example.org, example.org:443), an address or CIDR (repeatable; default: nothing)")
	fl.StringArrayVar(&f.netDeny, "net-deny", nil, "refuse NAME|HOST even where --net-allow covers it (repeatable)")
	fl.DurationVar(&f.ttl, "ttl", 0, "maximum lifetime, e.g. 1h (default none)")
	fl.DurationVar(&f.idle, "idle-timeout", 0, "destroy (or, with --idle-action freeze, freeze) after this long without an operation (default none)")
	fl.StringVar(&f.idleAction, "idle-action", "destroy", "what --idle-timeout does: destroy or freeze")
}

func (f *createFlags) spec() (dsec.Spec, error) {
	if f.image == "" {
		return dsec.Spec{}, cli.Usagef("--image is required")
	}
	if f.ttl < 0 {
		return dsec.Spec{}, cli.Usagef("--ttl %s: must not be negative", f.ttl)
	}
	if f.idle < 0 {
		return dsec.Spec{}, cli.Usagef("--idle-timeout %s: must not be negative", f.idle)
	}
	if f.idleAction != dsec.IdleDestroy && f.idleAction != dsec.IdleFreeze {
		return dsec.Spec{}, cli.Usagef("--idle-action %q: want destroy or freeze", f.idleAction)
	}
	s := dsec.Spec{
		Backend:     f.backend,
		Image:       f.image,
		Workspace:   f.workspace,
		Toolkits:    f.toolkits,
		TTL:         f.ttl,
		IdleTimeout: f.idle,
		IdleAction:  f.idleAction,
		Env:         f.env,
		Network:     dsec.Network{Allow: f.netAllow, Deny: f.netDeny},
	}
	var err error
	if f.cpu != "" {
		if s.Resources.MilliCPU, err = cli.ParseCPU("cpu", f.cpu); err != nil {
			return s, cli.UsageError{Err: err}
		}
	}
	if f.memory != "" {
		if s.Resources.MemoryBytes, err = cli.ParseSize("memory", f.memory); err != nil {
			return s, cli.UsageError{Err: err}
		}
	}
	if f.disk != "" {
		if s.Resources.DiskBytes, err = cli.ParseSize("disk-size", f.disk); err != nil {
			return s, cli.UsageError{Err: err}
		}
	}
	if s.Labels, err = parseLabels("label", f.labels); err != nil {
		return s, cli.UsageError{Err: err}
	}
	if err := checkEnv("sandbox-env", f.env); err != nil {
		return s, cli.UsageError{Err: err}
	}
	return s, nil
}

func newSandboxCreateCmd(g *globals) *cobra.Command {
	var f createFlags
	cmd := &cobra.Command{
		Use:   "create --image NAME:TAG [flags]",
		Short: "Create a sandbox and print its ID",
		Args:  cli.ExactArgs(0, "no arguments (options are flags)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec, err := f.spec()
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			sb, err := c.Create(cmd.Context(), spec)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), sb.ID)
			return nil
		},
	}
	f.register(cmd)
	return cmd
}

// execFlags are the flags of `sandbox exec`, shared with `run`.
type execFlags struct {
	timeout time.Duration
	env     []string
	cwd     string
	user    string
}

func (f *execFlags) register(cmd *cobra.Command) {
	cmd.Flags().DurationVar(&f.timeout, "timeout", 0, "kill the command after this long, e.g. 30s (default none)")
	cmd.Flags().StringArrayVarP(&f.env, "env", "e", nil, "environment KEY=VALUE for this command (repeatable)")
	cmd.Flags().StringVarP(&f.cwd, "cwd", "w", "", "working directory inside the sandbox")
	cmd.Flags().StringVarP(&f.user, "user", "u", "", "user (name, uid or uid:gid)")
}

func (f *execFlags) options(argv []string) (dsec.ExecOptions, error) {
	if len(argv) == 0 {
		return dsec.ExecOptions{}, cli.Usagef("missing command: put it after --, e.g. -- echo hello")
	}
	if f.timeout < 0 {
		return dsec.ExecOptions{}, cli.Usagef("--timeout %s: must not be negative", f.timeout)
	}
	if err := checkEnv("env", f.env); err != nil {
		return dsec.ExecOptions{}, cli.UsageError{Err: err}
	}
	return dsec.ExecOptions{Argv: argv, Env: f.env, Cwd: f.cwd, User: f.user, Timeout: f.timeout}, nil
}

// streamExec runs opts in sb with output copied to the command's stdout and
// stderr, and turns the result into the process exit code.
func streamExec(cmd *cobra.Command, sb *dsec.Sandbox, opts dsec.ExecOptions) error {
	res, err := sb.ExecStream(cmd.Context(), opts, cmd.OutOrStdout(), cmd.ErrOrStderr())
	if err != nil {
		return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: err.Error()}
	}
	if res.Replayed {
		fmt.Fprintf(cmd.ErrOrStderr(), "dsec: seq %d replayed from the trajectory\n", res.Seq)
	}
	return resultExit(res)
}

// resultExit maps an exec result to an exit code; see the package comment.
func resultExit(res *dsec.ExecResult) error {
	switch {
	case res.Outcome == dsec.OutcomeInfraError:
		return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: "infra_error: " + res.InfraError}
	case res.TimedOut || res.Outcome == dsec.OutcomeTimeout:
		return &cli.ExitCodeError{Code: cli.ExitTimeout, Msg: "command timed out"}
	case res.Signal != 0:
		return &cli.ExitCodeError{Code: 128 + res.Signal}
	case res.ExitCode != 0:
		return &cli.ExitCodeError{Code: res.ExitCode}
	}
	return nil
}

func newSandboxExecCmd(g *globals) *cobra.Command {
	var (
		f   execFlags
		seq uint64
	)
	cmd := &cobra.Command{
		Use:   "exec [flags] ID -- CMD [ARG...]",
		Short: "Run a command in a sandbox, streaming its output; exit with its exit code",
		Long: `Run a command in a sandbox, streaming its output, and exit with its exit code.

With --seq N the command is step N of the sandbox's trajectory. If step N
is already recorded (a client re-sending its commands after a restart),
the recorded output and exit code come back without running anything
again, and a note on stderr says so. N must not be beyond the next step
the trajectory expects.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return cli.Usagef("want ID -- CMD [ARG...]")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			opts, err := f.options(args[1:])
			if err != nil {
				return err
			}
			if cmd.Flags().Changed("seq") && seq == 0 {
				return cli.Usagef("--seq 0: steps start at 1 (0 is the sandbox's creation record)")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			if seq != 0 {
				if err := checkSeq(cmd.Context(), c, args[0], seq); err != nil {
					return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: err.Error()}
				}
				opts.Seq = seq
			}
			return streamExec(cmd, c.Sandbox(args[0], dsec.Unnumbered()), opts)
		},
	}
	f.register(cmd)
	cmd.Flags().Uint64Var(&seq, "seq", 0, "run as step N of the sandbox's trajectory; a recorded step returns its recorded result")
	return cmd
}

// checkSeq refuses a step beyond the next one the sandbox's trajectory
// expects. The server refuses it too, but the SDK keeps re-sending such a
// number for a while (for its own handles, an earlier number may still be
// on its way), which would only make the CLI hang before failing.
func checkSeq(ctx context.Context, c *dsec.Client, id string, seq uint64) error {
	sb, err := c.Get(ctx, id)
	if err != nil {
		return err
	}
	if sb.NextSeq != 0 && seq > sb.NextSeq {
		return fmt.Errorf("--seq %d: sandbox %s's trajectory expects step %d next", seq, id, sb.NextSeq)
	}
	return nil
}

// maxCopyBytes bounds a file read from a sandbox by `cp`.
const maxCopyBytes = 1 << 30

// copyChunk is the most `cp` sends or asks for in one call: one ReadFile
// returns at most the server's ceiling (16 MiB) and one request carries at
// most 64 MiB, so larger files go through exec's output stream and stdin.
const copyChunk = 16 << 20

func newSandboxCpCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file into or out of a sandbox (one side is ID:PATH; - is stdin/stdout)",
		Args:  cli.ExactArgs(2, "SRC DST"),
		RunE: func(cmd *cobra.Command, args []string) error {
			from, to, err := parseCopyArgs(args[0], args[1])
			if err != nil {
				return cli.UsageError{Err: err}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			if to.Sandbox != "" {
				data, mode, err := readLocal(cmd.InOrStdin(), from.Path)
				if err != nil {
					return err
				}
				dst := to.Path
				if strings.HasSuffix(dst, "/") && from.Path != "-" {
					dst = path.Join(dst, filepath.Base(from.Path))
				}
				return copyIn(ctx, c.Sandbox(to.Sandbox, dsec.Unnumbered()), dst, data, mode)
			}
			data, err := copyOut(ctx, c.Sandbox(from.Sandbox, dsec.Unnumbered()), from.Path)
			if err != nil {
				return err
			}
			return writeLocal(cmd.OutOrStdout(), to.Path, path.Base(from.Path), data)
		},
	}
}

// copyIn writes data to dst in the sandbox: one WriteFile, or for a file
// over copyChunk the first chunk by WriteFile and the rest appended by
// `cat`, copyChunk of stdin at a time.
func copyIn(ctx context.Context, sb *dsec.Sandbox, dst string, data []byte, mode uint32) error {
	first := data[:min(len(data), copyChunk)]
	if err := sb.WriteFile(ctx, dst, first, mode); err != nil {
		return err
	}
	for rest := data[len(first):]; len(rest) > 0; {
		n := min(len(rest), copyChunk)
		res, err := sb.ExecWith(ctx, dsec.ExecOptions{Argv: []string{"sh", "-c", `cat >> "$1"`, "sh", dst}, Stdin: rest[:n]})
		if err != nil {
			return err
		}
		if res.ExitCode != 0 || res.Outcome != "ok" {
			return fmt.Errorf("append to %s in the sandbox: %s (exit %d) %s", dst, res.Outcome, res.ExitCode, strings.TrimSpace(string(res.Stderr)))
		}
		rest = rest[n:]
	}
	return nil
}

// copyOut reads p from the sandbox: one ReadFile, or for a file over the
// server's ReadFile bound its bytes as `cat` prints them, streamed.
func copyOut(ctx context.Context, sb *dsec.Sandbox, p string) ([]byte, error) {
	data, err := sb.ReadFile(ctx, p, 0)
	if err == nil || !dsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), "larger than") {
		return data, err
	}
	var out, errOut bytes.Buffer
	res, err := sb.ExecStream(ctx, dsec.ExecOptions{Argv: []string{"cat", "--", p}},
		&capped{w: &out, left: maxCopyBytes}, &capped{w: &errOut, left: 64 << 10})
	if err != nil {
		return nil, err
	}
	if res.ExitCode != 0 || res.Outcome != "ok" {
		return nil, fmt.Errorf("read %s in the sandbox: %s (exit %d) %s", p, res.Outcome, res.ExitCode, strings.TrimSpace(errOut.String()))
	}
	return out.Bytes(), nil
}

// capped fails once more than left bytes were written to it.
type capped struct {
	w    io.Writer
	left int64
}

func (c *capped) Write(p []byte) (int, error) {
	if int64(len(p)) > c.left {
		return 0, fmt.Errorf("more than %d bytes", maxCopyBytes)
	}
	c.left -= int64(len(p))
	return c.w.Write(p)
}

func readLocal(stdin io.Reader, p string) ([]byte, uint32, error) {
	if p == "-" {
		b, err := io.ReadAll(stdin)
		return b, 0o644, err
	}
	info, err := os.Stat(p)
	if err != nil {
		return nil, 0, err
	}
	if info.IsDir() {
		return nil, 0, fmt.Errorf("%s is a directory; cp copies single files", p)
	}
	b, err := os.ReadFile(p)
	return b, uint32(info.Mode().Perm()), err
}

func writeLocal(stdout io.Writer, p, base string, data []byte) error {
	if p == "-" {
		_, err := stdout.Write(data)
		return err
	}
	if info, err := os.Stat(p); err == nil && info.IsDir() {
		p = filepath.Join(p, base)
	} else if strings.HasSuffix(p, string(filepath.Separator)) {
		return fmt.Errorf("directory %s does not exist", p)
	}
	return os.WriteFile(p, data, 0o644)
}

// sandboxJSON is the --json form of a sandbox.
type sandboxJSON struct {
	ID           string            `json:"id"`
	Node         string            `json:"node"`
	Tenant       string            `json:"tenant,omitempty"`
	State        string            `json:"state"`
	Reason       string            `json:"reason,omitempty"`
	Backend      string            `json:"backend"`
	Image        string            `json:"image"`
	Workspace    string            `json:"workspace,omitempty"`
	Toolkits     []string          `json:"toolkits,omitempty"`
	MilliCPU     int64             `json:"milli_cpu,omitempty"`
	MemoryBytes  int64             `json:"memory_bytes,omitempty"`
	Pids         int64             `json:"pids,omitempty"`
	DiskBytes    int64             `json:"disk_bytes,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	TTL          string            `json:"ttl,omitempty"`
	IdleTimeout  string            `json:"idle_timeout,omitempty"`
	CreatedAt    time.Time         `json:"created_at"`
	LastActiveAt time.Time         `json:"last_active_at"`
	Layers       []string          `json:"layers,omitempty"`
	// Usage is what it uses as its node last measured it (absent until
	// measured).
	Usage *usageJSON `json:"usage,omitempty"`
}

type usageJSON struct {
	MilliCPU    int64      `json:"milli_cpu"`
	MemoryBytes int64      `json:"memory_bytes"`
	SwapBytes   int64      `json:"swap_bytes"`
	Window      string     `json:"window,omitempty"`
	MeasuredAt  *time.Time `json:"measured_at,omitempty"`
}

func toJSON(sb *dsec.Sandbox) sandboxJSON {
	j := sandboxJSON{
		ID: sb.ID, Node: sb.Node, Tenant: sb.Tenant, State: sb.State, Reason: sb.Reason,
		Backend: sb.Spec.Backend, Image: sb.Spec.Image, Workspace: sb.Spec.Workspace, Toolkits: sb.Spec.Toolkits,
		MilliCPU: sb.Spec.Resources.MilliCPU, MemoryBytes: sb.Spec.Resources.MemoryBytes,
		Pids: sb.Spec.Resources.Pids, DiskBytes: sb.Spec.Resources.DiskBytes,
		Labels: sb.Spec.Labels, CreatedAt: sb.CreatedAt, LastActiveAt: sb.LastActiveAt, Layers: sb.Layers,
	}
	if sb.Spec.TTL > 0 {
		j.TTL = sb.Spec.TTL.String()
	}
	if sb.Spec.IdleTimeout > 0 {
		j.IdleTimeout = sb.Spec.IdleTimeout.String()
	}
	if u := sb.Usage; u != nil {
		j.Usage = &usageJSON{MilliCPU: u.MilliCPU, MemoryBytes: u.MemoryBytes, SwapBytes: u.SwapBytes}
		if u.Window > 0 {
			j.Usage.Window = u.Window.String()
		}
		if !u.MeasuredAt.IsZero() {
			at := u.MeasuredAt
			j.Usage.MeasuredAt = &at
		}
	}
	return j
}

// usedCPU and usedMemory are a sandbox's measured use as ls shows it:
// cores busy over the node's last window, memory it holds; "-" until
// measured (CPU needs two measurements, a few seconds apart).
func usedCPU(u *dsec.SandboxUsage) string {
	if u == nil || u.Window == 0 {
		return "-"
	}
	return strconv.FormatFloat(float64(u.MilliCPU)/1000, 'f', 2, 64)
}

func usedMemory(u *dsec.SandboxUsage) string {
	if u == nil {
		return "-"
	}
	return humanBytes(u.MemoryBytes)
}

func formatLabels(m map[string]string) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

func newSandboxLsCmd(g *globals) *cobra.Command {
	var labels []string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls [--label k=v]...",
		Short: "List sandboxes",
		Args:  cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			sel, err := parseLabels("label", labels)
			if err != nil {
				return cli.UsageError{Err: err}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			list, err := c.List(cmd.Context(), sel)
			if err != nil {
				return err
			}
			slices.SortFunc(list, func(a, b *dsec.Sandbox) int { return a.CreatedAt.Compare(b.CreatedAt) })
			out := cmd.OutOrStdout()
			if asJSON {
				js := make([]sandboxJSON, 0, len(list))
				for _, sb := range list {
					js = append(js, toJSON(sb))
				}
				return writeJSON(out, js)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tNODE\tSTATE\tIMAGE\tCPU\tMEM\tCREATED\tLABELS")
			for _, sb := range list {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", sb.ID, sb.Node, sb.State, sb.Spec.Image,
					usedCPU(sb.Usage), usedMemory(sb.Usage), ago(sb.CreatedAt), formatLabels(sb.Spec.Labels))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only sandboxes with label KEY=VALUE (repeatable; all must match)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newSandboxGetCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "get ID",
		Short: "Describe a sandbox",
		Args:  cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			sb, err := c.Get(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				return writeJSON(out, toJSON(sb))
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			j := toJSON(sb)
			rows := [][2]string{
				{"id", j.ID}, {"node", j.Node}, {"tenant", j.Tenant}, {"state", j.State}, {"reason", j.Reason},
				{"backend", j.Backend}, {"image", j.Image}, {"workspace", j.Workspace},
				{"toolkits", strings.Join(j.Toolkits, ",")}, {"cpu", cpuString(j.MilliCPU)},
				{"memory", memString(j.MemoryBytes)}, {"pids", pidsString(j.Pids)}, {"disk", memString(j.DiskBytes)},
				{"labels", formatLabels(j.Labels)},
				{"ttl", j.TTL}, {"idle_timeout", j.IdleTimeout}, {"created", ago(j.CreatedAt)},
				{"last_active", ago(j.LastActiveAt)},
			}
			if u := sb.Usage; u != nil {
				rows = append(rows, [2]string{"cpu_used", usedCPU(u)}, [2]string{"memory_used", usedMemory(u)})
				if u.SwapBytes > 0 {
					rows = append(rows, [2]string{"swap_used", humanBytes(u.SwapBytes)})
				}
			}
			for _, r := range rows {
				if r[1] != "" {
					fmt.Fprintf(tw, "%s:\t%s\n", r[0], r[1])
				}
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newSandboxRmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rm ID...",
		Short: "Destroy sandboxes",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cli.Usagef("want at least one ID")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			if len(args) == 1 {
				return c.Destroy(cmd.Context(), args[0])
			}
			err = c.DestroyMany(cmd.Context(), args...)
			var be *dsec.BatchError
			if errors.As(err, &be) {
				for _, e := range be.Errs {
					fmt.Fprintln(cmd.ErrOrStderr(), "dsec:", e)
				}
				return &cli.ExitCodeError{Code: cli.ExitError}
			}
			return err
		},
	}
}

func cpuString(m int64) string {
	if m == 0 {
		return ""
	}
	return strconv.FormatFloat(float64(m)/1000, 'f', -1, 64)
}

func pidsString(n int64) string {
	if n == 0 {
		return ""
	}
	return strconv.FormatInt(n, 10)
}

func memString(b int64) string {
	if b == 0 {
		return ""
	}
	return humanBytes(b)
}
