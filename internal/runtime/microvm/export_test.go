package microvm

import (
	"context"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// FloorConfig is the QEMU configuration a sandbox of spec gets, with its
// writable disk made at disk: the benchmarks boot it with another initrd.
func (b *Backend) FloorConfig(ctx context.Context, dir string, spec rt.Spec, disk string) (qemu.Config, error) {
	r := spec.Resources
	if r.MemoryBytes == 0 {
		r.MemoryBytes = b.opts.DefaultMemoryBytes
	}
	if r.DiskBytes == 0 {
		r.DiskBytes = b.opts.DefaultDiskBytes
	}
	if err := b.makeDisk(ctx, disk, r.DiskBytes); err != nil {
		return qemu.Config{}, err
	}
	return b.config(dir, spec, r, disk, nil), nil
}

// QEMUPid is the pid of the QEMU running sb.
func QEMUPid(sb rt.Sandbox) int { return sb.(*sandbox).vm.Pid() }
