package agent

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/testutil"
)

// startBinaryAgent runs the real dsec-agent binary as PID 1 of a new pid
// namespace, with the control socket as fd 3, as the container backend does
// (minus the mount setup: it shares the host's filesystem and /proc).
func startBinaryAgent(t testing.TB) (*Client, *exec.Cmd) {
	t.Helper()
	testutil.RequireRoot(t)
	bin := testutil.BuildBinary(t, "./cmd/dsec-agent")
	a, e := socketPair(t)
	cmd := exec.Command(bin)
	cmd.ExtraFiles = []*os.File{a}
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	a.Close()
	c := NewClient(e)
	t.Cleanup(func() {
		c.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	return c, cmd
}

func TestBinaryAgent(t *testing.T) {
	c, cmd := startBinaryAgent(t)
	ctx := context.Background()
	require.NoError(t, c.Ping(ctx))

	res, err := c.Exec(ctx, ExecRequest{Shell: `echo $$ $PPID; exit 7`}, nil)
	require.NoError(t, err)
	assert.Equal(t, 7, res.ExitCode)
	ids := strings.Fields(string(res.Stdout))
	require.Len(t, ids, 2)
	assert.Equal(t, "1", ids[1], "the agent is PID 1 of its namespace")

	res, err = c.Exec(ctx, ExecRequest{Argv: []string{"cat"}, Stdin: []byte("through the binary"), User: "nobody"}, nil)
	require.NoError(t, err)
	assert.Equal(t, "through the binary", string(res.Stdout))

	t.Run("reaps orphans", func(t *testing.T) {
		// Each subshell exits at once, leaving a child that is re-parented
		// to the agent; PID 1 must reap them or they stay zombies.
		res, err := c.Exec(ctx, ExecRequest{Shell: `for i in 1 2 3 4 5 6 7 8 9 10; do (true &); done`}, nil)
		require.NoError(t, err)
		require.Equal(t, 0, res.ExitCode)
		agentPid := strconv.Itoa(cmd.Process.Pid)
		eventually(t, "orphans reaped", func() bool { return len(zombieChildren(t, agentPid)) == 0 })
	})

	t.Run("timeout kills tree", func(t *testing.T) {
		m := marker()
		t.Cleanup(func() { killMarked(t, m) })
		res, err := c.Exec(ctx, ExecRequest{
			Shell:   treeScript(m),
			Env:     []string{"TMPF=" + filepath.Join(t.TempDir(), "started")},
			Timeout: 2e9,
		}, nil)
		require.NoError(t, err)
		require.True(t, res.TimedOut)
		if !strings.Contains(string(res.Stdout), "ready") {
			t.Skip("tree did not finish starting before the timeout")
		}
		assert.Empty(t, liveWithMarker(t, m))
	})
}

func zombieChildren(t *testing.T, ppid string) []string {
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue
		}
		if f := statusField(b, "PPid:"); len(f) == 1 && f[0] == ppid {
			if st := statusField(b, "State:"); len(st) > 0 && st[0] == "Z" {
				out = append(out, e.Name())
			}
		}
	}
	return out
}

func TestBinaryAgentKilledMidExec(t *testing.T) {
	c, cmd := startBinaryAgent(t)
	m := marker()
	t.Cleanup(func() { killMarked(t, m) })
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(context.Background(), ExecRequest{Shell: "echo up; sleep " + m},
			func(Stream, []byte) { close(started) })
		done <- err
	}()
	<-started
	require.NoError(t, cmd.Process.Kill())
	err := <-done
	require.ErrorIs(t, err, ErrDisconnected)
	<-c.Done()
	require.ErrorIs(t, c.Ping(context.Background()), ErrDisconnected)
	_, err = c.ReadFile(context.Background(), "/etc/passwd", 0)
	require.ErrorIs(t, err, ErrDisconnected)
	// PID 1 died: the kernel kills the rest of its namespace.
	eventually(t, "namespace emptied", func() bool { return len(liveWithMarker(t, m)) == 0 })
}
