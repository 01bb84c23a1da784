package memback

import (
	"bytes"
	"context"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"slices"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// Screen is the size of a display sandbox's screen (Options.Display).
var Screen = image.Point{X: 64, Y: 48}

// screenshot returns the screen as a PNG: one colour, which changes with
// every input event, so that a caller can tell its input arrived.
func (s *Sandbox) screenshot(ctx context.Context) ([]byte, error) {
	if _, err := s.enter(ctx); err != nil {
		return nil, err
	}
	s.mu.Lock()
	n := len(s.events)
	s.mu.Unlock()
	img := image.NewRGBA(image.Rectangle{Max: Screen})
	c := color.RGBA{R: uint8(n * 40), G: uint8(n * 80), B: 200, A: 255}
	for y := range Screen.Y {
		for x := range Screen.X {
			img.Set(x, y, c)
		}
	}
	var buf bytes.Buffer
	if err := png.Encode(&buf, img); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// input records events in order; an event of an unknown kind refuses the
// whole call (runtime.ErrInvalidSpec), as a guest's display would refuse
// it before sending anything.
func (s *Sandbox) input(ctx context.Context, events []runtime.InputEvent) error {
	if _, err := s.enter(ctx); err != nil {
		return err
	}
	for i, ev := range events {
		switch ev.Kind {
		case runtime.InputText, runtime.InputKey, runtime.InputMove, runtime.InputClick:
		default:
			return fmt.Errorf("events[%d].kind %q: %w", i, ev.Kind, runtime.ErrInvalidSpec)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.goneLocked(); err != nil {
		return err
	}
	s.events = append(s.events, events...)
	return nil
}

// Events returns the input events a display sandbox received, in order.
func (s *Sandbox) Events() []runtime.InputEvent {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.events)
}

// withDisplay is a Sandbox that also implements runtime.Display.
type withDisplay struct{ *Sandbox }

func (d withDisplay) Screenshot(ctx context.Context) ([]byte, error) { return d.screenshot(ctx) }
func (d withDisplay) Input(ctx context.Context, events []runtime.InputEvent) error {
	return d.input(ctx, events)
}

// resettableDisplay implements both runtime.Resetter and runtime.Display.
type resettableDisplay struct{ *resettable }

func (d resettableDisplay) Screenshot(ctx context.Context) ([]byte, error) { return d.screenshot(ctx) }
func (d resettableDisplay) Input(ctx context.Context, events []runtime.InputEvent) error {
	return d.input(ctx, events)
}

var (
	_ runtime.Display  = withDisplay{}
	_ runtime.Display  = resettableDisplay{}
	_ runtime.Resetter = resettableDisplay{}
)
