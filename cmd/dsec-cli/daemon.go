package main

// The daemon commands (up, server, edge) live in dsecd, so that this binary
// links no server-side package and starts in a few milliseconds. The front
// dsec hands `dsec up ARGS...` to dsecd itself; this binary does when the
// command comes after a flag (`dsec --token-file F up`, which the front
// passes here) or through `dsec help up`. The handover replaces the
// process: same PID, same environment, same arguments after the command,
// so signals, exit codes and process supervision behave as if dsec were
// the daemon.

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff"
)

// newDaemonCmds lists dsecd's commands in dsec's help.
func newDaemonCmds() []*cobra.Command {
	var cmds []*cobra.Command
	for _, d := range cli.Daemons {
		name := d.Name
		c := &cobra.Command{
			Use:   name,
			Short: d.Short,
			Long:  d.Short + ".\n\nRuns in " + cli.DaemonBinary + ": `dsec " + name + " ARGS...` is `" + cli.DaemonBinary + " " + name + " ARGS...`.",
			// Every argument, flags included, belongs to dsecd.
			DisableFlagParsing: true,
			RunE: func(_ *cobra.Command, args []string) error {
				return execDaemon(append([]string{name}, args...))
			},
		}
		c.SetHelpFunc(func(c *cobra.Command, _ []string) {
			err := execDaemon([]string{name, "--help"})
			// Only reached when dsecd could not be started.
			fmt.Fprintln(c.OutOrStdout(), c.Long)
			fmt.Fprintln(c.ErrOrStderr(), "dsec:", err)
		})
		cmds = append(cmds, c)
	}
	return cmds
}

// execDaemon replaces this process with dsecd running args (args[0] is the
// command). It returns only on failure.
func execDaemon(args []string) error {
	path, err := handoff.FindDaemon()
	if err != nil {
		return fmt.Errorf("%s: %w", args[0], err)
	}
	return fmt.Errorf("%s: %w", args[0], handoff.Exec(path, args))
}
