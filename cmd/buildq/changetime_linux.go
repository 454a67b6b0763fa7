package main

import (
	"os"
	"syscall"
	"time"
)

// changeTime is fi's change time (ctime): set by the kernel on every
// write, chmod, link or rename, and never by utimes.
func changeTime(fi os.FileInfo) (time.Time, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return time.Time{}, false
	}
	return time.Unix(st.Ctim.Unix()), true
}
