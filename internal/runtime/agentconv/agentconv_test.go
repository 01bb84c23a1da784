package agentconv_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/agent"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/agentconv"
)

// TestErr checks each agent failure against the runtime sentinel the edge
// maps to an API code, on errors produced by a real agent server over a
// socket pair rather than built by hand.
func TestErr(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, make([]byte, 100), 0o644); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := mkfifo(fifo); err != nil {
		t.Fatal(err)
	}
	c, stop := serve(t)
	ctx := context.Background()

	_, err := c.ReadFile(ctx, big, 10)
	mustBe(t, "read over the bound", agentconv.Err(err), rt.ErrTooLarge, rt.ErrSandboxGone)
	var ae *agent.Error
	if !errors.As(agentconv.Err(err), &ae) || ae.Code != agent.CodeTooLarge {
		t.Errorf("the *agent.Error is lost from the chain: %v", agentconv.Err(err))
	}
	if got := agentconv.Err(err).Error(); got != err.Error() {
		t.Errorf("message changed: %q, agent said %q", got, err.Error())
	}

	_, err = c.ReadFile(ctx, fifo, 10)
	mustBe(t, "read of a FIFO", agentconv.Err(err), rt.ErrFailedPrecondition, rt.ErrTooLarge)

	_, err = c.ReadFile(ctx, filepath.Join(dir, "missing"), 10)
	if got := agentconv.Err(err); got != err || !errors.Is(got, fs.ErrNotExist) {
		t.Errorf("a missing file: %v changed or lost fs.ErrNotExist", got)
	}

	stop()
	err = c.Ping(ctx)
	mustBe(t, "ping after the agent stopped", agentconv.Err(err), rt.ErrSandboxGone, rt.ErrTooLarge)

	if agentconv.Err(nil) != nil {
		t.Error("Err(nil) is not nil")
	}
	other := fmt.Errorf("plain")
	if agentconv.Err(other) != other {
		t.Error("an error of no agent kind is not passed through")
	}
}

func mustBe(t *testing.T, what string, err, want, notWant error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: %v is not %v", what, err, want)
	}
	if errors.Is(err, notWant) {
		t.Errorf("%s: %v is also %v", what, err, notWant)
	}
}

func TestExec(t *testing.T) {
	c, _ := serve(t)
	req := rt.ExecRequest{Shell: `read x; echo "out $x $FOO $(pwd)"; echo err >&2; exit 3`, Env: []string{"FOO=bar"},
		Cwd: "/", Stdin: []byte("in\n"), Timeout: time.Minute, MaxOutputBytes: 4}
	var streamed [3][]byte
	res, err := c.Exec(context.Background(), agentconv.ExecRequest(req), agentconv.Output(func(s rt.Stream, b []byte) {
		streamed[s] = append(streamed[s], b...)
	}))
	if err != nil {
		t.Fatal(err)
	}
	got := agentconv.ExecResult(res)
	if got.ExitCode != 3 || string(got.Stdout) != "out " || !got.StdoutTruncated || string(got.Stderr) != "err\n" || got.StderrTruncated {
		t.Errorf("result %+v", got)
	}
	if string(streamed[rt.Stdout]) != "out in bar /\n" || string(streamed[rt.Stderr]) != "err\n" {
		t.Errorf("streamed %q", streamed)
	}
	if agentconv.Output(nil) != nil {
		t.Error("Output(nil) is not nil: the agent would stream to nobody")
	}
	// Every field is carried: a field added to one side and not the
	// other fails here.
	full := rt.ExecRequest{Argv: []string{"a"}, Shell: "s", Env: []string{"E=1"}, Cwd: "c", User: "u",
		Stdin: []byte("i"), Timeout: 1, MaxOutputBytes: 2}
	if back := agentconv.ExecRequest(full); !reflect.DeepEqual(fieldValues(back), fieldValues(full)) {
		t.Errorf("ExecRequest lost a field: %+v from %+v", back, full)
	}
	ares := agent.ExecResult{ExitCode: 1, Signal: 2, Stdout: []byte("o"), Stderr: []byte("e"), StdoutTruncated: true,
		StderrTruncated: true, Duration: 3, TimedOut: true, PidsExhausted: true}
	rres := agentconv.ExecResult(ares)
	if rres.OOMKilled || rres.DiskFull {
		t.Error("the agent cannot know OOMKilled or DiskFull")
	}
	rres.OOMKilled, rres.DiskFull = true, true // set on both sides' remainder
	want := fieldValues(ares)
	want["OOMKilled"], want["DiskFull"] = true, true
	if !reflect.DeepEqual(fieldValues(rres), want) {
		t.Errorf("ExecResult lost a field: %+v from %+v", rres, ares)
	}
}

// fieldValues maps a struct's field names to their values.
func fieldValues(v any) map[string]any {
	rv := reflect.ValueOf(v)
	m := map[string]any{}
	for i := range rv.NumField() {
		m[rv.Type().Field(i).Name] = rv.Field(i).Interface()
	}
	return m
}

// serve runs an agent server on one end of a socket pair and returns a
// client of the other end and a function that stops the server.
func serve(t *testing.T) (*agent.Client, func()) {
	t.Helper()
	a, b := net.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		agent.Serve(ctx, a, agent.Options{})
	}()
	c := agent.NewClient(b)
	stop := func() { cancel(); <-done }
	t.Cleanup(func() { c.Close(); stop() })
	return c, stop
}
