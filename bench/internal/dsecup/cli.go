package dsecup

// The command line of a harness: its flags and how it prints its report.

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

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
