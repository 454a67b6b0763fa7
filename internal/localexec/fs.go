package localexec

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
)

// Entry types, in tar terms, which is what every filesystem here is reduced to.
const (
	typeReg     = tar.TypeReg
	typeDir     = tar.TypeDir
	typeSymlink = tar.TypeSymlink
)

var (
	errNotFound = errors.New("no such file or directory")
	errNotDir   = errors.New("not a directory")
	errLoop     = errors.New("too many levels of symbolic links")
)

// node is one filesystem entry. The build context on disk, snapshots of
// images and the layer being written all use it, so COPY has one code path
// whatever it copies from.
type node struct {
	typ                byte  // tar type flag: typeReg, typeDir, typeSymlink, or a device/fifo type
	mode               int64 // permission bits plus setuid/setgid/sticky
	uid, gid           int
	size               int64
	linkname           string            // symlink target
	devmajor, devminor int64             // device numbers
	xattrs             map[string]string // PAX xattr records kept from image sources (e.g. file capabilities)
	// open returns the content of a regular file; nil when the content was
	// not captured (index-only snapshots).
	open func() (io.ReadCloser, error)
}

// fsView is a read-only filesystem addressed by clean, slash-separated paths
// relative to its root ("" is the root).
type fsView interface {
	// lstat describes p without following a final symlink; (nil, nil) when
	// p does not exist.
	lstat(p string) (*node, error)
	// readDir lists the names in directory p, sorted.
	readDir(p string) ([]string, error)
}

// relPath turns an absolute image path into the root-relative form used here.
func relPath(p string) string {
	return strings.TrimPrefix(path.Clean("/"+p), "/")
}

// joinPath joins a root-relative directory and a name.
func joinPath(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// parentPath is the directory of a root-relative path; the root is its own parent.
func parentPath(p string) string {
	i := strings.LastIndexByte(p, '/')
	if i < 0 {
		return ""
	}
	return p[:i]
}

// splitPath splits into components, dropping empty and "." ones.
func splitPath(p string) []string {
	var out []string
	for _, part := range strings.Split(p, "/") {
		if part != "" && part != "." {
			out = append(out, part)
		}
	}
	return out
}

// resolvePath resolves p inside fsys the way the kernel would inside a
// chroot: symlinks in intermediate components (and in the last one when
// followLast) are followed, absolute targets restart at the root, and ".."
// never climbs above it. This is how COPY sources are looked up and how
// destinations are found in the image being built. It returns the real
// path and its node; the node is nil (with a nil error) when only the last
// component is missing.
func resolvePath(fsys fsView, p string, followLast bool) (string, *node, error) {
	pending := splitPath(p)
	cur := ""
	var curNode *node
	hops := 0
	for len(pending) > 0 {
		part := pending[0]
		pending = pending[1:]
		if part == ".." {
			cur = parentPath(cur)
			curNode = nil
			continue
		}
		next := joinPath(cur, part)
		n, err := fsys.lstat(next)
		if err != nil {
			return "", nil, err
		}
		if n == nil {
			if len(pending) == 0 {
				return next, nil, nil
			}
			return "", nil, errNotFound
		}
		if n.typ == typeSymlink && (len(pending) > 0 || followLast) {
			hops++
			if hops > 255 {
				return "", nil, errLoop
			}
			if strings.HasPrefix(n.linkname, "/") {
				cur = ""
			}
			curNode = nil
			pending = append(splitPath(n.linkname), pending...)
			continue
		}
		if len(pending) > 0 && n.typ != typeDir {
			return "", nil, errNotDir
		}
		cur, curNode = next, n
	}
	if curNode == nil {
		n, err := fsys.lstat(cur)
		return cur, n, err
	}
	return cur, curNode, nil
}

// hasWildcard reports whether a COPY source is a pattern, honouring
// backslash escapes as BuildKit does.
func hasWildcard(s string) bool {
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '*', '?', '[':
			return true
		}
	}
	return false
}

// glob expands a COPY source pattern component by component with
// path.Match semantics (a "*" never crosses "/"), returning matches in
// sorted order. Non-existent results are dropped.
func glob(fsys fsView, pattern string) ([]string, error) {
	matches := []string{""}
	for _, part := range splitPath(pattern) {
		var next []string
		for _, m := range matches {
			if part == ".." {
				next = append(next, parentPath(m))
				continue
			}
			if !hasWildcard(part) {
				next = append(next, joinPath(m, part))
				continue
			}
			resolved, n, err := resolvePath(fsys, m, true)
			if err != nil || n == nil || n.typ != typeDir {
				continue
			}
			names, err := fsys.readDir(resolved)
			if err != nil {
				return nil, err
			}
			for _, name := range names {
				ok, err := path.Match(part, name)
				if err != nil {
					return nil, fmt.Errorf("bad pattern %q: %w", pattern, err)
				}
				if ok {
					next = append(next, joinPath(m, name))
				}
			}
		}
		matches = next
	}
	var out []string
	for _, m := range matches {
		if _, n, err := resolvePath(fsys, m, true); err == nil && n != nil {
			out = append(out, m)
		}
	}
	return out, nil
}
