package localexec

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"path"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

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
		if errors.Is(err, io.EOF) {
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
