package flagval

import (
	"strings"
	"testing"
)

func TestParseCPU(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		err  string
	}{
		{in: "1", want: 1000},
		{in: "0.5", want: 500},
		{in: "2.25", want: 2250},
		{in: " 4 ", want: 4000},
		{in: "0.001", want: 1},
		{in: "0", want: 0},
		{in: "0.0001", err: "smallest unit"},
		{in: "-1", err: "negative"},
		{in: "one", err: "number of cores"},
		{in: "", err: "number of cores"},
		{in: "NaN", err: "number of cores"},
		{in: "500m", err: "number of cores"},
	} {
		got, err := ParseCPU("cpu", tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "--cpu") {
				t.Errorf("ParseCPU(%q) = %d, %v; want error containing --cpu and %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseCPU(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		err  bool
	}{
		{in: "512m", want: 512 << 20},
		{in: "1g", want: 1 << 30},
		{in: "1GiB", want: 1 << 30},
		{in: "1Gi", want: 1 << 30},
		{in: "1.5g", want: 3 << 29},
		{in: "2MB", want: 2 << 20},
		{in: "64k", want: 64 << 10},
		{in: "1048576", want: 1 << 20},
		{in: "100b", want: 100},
		{in: "1T", want: 1 << 40},
		{in: "0", want: 0},
		{in: "", err: true},
		{in: "g", err: true},
		{in: "-1g", err: true},
		{in: "1x", err: true},
		{in: "lots", err: true},
		{in: "1e30g", err: true},
	} {
		got, err := ParseSize("memory", tc.in)
		if tc.err {
			if err == nil || !strings.Contains(err.Error(), "--memory") {
				t.Errorf("ParseSize(%q) = %d, %v; want an error naming --memory", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

// TestFormatRoundTrips: what FormatCPU and FormatSize write, ParseCPU and
// ParseSize read back (the daemons' help states defaults this way).
func TestFormatRoundTrips(t *testing.T) {
	for _, m := range []int64{1, 250, 1000, 1500, 64000} {
		if got, err := ParseCPU("x", FormatCPU(m)); err != nil || got != m {
			t.Errorf("ParseCPU(FormatCPU(%d) = %q) = %d, %v", m, FormatCPU(m), got, err)
		}
	}
	for b, want := range map[int64]string{1 << 30: "1GiB", 10 << 30: "10GiB", 512 << 20: "512MiB", 1536: "1536", 3 << 10: "3KiB", 2 << 40: "2TiB"} {
		if s := FormatSize(b); s != want {
			t.Errorf("FormatSize(%d) = %q, want %q", b, s, want)
		}
		if got, err := ParseSize("x", FormatSize(b)); err != nil || got != b {
			t.Errorf("ParseSize(%q) = %d, %v, want %d", FormatSize(b), got, err, b)
		}
	}
}
