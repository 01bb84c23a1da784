package trajectory_test

import (
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/trajectory"
)

func execRec(outcome string, code int32, stdout, stderr string) *trajectory.Record {
	return &trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{
		Shell: "echo hi", Outcome: outcome, ExitCode: code,
		Stdout: trajectory.NewData([]byte(stdout)), Stderr: trajectory.NewData([]byte(stderr)),
	}}
}

func TestCompare(t *testing.T) {
	readRec := func(data string) *trajectory.Record {
		return &trajectory.Record{Kind: trajectory.KindReadFile, File: &trajectory.File{Path: "/f", Data: trajectory.NewData([]byte(data))}}
	}
	withErr := func(r *trajectory.Record, code string) *trajectory.Record {
		r.Error = &trajectory.Error{Code: code, Message: "boom"}
		return r
	}
	// A record as a log holds it without data: digest and size only.
	bare := func(r *trajectory.Record) *trajectory.Record {
		r.Exec.Stdout.Inline, r.Exec.Stderr.Inline = nil, nil
		return r
	}
	write := func() *trajectory.Record {
		return &trajectory.Record{Kind: trajectory.KindWriteFile, File: &trajectory.File{Path: "/f", Data: trajectory.NewData([]byte("x"))}}
	}
	tests := []struct {
		name          string
		recorded, now *trajectory.Record
		want          []string // substrings, one per difference
	}{
		{"same exec", execRec("ok", 0, "hello\n", ""), execRec("ok", 0, "hello\n", ""), nil},
		{"same exec, recorded without inline data", bare(execRec("ok", 0, "hello\n", "")), execRec("ok", 0, "hello\n", ""), nil},
		{"stdout", execRec("ok", 0, "hello\n", ""), execRec("ok", 0, "world\n", ""),
			[]string{`stdout differs (recorded sha256:`}},
		{"stderr and exit code", execRec("failed", 1, "", "a"), execRec("failed", 2, "", "b"),
			[]string{"exit code differs: recorded 1, now 2", "stderr differs"}},
		{"outcome", execRec("ok", 0, "", ""), execRec("failed", 3, "", ""),
			[]string{"outcome differs: recorded ok, now failed", "exit code differs"}},
		{"signal and timeout", execRec("timeout", -1, "", ""),
			func() *trajectory.Record {
				r := execRec("timeout", -1, "", "")
				r.Exec.Signal, r.Exec.TimedOut = 9, true
				return r
			}(),
			[]string{"signal differs: recorded 0, now 9", "timed_out differs: recorded false, now true"}},
		{"same read", readRec("abc"), readRec("abc"), nil},
		{"read", readRec("abc"), readRec("abd"), []string{"data read differs"}},
		{"same error", withErr(readRec(""), "not_found"), withErr(readRec(""), "not_found"), nil},
		{"error code", withErr(readRec(""), "not_found"), withErr(readRec(""), "permission_denied"),
			[]string{"error differs: recorded not_found, now permission_denied"}},
		{"error now", readRec("abc"), withErr(readRec(""), "not_found"), []string{"failed now with not_found"}},
		{"error recorded", withErr(readRec(""), "not_found"), readRec("abc"), []string{"recorded error not_found"}},
		{"write", write(), write(), nil},
		{"kind", write(), readRec("x"), []string{"kind differs"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := trajectory.Compare(tt.recorded, tt.now)
			if len(got) != len(tt.want) {
				t.Fatalf("Compare = %q, want %d differences like %q", got, len(tt.want), tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("difference %d = %q, want it to contain %q", i, got[i], w)
				}
			}
		})
	}
}

func TestCompareShowsSmallOutputs(t *testing.T) {
	got := trajectory.Compare(execRec("ok", 0, "1700000000\n", ""), execRec("ok", 0, "1700000001\n", ""))
	if len(got) != 1 || !strings.Contains(got[0], `11 bytes "1700000000\n"`) || !strings.Contains(got[0], `11 bytes "1700000001\n"`) {
		t.Fatalf("Compare = %q, want both outputs quoted with their sizes", got)
	}
	big := strings.Repeat("x", 1000)
	got = trajectory.Compare(execRec("ok", 0, big, ""), execRec("ok", 0, big+"y", ""))
	if len(got) != 1 || strings.Contains(got[0], "xxxx") || !strings.Contains(got[0], "1000 bytes") || !strings.Contains(got[0], "1001 bytes") {
		t.Fatalf("Compare of large outputs = %q, want sizes and digests without the bytes", got)
	}
}

func TestReplayOrderAndSkips(t *testing.T) {
	recs := []*trajectory.Record{
		{Seq: 0, Kind: trajectory.KindCreate},
		{Seq: 2, Kind: trajectory.KindExec, Exec: &trajectory.Exec{Shell: "b"}},
		{Seq: 1, Kind: trajectory.KindWriteFile, File: &trajectory.File{Path: "/a"}},
		{Seq: 3, Kind: trajectory.KindReward, Reward: &trajectory.Reward{Value: 1}},
		{Seq: 4, Kind: trajectory.KindReadFile, File: &trajectory.File{Path: "/a"}},
		{Seq: 4, Kind: trajectory.KindLost, Reason: "node restarted"},
	}
	var seqs []uint64
	for _, r := range trajectory.ReplayOrder(recs) {
		seqs = append(seqs, r.Seq)
	}
	if want := []uint64{1, 2, 4}; len(seqs) != len(want) || seqs[0] != 1 || seqs[1] != 2 || seqs[2] != 4 {
		t.Fatalf("ReplayOrder seqs = %v, want %v", seqs, want)
	}
	if got := trajectory.SkipReason(&trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Outcome: "infra_error"}}); got != "infra_error recorded" {
		t.Fatalf("SkipReason(infra_error) = %q", got)
	}
	if got := trajectory.SkipReason(execRec("failed", 1, "", "")); got != "" {
		t.Fatalf("SkipReason(failed) = %q, want none", got)
	}
	// An operation replay cannot perform is a step, reported as skipped.
	other := &trajectory.Record{Seq: 5, Kind: "rollback"}
	if steps := trajectory.ReplayOrder(append(recs, other)); len(steps) != 4 || steps[3] != other {
		t.Fatalf("ReplayOrder with a rollback = %v, want it as the last step", steps)
	}
	if got := trajectory.SkipReason(other); got != "rollback is not replayed" {
		t.Fatalf("SkipReason(rollback) = %q", got)
	}
}

func TestMissing(t *testing.T) {
	w := &trajectory.Record{Kind: trajectory.KindWriteFile, File: &trajectory.File{Path: "/f", Data: trajectory.NewData([]byte("data"))}}
	if m := trajectory.Missing(w); len(m) != 0 {
		t.Fatalf("Missing with inline data = %q", m)
	}
	w.File.Data.Inline = nil
	if m := trajectory.Missing(w); len(m) != 1 || !strings.HasPrefix(m[0], "data sha256:") {
		t.Fatalf("Missing without inline data = %q", m)
	}
	e := execRec("ok", 0, "", "")
	e.Exec.Stdin = &trajectory.Data{Digest: "sha256:00", Size: 5}
	if m := trajectory.Missing(e); len(m) != 1 || !strings.HasPrefix(m[0], "stdin ") {
		t.Fatalf("Missing stdin = %q", m)
	}
	// Outputs are compared by digest: they need not be at hand.
	e.Exec.Stdin = nil
	e.Exec.Stdout.Inline = nil
	if m := trajectory.Missing(e); len(m) != 0 {
		t.Fatalf("Missing for an exec without inline stdout = %q", m)
	}
}

func TestTitle(t *testing.T) {
	tests := []struct {
		rec  *trajectory.Record
		want string
	}{
		{&trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Argv: []string{"sh", "-c", "echo x >> /tmp/f"}}}, "exec `sh -c 'echo x >> /tmp/f'`"},
		{&trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Argv: []string{"echo", "it's"}}}, `exec ` + "`" + `echo 'it'\''s'` + "`"},
		{&trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Shell: "date +%s%N"}}, "exec `date +%s%N`"},
		{&trajectory.Record{Kind: trajectory.KindWriteFile, File: &trajectory.File{Path: "/tmp/a"}}, "write_file /tmp/a"},
		{&trajectory.Record{Kind: trajectory.KindReward, Reward: &trajectory.Reward{Value: 0.5}}, "reward 0.5"},
		{&trajectory.Record{Kind: trajectory.KindDestroy}, "destroy"},
	}
	for _, tt := range tests {
		if got := tt.rec.Title(); got != tt.want {
			t.Errorf("Title = %q, want %q", got, tt.want)
		}
	}
	long := &trajectory.Record{Kind: trajectory.KindExec, Exec: &trajectory.Exec{Shell: strings.Repeat("a", 200)}}
	if got := long.Title(); len(got) > 70 || !strings.HasSuffix(got, "...`") {
		t.Errorf("Title of a long command = %q, want it clipped", got)
	}
}

func TestCompareLayers(t *testing.T) {
	a := []string{"sha256:" + strings.Repeat("a", 64), "sha256:" + strings.Repeat("b", 64)}
	if d := trajectory.CompareLayers(a, []string{a[0], a[1]}); d != "" {
		t.Fatalf("CompareLayers of equal lists = %q", d)
	}
	d := trajectory.CompareLayers(a, []string{a[0], "sha256:" + strings.Repeat("c", 64)})
	if !strings.Contains(d, "recorded 2 [sha256:aaaaaaaaaaaa sha256:bbbbbbbbbbbb]") || !strings.Contains(d, "sha256:cccccccccccc") {
		t.Fatalf("CompareLayers = %q", d)
	}
}

func TestReadAll(t *testing.T) {
	rec := &trajectory.Record{Sandbox: "n-1", Kind: trajectory.KindCreate, Environment: &trajectory.Environment{Image: "x:1"}}
	line, err := rec.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	recs, err := trajectory.ReadAll(strings.NewReader(string(line) + "\n" + string(line) + "\n"))
	if err != nil || len(recs) != 2 || recs[1].Environment.Image != "x:1" {
		t.Fatalf("ReadAll = %v, %v", recs, err)
	}
	if _, err := trajectory.ReadAll(strings.NewReader(string(line) + "\n{\"bogus\":1}\n")); err == nil || !strings.HasPrefix(err.Error(), "line 2:") {
		t.Fatalf("ReadAll of a bad line: %v, want an error naming line 2", err)
	}
}
