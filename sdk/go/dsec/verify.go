package dsec

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Verify runs a grading command (opts, as for ExecWith) in a verifier: a
// fresh sandbox of this sandbox's images as created, with its resources
// and environment and no network, into which only artifacts are copied
// from this sandbox (absolute paths, files or directories, each to the
// same path). Nothing else the agent changed (a conftest.py that passes
// every test, a patched test runner, a trojaned binary) reaches the grade.
// The verifier is destroyed afterwards; the step is on this sandbox's
// trajectory, numbered like an exec.
func (s *Sandbox) Verify(ctx context.Context, opts ExecOptions, artifacts ...string) (*ExecResult, error) {
	opts.Seq = s.take(opts.Seq)
	req := &dsecv1.VerifyRequest{SandboxId: s.ID, Artifacts: artifacts, Exec: opts.proto(s.ID), Seq: opts.Seq}
	var resp *connect.Response[dsecv1.VerifyResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.Verify(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("verify sandbox %s: %w", s.ID, err)
	}
	return resultFromProto(resp.Msg.GetResult()), nil
}
