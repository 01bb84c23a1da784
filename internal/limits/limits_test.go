package limits

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

func TestExec(t *testing.T) {
	big := strings.Repeat("x", MaxArgString)
	for _, tc := range []struct {
		name    string
		r       *dsecv1.ExecRequest
		mention string // "" means valid
	}{
		{"argv", &dsecv1.ExecRequest{Argv: []string{"echo", "hi"}}, ""},
		{"longest argument", &dsecv1.ExecRequest{Argv: []string{"echo", big}}, ""},
		{"argument one byte longer", &dsecv1.ExecRequest{Argv: []string{"echo", big + "x"}}, "p.argv[1] is"},
		{"too much in all", &dsecv1.ExecRequest{Argv: []string{big, big, big, big, big, big, big, big}}, "p.argv and p.env"},
		{"no command", &dsecv1.ExecRequest{}, "p.argv or p.shell"},
		{"NUL in env value", &dsecv1.ExecRequest{Shell: "true", Env: []string{"A=\x00"}}, "p.env[0] has a NUL byte at offset 2"},
		{"env without =", &dsecv1.ExecRequest{Shell: "true", Env: []string{"A"}}, "must be K=V"},
		{"NUL in cwd", &dsecv1.ExecRequest{Shell: "true", Cwd: "\x00"}, "p.cwd"},
		{"timeout at the limit", &dsecv1.ExecRequest{Shell: "true", Timeout: durationpb.New(MaxExecTimeout)}, ""},
		{"timeout past the limit", &dsecv1.ExecRequest{Shell: "true", Timeout: durationpb.New(MaxExecTimeout + time.Nanosecond)}, "p.timeout"},
		{"timeout past Go's durations", &dsecv1.ExecRequest{Shell: "true", Timeout: &durationpb.Duration{Seconds: 9_300_000_000}}, "p.timeout"},
		{"timeout far negative", &dsecv1.ExecRequest{Shell: "true", Timeout: &durationpb.Duration{Seconds: -9_300_000_000}}, "p.timeout"},
		{"output bound above the ceiling", &dsecv1.ExecRequest{Shell: "true", MaxOutputBytes: 1 << 40}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Exec("p.", tc.r)
			switch {
			case tc.mention == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.mention == "":
			case connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), tc.mention):
				t.Fatalf("error %v, want InvalidArgument naming %q", err, tc.mention)
			}
		})
	}
}

func TestBounds(t *testing.T) {
	if Output(0) != 0 || Output(5) != 5 || Output(1<<40) != MaxOutputBytes {
		t.Error("Output")
	}
	if Read(0) != MaxReadBytes || Read(5) != 5 || Read(1<<40) != MaxReadBytes {
		t.Error("Read")
	}
}

// The decompressor stops at its bound instead of inflating to the end.
func TestGzipBound(t *testing.T) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write(make([]byte, 10<<20))
	zw.Close()
	d := &boundedGzip{max: 1<<20 + 1}
	if err := d.Reset(bytes.NewReader(buf.Bytes())); err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, d)
	if !errors.Is(err, ErrInflate) || n != 1<<20+1 {
		t.Fatalf("inflated %d bytes, %v; want %d and ErrInflate", n, err, 1<<20+1)
	}
	// Reused (Connect pools decompressors) for a small message.
	buf.Reset()
	zw = gzip.NewWriter(&buf)
	zw.Write([]byte("hello"))
	zw.Close()
	if err := d.Reset(bytes.NewReader(buf.Bytes())); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(d); err != nil || string(b) != "hello" {
		t.Fatalf("after reset: %q %v", b, err)
	}
}
