package trajectory_test

import (
	"io/fs"
	"path/filepath"
	"syscall"
	"testing"
)

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
