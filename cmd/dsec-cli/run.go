package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
)

// newRunCmd is `dsec run`. The front binary dsec serves the common form
// of it without this binary (cmd/dsec/run.go), with the same flags,
// output, messages and exit codes: a change here must be made there too
// (TestRunPathsAgree in cmd/dsec compares the two).
func newRunCmd(g *globals) *cobra.Command {
	var cf createFlags
	var ef execFlags
	cmd := &cobra.Command{
		Use:   "run --image NAME:TAG [flags] -- CMD [ARG...]",
		Short: "Create a sandbox, run one command in it streaming its output, destroy it",
		Long: `Create a sandbox, run one command in it streaming its output, and destroy
it, in one API call. Exits with the command's exit code (see dsec --help).`,
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
			// One call: the server creates, runs and destroys (the destroy
			// happens even if this process is interrupted).
			res, err := c.Run(cmd.Context(), spec, opts, cmd.OutOrStdout(), cmd.ErrOrStderr())
			if err != nil {
				return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: err.Error()}
			}
			if res.DestroyError != "" {
				fmt.Fprintln(cmd.ErrOrStderr(), "dsec: warning:", res.DestroyError)
			}
			return resultExit(&res.ExecResult)
		},
	}
	cf.register(cmd)
	ef.register(cmd)
	return cmd
}
