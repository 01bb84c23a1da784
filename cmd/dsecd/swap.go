package main

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/swap"
)

// The node's swap area (internal/swap): made at start under the data
// directory, removed at stop. Idle sandboxes' memory goes there when the
// node runs short (the container backend's reclaim), so that limits whose
// sum is above the node's RAM stay safe. None by default: a swap area is
// host-wide (the kernel may then page out any process of the host, not
// only sandboxes) and takes its size on disk, which is the operator's
// decision to make once per node, not a side effect of `dsec up`; the
// edge says at start what running without one means.

func (f *edgeFlags) registerSwap(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.swapSize, "swap", "0", fmt.Sprintf(
		"size of the swap file idle sandboxes' memory is paged out to when the node runs short, e.g. 8g "+
			"(at least %d MiB; 0: none, and what sandboxes touch stays in RAM)", swap.MinSize>>20))
	fl.StringVar(&f.swapFile, "swap-file", "", "the swap file (default DATA-DIR/swap.img; on ext4 or XFS, not tmpfs)")
}

// swapBytes parses --swap.
func (f *edgeFlags) swapBytes() (int64, error) {
	n, err := cli.ParseSize("swap", f.swapSize)
	if err != nil {
		return 0, cli.UsageError{Err: err}
	}
	if n != 0 && n < swap.MinSize {
		return 0, cli.Usagef("--swap %s: at least %d MiB, or 0 for none", f.swapSize, swap.MinSize>>20)
	}
	return n, nil
}

// openSwap makes and enables the swap file (none with --swap 0).
func (f *edgeFlags) openSwap(dataDir string, log *slog.Logger) error {
	size, err := f.swapBytes()
	if err != nil {
		return err
	}
	if size == 0 {
		total, _, _ := swap.Total()
		log.Info("no swap area of the edge's (--swap 0): idle sandboxes' memory cannot be paged out beyond the host's own swap",
			"host_swap_mib", total>>20)
		return nil
	}
	file := f.swapFile
	if file == "" {
		file = filepath.Join(dataDir, "swap.img")
	}
	a, err := swap.Open(swap.Options{File: file, Size: size})
	if err != nil {
		return fmt.Errorf("swap area (--swap, --swap-file; --swap 0 runs without): %w", err)
	}
	f.swap = a
	log.Info("swap area", "file", a.File(), "size_mib", a.Size()>>20)
	return nil
}

// closeSwap turns the swap file off and removes it, once the sandboxes
// are gone (turning it off reads back what is still in it).
func (f *edgeFlags) closeSwap(log *slog.Logger) {
	if f.swap == nil {
		return
	}
	if err := f.swap.Close(); err != nil {
		log.Warn("swap area", "err", err)
	}
	f.swap = nil
}
