package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/swap"
	dsectest "github.com/dsec-dev/dsec/internal/testutil"
)

// TestUpCallsEdgeInProcess runs `dsecd up` in this process and drives
// create, exec, a streamed exec, run and destroy through its API: the
// server's calls to its edge all arrive in process, none over the port.
func TestUpCallsEdgeInProcess(t *testing.T) {
	dsectest.RequireRoot(t)
	agent := dsectest.BuildBinary(t, "./cmd/dsec-agent")
	data := t.TempDir()
	base := startUp(t, "up", "--data-dir", data, "--listen", "127.0.0.1:0", "--agent", agent,
		"--node-id", "inproc-test", "--log-level", "warn", "--import", "busybox:inproc="+testsuite.BusyboxRootfs(t))
	b, err := os.ReadFile(filepath.Join(data, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	token := strings.TrimSpace(string(b))
	sb := dsecv1connect.NewSandboxServiceClient(http.DefaultClient, base)
	ctx := t.Context()
	auth := func(h http.Header) { h.Set("Authorization", "Bearer "+token) }

	cr := connect.NewRequest(&dsecv1.CreateSandboxRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:inproc"}})
	auth(cr.Header())
	created, err := sb.Create(ctx, cr)
	if err != nil {
		t.Fatal(err)
	}
	id := created.Msg.GetSandbox().GetId()

	er := connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Argv: []string{"echo", "hello"}})
	auth(er.Header())
	res, err := sb.Exec(ctx, er)
	if err != nil || string(res.Msg.GetResult().GetStdout()) != "hello\n" {
		t.Fatalf("exec: %v, %v", res, err)
	}

	// The command cannot end before the test has seen its first line and
	// answered it with a file: output streams through while it runs.
	sr := connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Shell: "echo first; while [ ! -e /tmp/go ]; do sleep 0.01; done; echo second"})
	auth(sr.Header())
	st, err := sb.ExecStream(ctx, sr)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for !strings.Contains(out.String(), "first\n") {
		if !st.Receive() {
			t.Fatalf("stream ended before its first line (%q): %v", out.String(), st.Err())
		}
		out.Write(st.Msg().GetStdout())
	}
	wr := connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/tmp/go", Data: []byte("x")})
	auth(wr.Header())
	if _, err := sb.WriteFile(ctx, wr); err != nil {
		t.Fatal(err)
	}
	var exit *dsecv1.ExecResult
	for st.Receive() {
		out.Write(st.Msg().GetStdout())
		if r := st.Msg().GetResult(); r != nil {
			exit = r
		}
	}
	if st.Err() != nil || out.String() != "first\nsecond\n" || exit == nil || exit.GetExitCode() != 0 {
		t.Fatalf("stream: %q, result %v, %v", out.String(), exit, st.Err())
	}
	st.Close()

	dr := connect.NewRequest(&dsecv1.DestroySandboxRequest{Id: id})
	auth(dr.Header())
	if _, err := sb.Destroy(ctx, dr); err != nil {
		t.Fatal(err)
	}

	rr := connect.NewRequest(&dsecv1.RunRequest{Spec: &dsecv1.SandboxSpec{Image: "busybox:inproc"}, Exec: &dsecv1.ExecRequest{Shell: "echo ran; exit 7"}})
	auth(rr.Header())
	run, err := sb.Run(ctx, rr)
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	exit = nil
	for run.Receive() {
		out.Write(run.Msg().GetStdout())
		if r := run.Msg().GetResult(); r != nil {
			exit = r
		}
	}
	if run.Err() != nil || out.String() != "ran\n" || exit.GetExitCode() != 7 {
		t.Fatalf("run: %q, result %v, %v", out.String(), exit, run.Err())
	}
	run.Close()

	// Create, exec, stream, write, destroy and run: at least six calls,
	// every one in process.
	// /metrics answers the metrics token only.
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/metrics without a token: %s, want 401", resp.Status)
	}
	mt, err := os.ReadFile(filepath.Join(data, "metrics.token"))
	if err != nil {
		t.Fatal(err)
	}
	calls := scrape(t, base, strings.TrimSpace(string(mt)), "dsec_up_edge_requests_total")
	if calls["inproc"] < 6 || calls["network"] != 0 {
		t.Errorf("edge requests by way %v: want >= 6 inproc and no network", calls)
	}
}

// startUp runs dsecd with args (an `up` listening on 127.0.0.1:0) until the
// test ends and returns its URL once it is healthy. The test's cleanup
// stops it as Ctrl-C would and waits for it to finish.
func startUp(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	root := newRoot()
	root.SetOut(pw)
	root.SetErr(pw)
	root.SetArgs(args)
	done := make(chan error, 1)
	go func() {
		err := root.ExecuteContext(ctx)
		pw.CloseWithError(err)
		done <- err
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("dsecd up: %v", err)
		}
	})
	lines := bufio.NewScanner(pr)
	if !lines.Scan() {
		t.Fatalf("dsecd up printed nothing: %v", lines.Err())
	}
	// "dsec up: serving on http://127.0.0.1:PORT (node ...)"
	first := lines.Text()
	_, rest, ok := strings.Cut(first, "serving on ")
	base, _, _ := strings.Cut(rest, " ")
	if !ok || !strings.HasPrefix(base, "http://127.0.0.1:") {
		t.Fatalf("dsecd up's first line %q names no URL", first)
	}
	go io.Copy(io.Discard, pr) // the rest, so that its writes never block
	poll(t, "dsecd up healthy", func() bool {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return base
}

// poll calls cond until it holds, waiting longer each time; it is how a
// test waits for a daemon's state it has no event for.
func poll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for delay := 5 * time.Millisecond; !cond(); delay = min(2*delay, 250*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(delay)
	}
}

// scrape reads the counter name from base's /metrics (with the metrics
// token), by its "via" label.
func scrape(t *testing.T, base, token, name string) map[string]float64 {
	t.Helper()
	r, err := http.NewRequest(http.MethodGet, base+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics with the metrics token: %s", resp.Status)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	lines := bufio.NewScanner(resp.Body)
	for lines.Scan() {
		// name{via="inproc"} 12
		rest, ok := strings.CutPrefix(lines.Text(), name+`{via="`)
		via, value, ok2 := strings.Cut(rest, `"} `)
		if !ok || !ok2 {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			t.Fatalf("/metrics: %q: %v", lines.Text(), err)
		}
		out[via] = v
	}
	if err := lines.Err(); err != nil {
		t.Fatal(err)
	}
	if len(out) == 0 {
		t.Fatalf("no %s in /metrics", name)
	}
	return out
}

// TestUpSwap: `dsecd up --swap` makes its swap file in the data directory
// and enables it while it runs, and turns it off and removes it at stop.
func TestUpSwap(t *testing.T) {
	dsectest.RequireRoot(t)
	agent := dsectest.BuildBinary(t, "./cmd/dsec-agent")
	data := t.TempDir()
	file := filepath.Join(data, "swap.img")
	// Registered before startUp's cleanup, so it runs after the stop.
	t.Cleanup(func() {
		if on, _, err := swap.Enabled(file); on || err != nil {
			t.Errorf("after stop: swap file still enabled (%v)", err)
		}
		if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("after stop: swap file left: %v", err)
		}
	})
	startUp(t, "up", "--data-dir", data, "--listen", "127.0.0.1:0", "--agent", agent,
		"--node-id", "swap-test", "--log-level", "warn", "--swap", "32m")
	on, size, err := swap.Enabled(file)
	if err != nil || !on || size != 32<<20-int64(os.Getpagesize()) {
		t.Fatalf("while up: swap file enabled %v, %d bytes, %v", on, size, err)
	}
}
