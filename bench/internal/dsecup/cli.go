package dsecup

// The command line of a harness: its flags and how it prints its report.

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// Flags are the flags every harness that starts dsec up has.
type Flags struct {
	JSON, Keep  bool
	Dsec, Agent string // prebuilt binaries, "" to build them
}

// Register defines -json, -keep, -dsec and -agent on the default flag set.
func (f *Flags) Register() {
	flag.BoolVar(&f.JSON, "json", false, "print results as JSON instead of a table")
	flag.BoolVar(&f.Keep, "keep", false, "keep the work dir (data dirs, dsec up logs) for debugging")
	flag.StringVar(&f.Dsec, "dsec", "", "use this dsec binary, and the dsec-cli and dsecd next to it, instead of building ./cmd/dsec, ./cmd/dsec-cli and ./cmd/dsecd (copied into the work dir)")
	flag.StringVar(&f.Agent, "agent", "", "use this dsec-agent binary instead of building ./cmd/dsec-agent (copied into the work dir)")
}

// ParseList parses the comma-separated value of flag name as a selection
// of known names: unknown ones are refused, repeats dropped, order kept.
func ParseList(name, value string, known []string) ([]string, error) {
	var sel []string
	for _, v := range strings.Split(value, ",") {
		v = strings.TrimSpace(v)
		if !slices.Contains(known, v) {
			return nil, fmt.Errorf("-%s: unknown value %q (want %s)", name, v, strings.Join(known, ", "))
		}
		if !slices.Contains(sel, v) {
			sel = append(sel, v)
		}
	}
	return sel, nil
}

// CheckFlags refuses a count flag (name without the dash: value) below 1
// and any argument left after the flags.
func CheckFlags(counts map[string]int) error {
	for name, v := range counts {
		if v < 1 {
			return fmt.Errorf("-%s must be at least 1, got %d", name, v)
		}
	}
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	return nil
}

// PrintReport writes rep to stdout: indented JSON, or a line naming the
// command and its arguments followed by the table print writes.
func PrintReport(asJSON bool, command string, rep any, print func(io.Writer)) error {
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	fmt.Printf("%s %s\n", command, strings.Join(os.Args[1:], " "))
	print(os.Stdout)
	return nil
}
