// Command dsec-cli is DSec's full client CLI (tenant, image, sandbox, run,
// fn, pool, job, gc, trajectory, replay, node) over the public API. Users run it
// as `dsec`: the front binary dsec (cmd/dsec) serves the common form of
// `dsec run` itself, in a few milliseconds, and replaces itself with
// dsec-cli for everything else, so this binary is the source of truth for
// every command's behaviour, run included. It is kept thin too: the
// daemons (up, server, edge) are in the separate binary dsecd, and
// `dsec up|server|edge ARGS...` replaces itself with `dsecd up|server|edge
// ARGS...` (see daemon.go).
//
// Exit codes: exec and run exit with the command's own exit code (128+N
// when it was killed by signal N, 124 when it timed out). DSec itself uses
// 125 when it could not run the command at all: an API error, or an
// infra_error outcome (the sandbox or its node failed), so a script can tell
// "the task failed" from "the infrastructure failed". Other commands exit 1
// on error and 2 on bad usage; `trajectory verify` exits 1 on a broken hash
// chain and `replay` when a step diverged.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// globals are the client flags shared by every client command.
type globals struct {
	endpoint  string
	token     string
	tokenFile string
}

func (g *globals) client() (*dsec.Client, error) {
	token := g.token
	if token == "" && g.tokenFile != "" {
		b, err := os.ReadFile(g.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	return dsec.New(g.endpoint, token), nil
}

func newRoot() *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:   "dsec",
		Short: "DSec: elastic sandboxes for agentic RL",
		Long: `DSec runs isolated, stateful sandboxes for agent rollouts.

Start a single-node service with "dsec up" (it runs dsecd, the daemons'
binary: $DSEC_DAEMON, else next to dsec, else on $PATH), then use the
client commands.
Clients read DSEC_ENDPOINT (default http://127.0.0.1:7110) and DSEC_TOKEN
(default: the admin token in /var/lib/dsec/admin.token when readable).

Exit codes: exec and run exit with the command's exit code (128+N if it was
killed by signal N, 124 if it timed out); 125 means DSec could not run it
(API error or infra_error: the sandbox or its node failed). Other commands
exit 1 on error and 2 on bad usage; "trajectory verify" exits 1 on a broken
hash chain, "replay" when a step diverged.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.endpoint, "endpoint", "", "API endpoint (default $DSEC_ENDPOINT or "+dsec.DefaultEndpoint+")")
	root.PersistentFlags().StringVar(&g.token, "token", "", "bearer token (default $DSEC_TOKEN or the local admin token)")
	root.PersistentFlags().StringVar(&g.tokenFile, "token-file", "", "read the bearer token from this file")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return cli.UsageError{Err: err} })
	root.AddCommand(newDaemonCmds()...)
	root.AddCommand(
		newTenantCmd(g),
		newImageCmd(g),
		newSandboxCmd(g),
		newJobCmd(g),
		newRunCmd(g),
		newTrajectoryCmd(g),
		newReplayCmd(g),
		newGCCmd(g),
		newPoolCmd(g), newFnCmd(g),
		newNodeCmd(g),
	)
	return root
}

func main() {
	// The daemon commands live in dsecd: hand the process over before
	// anything else runs (see daemon.go).
	if len(os.Args) > 1 && handoff.IsDaemon(os.Args[1]) {
		os.Exit(report(execDaemon(os.Args[1:])))
	}
	// Shell completion of a daemon command's flags is dsecd's too.
	if len(os.Args) > 2 && strings.HasPrefix(os.Args[1], "__complete") && handoff.IsDaemon(os.Args[2]) {
		os.Exit(report(execDaemon(os.Args[1:])))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRoot().ExecuteContext(ctx)
	stop()
	os.Exit(report(err))
}

// report prints err (if any) and returns the process exit code.
func report(err error) int { return cli.Report(os.Stderr, "dsec", err) }
