package main

import (
	"io/fs"
	"syscall"
)

// fileInode identifies a file by device and inode so that hard links are
// archived once.
func fileInode(info fs.FileInfo) (struct{ dev, ino uint64 }, bool) {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok || st.Nlink < 2 {
		return struct{ dev, ino uint64 }{}, false
	}
	return struct{ dev, ino uint64 }{uint64(st.Dev), st.Ino}, true
}
