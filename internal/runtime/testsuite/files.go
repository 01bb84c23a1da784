package testsuite

import (
	"archive/tar"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"path"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testFiles(t *testing.T) {
	t.Run("write-read", s.testWriteRead)
	t.Run("read-missing", s.testReadMissing)
	t.Run("read-max-bytes", s.testReadMaxBytes)
	t.Run("archive-round-trip", s.testArchive)
}

func (s *suite) testWriteRead(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	// Every byte value, then random bytes: nothing may be treated as text.
	data := make([]byte, 256+1<<20)
	for i := range 256 {
		data[i] = byte(i)
	}
	rand.Read(data[256:])
	const p = "/tmp/dsec-files/a/b/c.bin"
	if err := sb.WriteFile(ctx, p, data, 0o640); err != nil {
		t.Fatalf("WriteFile(%s) with missing parents: %v", p, err)
	}
	got, err := sb.ReadFile(ctx, p, 4<<20)
	if err != nil {
		t.Fatalf("ReadFile(%s): %v", p, err)
	}
	if !bytes.Equal(got, data) {
		t.Errorf("ReadFile(%s) returned %d bytes that differ from the %d written", p, len(got), len(data))
	}
	// The exec side sees the same bytes and the requested mode.
	sum := sha256.Sum256(data)
	want := hex.EncodeToString(sum[:]) + " 640\n"
	if out := s.sh(t, sb, `echo "$(sha256sum < `+p+` | cut -d' ' -f1) $(stat -c %a `+p+`)"`); out != want {
		t.Errorf("inside the sandbox %s has sha256 and mode %q, want %q", p, out, want)
	}

	// An executable written by WriteFile runs.
	const script = "/tmp/dsec-files/run.sh"
	if err := sb.WriteFile(ctx, script, []byte("#!/bin/sh\necho ran-$1\n"), 0o755); err != nil {
		t.Fatalf("WriteFile(%s): %v", script, err)
	}
	res := s.exec(t, sb, runtime.ExecRequest{Argv: []string{script, "x"}})
	requireExit(t, res, 0, script)
	if string(res.Stdout) != "ran-x\n" {
		t.Errorf("%s printed %q", script, res.Stdout)
	}

	// Overwriting a base-layer file works and replaces all of it.
	if err := sb.WriteFile(ctx, BaseMarkerPath, []byte("over"), 0o644); err != nil {
		t.Fatalf("WriteFile(%s) over a base-layer file: %v", BaseMarkerPath, err)
	}
	if out := s.sh(t, sb, "cat "+BaseMarkerPath); out != "over" {
		t.Errorf("after overwriting %s: %q", BaseMarkerPath, out)
	}
	// An empty file is a file, not an error.
	if err := sb.WriteFile(ctx, "/tmp/empty", nil, 0o600); err != nil {
		t.Fatalf("WriteFile of an empty file: %v", err)
	}
	if got, err := sb.ReadFile(ctx, "/tmp/empty", 10); err != nil || len(got) != 0 {
		t.Errorf("ReadFile of an empty file: %q, %v", got, err)
	}
}

func (s *suite) testReadMissing(t *testing.T) {
	sb := s.create(t, nil)
	_, err := sb.ReadFile(s.ctx(t), "/no/such/file", 1<<20)
	if err == nil {
		t.Fatal("ReadFile of a missing file succeeded")
	}
	if isGone(err) {
		t.Errorf("ReadFile of a missing file reported the sandbox gone: %v", err)
	}
	if err := sb.WriteFile(s.ctx(t), "/proc/dsec-cannot-write", []byte("x"), 0o644); err == nil {
		t.Errorf("WriteFile into /proc succeeded")
	}
}

func (s *suite) testReadMaxBytes(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	data := bytes.Repeat([]byte("0123456789"), 1000)
	if err := sb.WriteFile(ctx, "/tmp/ten-k", data, 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := sb.ReadFile(ctx, "/tmp/ten-k", 1000)
	// Refusing and returning at most maxBytes both enforce the bound.
	if err == nil && len(got) > 1000 {
		t.Errorf("ReadFile with maxBytes=1000 of a 10000-byte file returned %d bytes", len(got))
	}
	if isGone(err) {
		t.Errorf("ReadFile over maxBytes reported the sandbox gone: %v", err)
	}
	got, err = sb.ReadFile(ctx, "/tmp/ten-k", int64(len(data)))
	if err != nil || !bytes.Equal(got, data) {
		t.Errorf("ReadFile with maxBytes equal to the size: %d bytes, %v", len(got), err)
	}
}

// archEntry is one entry of the archive round trip.
type archEntry struct {
	name   string
	typ    byte
	mode   int64
	data   string
	target string
}

func (s *suite) testArchive(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	bin := make([]byte, 64<<10)
	rand.Read(bin)
	entries := []archEntry{
		{name: "d", typ: tar.TypeDir, mode: 0o755},
		{name: "d/sub", typ: tar.TypeDir, mode: 0o700},
		{name: "d/sub/f.txt", typ: tar.TypeReg, mode: 0o644, data: "hello\n"},
		{name: "d/run.sh", typ: tar.TypeReg, mode: 0o755, data: "#!/bin/sh\necho archived\n"},
		{name: "d/bin.dat", typ: tar.TypeReg, mode: 0o600, data: string(bin)},
		{name: "d/link", typ: tar.TypeSymlink, mode: 0o777, target: "sub/f.txt"},
		{name: "top.txt", typ: tar.TypeReg, mode: 0o640, data: "top\n"},
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Size: int64(len(e.data)), Linkname: e.target}
		if e.typ == tar.TypeDir {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}

	const dir = "/tmp/dsec-archive/in" // parent missing: PutArchive creates it
	if err := sb.PutArchive(ctx, dir, bytes.NewReader(buf.Bytes())); err != nil {
		t.Fatalf("PutArchive(%s): %v", dir, err)
	}
	// What the sandbox's own tools see.
	out := s.sh(t, sb, `cd `+dir+` && stat -c '%n %a %F' d d/sub d/sub/f.txt d/run.sh d/bin.dat top.txt && readlink d/link && cat d/link && ./d/run.sh`)
	want := "d 755 directory\nd/sub 700 directory\nd/sub/f.txt 644 regular file\nd/run.sh 755 regular file\n" +
		"d/bin.dat 600 regular file\ntop.txt 640 regular file\nsub/f.txt\nhello\narchived\n"
	if out != want {
		t.Errorf("extracted tree inside the sandbox:\n%s\nwant:\n%s", out, want)
	}

	var back bytes.Buffer
	if err := sb.GetArchive(ctx, dir, &back); err != nil {
		t.Fatalf("GetArchive(%s): %v", dir, err)
	}
	got := map[string]archEntry{}
	tr := tar.NewReader(&back)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("GetArchive(%s) stream: %v", dir, err)
		}
		// Archivers differ in "./" prefixes and trailing slashes; the tree is the same.
		name := strings.TrimPrefix(path.Clean("/"+h.Name), "/")
		if name == "" {
			continue // the root itself
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("GetArchive(%s) entry %s: %v", dir, name, err)
		}
		typ := h.Typeflag
		if typ == 0 { // the pre-POSIX spelling of a regular file
			typ = tar.TypeReg
		}
		got[name] = archEntry{name: name, typ: typ, mode: h.Mode & 0o7777, data: string(data), target: h.Linkname}
	}
	if len(got) != len(entries) {
		names := make([]string, 0, len(got))
		for n := range got {
			names = append(names, n)
		}
		t.Errorf("GetArchive returned %d entries %v, want %d", len(got), names, len(entries))
	}
	for _, e := range entries {
		g, ok := got[e.name]
		switch {
		case !ok:
			t.Errorf("GetArchive: %s missing", e.name)
		case g.typ != e.typ:
			t.Errorf("GetArchive: %s has type %q, want %q", e.name, g.typ, e.typ)
		case e.typ != tar.TypeSymlink && g.mode != e.mode:
			t.Errorf("GetArchive: %s has mode %o, want %o", e.name, g.mode, e.mode)
		case g.data != e.data:
			t.Errorf("GetArchive: %s has %d bytes that differ from the %d put", e.name, len(g.data), len(e.data))
		case g.target != e.target:
			t.Errorf("GetArchive: %s links to %q, want %q", e.name, g.target, e.target)
		}
	}
}
