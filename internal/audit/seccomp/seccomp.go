// Package seccomp builds the syscall filter every sandbox runs under and
// installs it.
//
// The filter is Docker's default profile (github.com/moby/profiles/seccomp),
// resolved for the capabilities a sandbox keeps (caps.DockerDefault), plus
// DSec's own denials of ioctls that copy, share or swap file blocks between
// descriptors. It is compiled to classic BPF in pure Go, once, on the edge:
// compiling costs far more than installing, and creation is the hot path.
// The edge hands the compiled Program to the agent as bytes; the agent
// installs it on all its threads (SECCOMP_FILTER_FLAG_TSYNC) after
// caps.Restrict and before serving requests, so every command it forks
// inherits it.
package seccomp

import (
	"sync"

	"github.com/dsec-dev/dsec/internal/audit/seccomp/filter"
)

// Program is a compiled classic BPF seccomp filter for x86_64.
type Program = filter.Program

// ErrThreadSync: see filter.ErrThreadSync.
var ErrThreadSync = filter.ErrThreadSync

// MaxInstructions is the kernel's limit on a classic BPF program.
const MaxInstructions = filter.MaxInstructions

// Install puts p on every thread of the calling process (see filter.Install).
func Install(p Program) error { return filter.Install(p) }

var defaultProgram = sync.OnceValues(func() (Program, error) {
	pol, err := DefaultPolicy()
	if err != nil {
		return nil, err
	}
	return Compile(pol)
})

// Default returns the sandbox filter (see DefaultPolicy), compiled on first
// use and shared afterwards. Callers must not modify it.
func Default() (Program, error) { return defaultProgram() }
