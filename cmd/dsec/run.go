package main

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
)

func newRunCmd(g *globals) *cobra.Command {
	var cf createFlags
	var ef execFlags
	cmd := &cobra.Command{
		Use:   "run --image NAME:TAG [flags] -- CMD [ARG...]",
		Short: "Create a sandbox, run one command in it streaming its output, destroy it",
		Args: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 0 || len(args) == 0 {
				return cli.Usagef("want -- CMD [ARG...] after the flags")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			spec, err := cf.spec()
			if err != nil {
				return err
			}
			opts, err := ef.options(args)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			sb, err := c.Create(cmd.Context(), spec)
			if err != nil {
				return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: err.Error()}
			}
			// Destroy even when interrupted: the caller's context may be
			// cancelled already, so the cleanup gets its own deadline.
			defer func() {
				ctx, cancel := context.WithTimeout(context.WithoutCancel(cmd.Context()), 30*time.Second)
				defer cancel()
				if err := sb.Destroy(ctx); err != nil {
					fmt.Fprintln(cmd.ErrOrStderr(), "dsec: warning:", err)
				}
			}()
			return streamExec(cmd, sb, opts)
		},
	}
	cf.register(cmd)
	ef.register(cmd)
	return cmd
}
