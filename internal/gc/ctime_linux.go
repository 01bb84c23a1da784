package gc

import (
	"os"
	"syscall"
	"time"
)

// changeTime returns the file's status change time (ctime).
func changeTime(info os.FileInfo) (time.Time, bool) {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return time.Time{}, false
	}
	return time.Unix(st.Ctim.Sec, st.Ctim.Nsec), true
}
