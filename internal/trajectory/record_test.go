package trajectory_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

func fullRecord() *trajectory.Record {
	return &trajectory.Record{
		Sandbox: "sb", Seq: 3, Kind: trajectory.KindExec, RequestID: "r",
		Start: trajectory.Timestamp(t0), End: trajectory.Timestamp(t0.Add(time.Second)),
		Exec: &trajectory.Exec{
			Argv:     []string{"cat"},
			Stdin:    trajectory.NewData([]byte("input")),
			Outcome:  "exited",
			ExitCode: 0,
			Stdout:   trajectory.NewData([]byte("output <&>")),
			Stderr:   trajectory.NewData([]byte("errors")),
		},
		Prev: "sha256:" + strings.Repeat("0", 64),
	}
}

// The hash covers digests and sizes, never inline copies.
func TestHashIgnoresInline(t *testing.T) {
	withData := fullRecord()
	h1, err := withData.ComputeHash()
	if err != nil {
		t.Fatal(err)
	}
	bare := fullRecord()
	bare.Exec.Stdin.Inline, bare.Exec.Stdout.Inline, bare.Exec.Stderr.Inline = nil, nil, nil
	h2, err := bare.ComputeHash()
	if err != nil {
		t.Fatal(err)
	}
	if h1 != h2 {
		t.Fatalf("hash with inline data %s, without %s", h1, h2)
	}
	// ComputeHash does not touch the record's data.
	if string(withData.Exec.Stdout.Inline) != "output <&>" {
		t.Fatal("ComputeHash dropped the inline data of its record")
	}
	// Same for file data.
	f1 := &trajectory.Record{Sandbox: "sb", Seq: 1, Kind: trajectory.KindWriteFile,
		File: &trajectory.File{Path: "/a", Data: trajectory.NewData([]byte("content"))}}
	f2 := &trajectory.Record{Sandbox: "sb", Seq: 1, Kind: trajectory.KindWriteFile,
		File: &trajectory.File{Path: "/a", Data: &trajectory.Data{Digest: f1.File.Data.Digest, Size: 7}}}
	if a, b := mustHash(t, f1), mustHash(t, f2); a != b {
		t.Fatalf("file record: hash with inline data %s, without %s", a, b)
	}
	// The stored hash field itself is not covered.
	withData.Hash = "sha256:whatever"
	if mustHash(t, withData) != h1 {
		t.Fatal("ComputeHash depends on the Hash field")
	}
}

func mustHash(t *testing.T, r *trajectory.Record) string {
	t.Helper()
	h, err := r.ComputeHash()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// Every field other than inline bytes and Hash is covered.
func TestHashCoversContent(t *testing.T) {
	base := mustHash(t, fullRecord())
	for name, change := range map[string]func(r *trajectory.Record){
		"sandbox":       func(r *trajectory.Record) { r.Sandbox = "other" },
		"seq":           func(r *trajectory.Record) { r.Seq++ },
		"kind":          func(r *trajectory.Record) { r.Kind = trajectory.KindReadFile },
		"start":         func(r *trajectory.Record) { r.Start = trajectory.Timestamp(t0.Add(time.Nanosecond)) },
		"prev":          func(r *trajectory.Record) { r.Prev = "" },
		"argv":          func(r *trajectory.Record) { r.Exec.Argv = []string{"cat", "-"} },
		"exit code":     func(r *trajectory.Record) { r.Exec.ExitCode = 1 },
		"stdout digest": func(r *trajectory.Record) { r.Exec.Stdout = trajectory.NewData([]byte("other")) },
		"stdout size":   func(r *trajectory.Record) { r.Exec.Stdout.Size++ },
		"stdin gone":    func(r *trajectory.Record) { r.Exec.Stdin = nil },
		"error":         func(r *trajectory.Record) { r.Error = &trajectory.Error{Code: "internal", Message: "x"} },
		"reason":        func(r *trajectory.Record) { r.Reason = "why" },
	} {
		r := fullRecord()
		change(r)
		if mustHash(t, r) == base {
			t.Errorf("changing %s does not change the hash", name)
		}
	}
}

func TestNewData(t *testing.T) {
	b := []byte("some bytes")
	d := trajectory.NewData(b)
	if d.Digest != blobstore.Digest(b) || d.Size != int64(len(b)) || !bytes.Equal(d.Inline, b) || !d.Complete() {
		t.Fatalf("NewData: %+v", d)
	}
	empty := trajectory.NewData(nil)
	if empty.Digest != blobstore.Digest(nil) || empty.Size != 0 || !empty.Complete() {
		t.Fatalf("NewData(nil): %+v", empty)
	}
	var none *trajectory.Data
	if !none.Complete() {
		t.Fatal("nil Data is not complete")
	}
	if (&trajectory.Data{Digest: d.Digest, Size: d.Size}).Complete() {
		t.Fatal("data without its bytes is complete")
	}
}

func TestMarshalParseCanonical(t *testing.T) {
	r := fullRecord()
	r.Hash = mustHash(t, r)
	r.Environment = testEnv()
	b, err := r.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if bytes.HasSuffix(b, []byte("\n")) {
		t.Fatal("Marshal ends with a newline")
	}
	if bytes.Contains(b, []byte(`\u003c`)) {
		t.Fatal("Marshal escapes HTML")
	}
	// Fields in declaration order, map keys sorted.
	if !bytes.HasPrefix(b, []byte(`{"sandbox":"sb","seq":3,"kind":"exec","request_id":"r","start":`)) ||
		!bytes.Contains(b, []byte(`"labels":{"a":"1","b":"2"}`)) ||
		!bytes.HasSuffix(b, []byte(`"hash":"`+r.Hash+`"}`)) {
		t.Fatalf("not the canonical form: %s", b)
	}
	for _, in := range [][]byte{b, append(cloneBytes(b), '\n')} {
		p, err := trajectory.Parse(in)
		if err != nil {
			t.Fatal(err)
		}
		again, err := p.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("round trip changed the record:\n%s\n%s", b, again)
		}
	}
	for name, bad := range map[string][]byte{
		"unknown field": append([]byte(`{"surprise":1,`), b[1:]...),
		"trailing data": append(cloneBytes(b), []byte(` {}`)...),
		"not json":      []byte("nope"),
		"empty":         nil,
	} {
		if _, err := trajectory.Parse(bad); err == nil {
			t.Errorf("Parse accepted %s", name)
		}
	}
}

func cloneBytes(b []byte) []byte { return append([]byte(nil), b...) }

func TestTimestamp(t *testing.T) {
	loc := time.FixedZone("x", 3600)
	ts := trajectory.Timestamp(time.Date(2025, 1, 2, 4, 5, 6, 7, loc))
	if ts != "2025-01-02T03:05:06.000000007Z" {
		t.Fatalf("Timestamp %q", ts)
	}
	p, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil || !p.Equal(time.Date(2025, 1, 2, 3, 5, 6, 7, time.UTC)) {
		t.Fatalf("Timestamp does not parse back: %v", err)
	}
}
