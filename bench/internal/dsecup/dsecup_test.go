package dsecup

import (
	"testing"
	"time"
)

func TestSummarize(t *testing.T) {
	var ds []time.Duration
	for v := 100; v >= 1; v-- {
		ds = append(ds, time.Duration(v)*time.Millisecond)
	}
	st := Summarize(ds)
	want := Stats{Median: 50 * time.Millisecond, P90: 90 * time.Millisecond, P99: 99 * time.Millisecond,
		Max: 100 * time.Millisecond, Mean: 50500 * time.Microsecond}
	if st != want {
		t.Fatalf("Summarize = %+v, want %+v", st, want)
	}
	if ds[0] != 100*time.Millisecond {
		t.Fatal("Summarize sorted its input in place")
	}
	if one := Summarize([]time.Duration{7}); one.Median != 7 || one.P99 != 7 || one.Max != 7 {
		t.Fatalf("Summarize of one sample = %+v", one)
	}
	var ten []time.Duration
	for v := 10; v >= 1; v-- {
		ten = append(ten, time.Duration(v)*time.Millisecond)
	}
	if st := Summarize(ten); st.Median != 5*time.Millisecond || st.P90 != 9*time.Millisecond || st.Mean != 5500*time.Microsecond {
		t.Fatalf("Summarize of 10 = %+v", st)
	}
}

func TestUnescapeMount(t *testing.T) {
	if got := unescapeMount(`/tmp/a\040b\134c`); got != `/tmp/a b\c` {
		t.Fatalf("unescapeMount = %q", got)
	}
}

func TestFormats(t *testing.T) {
	for v, want := range map[float64]string{0: "n/a", -1: "n/a", 2: "2.00x", 1.234: "1.23x"} {
		if got := FmtX(v); got != want {
			t.Errorf("FmtX(%v) = %q, want %q", v, got, want)
		}
	}
	for v, want := range map[float64]string{150: "150 ms", 30: "30.0 ms", 1.5: "1.50 ms"} {
		if got := FmtMs(v); got != want {
			t.Errorf("FmtMs(%v) = %q, want %q", v, got, want)
		}
	}
}
