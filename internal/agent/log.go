package agent

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Logger receives the agent's warnings, which are rare: they report a
// sandbox in an odd state, not requests. *slog.Logger implements it; the
// default writes to stderr without pulling log/slog into dsec-agent.
type Logger interface {
	Warn(msg string, args ...any)
}

// textLogger writes one line per record in the shape of slog's text
// handler: time=... level=WARN msg="..." key=value ...
type textLogger struct {
	mu sync.Mutex
	w  io.Writer
}

// StderrLogger returns a Logger writing to standard error.
func StderrLogger() Logger { return &textLogger{w: os.Stderr} }

// Warn logs msg with key-value pairs args.
func (l *textLogger) Warn(msg string, args ...any) {
	var b strings.Builder
	b.WriteString("time=")
	b.WriteString(time.Now().UTC().Format(time.RFC3339Nano))
	b.WriteString(" level=WARN msg=")
	b.WriteString(logValue(msg))
	for i := 0; i < len(args); i += 2 {
		key, val := "!BADKEY", args[i]
		if k, ok := args[i].(string); ok && i+1 < len(args) {
			key, val = k, args[i+1]
		}
		b.WriteByte(' ')
		b.WriteString(key)
		b.WriteByte('=')
		b.WriteString(logValue(fmt.Sprint(val)))
	}
	b.WriteByte('\n')
	l.mu.Lock()
	io.WriteString(l.w, b.String())
	l.mu.Unlock()
}

// logValue quotes s if it is empty or has spaces, quotes or control
// characters, as slog's text handler does.
func logValue(s string) string {
	if s == "" || strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r == '"' || r == '=' || r == 0x7f }) {
		return strconv.Quote(s)
	}
	return s
}
