package memback

import (
	"context"
	"errors"
	"io/fs"
	"os"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// withDisk is a sandbox whose files stand for a whole disk
// (runtime.DiskSnapshotter), as a fullvm's do.
type withDisk struct{ *Sandbox }

var _ runtime.DiskSnapshotter = withDisk{}

// SnapshotDisk writes the sandbox's files as a tar to out: the "disk" a
// later Create with Options.Disk loads.
func (d withDisk) SnapshotDisk(ctx context.Context, out string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	if err := d.GetArchive(ctx, "/", f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// loadDisk fills the sandbox from the tar at path; a path that is no
// regular file (the test image's stand-in layers) leaves it as it is.
func (s *Sandbox) loadDisk(ctx context.Context, path string) error {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return err
	}
	return s.PutArchive(ctx, "/", f)
}
