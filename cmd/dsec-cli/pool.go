package main

import (
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

func newPoolCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pool",
		Short: "Manage warm pools of sandboxes",
		Long: `A warm pool keeps sandboxes of one spec created and clean ahead of demand.
A create (sandbox create, run, Acquire) whose spec matches a pool's (same
backend, images, resources and sandbox env) takes a ready sandbox at once;
a released one is reset and goes back.`,
	}
	cmd.AddCommand(newPoolCreateCmd(g), newPoolLsCmd(g), newPoolRmCmd(g))
	return cmd
}

func newPoolCreateCmd(g *globals) *cobra.Command {
	var (
		f             createFlags
		size, minSize int
		idleShrink    time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create --image NAME:TAG --size N [flags]",
		Short: "Create a warm pool and print its ID",
		Long: `Create a warm pool of --size sandboxes of the spec the flags describe (the
flags of "sandbox create"), and print its ID. The pool fills in the
background: "pool ls" shows how many are ready.`,
		Args: cli.ExactArgs(0, "no arguments (options are flags)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("size") {
				return cli.Usagef("--size is required")
			}
			if size < 1 {
				return cli.Usagef("--size %d: must be at least 1", size)
			}
			if minSize < 0 || minSize > size {
				return cli.Usagef("--min-size %d: must be between 0 and --size %d", minSize, size)
			}
			if idleShrink < 0 {
				return cli.Usagef("--idle-shrink %s: must not be negative", idleShrink)
			}
			spec, err := f.spec()
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			p, err := c.CreatePool(cmd.Context(), spec, size, dsec.PoolOptions{MinSize: minSize, IdleShrink: idleShrink})
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), p.ID)
			return nil
		},
	}
	f.register(cmd)
	fl := cmd.Flags()
	fl.IntVar(&size, "size", 0, "sandboxes to keep ready (required)")
	fl.IntVar(&minSize, "min-size", 0, "what the pool shrinks to when unused")
	fl.DurationVar(&idleShrink, "idle-shrink", 0, "how long unused before it shrinks (default the server's, 10m)")
	return cmd
}

// poolJSON is the --json form of a pool.
type poolJSON struct {
	ID          string   `json:"id"`
	Node        string   `json:"node"`
	Tenant      string   `json:"tenant,omitempty"`
	Backend     string   `json:"backend"`
	Image       string   `json:"image"`
	Workspace   string   `json:"workspace,omitempty"`
	Toolkits    []string `json:"toolkits,omitempty"`
	MilliCPU    int64    `json:"milli_cpu,omitempty"`
	MemoryBytes int64    `json:"memory_bytes,omitempty"`
	Env         []string `json:"env,omitempty"`
	Size        int      `json:"size"`
	Ready       int      `json:"ready"`
	InUse       int      `json:"in_use"`
	Resetting   int      `json:"resetting"`
	MinSize     int      `json:"min_size"`
	IdleShrink  string   `json:"idle_shrink,omitempty"`
	Hits        int64    `json:"hits"`
	Misses      int64    `json:"misses"`
}

func poolToJSON(p *dsec.Pool) poolJSON {
	j := poolJSON{
		ID: p.ID, Node: p.Node, Tenant: p.Tenant,
		Backend: p.Spec.Backend, Image: p.Spec.Image, Workspace: p.Spec.Workspace, Toolkits: p.Spec.Toolkits,
		MilliCPU: p.Spec.Resources.MilliCPU, MemoryBytes: p.Spec.Resources.MemoryBytes, Env: p.Spec.Env,
		Size: p.Size, Ready: p.Ready, InUse: p.InUse, Resetting: p.Resetting, MinSize: p.MinSize,
		Hits: p.Hits, Misses: p.Misses,
	}
	if p.IdleShrink > 0 {
		j.IdleShrink = p.IdleShrink.String()
	}
	return j
}

func newPoolLsCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List warm pools",
		Args:  cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			pools, err := c.ListPools(cmd.Context())
			if err != nil {
				return err
			}
			slices.SortFunc(pools, func(a, b *dsec.Pool) int { return strings.Compare(a.ID, b.ID) })
			out := cmd.OutOrStdout()
			if asJSON {
				js := make([]poolJSON, 0, len(pools))
				for _, p := range pools {
					js = append(js, poolToJSON(p))
				}
				return writeJSON(out, js)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tIMAGE\tSIZE\tREADY\tIN USE\tHITS\tMISSES\tNODE")
			for _, p := range pools {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\n", p.ID, p.Spec.Image, p.Size, p.Ready, p.InUse, p.Hits, p.Misses, p.Node)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newPoolRmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rm ID...",
		Short: "Delete warm pools",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cli.Usagef("want at least one pool ID")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			if len(args) == 1 {
				return c.DeletePool(cmd.Context(), args[0])
			}
			failed := 0
			for _, id := range args {
				if err := c.DeletePool(cmd.Context(), id); err != nil {
					fmt.Fprintln(cmd.ErrOrStderr(), "dsec:", err)
					failed++
				}
			}
			if failed > 0 {
				return &cli.ExitCodeError{Code: cli.ExitError, Msg: fmt.Sprintf("%d of %d pools could not be deleted", failed, len(args))}
			}
			return nil
		},
	}
}
