package edge

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// The screen, keyboard and mouse of sandboxes whose backend has them
// (runtime.Display: fullvm). They are not numbered steps: a screenshot
// changes nothing, and input is recorded as an event on the trajectory
// (what was typed is the workload's own business, so only its shape is).

func (s *service) ScreenshotOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSandboxRequest]) (*connect.Response[dsecv1.ScreenshotResponse], error) {
	var png []byte
	err := s.e.displayOp(ctx, req.Msg.Caller, req.Msg.SandboxId, func(ctx context.Context, d runtime.Display) (err error) {
		png, err = d.Screenshot(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	w, h := pngSize(png)
	return connect.NewResponse(&dsecv1.ScreenshotResponse{Png: png, Width: w, Height: h}), nil
}

func (s *service) InputOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeInputRequest]) (*connect.Response[dsecv1.InputResponse], error) {
	r := req.Msg.Request
	if r == nil {
		return nil, invalid("request is required")
	}
	if err := limits.Input("request.", r); err != nil {
		return nil, err
	}
	evs := make([]runtime.InputEvent, len(r.Events))
	counts := map[string]int{}
	for i, ev := range r.Events {
		evs[i] = runtime.InputEvent{Kind: runtime.InputKind(ev.Kind), Text: ev.Text, Key: ev.Key,
			X: int(ev.X), Y: int(ev.Y), Button: ev.Button}
		counts[ev.Kind]++
	}
	err := s.e.displayOp(ctx, req.Msg.Caller, r.SandboxId, func(ctx context.Context, d runtime.Display) error {
		return d.Input(ctx, evs)
	})
	if err != nil {
		return nil, err
	}
	if sb, err := s.e.lookup(req.Msg.Caller, r.SandboxId); err == nil {
		s.e.event(sb, trajectory.KindInput, fmt.Sprintf("%d events: %d text, %d key, %d move, %d click",
			len(evs), counts["text"], counts["key"], counts["move"], counts["click"]))
	}
	return connect.NewResponse(&dsecv1.InputResponse{}), nil
}

// displayOp runs op on the display of the caller's running sandbox id.
func (e *Edge) displayOp(ctx context.Context, caller *dsecv1.Caller, id string, op func(context.Context, runtime.Display) error) error {
	sb, err := e.lookup(caller, id)
	if err != nil {
		return err
	}
	rs, err := e.begin(sb)
	if err != nil {
		return err
	}
	d, ok := rs.(runtime.Display)
	if !ok {
		_ = e.end(sb, rs, nil)
		return fail.Errorf(fail.FailedPrecondition,
			"sandbox %q (backend %s) has no screen, keyboard or mouse: they are a fullvm sandbox's", id, sb.kind)
	}
	err = e.end(sb, rs, op(ctx, d))
	if err != nil && fail.KindOf(err) == fail.Unknown {
		// The backend failed to reach its own display (QMP): the platform's.
		err = fail.Errorf(fail.Internal, "sandbox %q: %w", id, err)
	}
	return err
}

// pngSize reads a PNG's width and height from its IHDR chunk (0, 0 when
// data is not a PNG).
func pngSize(data []byte) (w, h int32) {
	const sig = "\x89PNG\r\n\x1a\n"
	if len(data) < 24 || string(data[:8]) != sig || string(data[12:16]) != "IHDR" {
		return 0, 0
	}
	be := func(b []byte) int32 {
		return int32(uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]))
	}
	return be(data[16:20]), be(data[20:24])
}
