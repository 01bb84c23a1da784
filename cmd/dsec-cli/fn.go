package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

func newFnCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "fn", Short: "Stateless function calls: run code in a language"}
	cmd.AddCommand(newFnRunCmd(g))
	return cmd
}

// maxCodeBytes bounds the source read by `fn run`: a call's code travels
// in one request.
const maxCodeBytes = 16 << 20

func newFnRunCmd(g *globals) *cobra.Command {
	var (
		language, stdinFile, image, memory string
		timeout, compileTimeout            time.Duration
	)
	cmd := &cobra.Command{
		Use:   "run --language LANG [flags] FILE|- [-- ARG...]",
		Short: "Run code in a clean sandbox; print its output and exit with its exit code",
		Long: `Run the code in FILE (or on stdin with -) in LANG, in a clean sandbox
from a warm pool, print the program's stdout and stderr, and exit with the
program's exit code (128+N if it was killed by signal N). Arguments after
-- are passed to the program.

Exit codes: 124 when the program (or its compiler) hit its time limit; 1
when the code did not compile (the compiler's output goes to stderr); 125
when DSec could not run it (an API error, or a SandboxError result).`,
		Args: func(cmd *cobra.Command, args []string) error {
			dash := cmd.ArgsLenAtDash()
			if len(args) == 0 || dash == 0 || (dash < 0 && len(args) != 1) || dash > 1 {
				return cli.Usagef("want FILE|- [-- ARG...]")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if language == "" {
				return cli.Usagef("--language is required (python, bash, c, cpp, go, nodejs, ...)")
			}
			if timeout < 0 {
				return cli.Usagef("--timeout %s: must not be negative", timeout)
			}
			if compileTimeout < 0 {
				return cli.Usagef("--compile-timeout %s: must not be negative", compileTimeout)
			}
			if args[0] == "-" && stdinFile == "-" {
				return cli.Usagef("--stdin -: the code already comes from stdin")
			}
			req := dsec.RunCodeRequest{
				Language: language, RunTimeout: timeout, CompileTimeout: compileTimeout,
				Image: image, Args: args[1:],
			}
			if memory != "" {
				b, err := cli.ParseSize("memory", memory)
				if err != nil {
					return cli.UsageError{Err: err}
				}
				req.MemoryLimitMB = (b + 1<<20 - 1) >> 20 // MiB, rounded up
			}
			code, err := readInput(cmd.InOrStdin(), args[0], "code")
			if err != nil {
				return cli.UsageError{Err: err}
			}
			req.Code = string(code)
			if stdinFile != "" {
				if req.Stdin, err = readInput(cmd.InOrStdin(), stdinFile, "--stdin"); err != nil {
					return cli.UsageError{Err: err}
				}
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			resp, err := c.RunCode(cmd.Context(), req)
			if err != nil {
				if d := dsec.RetryAfter(err); d > 0 {
					return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: fmt.Sprintf("%v (the service asks to retry after %s)", err, d)}
				}
				return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: err.Error()}
			}
			return fnResult(cmd.OutOrStdout(), cmd.ErrOrStderr(), resp)
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&language, "language", "l", "", "language: python, bash, c, cpp, go, nodejs, ... (required)")
	fl.StringVar(&stdinFile, "stdin", "", "file to feed to the program's stdin (- for this command's stdin)")
	fl.DurationVar(&timeout, "timeout", 0, "run time limit, e.g. 5s (default the server's, 10s)")
	fl.DurationVar(&compileTimeout, "compile-timeout", 0, "compile time limit (default the server's, 10s)")
	fl.StringVar(&image, "image", "", "image NAME:TAG to run in instead of the language's")
	fl.StringVar(&memory, "memory", "", "memory limit, e.g. 256m (default the language's)")
	return cmd
}

// readInput reads a local file, or stdin for "-", bounded by maxCodeBytes.
func readInput(stdin io.Reader, path, what string) ([]byte, error) {
	var r io.Reader = stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		defer f.Close()
		if info, err := f.Stat(); err == nil && info.IsDir() {
			return nil, fmt.Errorf("%s: %s is a directory", what, path)
		}
		r = f
	}
	b, err := io.ReadAll(io.LimitReader(r, maxCodeBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if len(b) > maxCodeBytes {
		return nil, fmt.Errorf("%s: %s is larger than %s", what, path, humanBytes(maxCodeBytes))
	}
	return b, nil
}

// fnResult prints a call's output and turns it into the exit code; see the
// command's help.
func fnResult(stdout, stderr io.Writer, resp *dsec.RunCodeResponse) error {
	note := func(what string, r *dsec.CommandResult) {
		if r.StdoutTruncated || r.StderrTruncated {
			fmt.Fprintf(stderr, "dsec: %s output was truncated\n", what)
		}
	}
	if cr := resp.CompileResult; cr != nil && resp.RunResult == nil {
		// Compiling failed (or was all the call got to): its output is
		// diagnostics, so all of it goes to stderr.
		stderr.Write(cr.Stdout)
		stderr.Write(cr.Stderr)
		note("compiler", cr)
		switch {
		case resp.Status == dsec.RunSandboxError || cr.Status == dsec.CommandError:
			return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: sandboxErrorMsg(resp, "compiling")}
		case cr.Status == dsec.CommandTimeLimitExceeded:
			return &cli.ExitCodeError{Code: cli.ExitTimeout, Msg: "compiling timed out"}
		case resp.Status == dsec.RunSuccess:
			return nil
		}
		return &cli.ExitCodeError{Code: cli.ExitError, Msg: fmt.Sprintf("compilation failed (exit %d)", cr.ReturnCode)}
	}
	rr := resp.RunResult
	if rr == nil {
		if resp.Status == dsec.RunSuccess {
			return nil
		}
		return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: sandboxErrorMsg(resp, "running")}
	}
	stdout.Write(rr.Stdout)
	stderr.Write(rr.Stderr)
	note("program", rr)
	switch {
	case resp.Status == dsec.RunSandboxError || rr.Status == dsec.CommandError:
		return &cli.ExitCodeError{Code: cli.ExitInfra, Msg: sandboxErrorMsg(resp, "running")}
	case rr.Status == dsec.CommandTimeLimitExceeded:
		return &cli.ExitCodeError{Code: cli.ExitTimeout, Msg: "program timed out"}
	case rr.Signal != 0:
		msg := ""
		if rr.OOMKilled {
			msg = "program was killed: out of memory"
		}
		return &cli.ExitCodeError{Code: 128 + rr.Signal, Msg: msg}
	case rr.OOMKilled:
		return &cli.ExitCodeError{Code: max(rr.ReturnCode, 1), Msg: "program was killed: out of memory"}
	case rr.ReturnCode != 0:
		return &cli.ExitCodeError{Code: rr.ReturnCode}
	case resp.Status != dsec.RunSuccess:
		// Exit 0 yet not a success: say what the server said rather than
		// pretend it worked.
		return &cli.ExitCodeError{Code: cli.ExitError, Msg: fmt.Sprintf("call %s: %s", resp.Status, resp.Message)}
	}
	return nil
}

func sandboxErrorMsg(resp *dsec.RunCodeResponse, step string) string {
	msg := resp.Message
	if msg == "" {
		msg = "no detail from the server"
	}
	return fmt.Sprintf("sandbox error while %s: %s", step, msg)
}
