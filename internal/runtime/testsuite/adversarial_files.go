package testsuite

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func init() {
	adversarialCases = append(adversarialCases,
		advCase{"files/passwd-is-dev-zero", (*suite).advPasswdDevZero},
		advCase{"files/passwd-is-a-fifo", (*suite).advPasswdFIFO},
		advCase{"files/fifos-and-devices", (*suite).advFIFOsAndDevices},
		advCase{"files/no-writes-to-proc", (*suite).advNoWritesToProc},
	)
}

// advPasswdDevZero: /etc/passwd, which PID 1 reads for an exec without HOME
// or with a user, made a link to /dev/zero. The agent read it to its end
// (the sandbox was lost in 0.2 s with 128 MiB; host memory grew without a
// limit). It must be refused: an exec without HOME gets "/", one with a
// user fails as the sandbox's own doing.
func (s *suite) advPasswdDevZero(t *testing.T) {
	sb := s.create(t, nil)
	s.sh(t, sb, "ln -sf /dev/zero /etc/passwd")
	s.checkBrokenPasswd(t, sb)
}

// advPasswdFIFO: the same with a FIFO nobody writes to, which blocked the
// agent.
func (s *suite) advPasswdFIFO(t *testing.T) {
	sb := s.create(t, nil)
	s.sh(t, sb, "rm /etc/passwd && mkfifo /etc/passwd")
	s.checkBrokenPasswd(t, sb)
}

func (s *suite) checkBrokenPasswd(t *testing.T, sb runtime.Sandbox) {
	t.Helper()
	if got := s.sh(t, sb, "echo $HOME"); got != "/\n" {
		t.Errorf("HOME with an unusable /etc/passwd: %q, want /", got)
	}
	if _, ok := s.h.Lacks[Users]; !ok {
		_, err := sb.Exec(s.ctx(t), runtime.ExecRequest{Argv: []string{"true"}, User: "nobody"}, nil)
		if !errors.Is(err, runtime.ErrFailedPrecondition) || isGone(err) {
			t.Errorf("exec as nobody with an unusable /etc/passwd: %v; want a FailedPrecondition error", err)
		}
	}
	s.sh(t, sb, "true") // still answering
}

// advFIFOsAndDevices: file operations on a FIFO or a device (a link to
// /dev/zero) neither hang PID 1 nor make it read without end: ReadFile and
// WriteFile refuse them at once as the sandbox's own state, GetArchive of
// a directory holding them archives them as entries (no content), and
// PutArchive replaces them.
func (s *suite) advFIFOsAndDevices(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	s.sh(t, sb, "mkdir /tmp/d && mkfifo /tmp/d/fifo && ln -s /dev/zero /tmp/d/zero && echo hi >/tmp/d/file")
	for _, p := range []string{"/tmp/d/fifo", "/tmp/d/zero", "/dev/zero"} {
		if _, err := sb.ReadFile(ctx, p, 0); !errors.Is(err, runtime.ErrFailedPrecondition) || isGone(err) {
			t.Errorf("ReadFile(%s): %v; want a FailedPrecondition error", p, err)
		}
	}
	for _, p := range []string{"/tmp/d/fifo", "/tmp/d/zero"} {
		if err := sb.WriteFile(ctx, p, []byte("x"), 0o644); !errors.Is(err, runtime.ErrFailedPrecondition) || isGone(err) {
			t.Errorf("WriteFile(%s): %v; want a FailedPrecondition error", p, err)
		}
	}
	var buf bytes.Buffer
	if err := sb.GetArchive(ctx, "/tmp/d", &buf); err != nil {
		t.Fatalf("GetArchive of a directory with a FIFO and a link to /dev/zero: %v", err)
	}
	names := map[string]byte{}
	tr := tar.NewReader(&buf)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("GetArchive's tar: %v", err)
		}
		names[hdr.Name] = hdr.Typeflag
	}
	if names["fifo"] != tar.TypeFifo || names["zero"] != tar.TypeSymlink || names["file"] != tar.TypeReg {
		t.Errorf("GetArchive entries %v; want fifo (FIFO), zero (symlink), file", names)
	}
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	tw.WriteHeader(&tar.Header{Name: "fifo", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3})
	tw.Write([]byte("new"))
	tw.Close()
	if err := sb.PutArchive(ctx, "/tmp/d", &in); err != nil {
		t.Fatalf("PutArchive over a FIFO: %v", err)
	}
	if got, err := sb.ReadFile(ctx, "/tmp/d/fifo", 0); err != nil || string(got) != "new" {
		t.Errorf("after PutArchive, /tmp/d/fifo holds %q, %v; want %q", got, err, "new")
	}
}

// advNoWritesToProc: the agent writes nothing on /proc (where /proc/self is
// the agent) or /sys for a request: WriteFile of /proc/self/oom_score_adj
// returned PermissionDenied after the write had changed the agent's score.
func (s *suite) advNoWritesToProc(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	before := s.sh(t, sb, "cat /proc/1/oom_score_adj")
	if err := sb.WriteFile(ctx, "/proc/self/oom_score_adj", []byte("500"), 0o644); !errors.Is(err, fs.ErrPermission) || isGone(err) {
		t.Errorf("WriteFile(/proc/self/oom_score_adj): %v; want a PermissionDenied error", err)
	}
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	tw.WriteHeader(&tar.Header{Name: "oom_score_adj", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3})
	tw.Write([]byte("500"))
	tw.Close()
	if err := sb.PutArchive(ctx, "/proc/self", &in); !errors.Is(err, fs.ErrPermission) || isGone(err) {
		t.Errorf("PutArchive into /proc/self: %v; want a PermissionDenied error", err)
	}
	if after := s.sh(t, sb, "cat /proc/1/oom_score_adj"); strings.TrimSpace(after) != strings.TrimSpace(before) {
		t.Errorf("the agent's oom_score_adj went from %q to %q", before, after)
	}
}
