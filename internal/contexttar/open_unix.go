//go:build unix

package contexttar

import (
	"os"
	"syscall"
)

// openNoFollow opens a file the walk listed as regular. O_NOFOLLOW makes a
// path swapped for a symlink since the listing fail instead of reading
// whatever the link points at (outside the context, perhaps); O_NONBLOCK
// keeps a path swapped for a FIFO from blocking the open (the caller then
// sees from Stat that it is not a regular file). Neither flag changes how a
// regular file reads.
func openNoFollow(name string) (*os.File, error) {
	return os.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
}
