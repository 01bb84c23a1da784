package dsec

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Every sandbox keeps a trajectory: the durable, hash-chained log of its
// operations and their results. Each operation has a step number (seq) in
// it. A handle numbers its operations itself, so that after a reconnect,
// or after a client restart that resumes the sandbox by ID and re-issues
// the same operations, the server answers numbers it has recorded with the
// recorded results instead of running them again.

// numbering hands out a handle's step numbers.
type numbering struct {
	mu   sync.Mutex
	next uint64
	off  bool
}

// HandleOption configures a handle from Client.Sandbox.
type HandleOption func(*Sandbox)

// StartAt makes the handle's next operation step n (default 1).
func StartAt(n uint64) HandleOption {
	return func(s *Sandbox) { s.seq.next = n }
}

// Unnumbered makes the handle send operations without a step number: the
// server numbers them, and nothing is fast-forwarded. For tools (like the
// CLI) that act on a sandbox alongside its trainer.
func Unnumbered() HandleOption {
	return func(s *Sandbox) { s.seq.off = true }
}

// NextSeqToSend is the step number the handle's next operation will carry (0 for
// an unnumbered handle).
func (s *Sandbox) NextSeqToSend() uint64 {
	if s.seq == nil {
		return 0
	}
	s.seq.mu.Lock()
	defer s.seq.mu.Unlock()
	if s.seq.off {
		return 0
	}
	return s.seq.next
}

// take returns the number for an operation: explicit if given, else the
// handle's next (0 when unnumbered).
func (s *Sandbox) take(explicit uint64) uint64 {
	if explicit != 0 || s.seq == nil {
		return explicit
	}
	s.seq.mu.Lock()
	defer s.seq.mu.Unlock()
	if s.seq.off {
		return 0
	}
	n := s.seq.next
	s.seq.next++
	return n
}

// giveBack returns number n to the handle when it is the last number the
// handle took: the operation that carried it was refused without being
// recorded, so the sandbox still expects n next.
func (s *Sandbox) giveBack(n uint64) {
	if s.seq == nil || n == 0 {
		return
	}
	s.seq.mu.Lock()
	defer s.seq.mu.Unlock()
	if !s.seq.off && s.seq.next == n+1 {
		s.seq.next = n
	}
}

// send runs an operation of the handle with resend. When the server
// refused a numbered operation without recording it (the sandbox is
// frozen, being rolled back or still being created; a snapshot ref checked
// before numbering), the number stays unused on the server and the
// handle's later operations would be "beyond the next expected" for good.
// So on a refusal the handle asks the sandbox which number it expects and,
// if that is still seq and the handle took no later number meanwhile,
// takes seq back for its next operation.
func (s *Sandbox) send(ctx context.Context, seq uint64, call func() error) error {
	err := resend(ctx, seq, call)
	if err == nil || seq == 0 || !maybeUnrecorded(err) || s.NextSeqToSend() != seq+1 {
		return err
	}
	if sb, gerr := s.c.Get(ctx, s.ID); gerr == nil && sb.NextSeq == seq {
		s.giveBack(seq)
	}
	return err
}

// maybeUnrecorded reports whether err may be a refusal the server answered
// without recording the operation under its number. Transport failures,
// replays of recorded failures and numbering conflicts are not.
func maybeUnrecorded(err error) bool {
	var we *writerError
	if errors.As(err, &we) {
		return false
	}
	switch connect.CodeOf(err) {
	case connect.CodeFailedPrecondition, connect.CodeInvalidArgument:
		msg := err.Error()
		return !strings.Contains(msg, "recorded at seq") && !strings.Contains(msg, "beyond the next expected") &&
			!strings.Contains(msg, "recorded for a different request")
	}
	return false
}

// writerError is a failure of the caller's writer: never re-sent.
type writerError struct{ err error }

func (e *writerError) Error() string { return e.err.Error() }
func (e *writerError) Unwrap() error { return e.err }

// resendFor bounds how long a numbered operation is re-sent.
const resendFor = 30 * time.Second

// resend runs call and, for a numbered operation, runs it again after a
// transport failure (the server may have run it: the re-send gets the
// recorded result) or while an earlier number from this handle is still
// on its way (the server refuses a number beyond the next expected).
func resend(ctx context.Context, seq uint64, call func() error) error {
	deadline := time.Now().Add(resendFor)
	wait := 20 * time.Millisecond
	for {
		err := call()
		if err == nil || seq == 0 || !retriable(err) || time.Now().After(deadline) {
			return err
		}
		// A saturated service says when to come back; waiting less would
		// only be refused again.
		pause := max(wait, RetryAfter(err))
		if left := time.Until(deadline); pause > left {
			pause = max(left, 0)
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pause):
		}
		wait = min(2*wait, time.Second)
	}
}

func retriable(err error) bool {
	var we *writerError
	if errors.As(err, &we) {
		return false
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable:
		return true
	case connect.CodeFailedPrecondition:
		return strings.Contains(err.Error(), "beyond the next expected")
	}
	return false
}

// SubmitReward appends a reward to the sandbox's trajectory and returns its
// step number.
func (s *Sandbox) SubmitReward(ctx context.Context, value float64, metadata map[string]string) (uint64, error) {
	req := &dsecv1.SubmitRewardRequest{SandboxId: s.ID, Value: value, Metadata: metadata, Seq: s.take(0)}
	var resp *connect.Response[dsecv1.SubmitRewardResponse]
	err := s.send(ctx, req.Seq, func() (err error) {
		resp, err = s.c.sandboxes.SubmitReward(ctx, connect.NewRequest(req))
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("submit reward to sandbox %s: %w", s.ID, err)
	}
	return resp.Msg.GetSeq(), nil
}

// Trajectory is a sandbox's trajectory as the server keeps it.
type Trajectory struct {
	// Records are canonical JSON records in log order, one per element:
	// the lines of a JSONL export.
	Records []string
	// NextSeq is the step number the trajectory expects next.
	NextSeq uint64
}

// Trajectory fetches the sandbox's whole trajectory, also after the
// sandbox is destroyed. With includeData, data kept in the blob store
// (large outputs, file contents) is inlined into the records.
func (c *Client) Trajectory(ctx context.Context, id string, includeData bool) (*Trajectory, error) {
	out := &Trajectory{}
	token := ""
	for {
		resp, err := c.sandboxes.GetTrajectory(ctx, connect.NewRequest(&dsecv1.GetTrajectoryRequest{
			SandboxId: id, PageToken: token, IncludeData: includeData,
		}))
		if err != nil {
			return nil, fmt.Errorf("trajectory of sandbox %s: %w", id, err)
		}
		out.Records = append(out.Records, resp.Msg.GetRecords()...)
		out.NextSeq = resp.Msg.GetNextSeq()
		token = resp.Msg.GetNextPageToken()
		if token == "" {
			return out, nil
		}
	}
}

// Trajectory fetches the sandbox's trajectory (see Client.Trajectory).
func (s *Sandbox) Trajectory(ctx context.Context, includeData bool) (*Trajectory, error) {
	return s.c.Trajectory(ctx, s.ID, includeData)
}
