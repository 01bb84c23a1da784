package dsec_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// The batch API, pools, fncall and admission through the Go SDK against a
// real `dsec up` (a small node: 10 sandbox slots, an admission queue of
// one), as a trainer would use them.

const (
	liveSlots  = 10
	bashImage  = "busybox-bash:latest"
	fillWithin = time.Minute
)

// startUp runs `dsec up` on a fresh data directory with busybox imported
// and returns a client for it. Cleanup stops it (SIGTERM destroys its
// sandboxes). extra are more flags for dsec up.
func startUp(t *testing.T, extra ...string) *dsec.Client {
	t.Helper()
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, "./cmd/dsec")
	agent := testutil.BuildBinary(t, "./cmd/dsec-agent")
	data := t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	var log strings.Builder
	var logMu sync.Mutex
	args := append([]string{"up", "--data-dir", data, "--listen", addr, "--agent", agent, "--node-id", "live",
		"--log-level", "warn", "--max-sandboxes", fmt.Sprint(liveSlots), "--queue-size", "1", "--fn-warm", "1"}, extra...)
	cmd := exec.Command(bin, args...)
	w := writerFunc(func(b []byte) (int, error) { logMu.Lock(); defer logMu.Unlock(); return log.Write(b) })
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(time.Minute):
			cmd.Process.Kill()
			<-done
			t.Error("dsec up did not stop in a minute")
		}
		if t.Failed() {
			logMu.Lock()
			t.Logf("dsec up log:\n%s", log.String())
			logMu.Unlock()
		}
	})
	endpoint := "http://" + addr
	poll(t, 30*time.Second, "dsec up healthy", func() bool {
		select {
		case err := <-done:
			t.Fatalf("dsec up exited: %v\n%s", err, log.String())
		default:
		}
		resp, err := http.Get(endpoint + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	token, err := os.ReadFile(filepath.Join(data, "admin.token"))
	if err != nil {
		t.Fatal(err)
	}
	c := dsec.New(endpoint, strings.TrimSpace(string(token)))
	rootfs := testsuite.BusyboxRootfs(t)
	if _, err := c.Images().ImportServerPath(t.Context(), "busybox:latest", rootfs, dsec.Public()); err != nil {
		t.Fatal(err)
	}
	// The language table runs bash code with `bash`; busybox has none, so
	// this image's /bin/bash hands the script to busybox's sh.
	if err := os.WriteFile(filepath.Join(rootfs, "bin", "bash"), []byte("#!/bin/sh\nexec /bin/sh \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Images().ImportServerPath(t.Context(), bashImage, rootfs); err != nil {
		t.Fatal(err)
	}
	return c
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// poll calls cond until it holds or timeout passes: how these tests wait
// for the server's background work, never a fixed sleep.
func poll(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for delay := 5 * time.Millisecond; !cond(); delay = min(2*delay, 100*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: not after %v", what, timeout)
		}
		time.Sleep(delay)
	}
}

func smallSpec(env ...string) dsec.Spec {
	return dsec.Spec{Image: "busybox:latest", Resources: dsec.Resources{MilliCPU: 250, MemoryBytes: 64 << 20}, Env: env}
}

func TestLive(t *testing.T) {
	c := startUp(t)
	t.Run("run", func(t *testing.T) { testLiveRun(t, c) })
	t.Run("batch", func(t *testing.T) { testLiveBatch(t, c) })
	t.Run("pool", func(t *testing.T) { testLivePool(t, c) })
	t.Run("runcode", func(t *testing.T) { testLiveRunCode(t, c) })
	t.Run("admission", func(t *testing.T) { testLiveAdmission(t, c) })
	t.Run("display", func(t *testing.T) { testLiveDisplay(t, c) })
}

// testLiveDisplay: a container sandbox has no screen, and bad input is
// refused naming the event before any sandbox is touched.
func testLiveDisplay(t *testing.T, c *dsec.Client) {
	ctx := t.Context()
	sb, err := c.Create(ctx, smallSpec())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Destroy(context.Background()) })
	if _, _, _, err := sb.Screenshot(ctx); !dsec.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "fullvm") {
		t.Fatalf("screenshot of a container sandbox: %v, want FailedPrecondition naming fullvm", err)
	}
	if err := sb.Input(ctx, dsec.PressKey("ret")); !dsec.IsFailedPrecondition(err) {
		t.Fatalf("input to a container sandbox: %v, want FailedPrecondition", err)
	}
	for _, tc := range []struct {
		events []dsec.InputEvent
		field  string
	}{
		{nil, "events is required"},
		{[]dsec.InputEvent{dsec.PressKey("ret"), dsec.PressKey("ctrl--c")}, "events[1].key"},
		{[]dsec.InputEvent{dsec.TypeText("")}, "events[0].text"},
		{[]dsec.InputEvent{dsec.ClickAt(-1, 5, "")}, "events[0].x"},
		{[]dsec.InputEvent{dsec.ClickAt(1, 5, "fourth")}, "events[0].button"},
	} {
		if err := sb.Input(ctx, tc.events...); !dsec.IsInvalidArgument(err) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("input %v: %v, want InvalidArgument naming %s", tc.events, err, tc.field)
		}
	}
}

func testLiveBatch(t *testing.T, c *dsec.Client) {
	ctx := t.Context()
	got, err := c.Acquire(ctx, 4, smallSpec())
	if err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	sbs := dsec.Acquired(got)
	t.Cleanup(func() { c.Release(context.Background(), sbs) })
	ghost := c.Sandbox(sbs[0].Node + "-0000000000000000")
	cmds := make([]dsec.ExecOptions, 5)
	for i := range cmds {
		cmds[i] = dsec.ExecOptions{Shell: fmt.Sprintf("echo v%d > /root/f; cat /root/f", i)}
	}
	res, err := c.BatchExec(ctx, append(sbs, ghost), cmds)
	var be *dsec.BatchError
	if !errors.As(err, &be) || len(be.Errs) != 1 || !dsec.IsNotFound(res[4].Err) {
		t.Fatalf("BatchExec with a missing sandbox: %v; items %+v", err, res)
	}
	for i, r := range res[:4] {
		if r.Err != nil || !r.Result.OK() || string(r.Result.Stdout) != fmt.Sprintf("v%d\n", i) || r.Result.Seq != 1 {
			t.Fatalf("item %d: %+v %+v", i, r.Result, r.Err)
		}
	}
	cks := make([]string, len(sbs))
	for i, sb := range sbs {
		if cks[i], err = sb.Checkpoint(ctx); err != nil { // step 2
			t.Fatal(err)
		}
	}
	if _, err := c.BatchExec(ctx, sbs, []dsec.ExecOptions{{Shell: "echo changed > /root/f"}}); err != nil { // step 3
		t.Fatal(err)
	}
	rolled, err := c.BatchRollback(ctx, sbs, cks) // step 4
	if err != nil {
		t.Fatalf("BatchRollback: %v", err)
	}
	for i, r := range rolled {
		if r.Result == nil || r.Result.Seq != 4 {
			t.Fatalf("rollback %d: %+v", i, r)
		}
	}
	res, err = c.BatchExec(ctx, sbs, []dsec.ExecOptions{{Argv: []string{"cat", "/root/f"}}}) // step 5
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if string(r.Result.Stdout) != fmt.Sprintf("v%d\n", i) || r.Result.Seq != 5 {
			t.Fatalf("after rollback, sandbox %d: %q seq %d", i, r.Result.Stdout, r.Result.Seq)
		}
	}
	one, err := sbs[2].ExecShell(ctx, "echo single")
	if err != nil || one.Seq != 6 {
		t.Fatalf("single exec after the batches: %+v, %v; want seq 6", one, err)
	}
	rel, err := c.Release(ctx, append(sbs, ghost))
	if !errors.As(err, &be) || len(be.Errs) != 1 || rel[0].Err != nil || !dsec.IsNotFound(rel[4].Err) {
		t.Fatalf("Release: %v; %+v", err, rel)
	}
	left, err := c.List(ctx, nil)
	if err != nil || len(left) != 0 {
		t.Fatalf("after Release: %d sandboxes left (%v)", len(left), err)
	}
}

func testLivePool(t *testing.T, c *dsec.Client) {
	ctx := t.Context()
	spec := smallSpec("POOL=go-live")
	p, err := c.CreatePool(ctx, spec, 2, dsec.PoolOptions{})
	if err != nil {
		t.Fatalf("CreatePool: %v", err)
	}
	t.Cleanup(func() { c.DeletePool(context.Background(), p.ID) })
	find := func() *dsec.Pool {
		pools, err := c.ListPools(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range pools {
			if q.ID == p.ID {
				return q
			}
		}
		t.Fatalf("pool %s not listed", p.ID)
		return nil
	}
	poll(t, fillWithin, "the pool to fill", func() bool { return find().Ready == 2 })
	before := find()
	got, err := c.Acquire(ctx, 2, spec)
	if err != nil {
		t.Fatal(err)
	}
	var after *dsec.Pool
	poll(t, fillWithin, "two hits", func() bool { after = find(); return after.Hits >= before.Hits+2 })
	if after.Hits != before.Hits+2 || after.Misses != before.Misses || after.InUse != 2 {
		t.Fatalf("pool after Acquire: %+v (before %+v)", after, before)
	}
	if _, err := c.Release(ctx, dsec.Acquired(got)); err != nil {
		t.Fatal(err)
	}
	if err := c.DeletePool(ctx, p.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.DeletePool(ctx, p.ID); !dsec.IsNotFound(err) {
		t.Fatalf("deleting a deleted pool: %v", err)
	}
}

func testLiveRunCode(t *testing.T, c *dsec.Client) {
	ctx := t.Context()
	resp, err := c.RunCode(ctx, dsec.RunCodeRequest{
		Code: `read x; echo "got $x $1"; echo oops >&2; exit 3`, Language: "bash", Image: bashImage,
		Stdin: []byte("42\n"), Args: []string{"arg"},
	})
	if err != nil {
		t.Fatalf("RunCode: %v", err)
	}
	r := resp.RunResult
	if resp.Status != dsec.RunFailed || resp.CompileResult != nil || r == nil || r.Status != dsec.CommandFinished ||
		r.ReturnCode != 3 || string(r.Stdout) != "got 42 arg\n" || string(r.Stderr) != "oops\n" {
		t.Fatalf("RunCode = %+v (run %+v)", resp, r)
	}
	resp, err = c.RunCode(ctx, dsec.RunCodeRequest{Code: "sleep 30", Language: "bash", Image: bashImage, RunTimeout: time.Second})
	if err != nil || resp.RunResult == nil || resp.RunResult.Status != dsec.CommandTimeLimitExceeded {
		t.Fatalf("RunCode past its time limit = %+v, %v", resp, err)
	}
	if _, err := c.RunCode(ctx, dsec.RunCodeRequest{Code: "x", Language: "cobol", Image: bashImage}); !dsec.IsInvalidArgument(err) {
		t.Fatalf("RunCode in an unknown language: %v", err)
	}
}

// testLiveAdmission fills the node and checks what a saturated service
// answers: a bounded queue, then Unavailable with a retry-after hint,
// item by item in an Acquire.
func testLiveAdmission(t *testing.T, c *dsec.Client) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	spec := smallSpec()
	got, err := c.Acquire(ctx, liveSlots+6, spec)
	held := dsec.Acquired(got)
	t.Cleanup(func() { c.Release(context.Background(), held) })
	var be *dsec.BatchError
	if !errors.As(err, &be) {
		t.Fatalf("Acquire past capacity: %v; want per-item failures (the call itself answered before the deadline)", err)
	}
	if len(held) == 0 || len(held) > liveSlots {
		t.Fatalf("Acquire past capacity got %d sandboxes on a node of %d slots", len(held), liveSlots)
	}
	hinted := 0
	for i, r := range got {
		switch {
		case r.Sandbox != nil:
		case dsec.IsUnavailable(r.Err):
			if dsec.RetryAfter(r.Err) <= 0 {
				t.Errorf("item %d: Unavailable without a retry-after hint: %v", i, r.Err)
			}
			hinted++
		case dsec.IsResourceExhausted(r.Err):
			// waited in the queue until the deadline
		default:
			t.Errorf("item %d: %v", i, r.Err)
		}
	}
	// At most one item may wait in a queue of one: the rest are refused.
	if hinted < liveSlots+6-len(held)-1 {
		t.Fatalf("%d items refused with a hint, want all but the one queued; results %+v", hinted, got)
	}

	// Single creates on a full node: at most one waits, the others get
	// Unavailable at once with the hint in the Retry-After header.
	var (
		wg sync.WaitGroup
		mu sync.Mutex
	)
	errs := make([]error, 3)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			defer cancel()
			sb, err := c.Create(cctx, spec)
			if err == nil {
				mu.Lock()
				held = append(held, sb) // not expected; released at cleanup
				mu.Unlock()
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	refused := 0
	for _, err := range errs {
		if dsec.IsUnavailable(err) && dsec.RetryAfter(err) > 0 {
			refused++
		} else if !dsec.IsResourceExhausted(err) {
			t.Errorf("create on a full node: %v", err)
		}
	}
	if refused < 2 {
		t.Fatalf("creates on a full node: %v; want at least two refused with a hint", errs)
	}
}
