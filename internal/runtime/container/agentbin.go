package container

import (
	"debug/buildinfo"
	"fmt"
)

// checkAgentBinary refuses an agent that cannot lock a sandbox down. The
// agent restricts every one of its threads at once (capabilities,
// no_new_privs, seccomp with syscall.AllThreadsSyscall), which the Go
// runtime allows only without cgo; an agent built with cgo (plain `go build`
// where a C compiler is present) would fail every create. Saying so once at
// start beats a failure per create. A binary without Go build information
// (not a Go program, or stripped of it) is let through: the first create
// then reports what is wrong with it.
func checkAgentBinary(path string) error {
	info, err := buildinfo.ReadFile(path)
	if err != nil {
		return nil
	}
	for _, s := range info.Settings {
		if s.Key == "CGO_ENABLED" && s.Value == "1" {
			return fmt.Errorf("dsec-agent binary %s was built with cgo (CGO_ENABLED=1): the agent must be built with CGO_ENABLED=0 to restrict all its threads; build with `make build`", path)
		}
	}
	return nil
}
