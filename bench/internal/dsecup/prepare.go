package dsecup

import (
	"context"
	"fmt"
	"path/filepath"
)

// Prepare puts what a run starts dsec up from into work: the binaries in
// work/bin (BuildBinaries from f.Dsec and f.Agent, the agent checked with
// RequireStatic) and the busybox rootfs `make up` imports in work/rootfs.
func Prepare(ctx context.Context, root, work string, f Flags) (Binaries, string, error) {
	bins, err := BuildBinaries(ctx, root, filepath.Join(work, "bin"), f.Dsec, f.Agent)
	if err != nil {
		return Binaries{}, "", err
	}
	if err := RequireStatic(bins.Agent); err != nil {
		if f.Agent != "" {
			err = fmt.Errorf("-agent %s: %w", f.Agent, err)
		}
		return Binaries{}, "", err
	}
	rootfs := filepath.Join(work, "rootfs")
	if err := BuildRootfs(ctx, root, rootfs); err != nil {
		return Binaries{}, "", err
	}
	return bins, rootfs, nil
}
