package main

// The daemon commands (up, server, edge) live in dsecd, so that this binary
// links no server-side package and starts in a few milliseconds. `dsec up
// ARGS...` replaces this process with `dsecd up ARGS...`: same PID, same
// environment, same arguments after the command, so signals, exit codes
// and process supervision behave as if dsec were the daemon.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
)

// isDaemonCmd reports whether name is one of dsecd's commands.
func isDaemonCmd(name string) bool {
	for _, d := range cli.Daemons {
		if d.Name == name {
			return true
		}
	}
	return false
}

// newDaemonCmds lists dsecd's commands in dsec's help. They are reached
// here only when flags come before the command (`dsec --token-file F up`,
// which main's fast path does not catch) or through `dsec help up`.
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
	path, err := findDaemon()
	if err != nil {
		return fmt.Errorf("%s: %w", args[0], err)
	}
	argv := append([]string{path}, args...)
	if err := syscall.Exec(path, argv, os.Environ()); err != nil {
		return fmt.Errorf("%s: exec %s: %w", args[0], path, err)
	}
	panic("unreachable: exec returned without an error")
}

// findDaemon finds dsecd: $DSEC_DAEMON when set, else next to this
// executable (bin/dsec and bin/dsecd from `make build`), else on $PATH.
func findDaemon() (string, error) {
	self, selfErr := os.Executable()
	if p := os.Getenv(cli.DaemonEnv); p != "" {
		if err := checkDaemon(p, self); err != nil {
			return "", fmt.Errorf("$%s=%s: %w", cli.DaemonEnv, p, err)
		}
		return p, nil
	}
	nextTo := cli.DaemonBinary + " next to dsec"
	if selfErr == nil {
		p := filepath.Join(filepath.Dir(self), cli.DaemonBinary)
		if checkDaemon(p, self) == nil {
			return p, nil
		}
		nextTo = p
	}
	if p, err := exec.LookPath(cli.DaemonBinary); err == nil {
		if err := checkDaemon(p, self); err != nil {
			return "", fmt.Errorf("%s on $PATH: %w", p, err)
		}
		return p, nil
	}
	return "", fmt.Errorf("the daemon commands are in a separate binary, %[1]s, and none was found "+
		"($%[2]s is not set, no %[3]s, none on $PATH); build it with `make build` (bin/%[1]s next to bin/dsec) "+
		"or `go build -o DIR/ ./cmd/%[1]s` with DIR dsec's directory, or set $%[2]s to its path",
		cli.DaemonBinary, cli.DaemonEnv, nextTo)
}

// checkDaemon refuses what cannot be dsecd: a missing or non-executable
// file, or this very binary (which would hand over to itself forever).
func checkDaemon(p, self string) error {
	info, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !info.Mode().IsRegular() || info.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("not an executable file")
	}
	if self != "" {
		if me, err := os.Stat(self); err == nil && os.SameFile(me, info) {
			return errors.New("that is dsec itself, not " + cli.DaemonBinary)
		}
	}
	return nil
}
