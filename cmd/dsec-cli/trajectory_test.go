package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// chain hash-chains recs as sandbox id's trajectory and returns the JSONL.
func chain(t *testing.T, id string, recs ...*trajectory.Record) string {
	t.Helper()
	var b strings.Builder
	prev := ""
	for _, r := range recs {
		r.Sandbox, r.Prev = id, prev
		r.Start, r.End = "2026-01-02T03:04:05.000000001Z", "2026-01-02T03:04:05.002000001Z"
		h, err := r.ComputeHash()
		if err != nil {
			t.Fatal(err)
		}
		r.Hash, prev = h, h
		line, err := r.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		b.Write(line)
		b.WriteByte('\n')
	}
	return b.String()
}

const testSandbox = "n1-0123456789abcdef"

func sampleTrajectory(t *testing.T) string {
	return chain(t, testSandbox,
		&trajectory.Record{Seq: 0, Kind: trajectory.KindCreate, Environment: &trajectory.Environment{
			Backend: "container", Image: "busybox:latest", MilliCPU: 500,
			Layers: []string{"sha256:" + strings.Repeat("a", 64), "sha256:" + strings.Repeat("b", 64)}}},
		&trajectory.Record{Seq: 1, Kind: trajectory.KindWriteFile, File: &trajectory.File{Path: "/tmp/x", Mode: 0o644, Data: trajectory.NewData([]byte("hi\n"))}},
		&trajectory.Record{Seq: 2, Kind: trajectory.KindExec, Exec: &trajectory.Exec{Argv: []string{"cat", "/tmp/x"},
			Outcome: "ok", Stdout: trajectory.NewData([]byte("hi\n")), Stderr: trajectory.NewData(nil)}},
		// An event carries the seq of the step it follows.
		&trajectory.Record{Seq: 2, Kind: trajectory.KindDestroy, Reason: "destroyed on request"},
	)
}

// runCLI runs the CLI in-process and returns stdout, the error's text and
// the exit code.
func runCLI(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	root := newRoot()
	root.SetArgs(args)
	var out, errb bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errb)
	err := root.Execute()
	msg := errb.String()
	if err != nil {
		msg += err.Error()
	}
	return out.String(), msg, report(err)
}

func TestTrajectoryFileCommands(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.jsonl")
	if err := os.WriteFile(good, []byte(sampleTrajectory(t)), 0o644); err != nil {
		t.Fatal(err)
	}
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	edited := write("edited.jsonl", strings.Replace(sampleTrajectory(t), `"path":"/tmp/x"`, `"path":"/tmp/y"`, 1))
	lines := strings.SplitAfter(sampleTrajectory(t), "\n")
	withoutData := write("nodata.jsonl", strings.Replace(sampleTrajectory(t), `,"inline":"aGkK"`, "", 1))
	other := chain(t, "n1-ffffffffffffffff", &trajectory.Record{Kind: trajectory.KindCreate, Environment: &trajectory.Environment{Image: "x:1"}})
	twoSandboxes := write("two.jsonl", lines[0]+other+strings.Join(lines[1:], ""))

	tests := []struct {
		name       string
		args       []string
		code       int
		out, inErr string
	}{
		{"verify", []string{"trajectory", "verify", good}, 0, "ok: 4 records\n", ""},
		{"verify edited", []string{"trajectory", "verify", edited}, cli.ExitError, "", "line 2 (sandbox " + testSandbox + ", seq 1): hash"},
		{"verify empty", []string{"trajectory", "verify", write("empty.jsonl", "")}, cli.ExitError, "", "no trajectory records"},
		{"verify two sandboxes", []string{"trajectory", "verify", twoSandboxes}, 0, "ok: 5 records\n", ""},
		{"verify missing file", []string{"trajectory", "verify", filepath.Join(dir, "nosuch")}, cli.ExitUsage, "", "no such file, and not a sandbox ID"},
		{"verify directory", []string{"trajectory", "verify", dir}, cli.ExitUsage, "", "is a directory"},
		{"log", []string{"sandbox", "log", good}, 0, "SEQ", ""},
		{"log json", []string{"sandbox", "log", "--json", good}, 0, sampleTrajectory(t), ""},
		{"log step", []string{"sandbox", "log", good, "--step", "2"}, 0, `"kind": "exec"`, ""},
		{"log step json", []string{"sandbox", "log", good, "--step", "2", "--json"}, 0, lines[2], ""},
		{"log step missing", []string{"sandbox", "log", good, "--step", "7"}, cli.ExitError, "", "seq 7 is not in the trajectory"},
		{"log two sandboxes", []string{"sandbox", "log", twoSandboxes}, cli.ExitError, "", "more than one sandbox"},
		{"replay edited", []string{"replay", edited}, cli.ExitError, "", "refusing to replay"},
		{"replay without data", []string{"replay", withoutData}, cli.ExitError, "", "seq 1 (write_file /tmp/x) lacks its data"},
		{"replay two sandboxes", []string{"replay", twoSandboxes}, cli.ExitError, "", "more than one sandbox"},
		{"exec seq 0", []string{"sandbox", "exec", "--seq", "0", testSandbox, "--", "true"}, cli.ExitUsage, "", "--seq 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, msg, code := runCLI(t, tt.args...)
			if code != tt.code || !strings.Contains(out, tt.out) || !strings.Contains(msg, tt.inErr) {
				t.Fatalf("dsec %s: exit %d, stdout %q, error %q; want exit %d, stdout with %q, error with %q",
					strings.Join(tt.args, " "), code, out, msg, tt.code, tt.out, tt.inErr)
			}
		})
	}
}

func TestLogOutput(t *testing.T) {
	file := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(file, []byte(sampleTrajectory(t)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, msg, code := runCLI(t, "sandbox", "log", file)
	if code != 0 {
		t.Fatalf("log: exit %d: %s", code, msg)
	}
	rows := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	want := [][]string{
		{"SEQ", "KIND", "START", "DURATION", "SUMMARY"},
		{"0", "create", "2ms", "busybox:latest (container, 2 layers)"},
		{"1", "write_file", "2ms", "/tmp/x 3B"},
		{"2", "exec", "2ms", "`cat /tmp/x`: exit 0, stdout 3B"},
		{"2", "destroy", "2ms", "destroyed on request"},
	}
	if len(rows) != len(want) {
		t.Fatalf("log printed %d rows, want %d:\n%s", len(rows), len(want), out)
	}
	for i, w := range want {
		if f := strings.Fields(rows[i]); f[0] != w[0] || f[1] != w[1] {
			t.Errorf("row %d = %q, want %s %s", i, rows[i], w[0], w[1])
		}
		for _, s := range w[2:] {
			if !strings.Contains(rows[i], s) {
				t.Errorf("row %d = %q, want %q in it", i, rows[i], s)
			}
		}
	}

	// --step picks the operation, not the event sharing its seq, and shows
	// the provenance.
	out, msg, code = runCLI(t, "sandbox", "log", file, "--step", "2")
	if code != 0 {
		t.Fatalf("log --step 2: exit %d: %s", code, msg)
	}
	for _, s := range []string{
		`"kind": "exec"`, "stdout:\n  hi\n", "provenance:", "sandbox:   " + testSandbox, "step:      seq 2, exec `cat /tmp/x`",
		"chain:     verified (4 records)", "backend:   container", "image:     busybox:latest", "resources: cpu 0.5",
		"layers:    1. sha256:" + strings.Repeat("a", 64), "2. sha256:" + strings.Repeat("b", 64),
	} {
		if !strings.Contains(out, s) {
			t.Errorf("log --step 2 lacks %q:\n%s", s, out)
		}
	}
	if strings.Contains(out, `"kind": "destroy"`) {
		t.Errorf("log --step 2 printed the destroy event:\n%s", out)
	}
}
