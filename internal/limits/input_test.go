package limits

import (
	"strings"
	"testing"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

func TestInput(t *testing.T) {
	ev := func(kind string, mod func(*dsecv1.InputEvent)) *dsecv1.InputEvent {
		e := &dsecv1.InputEvent{Kind: kind}
		if mod != nil {
			mod(e)
		}
		return e
	}
	good := []*dsecv1.InputEvent{
		ev("text", func(e *dsecv1.InputEvent) { e.Text = "ls -l" }),
		ev("key", func(e *dsecv1.InputEvent) { e.Key = "ctrl-alt-delete" }),
		ev("key", func(e *dsecv1.InputEvent) { e.Key = "ret" }),
		ev("move", func(e *dsecv1.InputEvent) { e.X, e.Y = 0, 32767 }),
		ev("click", func(e *dsecv1.InputEvent) { e.X, e.Y, e.Button = 10, 20, "right" }),
		ev("click", nil),
	}
	if err := Input("", &dsecv1.InputRequest{Events: good}); err != nil {
		t.Fatalf("valid events refused: %v", err)
	}
	many := make([]*dsecv1.InputEvent, MaxInputEvents+1)
	for i := range many {
		many[i] = ev("key", func(e *dsecv1.InputEvent) { e.Key = "a" })
	}
	for _, tc := range []struct {
		events []*dsecv1.InputEvent
		want   string
	}{
		{nil, "events is required"},
		{many, "more than 256"},
		{[]*dsecv1.InputEvent{ev("scroll", nil)}, `events[0].kind "scroll"`},
		{[]*dsecv1.InputEvent{ev("text", nil)}, "events[0].text is required"},
		{[]*dsecv1.InputEvent{ev("text", func(e *dsecv1.InputEvent) { e.Text = strings.Repeat("x", MaxInputText+1) })}, "events[0].text is 4097 bytes"},
		{[]*dsecv1.InputEvent{good[0], ev("key", nil)}, "events[1].key is required"},
		{[]*dsecv1.InputEvent{ev("key", func(e *dsecv1.InputEvent) { e.Key = "ctrl--c" })}, "events[0].key"},
		{[]*dsecv1.InputEvent{ev("key", func(e *dsecv1.InputEvent) { e.Key = "Ret" })}, "events[0].key"},
		{[]*dsecv1.InputEvent{ev("move", func(e *dsecv1.InputEvent) { e.X = -1 })}, "events[0].x, y"},
		{[]*dsecv1.InputEvent{ev("click", func(e *dsecv1.InputEvent) { e.Y = 40000 })}, "off the screen"},
		{[]*dsecv1.InputEvent{ev("move", func(e *dsecv1.InputEvent) { e.Button = "left" })}, "events[0].button is for click"},
		{[]*dsecv1.InputEvent{ev("click", func(e *dsecv1.InputEvent) { e.Button = "fourth" })}, `events[0].button "fourth"`},
	} {
		err := Input("request.", &dsecv1.InputRequest{Events: tc.events})
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "request.events") {
			t.Errorf("events %v: %v, want an error with %q", tc.events, err, tc.want)
		}
	}
}
