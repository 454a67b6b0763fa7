package localexec

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
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
			real, n, err := resolvePath(fsys, m, true)
			if err != nil || n == nil || n.typ != typeDir {
				continue
			}
			names, err := fsys.readDir(real)
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

// contextFS is the build context on disk, minus what .dockerignore excludes.
type contextFS struct {
	root   string
	ignore *patternmatcher.PatternMatcher
}

func newContextFS(root string, ignore *patternmatcher.PatternMatcher) *contextFS {
	return &contextFS{root: root, ignore: ignore}
}

// loadDockerignore reads <Dockerfile>.dockerignore if present, else
// .dockerignore, like BuildKit. The files are user input, so bad patterns
// are BuildErrors.
func loadDockerignore(contextDir, dockerfile string) (*patternmatcher.PatternMatcher, error) {
	for _, name := range []string{dockerfile + ".dockerignore", ".dockerignore"} {
		f, err := os.Open(filepath.Join(contextDir, filepath.FromSlash(name)))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("localexec: read %s: %w", name, err)
		}
		patterns, err := ignorefile.ReadAll(f)
		f.Close()
		if err != nil {
			return nil, &BuildError{Err: fmt.Errorf("%s: %w", name, err)}
		}
		if len(patterns) == 0 {
			return nil, nil
		}
		pm, err := patternmatcher.New(patterns)
		if err != nil {
			return nil, &BuildError{Err: fmt.Errorf("%s: %w", name, err)}
		}
		return pm, nil
	}
	return nil, nil
}

// excludedBy reports whether pm excludes p. A directory that is excluded
// but has a "!" exception somewhere below stays visible so the exception
// can be reached, mirroring BuildKit's file walker.
func excludedBy(pm *patternmatcher.PatternMatcher, p string, isDir bool) (bool, error) {
	if pm == nil || p == "" {
		return false, nil
	}
	m, err := pm.MatchesOrParentMatches(p)
	if err != nil || !m {
		return false, err
	}
	if isDir && pm.Exclusions() {
		dirSlash := p + "/"
		for _, pat := range pm.Patterns() {
			if pat.Exclusion() && strings.HasPrefix(pat.String()+"/", dirSlash) {
				return false, nil
			}
		}
	}
	return true, nil
}

func (c *contextFS) abs(p string) string {
	return filepath.Join(c.root, filepath.FromSlash(p))
}

func (c *contextFS) lstat(p string) (*node, error) {
	full := c.abs(p)
	lstat := os.Lstat
	if p == "" {
		lstat = os.Stat // the context root may itself be a symlink
	}
	fi, err := lstat(full)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if ex, err := excludedBy(c.ignore, p, fi.IsDir()); err != nil || ex {
		return nil, err
	}
	return nodeFromFileInfo(full, fi)
}

func (c *contextFS) readDir(p string) ([]string, error) {
	ents, err := os.ReadDir(c.abs(p))
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(ents))
	for _, e := range ents {
		child := joinPath(p, e.Name())
		if ex, err := excludedBy(c.ignore, child, e.IsDir()); err != nil {
			return nil, err
		} else if ex {
			continue
		}
		t := e.Type()
		if t.IsRegular() || t.IsDir() || t&fs.ModeSymlink != 0 {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	return names, nil
}

// nodeFromFileInfo describes a context file. Owner and time are not taken
// from disk: the context is always copied as root with epoch times, so
// the result does not depend on who checked it out or when.
func nodeFromFileInfo(full string, fi fs.FileInfo) (*node, error) {
	m := fi.Mode()
	n := &node{mode: int64(m.Perm())}
	if m&fs.ModeSetuid != 0 {
		n.mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		n.mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		n.mode |= 0o1000
	}
	switch {
	case m.IsRegular():
		n.typ = typeReg
		n.size = fi.Size()
		n.open = func() (io.ReadCloser, error) { return os.Open(full) }
	case m.IsDir():
		n.typ = typeDir
	case m&fs.ModeSymlink != 0:
		target, err := os.Readlink(full)
		if err != nil {
			return nil, err
		}
		n.typ = typeSymlink
		n.linkname = target
		n.mode = 0o777
	default:
		// Sockets, fifos and devices are not part of a build context.
		return nil, nil
	}
	return n, nil
}

// imageFS is an in-memory view of an image filesystem: every entry's
// metadata, and (for snapshots taken for COPY --from) where its content
// was spooled. It also serves as the index of the stage being built, kept
// up to date as layers are added.
type imageFS struct {
	nodes map[string]*node
	kids  map[string][]string // sorted child names of each directory
}

func newImageFS() *imageFS {
	return &imageFS{
		nodes: map[string]*node{"": {typ: typeDir, mode: 0o755}},
		kids:  map[string][]string{},
	}
}

func (f *imageFS) lstat(p string) (*node, error) { return f.nodes[p], nil }

func (f *imageFS) readDir(p string) ([]string, error) { return f.kids[p], nil }

// put adds or replaces an entry whose parent already exists. Replacing a
// directory by a non-directory drops what was below it, as applying the
// layer would.
func (f *imageFS) put(p string, n *node) {
	old, exists := f.nodes[p]
	f.nodes[p] = n
	if exists {
		if old.typ == typeDir && n.typ != typeDir {
			f.removeBelow(p)
		}
		return
	}
	parent, name := parentPath(p), path.Base(p)
	kids := f.kids[parent]
	i := sort.SearchStrings(kids, name)
	kids = append(kids, "")
	copy(kids[i+1:], kids[i:])
	kids[i] = name
	f.kids[parent] = kids
}

func (f *imageFS) removeBelow(p string) {
	for _, k := range f.kids[p] {
		c := joinPath(p, k)
		f.removeBelow(c)
		delete(f.nodes, c)
	}
	delete(f.kids, p)
}

// clone copies the index for a stage that starts FROM another stage.
// Nodes are never mutated in place, so sharing them is safe.
func (f *imageFS) clone() *imageFS {
	out := &imageFS{nodes: make(map[string]*node, len(f.nodes)), kids: make(map[string][]string, len(f.kids))}
	for k, v := range f.nodes {
		out.nodes[k] = v
	}
	for k, v := range f.kids {
		out.kids[k] = append([]string(nil), v...)
	}
	return out
}

// reindex adds directories that only exist implicitly (an image may list
// /a/b without /a) and builds the sorted child lists.
func (f *imageFS) reindex() {
	paths := make([]string, 0, len(f.nodes))
	for p := range f.nodes {
		paths = append(paths, p)
	}
	for _, p := range paths {
		for d := parentPath(p); d != ""; d = parentPath(d) {
			if _, ok := f.nodes[d]; ok {
				break
			}
			f.nodes[d] = &node{typ: typeDir, mode: 0o755}
		}
	}
	f.kids = map[string][]string{}
	for p := range f.nodes {
		if p == "" {
			continue
		}
		parent := parentPath(p)
		f.kids[parent] = append(f.kids[parent], path.Base(p))
	}
	for _, k := range f.kids {
		sort.Strings(k)
	}
}

// userDBFiles are the files kept in memory by index-only snapshots, so
// --chown=name:group can be resolved without capturing everything.
var userDBFiles = map[string]bool{"etc/passwd": true, "etc/group": true}

// snapshot reads the flattened filesystem of img (mutate.Extract honours
// whiteouts and layer order). With withContent, regular files are spooled
// to disk so COPY --from can read them; otherwise only metadata is kept,
// plus /etc/passwd and /etc/group.
func (b *builder) snapshot(img v1.Image, withContent bool) (*imageFS, error) {
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	f := newImageFS()
	links := map[string]string{}
	for {
		if err := b.checkCtx(); err != nil {
			return nil, err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			// mutate.Extract writes the end-of-archive marker even when it
			// stops on an error, which only surfaces when reading past it.
			if _, err := io.Copy(io.Discard, rc); err != nil {
				return nil, err
			}
			break
		}
		if err != nil {
			return nil, err
		}
		if err := checkHeader(hdr); err != nil {
			return nil, err
		}
		p := relPath(hdr.Name)
		if p == "" {
			continue
		}
		if err := b.addEntry(p); err != nil {
			return nil, err
		}
		n := nodeFromHeader(hdr)
		switch hdr.Typeflag {
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old archives still use TypeRegA
			n.typ = typeReg
			switch {
			case withContent:
				if n.open, err = b.spool.write(tr, hdr.Size); err != nil {
					return nil, err
				}
			case userDBFiles[p]:
				data, err := io.ReadAll(io.LimitReader(tr, 4<<20))
				if err != nil {
					return nil, err
				}
				n.open = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
			}
		case tar.TypeLink:
			links[p] = relPath(hdr.Linkname)
			continue
		case tar.TypeDir, tar.TypeSymlink, tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		default:
			continue
		}
		f.nodes[p] = n
	}
	// Hard links become independent copies of their target: a layer entry
	// must not point at a file that may live in another layer.
	for len(links) > 0 {
		progress := false
		for p, target := range links {
			t := f.nodes[target]
			if _, pending := links[target]; pending {
				continue
			}
			delete(links, p)
			progress = true
			if t == nil || t.typ != typeReg {
				continue
			}
			cp := *t
			f.nodes[p] = &cp
		}
		if !progress {
			break // a cycle of links; drop them
		}
	}
	f.reindex()
	return f, nil
}

// nodeFromHeader keeps what a copy must preserve from an image entry.
func nodeFromHeader(hdr *tar.Header) *node {
	n := &node{
		typ:      hdr.Typeflag,
		mode:     hdr.Mode & 0o7777,
		uid:      hdr.Uid,
		gid:      hdr.Gid,
		size:     hdr.Size,
		linkname: hdr.Linkname,
		devmajor: hdr.Devmajor,
		devminor: hdr.Devminor,
	}
	for k, v := range hdr.PAXRecords {
		if strings.HasPrefix(k, "SCHILY.xattr.") {
			if n.xattrs == nil {
				n.xattrs = map[string]string{}
			}
			n.xattrs[k] = v
		}
	}
	if n.typ == typeSymlink {
		n.mode = 0o777
	}
	return n
}

// spool is an append-only temp file holding file contents read from image
// layers and archives, so large trees are not held in memory while a layer
// is assembled.
type spool struct {
	dir string
	b   *builder // its limits and counters
	f   *os.File
	off int64
}

// write stores exactly size bytes from r and returns an opener for them.
func (s *spool) write(r io.Reader, size int64) (func() (io.ReadCloser, error), error) {
	if err := s.b.addSpooled(size); err != nil {
		return nil, err
	}
	if s.f == nil {
		f, err := os.CreateTemp(s.dir, "spool-")
		if err != nil {
			return nil, err
		}
		s.f = f
	}
	off := s.off
	n, err := io.CopyN(s.f, r, size)
	s.off += n
	if err != nil {
		return nil, err
	}
	f := s.f
	return func() (io.ReadCloser, error) {
		return io.NopCloser(io.NewSectionReader(f, off, size)), nil
	}, nil
}

func (s *spool) close() {
	if s.f != nil {
		s.f.Close()
	}
}

// Per-entry bounds on what a header makes the builder hold in memory.
const (
	maxNameBytes = 4096     // PATH_MAX
	maxPAXBytes  = 64 << 10 // xattrs and other PAX records of one entry
)

// checkHeader refuses a header whose names or PAX records would make the
// builder hold more than the per-entry bounds.
func checkHeader(hdr *tar.Header) error {
	if len(hdr.Name) > maxNameBytes || len(hdr.Linkname) > maxNameBytes {
		return limitErrorf("an entry name or link target of more than %d bytes (%s…)", maxNameBytes, truncatePath(hdr.Name))
	}
	n := 0
	for k, v := range hdr.PAXRecords {
		n += len(k) + len(v)
	}
	if n > maxPAXBytes {
		return limitErrorf("/%s carries more than %d bytes of PAX records", truncatePath(hdr.Name), maxPAXBytes)
	}
	return nil
}

// addSpooled counts n more bytes held on disk against the spool limit.
func (b *builder) addSpooled(n int64) error {
	b.spooled += n
	if b.spooled > b.limits.SpoolBytes {
		return limitErrorf("more than %d bytes of file content held on disk", b.limits.SpoolBytes)
	}
	return nil
}

// addEntry counts one more filesystem entry and checks its depth.
func (b *builder) addEntry(p string) error {
	b.entries++
	if b.entries > b.limits.Entries {
		return limitErrorf("more than %d filesystem entries in base images and archives", b.limits.Entries)
	}
	if d := strings.Count(p, "/") + 1; d > b.limits.Depth {
		return limitErrorf("path /%s is %d directories deep, more than %d", truncatePath(p), d, b.limits.Depth)
	}
	return nil
}

func truncatePath(p string) string {
	if len(p) > 120 {
		return p[:60] + "…" + p[len(p)-60:]
	}
	return p
}
