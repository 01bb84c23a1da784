package dsec_test

import (
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// testLiveRun: Run creates, runs and destroys in one call, streaming to
// the writers or collecting into the result, and leaves nothing behind.
func testLiveRun(t *testing.T, c *dsec.Client) {
	ctx := t.Context()
	var out, errOut strings.Builder
	res, err := c.Run(ctx, smallSpec("X=spec"), dsec.ExecOptions{Shell: "echo out $X; echo err >&2; exit 4"}, &out, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	if out.String() != "out spec\n" || errOut.String() != "err\n" || res.Outcome != dsec.OutcomeFailed || res.ExitCode != 4 ||
		res.SandboxID == "" || res.DestroyError != "" || len(res.Stdout) != 0 {
		t.Fatalf("Run: stdout %q stderr %q result %+v", out.String(), errOut.String(), res)
	}
	// Nil writers: the output is in the result.
	res, err = c.Run(ctx, smallSpec(), dsec.ExecOptions{Argv: []string{"sh", "-c", "echo a; echo b >&2"}}, nil, nil)
	if err != nil || !res.OK() || string(res.Stdout) != "a\n" || string(res.Stderr) != "b\n" {
		t.Fatalf("Run with nil writers: %+v, %v", res, err)
	}
	_, err = c.Run(ctx, dsec.Spec{Image: "nope:1"}, dsec.ExecOptions{Argv: []string{"true"}}, nil, nil)
	if !dsec.IsNotFound(err) || !strings.Contains(err.Error(), `run in a new sandbox from "nope:1"`) {
		t.Fatalf("Run of a missing image: %v", err)
	}
	if left, err := c.List(ctx, nil); err != nil || len(left) != 0 {
		t.Fatalf("after the runs: %d sandboxes left (%v)", len(left), err)
	}
}
