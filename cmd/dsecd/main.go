// Command dsecd is DSec's daemons' binary: up (a server and one edge in one
// process), server (a control-plane replica) and edge (a node agent). The
// client CLI is the separate, thin dsec; `dsec up|server|edge ARGS...`
// replaces itself with `dsecd up|server|edge ARGS...`, so both spellings
// run the same code with the same flags.
//
// Exit codes: 0 after a clean stop, 1 on error, 2 on bad usage.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
)

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   cli.DaemonBinary,
		Short: "DSec's daemons: up, server, edge",
		Long: `dsecd runs DSec's daemons. "dsecd up" (or "dsec up", which hands over to
dsecd) starts a one-node service; "server" and "edge" run the parts of a
cluster. The client commands are in dsec.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	// dsec's client flags were accepted, and ignored, by the daemon commands
	// when they lived in dsec: keep accepting them (`dsec --token-file F up`
	// hands them over), without advertising them.
	var ignored string
	for _, name := range []string{"endpoint", "token", "token-file"} {
		root.PersistentFlags().StringVar(&ignored, name, "", "client flag, ignored by the daemons")
		if err := root.PersistentFlags().MarkHidden(name); err != nil {
			panic(err)
		}
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return cli.UsageError{Err: err} })
	root.AddCommand(newUpCmd(), newServerCmd(), newEdgeCmd())
	return root
}

// short is the one-line description of daemon command name, shared with
// the listing in dsec's help.
func short(name string) string {
	for _, d := range cli.Daemons {
		if d.Name == name {
			return d.Short
		}
	}
	panic(fmt.Sprintf("dsecd: %q is not in cli.Daemons", name))
}

func main() {
	closeOnExec()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRoot().ExecuteContext(ctx)
	stop()
	os.Exit(cli.Report(os.Stderr, cli.DaemonBinary, err))
}

// closeOnExec marks every descriptor from 3 up close-on-exec. Whatever
// started dsecd may have left descriptors open without the flag (a
// supervisor's pipe, a shell's fd 251); Go keeps them so and every process
// dsecd starts would inherit them, sandbox agents included, which must get
// nothing but their own channel. Nothing in dsecd uses inherited
// descriptors. Before Linux 5.11 (no CLOSE_RANGE_CLOEXEC) it does nothing;
// the agent marks its own at start as well.
func closeOnExec() {
	_ = unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
}
