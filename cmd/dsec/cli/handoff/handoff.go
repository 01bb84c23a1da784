// Package handoff finds DSec's other binaries and replaces the running
// process with one of them. `dsec` is a small front binary: it serves
// `dsec run` itself and hands every other command over, by exec(2) (same
// PID, environment and arguments), to dsecd (the daemons: up, server,
// edge) or dsec-cli (every client command). It links only the standard
// library, so that the front starts in a few milliseconds.
package handoff

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// Daemon is a command of dsecd, the daemons' binary. The clients list
// these too and hand them over to dsecd, so that `dsec up` keeps working
// and `dsec --help` still shows it.
type Daemon struct{ Name, Short string }

// Daemons are dsecd's commands.
var Daemons = []Daemon{
	{"up", "Run a server and one edge in one process: a one-node DSec with no configuration"},
	{"server", "Run a control-plane replica (API, IAM, placement); edges heartbeat to it"},
	{"edge", "Run a node agent: own this node's sandboxes, heartbeat to every server"},
}

// IsDaemon reports whether name is one of dsecd's commands.
func IsDaemon(name string) bool {
	for _, d := range Daemons {
		if d.Name == name {
			return true
		}
	}
	return false
}

// The binaries, and the environment variables that point at them.
const (
	DaemonBinary = "dsecd"
	DaemonEnv    = "DSEC_DAEMON"
	ClientBinary = "dsec-cli"
	ClientEnv    = "DSEC_CLI"
)

// Exec replaces this process with path running args (the arguments after
// the program name). It returns only on failure.
func Exec(path string, args []string) error {
	argv := append([]string{path}, args...)
	if err := syscall.Exec(path, argv, os.Environ()); err != nil {
		return fmt.Errorf("exec %s: %w", path, err)
	}
	panic("unreachable: exec returned without an error")
}

// FindDaemon finds dsecd: $DSEC_DAEMON when set, else next to this
// executable (bin/dsec and bin/dsecd from `make build`), else on $PATH.
func FindDaemon() (string, error) {
	return find(DaemonBinary, DaemonEnv, func(nextTo string) error {
		return fmt.Errorf("the daemon commands are in a separate binary, %[1]s, and none was found "+
			"($%[2]s is not set, no %[3]s, none on $PATH); build it with `make build` (bin/%[1]s next to bin/dsec) "+
			"or `go build -o DIR/ ./cmd/%[1]s` with DIR dsec's directory, or set $%[2]s to its path",
			DaemonBinary, DaemonEnv, nextTo)
	})
}

// FindClient finds dsec-cli: $DSEC_CLI when set, else next to this
// executable, else on $PATH.
func FindClient() (string, error) {
	return find(ClientBinary, ClientEnv, func(nextTo string) error {
		return fmt.Errorf("this command needs the full client, a separate binary, %[1]s, and none was found "+
			"($%[2]s is not set, no %[3]s, none on $PATH); build it with `make build` (bin/%[1]s next to bin/dsec) "+
			"or `go build -o DIR/ ./cmd/%[1]s` with DIR dsec's directory, or set $%[2]s to its path",
			ClientBinary, ClientEnv, nextTo)
	})
}

func find(name, env string, notFound func(nextTo string) error) (string, error) {
	self, selfErr := os.Executable()
	if p := os.Getenv(env); p != "" {
		if err := check(p, self, name); err != nil {
			return "", fmt.Errorf("$%s=%s: %w", env, p, err)
		}
		return p, nil
	}
	nextTo := name + " next to dsec"
	if selfErr == nil {
		p := filepath.Join(filepath.Dir(self), name)
		if check(p, self, name) == nil {
			return p, nil
		}
		nextTo = p
	}
	if p, ok := lookPath(name); ok {
		if err := check(p, self, name); err != nil {
			return "", fmt.Errorf("%s on $PATH: %w", p, err)
		}
		return p, nil
	}
	return "", notFound(nextTo)
}

// lookPath is exec.LookPath for a bare name (os/exec is not linked: its
// initialisation would cost the front's start-up).
func lookPath(name string) (string, bool) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, name)
		if info, err := os.Stat(p); err == nil && info.Mode().IsRegular() && info.Mode().Perm()&0o111 != 0 {
			if !filepath.IsAbs(p) {
				// As exec.LookPath: a relative result is refused
				// (exec.ErrDot) rather than run from the current directory.
				return "", false
			}
			return p, true
		}
	}
	return "", false
}

// check refuses what cannot be the binary: a missing or non-executable
// file, or this very binary (which would hand over to itself forever).
func check(p, self, name string) error {
	info, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !info.Mode().IsRegular() || info.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("not an executable file")
	}
	if self != "" {
		if me, err := os.Stat(self); err == nil && os.SameFile(me, info) {
			return errors.New("that is dsec itself, not " + name)
		}
	}
	return nil
}
