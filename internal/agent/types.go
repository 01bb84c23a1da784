package agent

import "time"

// The client's vocabulary. It mirrors the runtime's on purpose but is the
// agent's own, so that this package depends on no backend: the container
// backend and the VM backends convert at their edge (the agent protocol is
// the same whatever carries it).

// ExecRequest is one command for the agent to run.
type ExecRequest struct {
	// Argv is the command (Argv[0] looked up in PATH); if empty, Shell is
	// run with /bin/sh -c.
	Argv  []string
	Shell string
	// Env are K=V entries; they override the agent's defaults by key.
	Env []string
	// Cwd and User default to the agent's (see Options); User is a name,
	// uid, name:group or uid:gid resolved from the sandbox's own files.
	Cwd  string
	User string
	// Stdin is sent to the process, which then reads end of file.
	Stdin []byte
	// Timeout kills the exec's whole process tree; zero means none.
	Timeout time.Duration
	// MaxOutputBytes bounds the captured stdout and stderr each; zero
	// means DefaultMaxOutputBytes. A streaming caller still receives all.
	MaxOutputBytes int64
}

// Stream names an output stream of an exec.
type Stream int

// The output streams.
const (
	Stdout Stream = 1
	Stderr Stream = 2
)

// OutputFunc receives an exec's output as it is produced, on the calling
// goroutine. It must not retain data after returning.
type OutputFunc func(s Stream, data []byte)

// ExecResult is what happened to one exec.
type ExecResult struct {
	// ExitCode is the process's; 128+Signal when a signal killed it, as a
	// shell reports.
	ExitCode int
	Signal   int
	Stdout   []byte
	Stderr   []byte
	// StdoutTruncated, StderrTruncated: the stream had more than
	// MaxOutputBytes; the rest was dropped.
	StdoutTruncated bool
	StderrTruncated bool
	Duration        time.Duration
	TimedOut        bool
	// PidsExhausted: the command could not be started because the
	// sandbox's process limit is reached.
	PidsExhausted bool
	// OOMKilled and DiskFull: the sandbox's memory limit killed one of its
	// processes, or its writable layer was full, while the command ran.
	// Only an agent that can tell sets them (Options.Verdict: a VM guest's;
	// a container's backend reads its cgroup and disk on the host).
	OOMKilled bool
	DiskFull  bool
}
