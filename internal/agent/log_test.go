package agent

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
)

// The default logger writes slog-shaped lines, and a *slog.Logger still
// fits Options.Logger.
func TestTextLogger(t *testing.T) {
	var b strings.Builder
	l := &textLogger{w: &b}
	l.Warn("cannot reset oom_score_adj", "pid", 42, "err", errors.New("no such process"), "odd")
	got := b.String()
	_, rest, ok := strings.Cut(got, " ")
	if !strings.HasPrefix(got, "time=") || !ok {
		t.Fatalf("no time: %q", got)
	}
	want := `level=WARN msg="cannot reset oom_score_adj" pid=42 err="no such process" !BADKEY=odd` + "\n"
	if rest != want {
		t.Errorf("got  %q\nwant %q", rest, want)
	}
	var _ Logger = slog.Default()
}
