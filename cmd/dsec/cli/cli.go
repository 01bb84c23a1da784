// Package cli is the command-line plumbing DSec's cobra binaries share: the
// full client dsec-cli and the daemons' dsecd. It holds exit codes, usage
// errors, argument checks and the parsing of CPU and size flags, and
// nothing that links a server-side package: dsec-cli imports it, and
// dsec-cli must start fast. (The front binary dsec links cobra-free
// packages only: flagval and handoff.)
//
// Exit codes: exec and run exit with the command's own exit code (128+N
// when it was killed by signal N, 124 when it timed out). DSec itself uses
// 125 when it could not run the command at all: an API error, or an
// infra_error outcome (the sandbox or its node failed), so a script can tell
// "the task failed" from "the infrastructure failed". Other commands exit 1
// on error and 2 on bad usage.
package cli

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
	"github.com/dsec-dev/dsec/cmd/dsec/cli/handoff"
)

// Exit codes; see the package comment.
const (
	ExitError   = 1
	ExitUsage   = 2
	ExitTimeout = 124
	ExitInfra   = 125
)

// ExitCodeError carries an exit code up to main. Msg, when not empty, is
// printed; an empty Msg means the command has already said what happened.
type ExitCodeError struct {
	Code int
	Msg  string
}

func (e *ExitCodeError) Error() string { return e.Msg }

// UsageError marks errors in how the command was called (exit 2).
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// Usagef returns a UsageError with a formatted message.
func Usagef(format string, args ...any) error { return UsageError{fmt.Errorf(format, args...)} }

// ExactArgs refuses anything but n positional arguments; what names them
// in the message ("NAME:TAG PATH", "no arguments").
func ExactArgs(n int, what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return Usagef("want %s, got %d argument(s)", what, len(args))
		}
		return nil
	}
}

// RangeArgs refuses fewer than lo or more than hi positional arguments;
// what names them in the message ("REF [NAME:TAG]").
func RangeArgs(lo, hi int, what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) < lo || len(args) > hi {
			return Usagef("want %s, got %d argument(s)", what, len(args))
		}
		return nil
	}
}

// Report prints err (if any) to stderr prefixed with prog, and returns the
// process exit code.
func Report(stderr io.Writer, prog string, err error) int {
	if err == nil {
		return 0
	}
	var ec *ExitCodeError
	if errors.As(err, &ec) {
		if ec.Msg != "" {
			fmt.Fprintf(stderr, "%s: %s\n", prog, ec.Msg)
		}
		return ec.Code
	}
	fmt.Fprintf(stderr, "%s: %v\n", prog, err)
	var ue UsageError
	if errors.As(err, &ue) || strings.HasPrefix(err.Error(), "unknown command") {
		return ExitUsage
	}
	return ExitError
}

// Daemon is a command of dsecd, the daemons' binary (see package handoff).
type Daemon = handoff.Daemon

// Daemons are dsecd's commands.
var Daemons = handoff.Daemons

// DaemonBinary is the file name of the daemons' binary.
const DaemonBinary = handoff.DaemonBinary

// DaemonEnv names the environment variable that points dsec at dsecd.
const DaemonEnv = handoff.DaemonEnv

// ParseCPU turns a core count ("1", "0.5", "2.25") into milliCPU.
func ParseCPU(flag, s string) (int64, error) { return flagval.ParseCPU(flag, s) }

// ParseSize turns "512m", "1g", "1GiB", "1.5g" or a plain byte count into
// bytes.
func ParseSize(flag, s string) (int64, error) { return flagval.ParseSize(flag, s) }

// FormatCPU writes milliCPU as ParseCPU reads it.
func FormatCPU(milli int64) string { return flagval.FormatCPU(milli) }

// FormatSize writes bytes as ParseSize reads them.
func FormatSize(b int64) string { return flagval.FormatSize(b) }
