package main

import (
	"fmt"
	"strings"

	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
	"github.com/dsec-dev/dsec/internal/ids"
)

// parseLabels turns repeated k=v flags into a map.
func parseLabels(flag string, kvs []string) (map[string]string, error) {
	return flagval.ParseLabels(flag, kvs)
}

// checkEnv validates repeated K=V flags.
func checkEnv(flag string, kvs []string) error { return flagval.CheckEnv(flag, kvs) }

// location is one side of `dsec sandbox cp`: a local path, "-" for
// stdin/stdout, or a path inside a sandbox.
type location struct {
	Sandbox string // empty for a local path
	Path    string
}

// parseLocation reads "ID:PATH" as a sandbox path when ID is a well-formed
// sandbox ID, and anything else (including local paths with colons) as a
// local path.
func parseLocation(s string) (location, error) {
	if s == "" {
		return location{}, fmt.Errorf("empty path")
	}
	if id, p, ok := strings.Cut(s, ":"); ok {
		if _, err := ids.NodeOf(id); err == nil {
			if p == "" {
				return location{}, fmt.Errorf("%q: empty path after sandbox id", s)
			}
			if !strings.HasPrefix(p, "/") {
				p = "/" + p
			}
			return location{Sandbox: id, Path: p}, nil
		}
	}
	return location{Path: s}, nil
}

// parseCopyArgs checks that exactly one side of a copy is in a sandbox.
func parseCopyArgs(src, dst string) (from, to location, err error) {
	if from, err = parseLocation(src); err != nil {
		return from, to, fmt.Errorf("SRC: %w", err)
	}
	if to, err = parseLocation(dst); err != nil {
		return from, to, fmt.Errorf("DST: %w", err)
	}
	switch {
	case from.Sandbox != "" && to.Sandbox != "":
		return from, to, fmt.Errorf("both SRC and DST are in sandboxes; copy through a local file")
	case from.Sandbox == "" && to.Sandbox == "":
		return from, to, fmt.Errorf("neither SRC nor DST is in a sandbox; one must be ID:PATH")
	}
	return from, to, nil
}
