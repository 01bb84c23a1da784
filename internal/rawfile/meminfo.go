package rawfile

import (
	"bytes"
	"fmt"
	"strconv"
)

// Meminfo returns /proc/meminfo's fields ("MemTotal", "SwapFree", ...), in
// bytes where the kernel gives kB.
func Meminfo() (map[string]int64, error) {
	b, err := Read("/proc/meminfo", 8192)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int64, 64)
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		k, v, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		f := bytes.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseInt(string(f[0]), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("/proc/meminfo %s: %q", k, v)
		}
		if len(f) > 1 && string(f[1]) == "kB" {
			n <<= 10
		}
		out[string(k)] = n
	}
	if out["MemTotal"] == 0 {
		return nil, fmt.Errorf("/proc/meminfo has no MemTotal")
	}
	return out, nil
}
