package edge_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// TestRunOnEdge: create, exec and destroy in one call on a real node, with
// the trajectory of each (creation, the command, the destroy), and
// refusals that create nothing.
func TestRunOnEdge(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "run1", nil)
	alice := tenant("alice")
	run := func(id string, ex *dsecv1.ExecRequest) (first string, stdout, stderr string, last *dsecv1.RunResponse, err error) {
		st, err := n.client.RunOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeRunRequest{
			Caller: alice, SandboxId: id, Spec: &dsecv1.SandboxSpec{Image: baseImage}, Exec: ex,
		}))
		if err != nil {
			return "", "", "", nil, err
		}
		defer st.Close()
		var out, errOut strings.Builder
		for i := 0; st.Receive(); i++ {
			m := st.Msg()
			if i == 0 {
				if m.GetEvent() != nil {
					t.Errorf("first message %v carries an event; want only the sandbox id", m)
				}
				first = m.GetSandboxId()
			}
			out.Write(m.GetStdout())
			errOut.Write(m.GetStderr())
			if m.GetResult() != nil {
				last = m
			}
		}
		return first, out.String(), errOut.String(), last, st.Err()
	}

	id := ids.NewSandbox(n.id)
	first, stdout, stderr, last, err := run(id, &dsecv1.ExecRequest{Shell: "echo hi; echo err >&2; exit 2"})
	if err != nil {
		t.Fatal(err)
	}
	if first != id || stdout != "hi\n" || stderr != "err\n" {
		t.Errorf("first %q, stdout %q, stderr %q", first, stdout, stderr)
	}
	if r := last.GetResult(); r.GetOutcome() != "failed" || r.GetExitCode() != 2 || len(r.GetStdout()) != 0 ||
		last.GetSandboxId() != id || last.GetDestroyError() != "" {
		t.Errorf("last message %v", last)
	}
	if sb, err := n.get(t, alice, id); err == nil && sb.GetState() != "destroyed" {
		t.Errorf("after the run the sandbox is %s", sb.GetState())
	}
	lines, _ := n.trajectory(t, alice, id, 0)
	var kinds []string
	for _, r := range verifyLines(t, lines) {
		kinds = append(kinds, string(r.Kind))
	}
	if want := []string{string(trajectory.KindCreate), string(trajectory.KindExec), string(trajectory.KindDestroy)}; strings.Join(kinds, " ") != strings.Join(want, " ") {
		t.Errorf("trajectory %v, want %v", kinds, want)
	}

	for _, tc := range []struct {
		ex      *dsecv1.ExecRequest
		mention string
	}{
		{nil, "exec"},
		{&dsecv1.ExecRequest{}, "argv"},
		{&dsecv1.ExecRequest{Argv: []string{"true"}, Seq: 3}, "seq"},
		{&dsecv1.ExecRequest{Argv: []string{"true"}, Env: []string{"NOEQ"}}, "env"},
	} {
		id := ids.NewSandbox(n.id)
		_, _, _, _, err := run(id, tc.ex)
		wantCode(t, err, connect.CodeInvalidArgument, tc.mention)
		if _, err := n.get(t, admin, id); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("a refused run (%v) left sandbox %s: %v", tc.ex, id, err)
		}
	}
}
