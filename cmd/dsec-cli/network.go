package main

import (
	"bytes"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/trajectory"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// A sandbox's egress policy and the events its trajectory holds.

func newSandboxNetworkCmd(g *globals) *cobra.Command {
	var allow, deny []string
	var set bool
	cmd := &cobra.Command{
		Use:   "network ID [--allow NAME|HOST]... [--deny NAME|HOST]... [--set]",
		Short: "Show or change a sandbox's egress policy",
		Long: `Show or change which outward connections a sandbox's proxy lets through.
With no flags it prints the policy. --allow and --deny add rules (a rule for
a target already there is replaced: --allow pypi after a deny of pypi allows
it); with --set they are the whole new policy (--set alone denies
everything). A deny wins over an allow. New connections follow the policy at
once; open connections it no longer allows are closed.

A rule is a named rule (pypi, npm, crates, goproxy, debian, ubuntu, github,
huggingface), a host (example.org; *.example.org for any name below it;
example.org:443 for one port), an address or a CIDR (10.0.0.0/8).`,
		Args: cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			sb := c.Sandbox(args[0], dsec.Unnumbered())
			n := dsec.Network{Allow: allow, Deny: deny}
			var got dsec.Network
			switch {
			case set:
				got, err = sb.ReplaceNetwork(cmd.Context(), n)
			default:
				got, err = sb.SetNetwork(cmd.Context(), n)
			}
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if len(got.Allow)+len(got.Deny) == 0 {
				fmt.Fprintln(out, "no rules: every outward connection is refused")
				return nil
			}
			if len(got.Allow) > 0 {
				fmt.Fprintln(out, "allow:", strings.Join(got.Allow, " "))
			}
			if len(got.Deny) > 0 {
				fmt.Fprintln(out, "deny: ", strings.Join(got.Deny, " "))
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringArrayVar(&allow, "allow", nil, "allow NAME|HOST (repeatable)")
	fl.StringArrayVar(&deny, "deny", nil, "deny NAME|HOST (repeatable)")
	fl.BoolVar(&set, "set", false, "make --allow and --deny the whole policy instead of adding to it")
	return cmd
}

func newSandboxEventsCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "events ID",
		Short: "List the events of a sandbox's trajectory (egress decisions, freezes, input, its end), apart from its steps",
		Args:  cli.ExactArgs(1, "ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			tr, err := c.Trajectory(cmd.Context(), args[0], false)
			if err != nil {
				return err
			}
			return printEvents(cmd.OutOrStdout(), tr.Records, asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the canonical records as JSONL")
	return cmd
}

// printEvents prints the event records among lines (canonical JSON).
func printEvents(w io.Writer, lines []string, asJSON bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if !asJSON {
		fmt.Fprintln(tw, "AFTER\tKIND\tTIME\tDURATION\tWHAT")
	}
	for _, l := range lines {
		r, err := trajectory.Parse([]byte(l))
		if err != nil {
			return err
		}
		if !trajectory.IsEvent(r.Kind) {
			continue
		}
		if asJSON {
			if _, err := fmt.Fprintln(w, l); err != nil {
				return err
			}
			continue
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\n", r.Seq, r.Kind, recordTime(r.Start), recordDuration(r), summary(r))
	}
	if asJSON {
		return nil
	}
	return tw.Flush()
}

// egressSummary is one line for an egress decision.
func egressSummary(e *trajectory.Egress) string {
	if e == nil {
		return ""
	}
	var b bytes.Buffer
	if e.Allowed {
		b.WriteString("allowed ")
	} else {
		b.WriteString("denied ")
	}
	if e.Method != "" {
		b.WriteString(e.Method + " ")
	}
	b.WriteString(e.Host)
	if e.Port != 0 {
		b.WriteString(":" + strconv.Itoa(e.Port))
	}
	b.WriteString(" (" + e.Rule + ")")
	if e.Allowed {
		fmt.Fprintf(&b, ", %d bytes out, %d in", e.BytesOut, e.BytesIn)
	}
	if e.Ended != "" {
		b.WriteString(", ended: " + e.Ended)
	}
	return b.String()
}

func newSandboxVerifyCmd(g *globals) *cobra.Command {
	var (
		f         execFlags
		artifacts []string
	)
	cmd := &cobra.Command{
		Use:   "verify ID --artifact PATH... -- CMD [ARG...]",
		Short: "Grade a sandbox's work in a fresh sandbox holding only its artifacts; exit with the grading command's exit code",
		Long: `Run a grading command in a verifier: a fresh sandbox of the sandbox's own
images as it was created (with its resources and environment, no network),
into which only the --artifact paths (files or directories, absolute) are
copied from the sandbox, each to the same path. Nothing else the sandbox's
workload changed (a conftest.py that passes every test, a patched test
runner, a trojaned binary) reaches the grade. The verifier is destroyed
afterwards; the step is recorded on the sandbox's trajectory. Output is
printed when the command ends; the exit code is the command's.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return cli.Usagef("want ID --artifact PATH... -- CMD [ARG...]")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(artifacts) == 0 {
				return cli.Usagef("give at least one --artifact PATH to copy into the verifier")
			}
			opts, err := f.options(args[1:])
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			res, err := c.Sandbox(args[0], dsec.Unnumbered()).Verify(cmd.Context(), opts, artifacts...)
			if err != nil {
				return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: err.Error()}
			}
			cmd.OutOrStdout().Write(res.Stdout)
			cmd.ErrOrStderr().Write(res.Stderr)
			return resultExit(res)
		},
	}
	f.register(cmd)
	cmd.Flags().StringArrayVar(&artifacts, "artifact", nil, "absolute PATH (file or directory) to copy from the sandbox into the verifier (repeatable)")
	return cmd
}
