package memback_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"image/png"
	"io"
	"io/fs"
	"slices"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/memback"
)

func newBackend(t *testing.T, opts memback.Options) *memback.Backend {
	t.Helper()
	b, err := memback.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func create(t *testing.T, b *memback.Backend, id string) runtime.Sandbox {
	t.Helper()
	sb, err := b.Create(t.Context(), runtime.Spec{ID: id})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(context.Background()) })
	return sb
}

func execOK(t *testing.T, sb runtime.Sandbox, req runtime.ExecRequest) runtime.ExecResult {
	t.Helper()
	res, err := sb.Exec(t.Context(), req, nil)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func TestExecCommands(t *testing.T) {
	b := newBackend(t, memback.Options{Base: map[string]string{"/etc/motd": "hi\n"}})
	sb := create(t, b, "s1")
	for _, tc := range []struct {
		name   string
		req    runtime.ExecRequest
		code   int
		stdout string
	}{
		{"echo", runtime.ExecRequest{Argv: []string{"echo", "a", "b"}}, 0, "a b\n"},
		{"true", runtime.ExecRequest{Argv: []string{"true"}}, 0, ""},
		{"false", runtime.ExecRequest{Argv: []string{"false"}}, 1, ""},
		{"exit stops a line", runtime.ExecRequest{Shell: "echo x; exit 3; echo y"}, 3, "x\n"},
		{"cat stdin", runtime.ExecRequest{Argv: []string{"cat"}, Stdin: []byte("in")}, 0, "in"},
		{"cat base file", runtime.ExecRequest{Argv: []string{"cat", "/etc/motd"}}, 0, "hi\n"},
		{"write then cat", runtime.ExecRequest{Shell: "write /w a b; cat /w"}, 0, "a b"},
		{"unknown", runtime.ExecRequest{Argv: []string{"python3"}}, 127, ""},
		{"hostname", runtime.ExecRequest{Argv: []string{"hostname"}}, 0, "s1\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := execOK(t, sb, tc.req)
			if res.ExitCode != tc.code || string(res.Stdout) != tc.stdout {
				t.Fatalf("exit %d stdout %q, want %d %q (stderr %q)", res.ExitCode, res.Stdout, tc.code, tc.stdout, res.Stderr)
			}
		})
	}
	if _, err := sb.Exec(t.Context(), runtime.ExecRequest{}, nil); !errors.Is(err, runtime.ErrInvalidSpec) {
		t.Fatalf("empty exec: %v, want ErrInvalidSpec", err)
	}
}

func TestExecTimeoutAndOutputBound(t *testing.T) {
	sb := create(t, newBackend(t, memback.Options{}), "s1")
	res := execOK(t, sb, runtime.ExecRequest{Argv: []string{"sleep", "3600"}, Timeout: time.Millisecond})
	if !res.TimedOut || res.Signal != 9 {
		t.Fatalf("sleep past its timeout: %+v, want timed out by SIGKILL", res)
	}
	var streamed []byte
	res, err := sb.Exec(t.Context(), runtime.ExecRequest{Argv: []string{"echo", "0123456789"}, MaxOutputBytes: 4},
		func(s runtime.Stream, d []byte) { streamed = append(streamed, d...) })
	if err != nil {
		t.Fatal(err)
	}
	if string(res.Stdout) != "0123" || !res.StdoutTruncated || string(streamed) != "0123456789\n" {
		t.Fatalf("bounded output %q truncated %v, streamed %q", res.Stdout, res.StdoutTruncated, streamed)
	}
}

func TestFiles(t *testing.T) {
	sb := create(t, newBackend(t, memback.Options{}), "s1")
	ctx := t.Context()
	if err := sb.WriteFile(ctx, "/a/b/c", []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := sb.ReadFile(ctx, "/a/b/c", 0)
	if err != nil || string(got) != "hello" {
		t.Fatalf("read back %q, %v", got, err)
	}
	if _, err := sb.ReadFile(ctx, "/a/b/c", 2); !errors.Is(err, runtime.ErrTooLarge) {
		t.Fatalf("read past the bound: %v, want ErrTooLarge", err)
	}
	if _, err := sb.ReadFile(ctx, "/nope", 0); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("read missing: %v, want ErrNotExist", err)
	}
	if _, err := sb.ReadFile(ctx, "/a", 0); !errors.Is(err, runtime.ErrFailedPrecondition) {
		t.Fatalf("read a directory: %v, want ErrFailedPrecondition", err)
	}
	if err := sb.WriteFile(ctx, "/a/b/c/d", nil, 0o644); !errors.Is(err, runtime.ErrFailedPrecondition) {
		t.Fatalf("write under a file: %v, want ErrFailedPrecondition", err)
	}

	var buf bytes.Buffer
	if err := sb.GetArchive(ctx, "/a", &buf); err != nil {
		t.Fatal(err)
	}
	other := create(t, newBackend(t, memback.Options{}), "s2")
	if err := other.PutArchive(ctx, "/x", &buf); err != nil {
		t.Fatal(err)
	}
	got, err = other.ReadFile(ctx, "/x/b/c", 0)
	if err != nil || string(got) != "hello" {
		t.Fatalf("archive round trip: %q, %v", got, err)
	}
}

func TestDiskLimit(t *testing.T) {
	b := newBackend(t, memback.Options{})
	sb, err := b.Create(t.Context(), runtime.Spec{ID: "s1", Resources: runtime.Resources{DiskBytes: 10}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Destroy(context.Background())
	if err := sb.WriteFile(t.Context(), "/a", make([]byte, 8), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := sb.WriteFile(t.Context(), "/b", make([]byte, 8), 0o644); !errors.Is(err, runtime.ErrFailedPrecondition) {
		t.Fatalf("write past the disk limit: %v, want ErrFailedPrecondition", err)
	}
}

func TestFreezeBlocksUntilThaw(t *testing.T) {
	sb := create(t, newBackend(t, memback.Options{}), "s1")
	if err := sb.Freeze(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := sb.Freeze(t.Context()); err != nil {
		t.Fatalf("second freeze: %v", err)
	}
	// A call on a frozen sandbox waits: with a cancelled context it
	// returns the context's error instead of running.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := sb.Exec(ctx, runtime.ExecRequest{Argv: []string{"true"}}, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("exec on a frozen sandbox: %v, want it to wait (context canceled)", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := sb.Exec(t.Context(), runtime.ExecRequest{Argv: []string{"true"}}, nil)
		done <- err
	}()
	if err := sb.Thaw(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("exec after thaw: %v", err)
	}
}

func TestKillAndDestroy(t *testing.T) {
	b := newBackend(t, memback.Options{})
	sb := create(t, b, "s1")
	running := make(chan error, 1)
	go func() {
		_, err := sb.Exec(context.Background(), runtime.ExecRequest{Argv: []string{"sleep", "3600"}}, nil)
		running <- err
	}()
	b.Sandbox("s1").Kill("test")
	<-sb.Done()
	if err := <-running; !errors.Is(err, runtime.ErrSandboxGone) {
		t.Fatalf("exec running at the kill: %v, want ErrSandboxGone", err)
	}
	if _, err := sb.ReadFile(t.Context(), "/x", 0); !errors.Is(err, runtime.ErrSandboxGone) {
		t.Fatalf("read after kill: %v, want ErrSandboxGone", err)
	}
	if got := b.Live(); !slices.Equal(got, []string{"s1"}) {
		t.Fatalf("a dead sandbox not yet destroyed: live %v", got)
	}
	for range 2 {
		if err := sb.Destroy(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	if got := b.Live(); len(got) != 0 {
		t.Fatalf("live after destroy: %v", got)
	}
	if _, err := b.Create(t.Context(), runtime.Spec{ID: "s1"}); err != nil {
		t.Fatalf("the ID is free again after destroy: %v", err)
	}
}

func TestCreateRefusals(t *testing.T) {
	busy := newBackend(t, memback.Options{CreateHook: func(context.Context, runtime.Spec) error { return runtime.ErrBusy }})
	if _, err := busy.Create(t.Context(), runtime.Spec{ID: "s1"}); !errors.Is(err, runtime.ErrBusy) {
		t.Fatalf("hooked create: %v, want ErrBusy", err)
	}
	if len(busy.Live()) != 0 {
		t.Fatal("a refused create left a sandbox")
	}
	b := newBackend(t, memback.Options{})
	create(t, b, "s1")
	if _, err := b.Create(t.Context(), runtime.Spec{ID: "s1"}); !errors.Is(err, runtime.ErrInvalidSpec) {
		t.Fatalf("duplicate ID: %v, want ErrInvalidSpec", err)
	}
	if _, err := b.Create(t.Context(), runtime.Spec{}); !errors.Is(err, runtime.ErrInvalidSpec) {
		t.Fatalf("no ID: %v, want ErrInvalidSpec", err)
	}
	if _, err := memback.New(memback.Options{Base: map[string]string{"": "x"}}); err == nil {
		t.Fatal("an empty Base path was accepted")
	}
}

func TestReset(t *testing.T) {
	plain := create(t, newBackend(t, memback.Options{}), "p")
	if _, ok := plain.(runtime.Resetter); ok {
		t.Fatal("a sandbox of a backend without Options.Reset is a Resetter")
	}
	b := newBackend(t, memback.Options{Reset: true, Base: map[string]string{"/etc/motd": "hi"}})
	sb := create(t, b, "s1")
	r, ok := sb.(runtime.Resetter)
	if !ok {
		t.Fatal("Options.Reset: sandbox is not a Resetter")
	}
	execOK(t, sb, runtime.ExecRequest{Shell: "rm /etc/motd; write /new x"})
	if err := r.Reset(t.Context()); err != nil {
		t.Fatal(err)
	}
	files := b.Sandbox("s1").Files()
	if files["/etc/motd"] != "hi" || files["/new"] != "" {
		t.Fatalf("after reset: %v, want only the base", files)
	}
	if _, resets := b.Stats(); resets != 1 {
		t.Fatalf("resets %d, want 1", resets)
	}
}

// TestWriteDiff checks the tar a DiffArchiver hands over: changes,
// whiteouts for removed base entries, an opaque marker for a base
// directory made again, and nothing for what is unchanged.
func TestWriteDiff(t *testing.T) {
	b := newBackend(t, memback.Options{Base: map[string]string{
		"/etc/keep": "k", "/etc/gone": "g", "/opt/d/x": "x", "/usr/lib/y": "y",
	}})
	sb := create(t, b, "s1")
	execOK(t, sb, runtime.ExecRequest{Shell: "rm /etc/gone; rm -r /opt/d; mkdir /opt/d; write /opt/d/new n; rm -r /usr/lib; write /home/a/f f"})
	if err := sb.Freeze(t.Context()); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := sb.(runtime.DiffArchiver).WriteDiff(t.Context(), &buf); err != nil {
		t.Fatal(err)
	}
	if !b.Sandbox("s1").Frozen() {
		t.Fatal("WriteDiff thawed a frozen sandbox")
	}
	var names []string
	tr := tar.NewReader(&buf)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, hdr.Name)
	}
	want := []string{
		"etc/", "etc/.wh.gone", "home/", "home/a/", "home/a/f",
		"opt/", "opt/d/", "opt/d/.wh..wh..opq", "opt/d/.wh.x", "opt/d/new",
		"usr/", "usr/.wh.lib",
	}
	if !slices.Equal(names, want) {
		t.Fatalf("diff entries\n got %q\nwant %q", names, want)
	}
}

func TestDisplay(t *testing.T) {
	plain := create(t, newBackend(t, memback.Options{}), "p")
	if _, ok := plain.(runtime.Display); ok {
		t.Fatal("a sandbox of a backend without Options.Display has a display")
	}
	b := newBackend(t, memback.Options{Display: true, Reset: true})
	sb := create(t, b, "s1")
	d, ok := sb.(runtime.Display)
	if _, reset := sb.(runtime.Resetter); !ok || !reset {
		t.Fatal("Options.Display and Reset: sandbox lacks one of them")
	}
	before, err := d.Screenshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(bytes.NewReader(before))
	if err != nil || img.Bounds().Size() != memback.Screen {
		t.Fatalf("screenshot is not a %v PNG: %v", memback.Screen, err)
	}
	evs := []runtime.InputEvent{{Kind: runtime.InputText, Text: "hi"}, {Kind: runtime.InputClick, X: 3, Y: 4}}
	if err := d.Input(t.Context(), evs); err != nil {
		t.Fatal(err)
	}
	if got := b.Sandbox("s1").Events(); !slices.Equal(got, evs) {
		t.Fatalf("events %+v, want %+v", got, evs)
	}
	after, err := d.Screenshot(t.Context())
	if err != nil || bytes.Equal(before, after) {
		t.Fatalf("the screen did not change after input: %v", err)
	}
	if err := d.Input(t.Context(), []runtime.InputEvent{{Kind: "wave"}}); !errors.Is(err, runtime.ErrInvalidSpec) {
		t.Fatalf("an unknown event kind: %v, want ErrInvalidSpec", err)
	}
	if err := sb.(runtime.Resetter).Reset(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := b.Sandbox("s1").Events(); len(got) != 0 {
		t.Fatalf("events after reset: %+v", got)
	}
}
