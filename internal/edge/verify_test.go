package edge_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// runTests is the task's test runner, as pytest is one: it loads a hook
// file from the task directory if one is there (conftest.py's part), then
// checks the solution.
const runTests = `#!/bin/sh
[ -f /task/conftest.sh ] && . /task/conftest.sh
if [ "$(sh /task/solution.sh)" = 42 ]; then echo "1 passed"; exit 0; fi
echo "1 failed"; exit 1
`

// TestVerify: an agent that plants a hook forcing every test to pass
// scores 1.0 when graded in its own sandbox and 0.0 through verify, which
// grades in a fresh sandbox of the task's image holding only the
// solution; a real solution passes there; the step is on the graded
// sandbox's trajectory.
func TestVerify(t *testing.T) {
	w := newWorld(t)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "task"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "task", "run_tests.sh"), []byte(runTests), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "task", "solution.sh"), []byte("echo TODO\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := layer.Import(t.Context(), w.store, image.NewStore(w.store, w.store.Refs()), "task:1", dir, nil); err != nil {
		t.Fatal(err)
	}
	n := w.startNode(t, "verify", nil)
	alice := tenant("alice")
	sb := n.mustCreate(t, alice, &dsecv1.SandboxSpec{Image: baseImage, Workspace: "task:1"})
	defer n.destroy(t, alice, sb.Id)
	sh := func(script string) *dsecv1.ExecResult {
		t.Helper()
		res, err := n.exec(t, alice, sb.Id, &dsecv1.ExecRequest{Shell: script})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	verify := func(seq uint64, artifacts ...string) (*dsecv1.ExecResult, error) {
		resp, err := n.client.VerifyOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeVerifyRequest{Caller: alice,
			Request: &dsecv1.VerifyRequest{SandboxId: sb.Id, Seq: seq, Artifacts: artifacts,
				Exec: &dsecv1.ExecRequest{Argv: []string{"/task/run_tests.sh"}, Timeout: nil}}}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.Result, nil
	}

	// The agent cheats: a wrong solution, a hook that reports a pass, a
	// tampered runner elsewhere too.
	sh(`echo 'echo 41' > /task/solution.sh
echo 'echo "1 passed"; exit 0' > /task/conftest.sh
mkdir -p /usr/local/bin && printf '#!/bin/sh\necho 42\n' > /usr/local/bin/sh`)
	if res := sh("/task/run_tests.sh"); res.ExitCode != 0 || strings.TrimSpace(string(res.Stdout)) != "1 passed" {
		t.Fatalf("graded in its own sandbox the cheat should pass (it is the attack): exit %d %q", res.ExitCode, res.Stdout)
	}
	seq := uint64(sb.NextSeq) + 2 // the two execs above took theirs
	res, err := verify(seq, "/task/solution.sh")
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 1 || strings.TrimSpace(string(res.Stdout)) != "1 failed" || res.Outcome != "failed" {
		t.Fatalf("verify of the cheat: exit %d %q %q, want 1 failed", res.ExitCode, res.Stdout, res.Stderr)
	}
	// Re-sent, the recorded grade comes back without running again.
	again, err := verify(seq, "/task/solution.sh")
	if err != nil || !again.Replayed || again.ExitCode != 1 {
		t.Fatalf("re-sent verify: %+v %v", again, err)
	}

	// A real solution passes in the verifier; a directory artifact works.
	sh(`mkdir -p /work/lib && echo 'echo 42' > /work/lib/answer.sh && echo 'sh /work/lib/answer.sh' > /task/solution.sh`)
	res, err = verify(0, "/task/solution.sh", "/work/lib")
	if err != nil || res.ExitCode != 0 || strings.TrimSpace(string(res.Stdout)) != "1 passed" {
		t.Fatalf("verify of a real solution: %+v %v", res, err)
	}

	// Bad input names the field; a missing artifact is the caller's.
	_, err = verify(0)
	wantCode(t, err, connect.CodeInvalidArgument, "artifacts")
	_, err = verify(0, "task/solution.sh")
	wantCode(t, err, connect.CodeInvalidArgument, "request.artifacts[0]")
	_, err = verify(0, "/task/nope.sh")
	wantCode(t, err, connect.CodeFailedPrecondition, "/task/nope.sh")

	// The steps are on the graded sandbox's trajectory; no verifier is
	// left (they are not listed, and the backend holds only the sandbox).
	deadline := time.Now().Add(30 * time.Second)
	var verifies int
	for {
		lines, _ := n.trajectory(t, alice, sb.Id, 0)
		verifies = 0
		for _, r := range verifyLines(t, lines) {
			if r.Kind == trajectory.KindVerify && r.Verify != nil && r.Exec != nil && r.Error == nil {
				verifies++
			}
		}
		if verifies == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if verifies != 2 {
		t.Fatalf("%d verify records without error on the trajectory, want 2", verifies)
	}
	list, err := n.client.ListOnEdge(t.Context(), connect.NewRequest(&dsecv1.EdgeListRequest{Caller: alice}))
	if err != nil || len(list.Msg.Sandboxes) != 1 {
		t.Fatalf("list after verifies: %v %v", list, err)
	}
	ents, _ := os.ReadDir(w.stateDir)
	if len(ents) != 1 {
		t.Fatalf("backend state holds %d sandboxes after the verifiers, want 1", len(ents))
	}
}
