package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// exactArgs is cobra.ExactArgs reporting a usage error (exit 2).
func newTenantCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "tenant", Short: "Manage tenants (admin token)"}
	var maxSandboxes int64
	var maxCPU, maxMemory string
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a tenant and print its token (shown once)",
		Args:  cli.ExactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			q := dsec.Quota{MaxSandboxes: maxSandboxes}
			if maxSandboxes < 0 {
				return cli.Usagef("--max-sandboxes %d: must not be negative", maxSandboxes)
			}
			var err error
			if maxCPU != "" {
				if q.MaxMilliCPU, err = cli.ParseCPU("max-cpu", maxCPU); err != nil {
					return cli.UsageError{Err: err}
				}
			}
			if maxMemory != "" {
				if q.MaxMemoryBytes, err = cli.ParseSize("max-memory", maxMemory); err != nil {
					return cli.UsageError{Err: err}
				}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			token, err := c.Tenants().Create(cmd.Context(), args[0], q)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), token)
			return nil
		},
	}
	create.Flags().Int64Var(&maxSandboxes, "max-sandboxes", 0, "most live sandboxes at once (0: unlimited)")
	create.Flags().StringVar(&maxCPU, "max-cpu", "", "most cores over all live sandboxes, e.g. 8 or 0.5 (default unlimited)")
	create.Flags().StringVar(&maxMemory, "max-memory", "", "most memory over all live sandboxes, e.g. 16g (default unlimited)")
	cmd.AddCommand(create)
	return cmd
}
