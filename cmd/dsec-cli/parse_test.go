package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

func TestParseLabels(t *testing.T) {
	got, err := parseLabels("label", []string{"a=1", "b=x=y", "empty=", "a=1"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"a": "1", "b": "x=y", "empty": ""}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("label %q = %q, want %q", k, got[k], v)
		}
	}
	if m, err := parseLabels("label", nil); err != nil || m != nil {
		t.Errorf("no labels: got %v, %v; want nil map", m, err)
	}
	for _, bad := range [][]string{{"novalue"}, {"=v"}, {"a=1", "a=2"}} {
		if _, err := parseLabels("label", bad); err == nil || !strings.Contains(err.Error(), "--label") {
			t.Errorf("parseLabels(%q): err %v, want an error naming --label", bad, err)
		}
	}
}

func TestParseCopyArgs(t *testing.T) {
	const id = "node-1-0123456789abcdef"
	for _, tc := range []struct {
		src, dst     string
		from, to     location
		errSubstring string
	}{
		{src: "local.txt", dst: id + ":/tmp/x", from: location{Path: "local.txt"}, to: location{Sandbox: id, Path: "/tmp/x"}},
		{src: id + ":/etc/hostname", dst: ".", from: location{Sandbox: id, Path: "/etc/hostname"}, to: location{Path: "."}},
		{src: id + ":etc/passwd", dst: "-", from: location{Sandbox: id, Path: "/etc/passwd"}, to: location{Path: "-"}},
		{src: "-", dst: id + ":/dir/", from: location{Path: "-"}, to: location{Sandbox: id, Path: "/dir/"}},
		// A colon in a local path that is not after a sandbox ID stays local.
		{src: "a:b.txt", dst: id + ":/x", from: location{Path: "a:b.txt"}, to: location{Sandbox: id, Path: "/x"}},
		{src: id + ":/a", dst: id + ":/b", errSubstring: "both"},
		{src: "a", dst: "b", errSubstring: "neither"},
		{src: id + ":", dst: "b", errSubstring: "empty path"},
		{src: "", dst: id + ":/b", errSubstring: "SRC"},
	} {
		from, to, err := parseCopyArgs(tc.src, tc.dst)
		if tc.errSubstring != "" {
			if err == nil || !strings.Contains(err.Error(), tc.errSubstring) {
				t.Errorf("cp %q %q: err %v, want one containing %q", tc.src, tc.dst, err, tc.errSubstring)
			}
			continue
		}
		if err != nil || from != tc.from || to != tc.to {
			t.Errorf("cp %q %q = %+v, %+v, %v; want %+v, %+v", tc.src, tc.dst, from, to, err, tc.from, tc.to)
		}
	}
}

// parseCreate parses args with the flags of `sandbox create`.
func parseCreate(t *testing.T, args []string) (*createFlags, error) {
	t.Helper()
	c := &cobra.Command{Use: "create"}
	var f createFlags
	f.register(c)
	return &f, c.ParseFlags(args)
}

func TestCreateFlagsSpec(t *testing.T) {
	f, err := parseCreate(t, []string{"--image", "busybox:latest", "--toolkit", "py:3", "--toolkit", "git:2",
		"--cpu", "0.5", "--memory", "1GiB", "--label", "run=7", "--label", "task=a",
		"--ttl", "1h", "--idle-timeout", "90s"})
	if err != nil {
		t.Fatal(err)
	}
	spec, err := f.spec()
	if err != nil {
		t.Fatal(err)
	}
	if spec.Image != "busybox:latest" || len(spec.Toolkits) != 2 || spec.Toolkits[1] != "git:2" ||
		spec.Resources.MilliCPU != 500 || spec.Resources.MemoryBytes != 1<<30 ||
		spec.Labels["run"] != "7" || spec.Labels["task"] != "a" ||
		spec.TTL.String() != "1h0m0s" || spec.IdleTimeout.String() != "1m30s" || spec.Backend != "container" {
		t.Errorf("spec = %+v", spec)
	}

	for _, bad := range [][]string{
		{},                                  // no --image
		{"--image", "x", "--cpu", "half"},   // bad cpu
		{"--image", "x", "--memory", "1q"},  // bad size
		{"--image", "x", "--label", "nope"}, // bad label
		{"--image", "x", "--ttl", "-1s"},    // negative ttl
	} {
		h, err := parseCreate(t, bad)
		if err != nil {
			t.Fatalf("%q: %v", bad, err)
		}
		_, err = h.spec()
		var ue cli.UsageError
		if !errors.As(err, &ue) {
			t.Errorf("%q: err %v, want a usage error", bad, err)
		}
	}
}

func TestResultExit(t *testing.T) {
	for _, tc := range []struct {
		res  dsec.ExecResult
		want int
	}{
		{dsec.ExecResult{Outcome: dsec.OutcomeOK}, 0},
		{dsec.ExecResult{Outcome: dsec.OutcomeFailed, ExitCode: 3}, 3},
		{dsec.ExecResult{Outcome: dsec.OutcomeFailed, Signal: 9}, 137},
		{dsec.ExecResult{Outcome: dsec.OutcomeTimeout, TimedOut: true, Signal: 9}, cli.ExitTimeout},
		{dsec.ExecResult{Outcome: dsec.OutcomeInfraError, InfraError: "node gone"}, cli.ExitInfra},
	} {
		if got := report(resultExit(&tc.res)); got != tc.want {
			t.Errorf("%+v: exit %d, want %d", tc.res, got, tc.want)
		}
	}
}

func TestUsageErrorsExit2(t *testing.T) {
	for _, args := range [][]string{
		{"sandbox", "exec", "id-0123456789abcdef"},     // no command
		{"sandbox", "cp", "a", "b"},                    // no sandbox side
		{"run", "--image", "x"},                        // no command
		{"tenant", "create", "t", "--max-cpu", "lots"}, // bad cpu
		{"sandbox", "ls", "--bogus"},                   // unknown flag
	} {
		root := newRoot()
		root.SetArgs(args)
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		err := root.Execute()
		if got := report(err); got != cli.ExitUsage {
			t.Errorf("%q: exit %d (err %v), want %d", args, got, err, cli.ExitUsage)
		}
	}
}
