package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/testutil"
)

func TestExec(t *testing.T) {
	c := startAgent(t, Options{Env: []string{"BASE=base", "FOO=default"}})
	dir := t.TempDir()
	realDir, err := filepath.EvalSymlinks(dir)
	require.NoError(t, err)

	tests := []struct {
		name       string
		req        ExecRequest
		wantCode   int
		wantSignal int
		wantOut    string
		wantErr    string
	}{
		{name: "true", req: ExecRequest{Argv: []string{"/bin/true"}}},
		{name: "exit code", req: ExecRequest{Shell: "exit 3"}, wantCode: 3},
		{name: "argv from PATH", req: ExecRequest{Argv: []string{"echo", "a b", "c"}}, wantOut: "a b c\n"},
		{name: "stderr", req: ExecRequest{Shell: "echo out; echo err >&2"}, wantOut: "out\n", wantErr: "err\n"},
		{name: "signal", req: ExecRequest{Shell: "kill -TERM $$"}, wantCode: 128 + 15, wantSignal: 15},
		{name: "stdin", req: ExecRequest{Argv: []string{"cat"}, Stdin: []byte("from stdin")}, wantOut: "from stdin"},
		{name: "no stdin reads EOF", req: ExecRequest{Argv: []string{"cat"}}},
		{name: "env overrides and defaults", req: ExecRequest{Shell: `echo "$BASE $FOO $HOME"; [ -n "$PATH" ]`, Env: []string{"FOO=over"}}, wantOut: "base over /root\n"},
		{name: "cwd", req: ExecRequest{Argv: []string{"pwd"}, Cwd: dir}, wantOut: realDir + "\n"},
		{name: "stdin not read", req: ExecRequest{Argv: []string{"true"}, Stdin: bytes.Repeat([]byte("x"), 3<<20)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res, err := c.Exec(context.Background(), tc.req, nil)
			require.NoError(t, err)
			assert.Equal(t, tc.wantCode, res.ExitCode)
			assert.Equal(t, tc.wantSignal, res.Signal)
			assert.Equal(t, tc.wantOut, string(res.Stdout))
			assert.Equal(t, tc.wantErr, string(res.Stderr))
			assert.False(t, res.TimedOut)
			assert.Positive(t, res.Duration)
		})
	}
}

func TestExecErrors(t *testing.T) {
	c := startAgent(t, Options{})
	tests := []struct {
		name string
		req  ExecRequest
		code Code
		is   error
		msg  string
	}{
		{"empty", ExecRequest{}, CodeInvalidArgument, fs.ErrInvalid, "empty"},
		{"missing cwd", ExecRequest{Argv: []string{"true"}, Cwd: "/no/such/dir"}, CodeNotFound, fs.ErrNotExist, "/no/such/dir"},
		{"cwd is a file", ExecRequest{Argv: []string{"true"}, Cwd: "/etc/passwd"}, CodeInvalidArgument, fs.ErrInvalid, "/etc/passwd"},
		{"unknown user", ExecRequest{Argv: []string{"true"}, User: "no-such-user-xyz"}, CodeNotFound, fs.ErrNotExist, "no-such-user-xyz"},
		{"bad user spec", ExecRequest{Argv: []string{"true"}, User: "root:"}, CodeInvalidArgument, fs.ErrInvalid, "root:"},
		{"NUL in argv", ExecRequest{Argv: []string{"echo", "a\x00b"}}, CodeInvalidArgument, fs.ErrInvalid, "argv[1] contains a NUL byte"},
		{"NUL in env", ExecRequest{Argv: []string{"true"}, Env: []string{"K=a\x00b"}}, CodeInvalidArgument, fs.ErrInvalid, "env[0] contains a NUL byte"},
		{"NUL in shell", ExecRequest{Shell: "true\x00"}, CodeInvalidArgument, fs.ErrInvalid, "NUL byte"},
		{"E2BIG", ExecRequest{Argv: []string{"echo", strings.Repeat("x", 256<<10)}}, CodeInvalidArgument, fs.ErrInvalid, "too large"},
		{"larger than a frame", ExecRequest{Argv: []string{"echo", strings.Repeat("x", MaxFrame)}}, CodeInvalidArgument, fs.ErrInvalid, "byte limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Exec(context.Background(), tc.req, nil)
			require.Error(t, err)
			var ae *Error
			require.ErrorAs(t, err, &ae)
			assert.Equal(t, tc.code, ae.Code)
			assert.ErrorIs(t, err, tc.is)
			assert.Contains(t, err.Error(), tc.msg)
			assert.NotErrorIs(t, err, ErrDisconnected)
		})
	}
	// The connection survives refused requests.
	require.NoError(t, c.Ping(context.Background()))
}

func TestExecUser(t *testing.T) {
	testutil.RequireRoot(t)
	etc := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(etc, "passwd"), []byte(
		"root:x:0:0:root:/root:/bin/sh\n"+
			"alice:x:1234:1235:Alice:/home/alice:/bin/sh\n"+
			"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(etc, "group"), []byte(
		"root:x:0:\n"+
			"alicegrp:x:1235:\n"+
			"dev:x:2000:bob,alice\n"+
			"ops:x:2001:alice\n"+
			"other:x:2002:bob\n"+
			"nogroup:x:65534:\n"), 0o644))
	c := startAgent(t, Options{EtcDir: etc})

	tests := []struct {
		user string
		want string
	}{
		{"nobody", "65534 65534 65534 /nonexistent"},
		{"65534", "65534 65534 65534 /nonexistent"},
		{"alice", "1234 1235 1235 2000 2001 /home/alice"},
		{"1234", "1234 1235 1235 2000 2001 /home/alice"},
		{"alice:ops", "1234 2001 2001 2000 /home/alice"},
		{"alice:2002", "1234 2002 2002 2000 2001 /home/alice"},
		{"4321:4322", "4321 4322 4322 /"},
		{"root", "0 0 0 /root"},
	}
	for _, tc := range tests {
		t.Run(tc.user, func(t *testing.T) {
			res, err := c.Exec(context.Background(), ExecRequest{
				Shell: `echo $(id -u) $(id -g) $(id -G) $HOME`, User: tc.user,
			}, nil)
			require.NoError(t, err)
			require.Equal(t, 0, res.ExitCode, "stderr: %s", res.Stderr)
			assert.Equal(t, tc.want, strings.TrimSpace(string(res.Stdout)))
		})
	}

	// The switch is real: nobody cannot write where root can.
	dir := t.TempDir()
	res, err := c.Exec(context.Background(), ExecRequest{Shell: "touch " + dir + "/f", User: "nobody"}, nil)
	require.NoError(t, err)
	assert.NotEqual(t, 0, res.ExitCode)
	assert.Contains(t, string(res.Stderr), "Permission denied")
}

func TestExecLargeOutput(t *testing.T) {
	c := startAgent(t, Options{})
	const total = 8 << 20
	line := []byte("0123456789abcdef\n")
	want := bytes.Repeat(line, total/len(line)+1)[:total]
	wantSum := sha256.Sum256(want)
	req := ExecRequest{Shell: fmt.Sprintf("yes 0123456789abcdef | head -c %d; yes e | head -c %d >&2", total, total/2), MaxOutputBytes: 1 << 20}

	t.Run("streaming delivers everything", func(t *testing.T) {
		h := sha256.New()
		var n, nerr int
		res, err := c.Exec(context.Background(), req, func(s Stream, data []byte) {
			if s == Stdout {
				h.Write(data)
				n += len(data)
			} else {
				nerr += len(data)
			}
		})
		require.NoError(t, err)
		assert.Equal(t, total, n)
		assert.Equal(t, total/2, nerr)
		assert.Equal(t, wantSum[:], h.Sum(nil))
		assert.Equal(t, want[:1<<20], res.Stdout)
		assert.Len(t, res.Stderr, 1<<20)
		assert.True(t, res.StdoutTruncated)
		assert.True(t, res.StderrTruncated)
	})
	t.Run("capture only", func(t *testing.T) {
		res, err := c.Exec(context.Background(), req, nil)
		require.NoError(t, err)
		assert.Equal(t, 0, res.ExitCode)
		assert.Equal(t, want[:1<<20], res.Stdout)
		assert.Len(t, res.Stderr, 1<<20)
		assert.True(t, res.StdoutTruncated)
		assert.True(t, res.StderrTruncated)
	})
	t.Run("exactly the limit is not truncated", func(t *testing.T) {
		res, err := c.Exec(context.Background(), ExecRequest{Shell: "head -c 1000 /dev/zero", MaxOutputBytes: 1000}, nil)
		require.NoError(t, err)
		assert.Len(t, res.Stdout, 1000)
		assert.False(t, res.StdoutTruncated)
	})
}

// treeScript starts a process tree that plain process-group killing would
// not fully get: background sleepers, an orphan (parent gone), and a child
// that moved to its own process group. It prints "ready" once all exist.
func treeScript(m string) string {
	return fmt.Sprintf(`
for i in 1 2 3 4 5; do sleep %[1]s & done
(sleep %[1]s &)
perl -e 'setpgrp(0,0); open(F, ">", $ARGV[1]); close F; exec "sleep", $ARGV[0]' %[1]s "$TMPF" &
while [ ! -e "$TMPF" ]; do sleep 0.01; done
echo ready
sleep %[1]s
`, m)
}

func TestExecTimeoutKillsTree(t *testing.T) {
	c := startAgent(t, Options{})
	m := marker()
	t.Cleanup(func() { killMarked(t, m) })
	// The tree must exist before the timeout fires for the test to mean
	// anything; on a very slow machine try again with more time.
	for _, timeout := range []time.Duration{time.Second, 5 * time.Second, 30 * time.Second} {
		res, err := c.Exec(context.Background(), ExecRequest{
			Shell:   treeScript(m),
			Env:     []string{"TMPF=" + filepath.Join(t.TempDir(), "started")},
			Timeout: timeout,
		}, nil)
		require.NoError(t, err)
		assert.True(t, res.TimedOut)
		assert.Equal(t, 9, res.Signal)
		if !strings.Contains(string(res.Stdout), "ready") {
			continue
		}
		assert.Empty(t, liveWithMarker(t, m), "processes of the exec survived its timeout")
		return
	}
	t.Fatal("the process tree never finished starting")
}

func TestExecCancelKillsTree(t *testing.T) {
	c := startAgent(t, Options{})
	m := marker()
	t.Cleanup(func() { killMarked(t, m) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res, err := c.Exec(ctx, ExecRequest{
		Shell: treeScript(m),
		Env:   []string{"TMPF=" + filepath.Join(t.TempDir(), "started")},
	}, func(s Stream, data []byte) {
		if bytes.Contains(data, []byte("ready")) {
			cancel()
		}
	})
	require.ErrorIs(t, err, context.Canceled)
	assert.NotErrorIs(t, err, ErrDisconnected)
	assert.Equal(t, 9, res.Signal)
	assert.False(t, res.TimedOut)
	assert.Empty(t, liveWithMarker(t, m), "processes of the exec survived its cancellation")
	require.NoError(t, c.Ping(context.Background()))
}

func TestExecBackgroundChildKeepsPipe(t *testing.T) {
	c := startAgent(t, Options{})
	m := marker()
	t.Cleanup(func() { killMarked(t, m) })
	// The sleeper inherits stdout and stderr and outlives the shell; the
	// exec still finishes (after the output grace) with everything the
	// shell wrote.
	res, err := c.Exec(context.Background(), ExecRequest{Shell: "sleep " + m + " & echo started"}, nil)
	require.NoError(t, err)
	assert.Equal(t, 0, res.ExitCode)
	assert.Equal(t, "started\n", string(res.Stdout))
	assert.Len(t, liveWithMarker(t, m), 1, "a normal exit leaves background processes alone")
}

func TestExecConcurrent(t *testing.T) {
	c := startAgent(t, Options{})
	const n = 50
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			res, err := c.Exec(context.Background(), ExecRequest{
				Shell: `echo "$N"; head -c 100000 /dev/zero | tr '\0' x; exit $((N % 7))`,
				Env:   []string{fmt.Sprintf("N=%d", i)},
			}, nil)
			switch {
			case err != nil:
				errs[i] = err
			case res.ExitCode != i%7:
				errs[i] = fmt.Errorf("exec %d: exit code %d", i, res.ExitCode)
			case !strings.HasPrefix(string(res.Stdout), fmt.Sprintf("%d\n", i)) || len(res.Stdout) != len(fmt.Sprint(i))+1+100000:
				errs[i] = fmt.Errorf("exec %d: wrong output (%d bytes)", i, len(res.Stdout))
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		assert.NoError(t, err)
	}
}

// A consumer that stops reading one exec's output must not hold up others:
// flow control stalls only that exec.
func TestSlowConsumerIsolated(t *testing.T) {
	c := startAgent(t, Options{})
	release := make(chan struct{})
	stalled := make(chan struct{})
	var once sync.Once
	slowDone := make(chan error, 1)
	var got int
	go func() {
		_, err := c.Exec(context.Background(), ExecRequest{Shell: "head -c 20000000 /dev/zero"}, func(s Stream, data []byte) {
			got += len(data)
			once.Do(func() {
				close(stalled)
				<-release
			})
		})
		slowDone <- err
	}()
	<-stalled
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		res, err := c.Exec(ctx, ExecRequest{Argv: []string{"echo", "fast"}}, nil)
		cancel()
		require.NoError(t, err, "an exec behind a stalled consumer did not finish")
		assert.Equal(t, "fast\n", string(res.Stdout))
	}
	close(release)
	require.NoError(t, <-slowDone)
	assert.Equal(t, 20000000, got)
}

func TestClientClosedFailsPending(t *testing.T) {
	c := startAgent(t, Options{})
	m := marker()
	t.Cleanup(func() { killMarked(t, m) })
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(context.Background(), ExecRequest{Shell: "echo up; sleep " + m}, func(Stream, []byte) { close(started) })
		done <- err
	}()
	<-started
	c.Close()
	err := <-done
	require.ErrorIs(t, err, ErrDisconnected)
	require.ErrorIs(t, c.Ping(context.Background()), ErrDisconnected)
	_, err = c.Exec(context.Background(), ExecRequest{Argv: []string{"true"}}, nil)
	require.ErrorIs(t, err, ErrDisconnected)
	// Serve kills what was running when its connection ended; Cleanup
	// waits for Serve, this waits for the kill to be visible.
	eventually(t, "exec tree killed after the connection ended", func() bool { return len(liveWithMarker(t, m)) == 0 })
}

func TestProtocolViolationEndsServe(t *testing.T) {
	a, e := socketPair(t)
	defer e.Close()
	done := make(chan error, 1)
	go func() { done <- Serve(context.Background(), a, Options{}) }()
	_, err := e.Write([]byte{0xff, 0xff, 0xff, 0xff})
	require.NoError(t, err)
	err = <-done
	require.Error(t, err)
	assert.Contains(t, err.Error(), "limit")
	assert.False(t, errors.Is(err, context.Canceled))
}

// TestExecHugeTimeout: a timeout near the largest duration (9.3e9 s
// overflowed into an immediate failure on its way here) runs the command.
func TestExecHugeTimeout(t *testing.T) {
	c := startAgent(t, Options{})
	res, err := c.Exec(context.Background(), ExecRequest{Argv: []string{"echo", "ok"}, Timeout: time.Duration(math.MaxInt64)}, nil)
	require.NoError(t, err)
	assert.Equal(t, 0, res.ExitCode)
	assert.False(t, res.TimedOut)
	assert.Equal(t, "ok\n", string(res.Stdout))
}

// TestExecCannotStart: a command that cannot start is the command's
// failure, as a shell reports it (127 no such program, 126 not runnable,
// the reason on stderr), not an error a caller could take for the
// platform's.
func TestExecCannotStart(t *testing.T) {
	c := startAgent(t, Options{})
	for _, tc := range []struct {
		name string
		argv []string
		code int
		msg  string
	}{
		{"not in PATH", []string{"no-such-command-xyz"}, 127, "no-such-command-xyz"},
		{"missing path", []string{"/no/such/bin"}, 127, "/no/such/bin not found"},
		{"not executable", []string{"/etc/passwd"}, 126, "/etc/passwd: permission denied"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var streamed []byte
			res, err := c.Exec(context.Background(), ExecRequest{Argv: tc.argv}, func(s Stream, b []byte) {
				if s == Stderr {
					streamed = append(streamed, b...)
				}
			})
			require.NoError(t, err)
			assert.Equal(t, tc.code, res.ExitCode)
			assert.Contains(t, string(streamed), tc.msg)
		})
	}
	res, err := c.Exec(context.Background(), ExecRequest{Argv: []string{"no-such-command-xyz"}}, nil)
	require.NoError(t, err)
	assert.Equal(t, 127, res.ExitCode)
	assert.Contains(t, string(res.Stderr), "no-such-command-xyz")
}

// TestExecVerdict: what Options.Verdict says reaches the client's result;
// a full disk only explains a failed command.
func TestExecVerdict(t *testing.T) {
	var calls atomic.Int32
	c := startAgent(t, Options{Verdict: func() Verdict {
		calls.Add(1)
		return Verdict{OOMKilled: true, DiskFull: true}
	}})
	ctx := context.Background()
	res, err := c.Exec(ctx, ExecRequest{Shell: "exit 0"}, nil)
	require.NoError(t, err)
	require.True(t, res.OOMKilled, "an OOM kill during a successful command is not reported: %+v", res)
	require.False(t, res.DiskFull, "a successful command is said to have met a full disk: %+v", res)
	res, err = c.Exec(ctx, ExecRequest{Shell: "exit 1"}, nil)
	require.NoError(t, err)
	require.True(t, res.OOMKilled && res.DiskFull, "the verdict did not reach the result: %+v", res)
	require.EqualValues(t, 2, calls.Load())
}
