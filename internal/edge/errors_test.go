package edge_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/edge"
)

// TestRuntimeErrorClassification: what a sandbox's workload does to its own
// sandbox, and what a caller sends that the agent refuses, is never an
// infrastructure failure. Input -> Connect code, or -> exec outcome; each
// row in a sandbox of its own (real container backend), after its setup.
func TestRuntimeErrorClassification(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "n1", nil)
	a := tenant("a")
	big := strings.Repeat("x", 3<<20)
	type op func(t *testing.T, id string) (*dsecv1.ExecResult, error)
	exec := func(r *dsecv1.ExecRequest) op {
		return func(t *testing.T, id string) (*dsecv1.ExecResult, error) { return n.exec(t, a, id, r) }
	}
	read := func(path string, max int64) op {
		return func(t *testing.T, id string) (*dsecv1.ExecResult, error) {
			_, err := n.client.ReadFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeReadFileRequest{
				Caller: a, Request: &dsecv1.ReadFileRequest{SandboxId: id, Path: path, MaxBytes: max}}))
			return nil, err
		}
	}
	write := func(path string) op {
		return func(t *testing.T, id string) (*dsecv1.ExecResult, error) {
			_, err := n.client.WriteFileOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeWriteFileRequest{
				Caller: a, Request: &dsecv1.WriteFileRequest{SandboxId: id, Path: path, Data: []byte("500")}}))
			return nil, err
		}
	}
	tests := []struct {
		name  string
		fill  bool
		setup string // shell run first; must exit 0
		op    op
		// want is a Connect code, or 0 and an outcome.
		code    connect.Code
		outcome string
		mention string
		check   func(t *testing.T, res *dsecv1.ExecResult)
	}{
		{name: "NUL in argv", op: exec(&dsecv1.ExecRequest{Argv: []string{"echo", "a\x00b"}}), code: connect.CodeInvalidArgument, mention: "argv[1] has a NUL byte"},
		{name: "NUL in env", op: exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Env: []string{"K=a\x00b"}}), code: connect.CodeInvalidArgument, mention: "NUL"},
		{name: "NUL in cwd", op: exec(&dsecv1.ExecRequest{Argv: []string{"true"}, Cwd: "/tmp\x00x"}), code: connect.CodeInvalidArgument, mention: "cwd has a NUL byte"},
		{name: "NUL in a path", op: read("/etc/\x00passwd", 0), code: connect.CodeInvalidArgument, mention: "NUL"},
		{name: "argv of 3 MiB", op: exec(&dsecv1.ExecRequest{Argv: []string{"echo", big}}), code: connect.CodeInvalidArgument, mention: "argv[1] is 3145728 bytes"},
		{name: "timeout of 9.3e9 s", op: exec(&dsecv1.ExecRequest{Argv: []string{"echo", "ok"}, Timeout: &durationpb.Duration{Seconds: 9_300_000_000}}), code: connect.CodeInvalidArgument, mention: "timeout"},
		{name: "missing program", op: exec(&dsecv1.ExecRequest{Argv: []string{"/no/such/program"}}), outcome: string(edge.OutcomeFailed)},
		{
			// Four sleeps, then the user cgroup's limit lowered to what it
			// holds: as a fork bomb leaves it, without a race.
			name: "exec with the pids limit full", fill: true,
			setup:   "for i in 1 2 3 4; do sleep 1000 >/dev/null 2>&1 </dev/null & done",
			op:      exec(&dsecv1.ExecRequest{Argv: []string{"true"}}),
			outcome: string(edge.OutcomeFailed),
			check: func(t *testing.T, res *dsecv1.ExecResult) {
				if !res.PidsExhausted || res.ExitCode != 126 || !strings.Contains(string(res.Stderr), "process limit") {
					t.Errorf("want pids_exhausted, exit 126 and the reason on stderr; got %v", res)
				}
			},
		},
		{name: "ReadFile of a FIFO", setup: "mkfifo /tmp/fifo", op: read("/tmp/fifo", 0), code: connect.CodeFailedPrecondition, mention: "FIFO"},
		{name: "WriteFile to a FIFO without a reader", setup: "mkfifo /tmp/fifo", op: write("/tmp/fifo"), code: connect.CodeFailedPrecondition, mention: "/tmp/fifo"},
		{name: "ReadFile of /dev/zero", setup: "ln -s /dev/zero /tmp/zero", op: read("/tmp/zero", 0), code: connect.CodeFailedPrecondition, mention: "character device"},
		{name: "ReadFile EIO", op: read("/proc/self/mem", 0), code: connect.CodeFailedPrecondition, mention: "input/output error"},
		{name: "ReadFile over max_bytes", setup: "echo 0123456789 >/tmp/ten", op: read("/tmp/ten", 4), code: connect.CodeInvalidArgument, mention: "max_bytes"},
		{name: "WriteFile to /proc/self/oom_score_adj", op: write("/proc/self/oom_score_adj"), code: connect.CodePermissionDenied, mention: "procfs"},
		{name: "passwd is /dev/zero, exec without HOME", setup: "ln -sf /dev/zero /etc/passwd", op: exec(&dsecv1.ExecRequest{Shell: "echo $HOME"}), outcome: string(edge.OutcomeOK)},
		{name: "passwd is /dev/zero, exec as a user", setup: "ln -sf /dev/zero /etc/passwd", op: exec(&dsecv1.ExecRequest{Argv: []string{"true"}, User: "nobody"}), code: connect.CodeFailedPrecondition, mention: "not a regular file"},
		{name: "passwd is a FIFO, exec without HOME", setup: "rm /etc/passwd && mkfifo /etc/passwd", op: exec(&dsecv1.ExecRequest{Shell: "echo $HOME"}), outcome: string(edge.OutcomeOK)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sb := n.mustCreate(t, a, &dsecv1.SandboxSpec{Image: baseImage, Resources: &dsecv1.Resources{Pids: 64}})
			if tc.setup != "" {
				if res, err := n.exec(t, a, sb.Id, &dsecv1.ExecRequest{Shell: tc.setup}); err != nil || res.ExitCode != 0 {
					t.Fatalf("setup %q: %v, %v", tc.setup, res, err)
				}
			}
			var restore func()
			if tc.fill {
				restore = fillUserPids(t, agentPID(t, w.backend, sb.Id))
			}
			res, err := tc.op(t, sb.Id)
			if tc.code != 0 {
				wantCode(t, err, tc.code, tc.mention)
			} else {
				if err != nil {
					t.Fatalf("want outcome %s, got error %v", tc.outcome, err)
				}
				if res.Outcome != tc.outcome {
					t.Fatalf("outcome %q (%v), want %q", res.Outcome, res, tc.outcome)
				}
				if tc.check != nil {
					tc.check(t, res)
				}
			}
			// And the sandbox is still fine.
			if restore != nil {
				restore()
			}
			if res, err := n.exec(t, a, sb.Id, &dsecv1.ExecRequest{Argv: []string{"cat", "/proc/1/oom_score_adj"}}); err != nil || res.Outcome != string(edge.OutcomeOK) {
				t.Fatalf("the sandbox after the row: %v, %v", res, err)
			} else if tc.name == "WriteFile to /proc/self/oom_score_adj" && strings.TrimSpace(string(res.Stdout)) == "500" {
				t.Errorf("the refused write changed the agent's oom_score_adj to 500")
			}
		})
	}
}

// fillUserPids sets the pids limit of the user cgroup of the sandbox whose
// agent is pid to the number of processes it holds, and returns what puts
// the limit back.
func fillUserPids(t *testing.T, pid int) func() {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	dir := ""
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if slices.Contains(strings.Split(parts[1], ","), "pids") {
			dir = filepath.Join("/sys/fs/cgroup/pids", parts[2], "user")
		} else if parts[0] == "0" && parts[1] == "" && dir == "" {
			dir = filepath.Join("/sys/fs/cgroup", parts[2], "user")
		}
	}
	cur, err := os.ReadFile(filepath.Join(dir, "pids.current"))
	if err != nil {
		t.Skipf("no user pids cgroup for the agent %d: %v", pid, err)
	}
	old, err := os.ReadFile(filepath.Join(dir, "pids.max"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "pids.max"), cur, 0); err != nil {
		t.Fatal(err)
	}
	return func() {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), old, 0); err != nil {
			t.Error(err)
		}
	}
}
