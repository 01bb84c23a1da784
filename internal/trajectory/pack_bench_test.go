package trajectory_test

import (
	"context"
	"io/fs"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// BenchmarkShipBatch ships ended sandboxes (create, one exec, destroy) in
// batches of 20, as the edge's ship loop gathers them under a
// create/destroy loop, to a dir store on the test's temp file system (the
// root file system here). Reported per sandbox: wall time, CPU time of the
// process, and files: the inodes the store holds afterwards (blobs and
// refs) per sandbox shipped, which is what each ship costs in inode
// allocations (and, once they are collected, frees).
func BenchmarkShipBatch(b *testing.B) {
	const batch = 20
	ctx := context.Background()
	store, err := blobstore.NewDir(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	l, err := trajectory.Open(trajectory.Options{Dir: b.TempDir(), Store: store})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	ids := endSandboxes(b, l, "sb", b.N)
	cpu := cpuTime()
	b.ResetTimer()
	for i := 0; i < len(ids); i += batch {
		if err := l.ShipBatch(ctx, ids[i:min(i+batch, len(ids))]); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64((cpuTime()-cpu).Microseconds())/float64(b.N), "cpu-us/op")
	b.ReportMetric(float64(storeInodes(b, store.Root()))/float64(b.N), "files/op")
}

// storeInodes counts the distinct inodes of the regular files under root.
func storeInodes(tb testing.TB, root string) int {
	tb.Helper()
	inodes := map[uint64]bool{}
	err := filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil || !e.Type().IsRegular() {
			return err
		}
		info, err := e.Info()
		if err != nil {
			return err
		}
		inodes[info.Sys().(*syscall.Stat_t).Ino] = true
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return len(inodes)
}
