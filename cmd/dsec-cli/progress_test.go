package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestProgressLine(t *testing.T) {
	var out bytes.Buffer
	p := newProgressLine(&out, "uploading rootfs", 3<<20)
	if got := out.String(); got != "\ruploading rootfs: 0B of 3.0MiB (0%)" {
		t.Errorf("first line %q", got)
	}
	// Redrawn once the interval has passed, with the rate after half a
	// second; a shorter line blanks the rest of the longer one.
	p.start = p.start.Add(-time.Second)
	p.drawn = p.drawn.Add(-time.Second)
	p.Write(make([]byte, 3<<19))
	p.Close()
	lines := strings.Split(out.String(), "\r")
	last := lines[len(lines)-1]
	if !strings.HasPrefix(last, "uploading rootfs: 1.5MiB of 3.0MiB (50%), ") || !strings.HasSuffix(last, "/s\n") {
		t.Errorf("last line %q", last)
	}

	out.Reset()
	p = newProgressLine(&out, "uploading dir", -1)
	p.Write(make([]byte, 2048))
	p.width = 100 // as if a longer line had been drawn
	p.Close()
	lines = strings.Split(out.String(), "\r")
	if last := lines[len(lines)-1]; last != "uploading dir: 2.0KiB"+strings.Repeat(" ", 100-len("uploading dir: 2.0KiB"))+"\n" {
		t.Errorf("unknown total: last line %q", last)
	}
}
