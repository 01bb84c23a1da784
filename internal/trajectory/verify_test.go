package trajectory_test

import (
	"bytes"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/trajectory"
)

// sampleJSONL writes two interleaved trajectories through a real log and
// returns the segment file's lines:
//
//	1 create a   2 create b   3 a seq 1   4 b seq 1
//	5 a seq 2    6 b seq 2    7 a seq 3
func sampleJSONL(t *testing.T) [][]byte {
	t.Helper()
	l, opts := newLog(t)
	create(t, l, "a")
	create(t, l, "b")
	exec(t, l, "a", 1, []byte("a-one"), "echo", "a1")
	exec(t, l, "b", 1, []byte("b-one"), "echo", "b1")
	exec(t, l, "a", 2, []byte("a-two"), "echo", "a2")
	exec(t, l, "b", 2, []byte("b-two"), "echo", "b2")
	exec(t, l, "a", 3, []byte("a-three"), "echo", "a3")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	segs := segments(t, opts.Dir)
	if len(segs) != 1 {
		t.Fatalf("%d segments", len(segs))
	}
	b := recordsOf(readFile(t, segs[0]))
	lines := bytes.Split(bytes.TrimSuffix(b, []byte("\n")), []byte("\n"))
	if len(lines) != 7 {
		t.Fatalf("%d lines", len(lines))
	}
	return lines
}

// edit parses line, changes it and re-encodes it without re-hashing.
func edit(t *testing.T, line []byte, change func(r *trajectory.Record)) []byte {
	t.Helper()
	r, err := trajectory.Parse(line)
	if err != nil {
		t.Fatal(err)
	}
	change(r)
	b, err := r.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func rehash(t *testing.T, r *trajectory.Record) {
	t.Helper()
	h, err := r.ComputeHash()
	if err != nil {
		t.Fatal(err)
	}
	r.Hash = h
}

func TestVerifyAcceptsLogOutput(t *testing.T) {
	lines := sampleJSONL(t)
	for name, in := range map[string][]byte{
		"joined":           joinLines(lines),
		"trailing newline": append(joinLines(lines), '\n'),
	} {
		n, err := trajectory.Verify(bytes.NewReader(in))
		if err != nil || n != 7 {
			t.Errorf("%s: %d records, %v", name, n, err)
		}
	}
	if n, err := trajectory.Verify(strings.NewReader("")); err != nil || n != 0 {
		t.Errorf("empty input: %d %v", n, err)
	}
	// One sandbox's records alone verify as well.
	var a [][]byte
	for _, i := range []int{0, 2, 4, 6} {
		a = append(a, lines[i])
	}
	verifyLines(t, a)
}

func TestVerifyDetectsEdits(t *testing.T) {
	type want struct {
		line    int
		sandbox string
		seq     uint64
		reason  string
	}
	cases := map[string]struct {
		edit func(t *testing.T, lines [][]byte) [][]byte
		want want
	}{
		"stdout bytes changed": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[4] = edit(t, lines[4], func(r *trajectory.Record) { r.Exec.Stdout.Inline = []byte("a-TWO") })
				return lines
			},
			want{5, "a", 2, "digest"},
		},
		"stdout shortened": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[2] = edit(t, lines[2], func(r *trajectory.Record) { r.Exec.Stdout.Inline = r.Exec.Stdout.Inline[:2] })
				return lines
			},
			want{3, "a", 1, "digest"},
		},
		"exit code changed": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[3] = edit(t, lines[3], func(r *trajectory.Record) { r.Exec.ExitCode = 1 })
				return lines
			},
			want{4, "b", 1, "hash"},
		},
		"creation environment changed": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[1] = edit(t, lines[1], func(r *trajectory.Record) { r.Environment.Image = "evil:latest" })
				return lines
			},
			want{2, "b", 0, "hash"},
		},
		"line deleted": {
			func(t *testing.T, lines [][]byte) [][]byte {
				return slices.Delete(lines, 4, 5) // a's seq 2
			},
			// a's seq 3, now line 6, no longer chains.
			want{6, "a", 3, "chain"},
		},
		"records of a sandbox swapped": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[2], lines[4] = lines[4], lines[2]
				return lines
			},
			want{3, "a", 2, "chain"},
		},
		"edited and re-hashed without fixing the chain": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[4] = edit(t, lines[4], func(r *trajectory.Record) { r.Exec.ExitCode = 9; rehash(t, r) })
				return lines
			},
			// The edited record verifies on its own; the next one of a
			// no longer chains to it.
			want{7, "a", 3, "chain"},
		},
		"unknown field added": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[5] = append([]byte(`{"extra":true,`), lines[5][1:]...)
				return lines
			},
			want{6, "b", 2, "not a trajectory record"},
		},
		"creation record missing": {
			func(t *testing.T, lines [][]byte) [][]byte {
				return lines[1:]
			},
			// Line 2 is now a's seq 1.
			want{2, "a", 1, "creation record"},
		},
		"sequence number twice": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[6] = edit(t, lines[6], func(r *trajectory.Record) { r.Seq = 2; rehash(t, r) })
				return lines
			},
			want{7, "a", 2, "twice"},
		},
		"not json": {
			func(t *testing.T, lines [][]byte) [][]byte {
				lines[3] = []byte("hello")
				return lines
			},
			want{4, "", 0, "not a trajectory record"},
		},
		"empty line": {
			func(t *testing.T, lines [][]byte) [][]byte {
				return slices.Insert(lines, 3, []byte{})
			},
			want{4, "", 0, "not a trajectory record"},
		},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			lines := c.edit(t, sampleJSONL(t))
			n, err := trajectory.Verify(bytes.NewReader(joinLines(lines)))
			var ve *trajectory.VerifyError
			if !errors.As(err, &ve) {
				t.Fatalf("Verify: %v, want a *VerifyError", err)
			}
			got := want{ve.Line, ve.Sandbox, ve.Seq, ve.Reason}
			if got.line != c.want.line || got.sandbox != c.want.sandbox || got.seq != c.want.seq || !strings.Contains(got.reason, c.want.reason) {
				t.Fatalf("VerifyError %+v, want line %d sandbox %q seq %d reason containing %q",
					ve, c.want.line, c.want.sandbox, c.want.seq, c.want.reason)
			}
			if n != c.want.line-1 {
				t.Fatalf("Verify counted %d good records before line %d", n, c.want.line)
			}
			msg := err.Error()
			if !strings.Contains(msg, "line ") || (ve.Sandbox != "" && !strings.Contains(msg, "sandbox "+ve.Sandbox)) {
				t.Fatalf("error message %q does not name the record", msg)
			}
		})
	}
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
