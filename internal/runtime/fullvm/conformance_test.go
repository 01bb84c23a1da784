package fullvm_test

import (
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
)

// TestConformance runs the runtime conformance suite over fullvm
// sandboxes of the Debian disk image. Its creates restore the boot
// template the first one makes, so the suite pays one cold boot.
func TestConformance(t *testing.T) {
	b, _ := backend(t)
	testsuite.Run(t, testsuite.Harness{
		Backend: b,
		NewSpec: func(t *testing.T) runtime.Spec { return newSpec(t) },
		Leaks: func(t *testing.T) testsuite.Snapshot {
			snap, err := testsuite.HostSnapshot(nil, []string{sandboxDir()})
			if err != nil {
				t.Fatal(err)
			}
			return snap
		},
		Lacks: map[testsuite.Capability]string{
			testsuite.LayerRootfs:    "a fullvm boots a disk image, not EROFS layers",
			testsuite.HostKernel:     "the guest runs its own kernel on virtual disks",
			testsuite.ProtectedAgent: "the agent is a service of the guest's own init, which the guest's root owns",
			testsuite.MemoryLimit:    "the guest's RAM is its memory; its own kernel's OOM killer reports nothing per exec",
			testsuite.PidsLimit:      "no pids limit inside the guest",
			testsuite.CPUQuota:       "CPU is whole vCPUs, not a quota",
			testsuite.ReadOnlySystem: "the guest's root owns its kernel's /sys and /proc/sys",
			testsuite.DiskLimit:      "the overlay may grow to the image's virtual size; Resources.DiskBytes is not enforced",
			testsuite.DiskStatfs:     "see disk-limit",
		},
		LeakCycles: 10,
		OpTimeout:  5 * time.Minute,
	})
}
