package dsec

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// InputEvent is one keyboard or mouse event for Sandbox.Input; make them
// with TypeText, PressKey, MoveTo and ClickAt.
type InputEvent struct {
	ev *dsecv1.InputEvent
}

// TypeText types text, one key press per character.
func TypeText(text string) InputEvent {
	return InputEvent{&dsecv1.InputEvent{Kind: "text", Text: text}}
}

// PressKey presses and releases key: one key or a chord joined by "-",
// with QEMU's key names ("ret", "esc", "tab", "ctrl-alt-delete", "shift-a").
func PressKey(key string) InputEvent {
	return InputEvent{&dsecv1.InputEvent{Kind: "key", Key: key}}
}

// MoveTo moves the pointer to x, y (pixels from the top left).
func MoveTo(x, y int) InputEvent {
	return InputEvent{&dsecv1.InputEvent{Kind: "move", X: int32(x), Y: int32(y)}}
}

// ClickAt moves the pointer to x, y and clicks button ("left", "middle",
// "right"; "" is "left").
func ClickAt(x, y int, button string) InputEvent {
	return InputEvent{&dsecv1.InputEvent{Kind: "click", X: int32(x), Y: int32(y), Button: button}}
}

// Screenshot returns what the sandbox's screen shows, as a PNG image, and
// its size. Only sandboxes with a screen (BackendFullVM) have one; others
// fail with FailedPrecondition.
func (s *Sandbox) Screenshot(ctx context.Context) (png []byte, width, height int, err error) {
	resp, err := s.c.sandboxes.Screenshot(ctx, connect.NewRequest(&dsecv1.ScreenshotRequest{SandboxId: s.ID}))
	if err != nil {
		return nil, 0, 0, fmt.Errorf("screenshot of sandbox %s: %w", s.ID, err)
	}
	return resp.Msg.GetPng(), int(resp.Msg.GetWidth()), int(resp.Msg.GetHeight()), nil
}

// Input sends keyboard and mouse events to the sandbox's screen, in order
// (at most 256 in one call). Only sandboxes with a screen take them.
func (s *Sandbox) Input(ctx context.Context, events ...InputEvent) error {
	req := &dsecv1.InputRequest{SandboxId: s.ID}
	for _, ev := range events {
		if ev.ev == nil {
			return fmt.Errorf("input to sandbox %s: an InputEvent must come from TypeText, PressKey, MoveTo or ClickAt", s.ID)
		}
		req.Events = append(req.Events, ev.ev)
	}
	if _, err := s.c.sandboxes.Input(ctx, connect.NewRequest(req)); err != nil {
		return fmt.Errorf("input to sandbox %s: %w", s.ID, err)
	}
	return nil
}
