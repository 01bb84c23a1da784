package testutil

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// MemoryLimit is the memory limit of the cgroup that holds pid, as the host
// sees it: v1 memory.limit_in_bytes, or v2 memory.max when the memory
// controller is on the unified hierarchy. When that cgroup has a "user"
// child (pid is a container sandbox's agent, whose user processes live
// there under the spec's limit), it is the child's limit: the sandbox's.
func MemoryLimit(t testing.TB, pid int) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		switch {
		case len(f) == 3 && f[0] == "0" && f[1] == "":
			if _, err := os.Stat("/sys/fs/cgroup/memory"); err == nil {
				continue // hybrid: the memory controller is on v1
			}
			dir := filepath.Join("/sys/fs/cgroup", f[2])
			if filepath.Base(dir) == "agent" {
				dir = filepath.Join(filepath.Dir(dir), "user")
			}
			v, err := os.ReadFile(filepath.Join(dir, "memory.max"))
			if err != nil {
				t.Fatal(err)
			}
			return strings.TrimSpace(string(v))
		case len(f) == 3 && strings.Contains(","+f[1]+",", ",memory,"):
			dir := filepath.Join("/sys/fs/cgroup/memory", f[2])
			if _, err := os.Stat(filepath.Join(dir, "user")); err == nil {
				dir = filepath.Join(dir, "user")
			}
			v, err := os.ReadFile(filepath.Join(dir, "memory.limit_in_bytes"))
			if err != nil {
				t.Fatal(err)
			}
			return strings.TrimSpace(string(v))
		}
	}
	t.Fatalf("no memory cgroup for %d in %s", pid, b)
	return ""
}
