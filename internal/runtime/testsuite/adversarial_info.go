package testsuite

import (
	"os"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// Information a workload must not get about the host: firmware, kernel
// memory and its layout, the host's kernel command line, where the host
// keeps the sandbox (its layer and writable-layer paths, the platform's
// PID in them), the physical placement of its files on the host's disk.

func init() {
	adversarialCases = append(adversarialCases,
		advCase{"info/block-maps-denied", (*suite).testInfoBlockMaps},
	)
}

// infoProbe copies infoprobe into sb (at /tmp/infoprobe) and returns its
// path there.
func (s *suite) infoProbe(t *testing.T, sb runtime.Sandbox) string {
	t.Helper()
	bin, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/infoprobe"))
	if err != nil {
		t.Fatal(err)
	}
	const probe = "/tmp/infoprobe"
	if err := sb.WriteFile(s.ctx(t), probe, bin, 0o755); err != nil {
		t.Fatalf("WriteFile(%s): %v", probe, err)
	}
	return probe
}

// testInfoBlockMaps: FS_IOC_FIEMAP and its kin give a file's physical
// offsets on the device below it, the host's disk for a file the sandbox
// wrote; every one is refused with EPERM, for written and image files.
func (s *suite) testInfoBlockMaps(t *testing.T) {
	sb := s.create(t, nil)
	probe := s.infoProbe(t, sb)
	s.sh(t, sb, `head -c 65536 /dev/urandom > /tmp/blockmap-data && mkdir -p /root && cp /tmp/blockmap-data /root/data && sync`)
	out := s.sh(t, sb, probe+` blockmaps /tmp/blockmap-data /root/data /bin/busybox /etc/passwd`)
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		n++
		if !strings.HasSuffix(line, " EPERM") {
			t.Errorf("block-mapping ioctl not refused with EPERM: %s", line)
		}
	}
	if n == 0 {
		t.Fatal("infoprobe blockmaps printed nothing")
	}
}
