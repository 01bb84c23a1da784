package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// Snapshots, checkpoints and freeze/thaw. Like the CLI's other sandbox
// operations they are unnumbered: the server gives them the sandbox's next
// step, so they do not disturb a trainer numbering its own.

func newSandboxSnapshotCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "snapshot ID NAME:TAG",
		Short: "Make an image of a sandbox's file system and print it (ref and digest)",
		Long: `Make an image NAME:TAG of a sandbox's file system: its layers plus one
holding everything it changed. Sandboxes created from the image, on any
node, start from the file system as it is now (processes and /tmp, a tmpfs,
are not part of it). The sandbox is frozen while its changes are packed and
keeps running. Prints "NAME:TAG DIGEST".`,
		Args: cli.ExactArgs(2, "ID NAME:TAG"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			im, err := c.Sandbox(args[0], dsec.Unnumbered()).Snapshot(cmd.Context(), args[1])
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s %s\n", im.Ref, im.Digest)
			return nil
		},
	}
}

func newSandboxCheckpointCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "checkpoint ID",
		Short: "Checkpoint a sandbox's file system in place and print the checkpoint ID",
		Long: `Checkpoint a sandbox's file system in place and print the checkpoint ID
(alone, so that ck=$(dsec sandbox checkpoint ID) works). "dsec sandbox
rollback ID CHECKPOINT" returns the sandbox to it. Checkpoints live on the
sandbox's node until the sandbox ends.`,
		Args: cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			id, err := c.Sandbox(args[0], dsec.Unnumbered()).Checkpoint(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), id)
			return nil
		},
	}
}

func newSandboxRollbackCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rollback ID CHECKPOINT",
		Short: "Kill a sandbox's processes and reset its file system to a checkpoint",
		Long: `Kill every process in a sandbox and reset its file system to exactly the
checkpoint's. The sandbox keeps its ID; the checkpoint stays, so it can be
rolled back to again.`,
		Args: cli.ExactArgs(2, "ID CHECKPOINT"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if args[1] == "" {
				return cli.Usagef("CHECKPOINT must not be empty")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			return c.Sandbox(args[0], dsec.Unnumbered()).Rollback(cmd.Context(), args[1])
		},
	}
}

func newSandboxFreezeCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "freeze ID",
		Short: "Stop every process of a sandbox, keeping its memory, until thaw",
		Long: `Stop every process of a sandbox (cgroup freezer): they use no CPU and keep
their memory. Until "dsec sandbox thaw ID", commands in the sandbox are
refused and it shows as frozen.`,
		Args: cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			return c.Sandbox(args[0], dsec.Unnumbered()).Freeze(cmd.Context())
		},
	}
}

func newSandboxThawCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "thaw ID",
		Short: "Resume a frozen sandbox",
		Args:  cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			return c.Sandbox(args[0], dsec.Unnumbered()).Thaw(cmd.Context())
		},
	}
}

func newJobCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "job",
		Short: "Act on every sandbox of a job (selected by labels), on every node",
	}
	cmd.AddCommand(newJobOpCmd(g, true), newJobOpCmd(g, false))
	return cmd
}

// newJobOpCmd is `job freeze` (freeze) or `job thaw`.
func newJobOpCmd(g *globals, freeze bool) *cobra.Command {
	verb, done, short := "thaw", "thawed", "Thaw every sandbox carrying the labels"
	if freeze {
		verb, done, short = "freeze", "frozen", "Freeze every sandbox carrying the labels"
	}
	var labels []string
	cmd := &cobra.Command{
		Use:   verb + " --label k=v [--label k=v]...",
		Short: short,
		Long: short + ` (all labels must match), on every node, in one call.
Prints one line per sandbox: its ID and "ok" or what went wrong. Exits 1 if
any sandbox could not be ` + done + `.`,
		Args: cli.ExactArgs(0, "no arguments (select sandboxes with --label)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			sel, err := parseLabels("label", labels)
			if err != nil {
				return cli.UsageError{Err: err}
			}
			if len(sel) == 0 {
				return cli.Usagef("at least one --label k=v is required (a job is the sandboxes carrying its labels)")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			op := c.ThawJob
			if freeze {
				op = c.FreezeJob
			}
			results, err := op(cmd.Context(), sel)
			if results == nil && err != nil {
				return err // the call itself failed
			}
			out := cmd.OutOrStdout()
			failed := 0
			for _, r := range results {
				if r.Err != nil {
					failed++
					fmt.Fprintf(out, "%s error: %v\n", r.ID, r.Err)
					continue
				}
				fmt.Fprintf(out, "%s ok\n", r.ID)
			}
			if failed > 0 {
				return &cli.ExitCodeError{Code: cli.ExitError, Msg: fmt.Sprintf("%d of %d sandboxes could not be %s", failed, len(results), done)}
			}
			if len(results) == 0 {
				fmt.Fprintf(cmd.ErrOrStderr(), "dsec: no live sandbox carries %s\n", formatLabels(sel))
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "select sandboxes with label KEY=VALUE (repeatable, at least one; all must match)")
	return cmd
}
