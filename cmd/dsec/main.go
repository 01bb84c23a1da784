// Command dsec is DSec's one binary: the daemons (up, server, edge) and the
// client CLI (tenant, image, sandbox, run, trajectory, replay) over the
// public API.
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
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// Exit codes; see the package comment.
const (
	exitError   = 1
	exitUsage   = 2
	exitTimeout = 124
	exitInfra   = 125
)

// exitCodeError carries an exit code up to main without printing anything
// more (the command has already said what happened).
type exitCodeError struct {
	code int
	msg  string
}

func (e *exitCodeError) Error() string { return e.msg }

// usageError marks errors in how the command was called.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

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

Start a single-node service with "dsec up", then use the client commands.
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
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.AddCommand(
		newUpCmd(),
		newServerCmd(),
		newEdgeCmd(),
		newTenantCmd(g),
		newImageCmd(g),
		newSandboxCmd(g),
		newJobCmd(g),
		newRunCmd(g),
		newTrajectoryCmd(g),
		newReplayCmd(g),
		newGCCmd(g),
		newPoolCmd(g), newFnCmd(g),
	)
	return root
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRoot().ExecuteContext(ctx)
	stop()
	os.Exit(report(err))
}

// report prints err (if any) and returns the process exit code.
func report(err error) int {
	if err == nil {
		return 0
	}
	var ec *exitCodeError
	if errors.As(err, &ec) {
		if ec.msg != "" {
			fmt.Fprintln(os.Stderr, "dsec:", ec.msg)
		}
		return ec.code
	}
	fmt.Fprintln(os.Stderr, "dsec:", err)
	var ue usageError
	if errors.As(err, &ue) || strings.HasPrefix(err.Error(), "unknown command") {
		return exitUsage
	}
	return exitError
}
