//go:build !unix

package contexttar

import "os"

// openNoFollow opens a file the walk listed as regular. Without O_NOFOLLOW
// this platform relies on the caller's Stat of the open file to notice a
// path that stopped being a regular file.
func openNoFollow(name string) (*os.File, error) {
	return os.Open(name)
}
