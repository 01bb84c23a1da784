package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/dsec-dev/dsec/internal/ids"
)

// parseCPU turns a core count ("1", "0.5", "2.25") into milliCPU.
func parseCPU(flag, s string) (int64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("--%s %q: want a number of cores such as 1 or 0.5", flag, s)
	}
	if f < 0 {
		return 0, fmt.Errorf("--%s %q: must not be negative", flag, s)
	}
	m := math.Round(f * 1000)
	if f > 0 && m < 1 {
		return 0, fmt.Errorf("--%s %q: smallest unit is 0.001 cores", flag, s)
	}
	if m > math.MaxInt64/2 {
		return 0, fmt.Errorf("--%s %q: too large", flag, s)
	}
	return int64(m), nil
}

// sizeUnits maps suffixes (lower case) to multipliers. Single letters and
// "kb"-style forms are binary, as in docker and Kubernetes "Gi": nobody
// means 10^9 bytes when giving a sandbox "1g" of memory.
var sizeUnits = []struct {
	suffix string
	mult   int64
}{
	{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"tib", 1 << 40},
	{"ki", 1 << 10}, {"mi", 1 << 20}, {"gi", 1 << 30}, {"ti", 1 << 40},
	{"kb", 1 << 10}, {"mb", 1 << 20}, {"gb", 1 << 30}, {"tb", 1 << 40},
	{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"t", 1 << 40},
	{"b", 1},
}

// parseSize turns "512m", "1g", "1GiB", "1.5g" or a plain byte count into
// bytes.
func parseSize(flag, s string) (int64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	mult := int64(1)
	for _, u := range sizeUnits {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	f, err := strconv.ParseFloat(t, 64)
	if t == "" || err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("--%s %q: want a size such as 512m, 1g, 1GiB or a byte count", flag, s)
	}
	if f < 0 {
		return 0, fmt.Errorf("--%s %q: must not be negative", flag, s)
	}
	b := f * float64(mult)
	if b >= math.MaxInt64 {
		return 0, fmt.Errorf("--%s %q: too large", flag, s)
	}
	return int64(math.Round(b)), nil
}

// parseLabels turns repeated k=v flags into a map.
func parseLabels(flag string, kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" {
			return nil, fmt.Errorf("--%s %q: want KEY=VALUE", flag, kv)
		}
		if old, dup := m[k]; dup && old != v {
			return nil, fmt.Errorf("--%s %q: key %q given twice", flag, kv, k)
		}
		m[k] = v
	}
	return m, nil
}

// checkEnv validates repeated K=V flags.
func checkEnv(flag string, kvs []string) error {
	for _, kv := range kvs {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fmt.Errorf("--%s %q: want KEY=VALUE", flag, kv)
		}
	}
	return nil
}

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

func validNode(id string) error { return ids.ValidNode(id) }
