package container

import (
	"github.com/containerd/cgroups/v3"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

var _ rt.UsageReporter = (*Backend)(nil)

// Usage reads what every sandbox of the backend uses together from their
// parent cgroup, as a sandbox's own Usage reads its cgroup: CPU time, and
// memory charged less inactive file pages (what reclaim takes first,
// without writing anything). A few small reads of cgroup files: cheap
// enough for every heartbeat.
func (b *Backend) Usage() (rt.Usage, error) {
	group := "/" + b.opts.CgroupParent
	if cgroupMode() == cgroups.Unified {
		return groupUsageV2(group)
	}
	return groupUsageV1(group)
}
