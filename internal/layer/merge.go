package layer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// Merge flattens a stack of layers (bottom first, each an EROFS file in
// files, or a directory layer: see DirLayers) into one layer stored in
// store: the layers are mounted read-only (directories are stacked as
// they are), stacked with a lower-only overlay (which resolves whiteouts
// and opaque directories) and the merged view is packed. It is how a chain
// of snapshots is kept short.
func Merge(ctx context.Context, store blobstore.Store, files []string) (_ blobstore.Descriptor, err error) {
	if len(files) == 0 {
		return blobstore.Descriptor{}, errors.New("merge layers: no layers")
	}
	scratch, err := os.MkdirTemp("", "dsec-merge-")
	if err != nil {
		return blobstore.Descriptor{}, fmt.Errorf("merge layers: %w", err)
	}
	var mounted []string
	defer func() {
		for i := len(mounted) - 1; i >= 0; i-- {
			if uerr := unix.Unmount(mounted[i], unix.MNT_DETACH); uerr != nil && !errors.Is(uerr, unix.EINVAL) {
				err = errors.Join(err, fmt.Errorf("merge layers: unmount %s: %w", mounted[i], uerr))
			}
		}
		if rerr := os.RemoveAll(scratch); rerr != nil {
			err = errors.Join(err, fmt.Errorf("merge layers: %w", rerr))
		}
	}()
	lowers := make([]string, len(files))
	for i, f := range files {
		if fi, err := os.Stat(f); err == nil && fi.IsDir() {
			lowers[len(files)-1-i] = f
			continue
		}
		dir := filepath.Join(scratch, fmt.Sprintf("l%d", i))
		if err := mountErofs(f, dir); err != nil {
			return blobstore.Descriptor{}, fmt.Errorf("merge layers: %s: %w", f, err)
		}
		mounted = append(mounted, dir)
		lowers[len(files)-1-i] = dir // overlay wants the top first
	}
	view := lowers[0]
	if len(lowers) > 1 {
		view = filepath.Join(scratch, "merged")
		if err := os.Mkdir(view, 0o755); err != nil {
			return blobstore.Descriptor{}, fmt.Errorf("merge layers: %w", err)
		}
		opts := "lowerdir=" + strings.Join(lowers, ":")
		if err := unix.Mount("overlay", view, "overlay", unix.MS_RDONLY, opts); err != nil {
			return blobstore.Descriptor{}, fmt.Errorf("merge layers: overlay of %d layers: %w", len(lowers), err)
		}
		mounted = append(mounted, view)
	}
	return Build(ctx, store, view)
}
