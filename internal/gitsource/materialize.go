package gitsource

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/filemode"
	"github.com/moby/patternmatcher"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
)

const (
	// maxVisited bounds the tree entries looked at, written or not: a
	// few bytes of pack can hold a tree of a million entries.
	maxVisited = 20 * contexttar.MaxEntries
	// maxSymlinkTarget is the longest symlink target Linux can create.
	maxSymlinkTarget = 4095
	// maxSmallFile bounds .dockerignore and .gitmodules.
	maxSmallFile = 1 << 20
	// lfsPointerMax is the size under which a Git LFS pointer file lives
	// (the LFS spec: pointers are smaller than 1024 bytes).
	lfsPointerMax = 1024
)

// lfsPrefix starts every Git LFS pointer file.
var lfsPrefix = []byte("version https://git-lfs.github.com/spec/v1")

// repoTree is the repository a tree being written belongs to, for its
// submodules: their URLs are relative to its URL, their paths to its
// root tree.
type repoTree struct {
	url     *url.URL
	sshUser string
	root    plumbing.Hash
	modules map[string]string // path -> URL, read on first need
}

// writer writes one context's tree into its directory.
type writer struct {
	r       *run
	ctx     context.Context
	root    *os.Root
	ig      *contexttar.Ignore
	br      *bufio.Reader
	buf     []byte
	entries int
	visited int
	bytes   int64
}

// materialize writes the SubPath tree of commit into dir, as a checkout
// would, minus what .dockerignore excludes. Every write goes through an
// os.Root on dir, so a symlink of the repository can never lead one
// outside it; symlinks are written as git stores them, never followed.
func (r *run) materialize(ctx context.Context, commit plumbing.Hash, dir string) error {
	c, err := r.commit(commit)
	if err != nil {
		return err
	}
	tree := c.TreeHash
	if r.src.SubPath != "" {
		if tree, err = r.subTree(c.TreeHash, commit); err != nil {
			return err
		}
	}
	ig, err := r.readIgnore(tree)
	if err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return transient("open the context directory", err)
	}
	defer func() { _ = root.Close() }()
	w := &writer{r: r, ctx: ctx, root: root, ig: ig, br: bufio.NewReaderSize(nil, 64<<10), buf: make([]byte, 128<<10)}
	rt := &repoTree{url: r.repoURL, sshUser: r.sshUser, root: c.TreeHash}
	return w.walk(tree, "", r.src.SubPath, patternmatcher.MatchInfo{}, rt, 0)
}

// subTree finds the SubPath directory in the commit's tree.
func (r *run) subTree(tree, commit plumbing.Hash) (plumbing.Hash, error) {
	for _, name := range strings.Split(r.src.SubPath, "/") {
		e, found, err := r.findEntry(tree, name)
		if err != nil {
			return plumbing.ZeroHash, err
		}
		if !found {
			return plumbing.ZeroHash, refuse(v1.ReasonGitSubPath,
				fmt.Sprintf("commit %s of %s has no directory %q", commit, r.display, r.src.SubPath), nil)
		}
		if e.mode != filemode.Dir {
			return plumbing.ZeroHash, refuse(v1.ReasonGitSubPath,
				fmt.Sprintf("%q in commit %s of %s is a %s, not a directory", r.src.SubPath, commit, r.display, kindOf(e.mode)), nil)
		}
		tree = e.hash
	}
	return tree, nil
}

// readIgnore compiles the .dockerignore at the root of the context tree.
// It must be a regular file: contexttar would follow a symlink, and on a
// worker that could read a file of the worker's own.
func (r *run) readIgnore(tree plumbing.Hash) (*contexttar.Ignore, error) {
	e, found, err := r.findEntry(tree, contexttar.DockerignoreName)
	if err != nil || !found {
		return &contexttar.Ignore{}, err
	}
	if e.mode != filemode.Regular && e.mode != filemode.Deprecated && e.mode != filemode.Executable {
		return nil, invalid(fmt.Sprintf("the context's %s is a %s; it must be a regular file", contexttar.DockerignoreName, kindOf(e.mode)))
	}
	data, err := r.readSmallBlob(e.hash, contexttar.DockerignoreName)
	if err != nil {
		return nil, err
	}
	ig, err := contexttar.ParseIgnore(bytes.NewReader(data), r.src.Dockerfile)
	if err != nil {
		return nil, refuse(v1.ReasonInvalidRequest, err.Error(), err)
	}
	return ig, nil
}

// walk writes the entries of tree under rel (context-relative) as
// contexttar's walk visits them; repoRel is rel relative to rt's root.
func (w *writer) walk(tree plumbing.Hash, rel, repoRel string, parent patternmatcher.MatchInfo, rt *repoTree, level int) error {
	tr, err := w.r.openTree(tree)
	if err != nil {
		return err
	}
	defer tr.close()
	for {
		e, err := tr.next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := w.ctx.Err(); err != nil {
			return err
		}
		if w.visited++; w.visited > maxVisited {
			return tooLarge(fmt.Sprintf("the context's trees have more than %d entries", maxVisited), nil)
		}
		if !validName(e.name) {
			return invalid(fmt.Sprintf("a tree of %s has an entry named %q, which git refuses to check out", rt.url, truncate(e.name, 80)))
		}
		child, repoChild := join(rel, e.name), join(repoRel, e.name)
		if strings.Count(child, "/")+1 > contexttar.MaxDepth {
			return tooLarge(fmt.Sprintf("%q is more than %d directories deep", truncate(child, 200), contexttar.MaxDepth), nil)
		}
		skip, info, err := w.ig.Match(child, parent)
		if err != nil {
			return refuse(v1.ReasonInvalidRequest, err.Error(), err)
		}
		isDir := e.mode == filemode.Dir || e.mode == filemode.Submodule
		if skip && (!isDir || !w.ig.MayReinclude(child)) {
			continue
		}
		switch e.mode {
		case filemode.Dir:
			if err := w.mkdir(child); err != nil {
				return err
			}
			if err := w.walk(e.hash, child, repoChild, info, rt, level); err != nil {
				return err
			}
		case filemode.Submodule:
			if err := w.mkdir(child); err != nil {
				return err
			}
			if w.r.src.Submodules {
				if err := w.submodule(child, repoChild, e.hash, info, rt, level); err != nil {
					return err
				}
			}
		case filemode.Regular, filemode.Deprecated, filemode.Executable:
			if err := w.file(child, e); err != nil {
				return err
			}
		case filemode.Symlink:
			if err := w.symlink(child, e); err != nil {
				return err
			}
		default:
			return invalid(fmt.Sprintf("%q has mode %o, which git does not check out", truncate(child, 200), uint32(e.mode)))
		}
	}
}

// count counts one entry written against contexttar's MaxEntries, which
// the build would refuse to extract anyway.
func (w *writer) count() error {
	if w.entries++; w.entries > contexttar.MaxEntries {
		return tooLarge(fmt.Sprintf("the context has more than %d files and directories", contexttar.MaxEntries), nil)
	}
	return nil
}

func (w *writer) mkdir(rel string) error {
	if err := w.count(); err != nil {
		return err
	}
	if err := w.root.Mkdir(rel, 0o755); err != nil {
		return w.writeError(rel, err)
	}
	return nil
}

// file writes a regular file with git's executable bit.
func (w *writer) file(rel string, e treeEntry) error {
	if err := w.count(); err != nil {
		return err
	}
	obj, err := w.r.st.EncodedObject(plumbing.BlobObject, e.hash)
	if err != nil {
		return w.r.missing(e.hash, rel, err)
	}
	size := obj.Size()
	if w.bytes+size > w.r.lim.MaxContextBytes {
		return tooLarge(fmt.Sprintf("the context's files are over MaxContextBytes=%d bytes (at %q, %d bytes)",
			w.r.lim.MaxContextBytes, truncate(rel, 200), size), nil)
	}
	w.bytes += size
	rc, err := obj.Reader()
	if err != nil {
		return fmt.Errorf("read blob %s: %w", e.hash, err)
	}
	defer func() { _ = rc.Close() }()
	w.br.Reset(rc)
	if size < lfsPointerMax {
		if head, _ := w.br.Peek(len(lfsPrefix)); bytes.Equal(head, lfsPrefix) {
			return refuse(v1.ReasonGitLFS, fmt.Sprintf("%q is a Git LFS pointer; LFS objects are not fetched "+
				"(commit the file itself, or exclude it in %s)", truncate(rel, 200), contexttar.DockerignoreName), nil)
		}
	}
	perm := os.FileMode(0o644)
	if e.mode == filemode.Executable {
		perm = 0o755
	}
	f, err := w.root.OpenFile(rel, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return w.writeError(rel, err)
	}
	n, err := io.CopyBuffer(f, io.LimitReader(ctxReader{w.ctx, w.br}, size), w.buf)
	if err == nil && n != size {
		err = fmt.Errorf("blob %s is %d bytes, not %d", e.hash, n, size)
	}
	if err == nil {
		err = f.Chmod(perm) // whatever the umask
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %q: %w", rel, err)
	}
	return nil
}

// symlink writes a symbolic link with the target git stores, unresolved.
func (w *writer) symlink(rel string, e treeEntry) error {
	if err := w.count(); err != nil {
		return err
	}
	obj, err := w.r.st.EncodedObject(plumbing.BlobObject, e.hash)
	if err != nil {
		return w.r.missing(e.hash, rel, err)
	}
	if obj.Size() == 0 || obj.Size() > maxSymlinkTarget {
		return invalid(fmt.Sprintf("symlink %q has a target of %d bytes", truncate(rel, 200), obj.Size()))
	}
	target, err := w.r.readSmallBlob(e.hash, rel)
	if err != nil {
		return err
	}
	if bytes.IndexByte(target, 0) >= 0 {
		return invalid(fmt.Sprintf("symlink %q has a target holding a NUL byte", truncate(rel, 200)))
	}
	if err := w.root.Symlink(string(target), rel); err != nil {
		return w.writeError(rel, err)
	}
	return nil
}

// writeError explains a failed write: an entry met twice is a malformed
// tree, anything else the disk's trouble.
func (w *writer) writeError(rel string, err error) error {
	if errors.Is(err, os.ErrExist) {
		return invalid(fmt.Sprintf("the tree holds %q twice", truncate(rel, 200)))
	}
	return transient(fmt.Sprintf("write %q", truncate(rel, 200)), err)
}

// missing explains an object the server should have sent and did not.
func (r *run) missing(h plumbing.Hash, rel string, err error) error {
	if errors.Is(err, plumbing.ErrObjectNotFound) {
		return invalid(fmt.Sprintf("the git server did not send object %s (%q)", h, truncate(rel, 200)))
	}
	return fmt.Errorf("read object %s: %w", h, err)
}

// readSmallBlob reads a blob of at most maxSmallFile bytes.
func (r *run) readSmallBlob(h plumbing.Hash, rel string) ([]byte, error) {
	obj, err := r.st.EncodedObject(plumbing.BlobObject, h)
	if err != nil {
		return nil, r.missing(h, rel, err)
	}
	if obj.Size() > maxSmallFile {
		return nil, tooLarge(fmt.Sprintf("%q is over %d bytes", rel, maxSmallFile), nil)
	}
	rc, err := obj.Reader()
	if err != nil {
		return nil, fmt.Errorf("read blob %s: %w", h, err)
	}
	defer func() { _ = rc.Close() }()
	data, err := io.ReadAll(io.LimitReader(rc, maxSmallFile))
	if err != nil {
		return nil, fmt.Errorf("read blob %s: %w", h, err)
	}
	return data, nil
}

// validName reports whether git would check out a tree entry so named:
// one path component that Linux can create, and never .git, in any case.
func validName(name string) bool {
	return name != "" && len(name) <= 255 && name != "." && name != ".." &&
		!strings.ContainsAny(name, "/\x00") && !strings.EqualFold(name, ".git")
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

func kindOf(m filemode.FileMode) string {
	switch m {
	case filemode.Dir:
		return "directory"
	case filemode.Symlink:
		return "symlink"
	case filemode.Submodule:
		return "submodule"
	}
	return "file"
}

// treeEntry is one entry of a tree object.
type treeEntry struct {
	name string
	mode filemode.FileMode
	hash plumbing.Hash
}

// treeReader streams a tree object's entries, so that a tree of a
// million entries is never held whole.
type treeReader struct {
	rc io.ReadCloser
	br *bufio.Reader
}

func (r *run) openTree(h plumbing.Hash) (*treeReader, error) {
	obj, err := r.st.EncodedObject(plumbing.TreeObject, h)
	if err != nil {
		return nil, r.missing(h, "a tree", err)
	}
	rc, err := obj.Reader()
	if err != nil {
		return nil, fmt.Errorf("read tree %s: %w", h, err)
	}
	return &treeReader{rc: rc, br: bufio.NewReaderSize(rc, 8<<10)}, nil
}

func (t *treeReader) close() { _ = t.rc.Close() }

// errBadTree marks a tree object that does not follow the format.
var errBadTree = errors.New("malformed tree object")

// next returns the next entry, or io.EOF.
func (t *treeReader) next() (treeEntry, error) {
	mode, err := t.br.ReadSlice(' ')
	if errors.Is(err, io.EOF) && len(mode) == 0 {
		return treeEntry{}, io.EOF
	}
	if err != nil || len(mode) > 7 {
		return treeEntry{}, invalid(errBadTree.Error())
	}
	m, err := strconv.ParseUint(string(mode[:len(mode)-1]), 8, 32)
	if err != nil {
		return treeEntry{}, invalid(errBadTree.Error())
	}
	name, err := t.br.ReadSlice(0)
	if err != nil {
		return treeEntry{}, invalid(errBadTree.Error() + ": an entry's name is missing or too long")
	}
	e := treeEntry{name: string(name[:len(name)-1]), mode: filemode.FileMode(m)}
	if _, err := io.ReadFull(t.br, e.hash[:]); err != nil {
		return treeEntry{}, invalid(errBadTree.Error())
	}
	return e, nil
}

// findEntry finds name in tree.
func (r *run) findEntry(tree plumbing.Hash, name string) (treeEntry, bool, error) {
	tr, err := r.openTree(tree)
	if err != nil {
		return treeEntry{}, false, err
	}
	defer tr.close()
	for {
		e, err := tr.next()
		if errors.Is(err, io.EOF) {
			return treeEntry{}, false, nil
		}
		if err != nil {
			return treeEntry{}, false, err
		}
		if e.name == name {
			return e, true, nil
		}
	}
}

// ctxReader stops a long copy soon after its context ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

// Read implements io.Reader.
func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
