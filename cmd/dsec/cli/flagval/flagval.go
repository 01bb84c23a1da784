// Package flagval parses and checks the values of DSec's command-line
// flags (CPU, sizes, labels, environment). It links only the standard
// library, so that the front binary dsec, which serves `dsec run` itself
// and must start in a few milliseconds, parses exactly as the full client
// dsec-cli does.
package flagval

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// ParseCPU turns a core count ("1", "0.5", "2.25") into milliCPU.
func ParseCPU(flag, s string) (int64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("--%s %q: want a number of cores such as 1 or 0.5", flag, s)
	}
	if f < 0 {
		return 0, fmt.Errorf("--%s %q: must not be negative", flag, s)
	}
	m := math.Round(f * 1000)
	if f > 0 && m < 1 {
		return 0, fmt.Errorf("--%s %q: smallest unit is 0.001 cores", flag, s)
	}
	if m > math.MaxInt64/2 {
		return 0, fmt.Errorf("--%s %q: too large", flag, s)
	}
	return int64(m), nil
}

// sizeUnits maps suffixes (lower case) to multipliers. Single letters and
// "kb"-style forms are binary, as in docker and Kubernetes "Gi": nobody
// means 10^9 bytes when giving a sandbox "1g" of memory.
var sizeUnits = []struct {
	suffix string
	mult   int64
}{
	{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"tib", 1 << 40},
	{"ki", 1 << 10}, {"mi", 1 << 20}, {"gi", 1 << 30}, {"ti", 1 << 40},
	{"kb", 1 << 10}, {"mb", 1 << 20}, {"gb", 1 << 30}, {"tb", 1 << 40},
	{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"t", 1 << 40},
	{"b", 1},
}

// ParseSize turns "512m", "1g", "1GiB", "1.5g" or a plain byte count into
// bytes.
func ParseSize(flag, s string) (int64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	mult := int64(1)
	for _, u := range sizeUnits {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	f, err := strconv.ParseFloat(t, 64)
	if t == "" || err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("--%s %q: want a size such as 512m, 1g, 1GiB or a byte count", flag, s)
	}
	if f < 0 {
		return 0, fmt.Errorf("--%s %q: must not be negative", flag, s)
	}
	b := f * float64(mult)
	if b >= math.MaxInt64 {
		return 0, fmt.Errorf("--%s %q: too large", flag, s)
	}
	return int64(math.Round(b)), nil
}

// ParseLabels turns repeated KEY=VALUE flags into a map (nil for none).
func ParseLabels(flag string, kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" {
			return nil, fmt.Errorf("--%s %q: want KEY=VALUE", flag, kv)
		}
		if old, dup := m[k]; dup && old != v {
			return nil, fmt.Errorf("--%s %q: key %q given twice", flag, kv, k)
		}
		m[k] = v
	}
	return m, nil
}

// CheckEnv validates repeated K=V flags.
func CheckEnv(flag string, kvs []string) error {
	for _, kv := range kvs {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fmt.Errorf("--%s %q: want KEY=VALUE", flag, kv)
		}
	}
	return nil
}

// FormatCPU writes milliCPU as ParseCPU reads it ("1", "0.5").
func FormatCPU(milli int64) string {
	return strconv.FormatFloat(float64(milli)/1000, 'f', -1, 64)
}

// FormatSize writes bytes as ParseSize reads them, in the largest binary
// unit that divides them ("1GiB", "512MiB", "1000").
func FormatSize(b int64) string {
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if b != 0 && b%u.mult == 0 {
			return strconv.FormatInt(b/u.mult, 10) + u.suffix
		}
	}
	return strconv.FormatInt(b, 10)
}
