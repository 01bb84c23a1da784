package main

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/runtime/container/scratchfs"
)

// The file system sandboxes' writable layers live on, with a kernel-enforced
// limit per sandbox (internal/runtime/container/scratchfs): made at start
// under the data directory, removed at stop.

func (f *edgeFlags) registerScratch(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.scratchSize, "scratch-size", "", fmt.Sprintf(
		"size of the file system sandboxes' writable layers live on (btrfs with quotas in a sparse file), e.g. 200g "+
			"(default %d%% of the free space where --scratch-file is; off: none, and sandboxes' disk limits are not enforced)",
		int(scratchfs.DefaultFraction*100)))
	fl.StringVar(&f.scratchFile, "scratch-file", "", "the sparse file holding that file system (default DATA-DIR/scratch.img)")
}

// scratchBytes parses --scratch-size: -1 for off, 0 for the default.
func (f *edgeFlags) scratchBytes() (int64, error) {
	switch strings.ToLower(f.scratchSize) {
	case "":
		return 0, nil
	case "off":
		return -1, nil
	}
	n, err := cli.ParseSize("scratch-size", f.scratchSize)
	if err != nil {
		return 0, cli.UsageError{Err: err}
	}
	if n < scratchfs.MinSize {
		return 0, cli.Usagef("--scratch-size %s: at least %d MiB, or off", f.scratchSize, scratchfs.MinSize>>20)
	}
	return n, nil
}

// openScratch makes and mounts the file system at DATA-DIR/sandboxes, the
// container backend's state directory (nil with --scratch-size off).
func (f *edgeFlags) openScratch(dataDir string, log *slog.Logger) (*scratchfs.FS, error) {
	size, err := f.scratchBytes()
	if err != nil {
		return nil, err
	}
	if size < 0 {
		log.Warn("--scratch-size off: sandboxes' writable layers are not limited (disk_bytes is not enforced)")
		return nil, nil
	}
	image := f.scratchFile
	if image == "" {
		image = filepath.Join(dataDir, "scratch.img")
	}
	fs, err := scratchfs.Open(scratchfs.Options{Image: image, Dir: filepath.Join(dataDir, "sandboxes"), Size: size, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("sandboxes' file system (--scratch-size, --scratch-file; --scratch-size off runs without disk limits): %w", err)
	}
	log.Info("sandboxes' file system", "dir", fs.Dir(), "file", image, "size_mib", fs.Size()>>20)
	return fs, nil
}

func (f *edgeFlags) closeScratch(log *slog.Logger) {
	if f.scratch == nil {
		return
	}
	if err := f.scratch.Close(); err != nil {
		log.Warn("sandboxes' file system", "err", err)
	}
	f.scratch = nil
}
