package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// api is how the harness talks to dsec up: the Go SDK for sandboxes, execs
// and files, and the generated Connect client for the state operations
// (snapshot, checkpoint, rollback, job freeze and thaw), over one HTTP/2
// connection pool as the SDK would use. Every handle is Unnumbered: the
// server numbers each operation in the trajectory, so the raw state calls
// (seq 0, "the next one") and the SDK's execs never disagree on numbers.
type api struct {
	c  *dsec.Client
	sb dsecv1connect.SandboxServiceClient
}

// opTimeout bounds one API call of the harness, so that a hung server
// fails the run instead of stalling it.
const opTimeout = 3 * time.Minute

func newAPI(endpoint, token string) *api {
	// Prior-knowledge h2c, as the SDK's default client speaks to an
	// http:// endpoint.
	t := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	t.Protocols = &p
	hc := &http.Client{Transport: t}
	return &api{
		c: dsec.New(endpoint, token, dsec.WithHTTPClient(hc)),
		sb: dsecv1connect.NewSandboxServiceClient(hc, endpoint,
			connect.WithInterceptors(bearerAuth("Bearer "+token))),
	}
}

// bearerAuth adds the Authorization header to unary calls (the only kind
// the harness makes with the raw client).
type bearerAuth string

func (b bearerAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", string(b))
		return next(ctx, req)
	}
}

func (b bearerAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", string(b))
		return conn
	}
}

func (b bearerAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// busybox is the image every sandbox of the run starts from.
const busybox = "busybox:latest"

// create makes one sandbox and returns an unnumbered handle to it.
func (a *api) create(ctx context.Context, labels map[string]string) (*dsec.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	sb, err := a.c.Create(ctx, dsec.Spec{Image: busybox, Labels: labels})
	if err != nil {
		return nil, err
	}
	return a.c.Sandbox(sb.ID, dsec.Unnumbered()), nil
}

// destroy destroys sandboxes in batches, also after the run's context was
// cancelled: a Ctrl-C must not leave them behind.
func (a *api) destroy(ctx context.Context, batch int, ids ...string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
	defer cancel()
	var errs []error
	for start := 0; start < len(ids); start += batch {
		if err := a.c.DestroyMany(ctx, ids[start:min(start+batch, len(ids))]...); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("destroy %d sandboxes: %v", len(ids), errs)
	}
	return nil
}

// sh runs script in sb and returns its stdout; anything but exit 0 is an
// error.
func sh(ctx context.Context, sb *dsec.Sandbox, script string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	r, err := sb.ExecWith(ctx, dsec.ExecOptions{Shell: script, MaxOutputBytes: 1 << 20})
	if err != nil {
		return "", fmt.Errorf("exec in %s: %w", sb.ID, err)
	}
	if r.Outcome != dsec.OutcomeOK || r.ExitCode != 0 {
		return "", fmt.Errorf("exec in %s: %q: outcome %s, exit %d %s: %s", sb.ID, short(script), r.Outcome, r.ExitCode,
			r.InfraError, strings.TrimSpace(string(r.Stderr)))
	}
	return string(r.Stdout), nil
}

func short(s string) string {
	if len(s) > 60 {
		return s[:57] + "..."
	}
	return s
}

// snapshot packs sb's writable layer into image ref.
func (a *api) snapshot(ctx context.Context, id, ref string) (*dsecv1.Image, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	resp, err := a.sb.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Ref: ref}))
	if err != nil {
		return nil, fmt.Errorf("snapshot %s as %s: %w", id, ref, err)
	}
	if resp.Msg.GetImage() == nil {
		return nil, fmt.Errorf("snapshot %s as %s: no image in the response", id, ref)
	}
	return resp.Msg.GetImage(), nil
}

func (a *api) checkpoint(ctx context.Context, id string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	resp, err := a.sb.Checkpoint(ctx, connect.NewRequest(&dsecv1.CheckpointRequest{SandboxId: id}))
	if err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", id, err)
	}
	if resp.Msg.GetCheckpointId() == "" {
		return "", fmt.Errorf("checkpoint %s: empty checkpoint id", id)
	}
	return resp.Msg.GetCheckpointId(), nil
}

func (a *api) rollback(ctx context.Context, id, ck string) error {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	if _, err := a.sb.Rollback(ctx, connect.NewRequest(&dsecv1.RollbackRequest{SandboxId: id, CheckpointId: ck})); err != nil {
		return fmt.Errorf("rollback %s to %s: %w", id, ck, err)
	}
	return nil
}

func (a *api) deleteCheckpoint(ctx context.Context, id, ck string) error {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	if _, err := a.sb.DeleteCheckpoint(ctx, connect.NewRequest(&dsecv1.DeleteCheckpointRequest{SandboxId: id, CheckpointId: ck})); err != nil {
		return fmt.Errorf("delete checkpoint %s of %s: %w", ck, id, err)
	}
	return nil
}

// job freezes (or thaws) every sandbox labelled labels and returns the
// per-sandbox results.
func (a *api) job(ctx context.Context, freeze bool, labels map[string]string) ([]*dsecv1.JobResult, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	req := connect.NewRequest(&dsecv1.JobRequest{Labels: labels})
	var (
		resp *connect.Response[dsecv1.JobResponse]
		err  error
	)
	if freeze {
		resp, err = a.sb.FreezeJob(ctx, req)
	} else {
		resp, err = a.sb.ThawJob(ctx, req)
	}
	if err != nil {
		return nil, fmt.Errorf("%s job %v: %w", freezeWord(freeze), labels, err)
	}
	return resp.Msg.GetResults(), nil
}

func freezeWord(freeze bool) string {
	if freeze {
		return "freeze"
	}
	return "thaw"
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}
