package main

// The upload progress of `image import`, on one terminal line. It is
// written out here instead of using a progress-bar library: those
// initialise colour and spinner tables at start-up, which every CLI call
// would pay for, and only an interactive import ever shows the line.

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// progressEvery bounds how often the line is redrawn.
const progressEvery = 100 * time.Millisecond

// progressLine counts the bytes written to it and redraws
// "LABEL: 12.3MiB of 45.6MiB (27%), 3.4MiB/s" on w, which must be a
// terminal: the line is rewritten in place with a carriage return.
type progressLine struct {
	w            io.Writer
	label        string
	total        int64 // -1 when unknown (a directory tarred on the fly)
	done         int64
	start, drawn time.Time
	width        int // of the last line drawn, to blank a shorter one
}

func newProgressLine(w io.Writer, label string, total int64) *progressLine {
	p := &progressLine{w: w, label: label, total: total, start: time.Now()}
	p.draw(p.start)
	return p
}

func (p *progressLine) Write(b []byte) (int, error) {
	p.done += int64(len(b))
	if now := time.Now(); now.Sub(p.drawn) >= progressEvery {
		p.draw(now)
	}
	return len(b), nil
}

// Close draws the final figures and ends the line.
func (p *progressLine) Close() {
	p.draw(time.Now())
	fmt.Fprintln(p.w)
}

func (p *progressLine) draw(now time.Time) {
	p.drawn = now
	s := p.label + ": " + humanBytes(p.done)
	if p.total >= 0 {
		pct := 100
		if p.total > 0 {
			pct = int(p.done * 100 / p.total)
		}
		s += fmt.Sprintf(" of %s (%d%%)", humanBytes(p.total), pct)
	}
	if secs := now.Sub(p.start).Seconds(); secs >= 0.5 {
		s += ", " + humanBytes(int64(float64(p.done)/secs)) + "/s"
	}
	pad := max(p.width-len(s), 0)
	p.width = len(s)
	fmt.Fprint(p.w, "\r"+s+strings.Repeat(" ", pad))
}
