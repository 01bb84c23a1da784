// Command dsec is DSec's command-line front. It serves the common form of
// `dsec run --image NAME:TAG [flags] -- CMD [ARG...]` itself, as one Run
// API call, and replaces itself (exec(2): same PID, environment and
// arguments) with another binary for everything else: dsecd for the
// daemon commands (up, server, edge) and dsec-cli, the full client, for
// every other command and for any `run` it does not fully understand
// (--help, an unknown flag, a value dsec-cli would refuse, an endpoint
// that needs DNS, TLS or a proxy, or a server it cannot connect to).
// Both are found as $DSEC_DAEMON / $DSEC_CLI, else next to dsec, else on
// $PATH.
//
// Why a front: every Go package linked into a binary runs its
// initialisation on every start, and on the VMs DSec targets each page
// fault costs tens of microseconds. The full client (cobra, protobuf,
// Connect, net/http, crypto) takes ~18 ms to start; this binary links the
// standard library's basics only and starts in about the time of a hello
// world, so that `dsec run` costs little more than the sandbox itself.
// dsec-cli stays the source of truth: the fast path's output, messages and
// exit codes are dsec-cli's (TestRunPathsAgree compares the two).
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
	"os"
	"runtime"
	"strings"

	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff"
)

func main() {
	args := os.Args[1:]
	if len(args) > 0 && args[0] == "run" {
		// One P: the call is one goroutine waiting on a socket, and with
		// two the runtime starts extra threads to run its background
		// goroutines while it waits (~25 more page faults, measured).
		runtime.GOMAXPROCS(1)
		if code, ok := fastRun(args[1:]); ok {
			os.Exit(code)
		}
	}
	// The daemon commands go straight to dsecd (and so does shell
	// completion of their flags).
	if len(args) > 0 && handoff.IsDaemon(args[0]) ||
		len(args) > 1 && strings.HasPrefix(args[0], "__complete") && handoff.IsDaemon(args[1]) {
		path, err := handoff.FindDaemon()
		if err == nil {
			err = handoff.Exec(path, args)
		}
		fatal(args[0] + ": " + err.Error())
	}
	path, err := handoff.FindClient()
	if err == nil {
		err = handoff.Exec(path, args)
	}
	fatal(err.Error())
}

// fatal reports a failed handover as dsec-cli reports errors (exit 1).
func fatal(msg string) {
	os.Stderr.WriteString("dsec: " + msg + "\n")
	os.Exit(1)
}
