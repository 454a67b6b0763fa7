package localexec

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"path"
	"strconv"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/patternmatcher"
)

// copyParams is what COPY and ADD have in common, after variable expansion.
type copyParams struct {
	name     string // "COPY" or "ADD", for messages and history
	line     int
	sd       instructions.SourcesAndDest
	from     string
	chown    string
	chmod    string
	exclude  []string
	parents  bool
	isAdd    bool
	unpack   bool // ADD: extract local tar archives
	checksum string
	original string // as written, for the step log
}

// copyOp carries one COPY/ADD (or the mkdir of a WORKDIR) while its layer
// is assembled. Every entry it creates goes both into the layer and into
// the stage index, so later sources in the same instruction see it.
type copyOp struct {
	b     *builder
	s     *stageState
	line  int
	name  string
	layer *layerBuilder
	idx   *imageFS

	src         fsView
	srcDesc     string
	fromContext bool

	chown    bool
	uid, gid int
	chmod    *int64
	// parentUID/GID own directories created implicitly (mkdir -p of the
	// destination): the --chown user, as in BuildKit, else root.
	parentUID, parentGID int
	exclude              *patternmatcher.PatternMatcher
	unpack               bool
}

// dispatchCopy runs one COPY or ADD and appends its layer.
func (b *builder) dispatchCopy(s *stageState, c copyParams) error {
	line := c.line
	if c.parents {
		return userErrorf(line, "%s --parents is not supported by the local executor", c.name)
	}
	if c.checksum != "" {
		return userErrorf(line, "ADD --checksum only applies to URL and git sources, which the local executor does not support; use COPY")
	}
	if c.isAdd {
		for _, src := range c.sd.SourcePaths {
			if isURL(src) {
				return userErrorf(line, "ADD of a URL is not supported by the local executor; use COPY (download %s into the build context first)", src)
			}
			if isGit(src) {
				return userErrorf(line, "ADD of a git repository is not supported by the local executor; use COPY (check %s out into the build context first)", src)
			}
		}
	}

	op := &copyOp{b: b, s: s, line: line, name: c.name, unpack: c.isAdd && c.unpack, layer: newLayerBuilder()}
	if c.from != "" {
		fsys, desc, err := b.fromSource(s, c.from, line)
		if err != nil {
			return err
		}
		op.src, op.srcDesc = fsys, desc
	} else {
		op.src, op.srcDesc, op.fromContext = b.context, "the build context", true
	}
	if c.chown != "" {
		uid, gid, err := b.resolveOwner(s, c.chown, line)
		if err != nil {
			return err
		}
		op.chown, op.uid, op.gid = true, uid, gid
		op.parentUID, op.parentGID = uid, gid
	}
	if c.chmod != "" {
		m, err := strconv.ParseUint(c.chmod, 8, 32)
		if err != nil || m > 0o7777 {
			return userErrorf(line, "invalid --chmod %q: want an octal mode such as 0755 (symbolic modes are not supported by the local executor)", c.chmod)
		}
		mode := int64(m)
		op.chmod = &mode
	}
	if len(c.exclude) > 0 {
		pm, err := patternmatcher.New(c.exclude)
		if err != nil {
			return userErrorf(line, "%s --exclude: %v", c.name, err)
		}
		op.exclude = pm
	}
	idx, err := b.stageFS(s)
	if err != nil {
		return err
	}
	op.idx = idx

	// The destination is relative to WORKDIR; a trailing slash (or ".")
	// makes it a directory even if it does not exist yet.
	dest := c.sd.DestPath
	destIsDir := dest == "" || dest == "." || strings.HasSuffix(dest, "/") || strings.HasSuffix(dest, "/.")
	abs := dest
	if !path.IsAbs(abs) {
		wd := s.cfg.Config.WorkingDir
		if wd == "" {
			wd = "/"
		}
		abs = path.Join(wd, abs)
	}
	destRel := relPath(abs)

	matches, err := op.sources(c)
	if err != nil {
		return err
	}
	mk := parentPath(destRel)
	if destIsDir {
		mk = destRel
	}
	if destRel != "" {
		if _, err := op.mkdirAll(mk); err != nil {
			return err
		}
	}
	if len(matches)+len(c.sd.SourceContents) > 1 && !destIsDir {
		if _, dn, _ := resolvePath(idx, destRel, true); dn == nil || dn.typ != typeDir {
			return userErrorf(line, "%s with more than one source file: the destination must be a directory and end with a /", c.name)
		}
	}
	for _, m := range matches {
		if err := op.copyOne(m, destRel); err != nil {
			return err
		}
	}
	for _, sc := range c.sd.SourceContents {
		if err := op.copyInline(sc, destRel); err != nil {
			return err
		}
	}

	l, err := op.layer.build(b, s.layerType)
	if err != nil {
		return err
	}
	b.logCopy(s, c, op)
	if err := s.addLayer(l, copyHistory(c)); err != nil {
		return err
	}
	b.logLayer(s, l)
	return nil
}

// copyHistory is the history text: the instruction after expansion, so it
// is stable for the same inputs and says what was actually copied.
func copyHistory(c copyParams) string {
	parts := []string{c.name}
	if c.from != "" {
		parts = append(parts, "--from="+c.from)
	}
	if c.chown != "" {
		parts = append(parts, "--chown="+c.chown)
	}
	if c.chmod != "" {
		parts = append(parts, "--chmod="+c.chmod)
	}
	for _, e := range c.exclude {
		parts = append(parts, "--exclude="+e)
	}
	parts = append(parts, c.sd.SourcePaths...)
	for _, sc := range c.sd.SourceContents {
		parts = append(parts, "<<"+sc.Path)
	}
	parts = append(parts, c.sd.DestPath)
	return strings.Join(parts, " ")
}

func isURL(src string) bool {
	return strings.HasPrefix(src, "http://") || strings.HasPrefix(src, "https://")
}

func isGit(src string) bool {
	return strings.HasPrefix(src, "git@") || strings.HasPrefix(src, "git://") || strings.HasPrefix(src, "ssh://")
}

// sources expands the source list: wildcards may match nothing (as in
// BuildKit), but a plain path that does not exist is an error.
func (op *copyOp) sources(c copyParams) ([]string, error) {
	var out []string
	for _, src := range c.sd.SourcePaths {
		p := relPath(src)
		if hasWildcard(src) {
			for _, part := range splitPath(p) {
				if _, err := path.Match(part, ""); err != nil {
					return nil, userErrorf(op.line, "%s %s: bad pattern: %v", c.name, src, err)
				}
			}
			ms, err := glob(op.src, p)
			if err != nil {
				return nil, err
			}
			for _, m := range ms {
				if ex, err := excludedBy(op.exclude, m, false); err != nil {
					return nil, err
				} else if !ex {
					out = append(out, m)
				}
			}
			continue
		}
		_, n, err := resolvePath(op.src, p, true)
		if err != nil && !isLookupErr(err) {
			return nil, err
		}
		if n == nil {
			return nil, userErrorf(op.line, "%s %s: not found in %s", c.name, src, op.srcDesc)
		}
		out = append(out, p)
	}
	return out, nil
}

// isLookupErr tells path problems (the user's) from I/O errors.
func isLookupErr(err error) bool {
	return errors.Is(err, errNotFound) || errors.Is(err, errNotDir) || errors.Is(err, errLoop)
}

// copyOne copies one matched source with docker's rules: a directory's
// contents go into the destination; a file goes into the destination if
// that is an existing directory, else becomes it; ADD extracts archives.
func (op *copyOp) copyOne(m, destRel string) error {
	srcReal, sn, err := resolvePath(op.src, m, true)
	if err != nil && !isLookupErr(err) {
		return err
	}
	if sn == nil {
		return userErrorf(op.line, "%s /%s: not found in %s", op.name, m, op.srcDesc)
	}
	dReal, dn, err := resolvePath(op.idx, destRel, true)
	if err != nil {
		return userErrorf(op.line, "%s: destination /%s: %v", op.name, destRel, err)
	}
	if sn.typ == typeDir {
		if dn == nil {
			if dReal, err = op.mkdirAll(dReal); err != nil {
				return err
			}
		} else if dn.typ != typeDir {
			return userErrorf(op.line, "%s: cannot copy directory /%s to /%s: it exists and is not a directory", op.name, m, dReal)
		}
		return op.copyTree(srcReal, "", dReal)
	}
	if op.unpack && op.fromContext && sn.typ == typeReg {
		kind, err := archiveKind(sn)
		if err != nil {
			return err
		}
		switch kind {
		case archiveXZ:
			return userErrorf(op.line, "ADD /%s: xz-compressed archives are not supported by the local executor; use a .tar, .tar.gz, .tar.bz2 or .tar.zst archive", m)
		case archiveNone:
		default:
			if dn != nil && dn.typ != typeDir {
				return userErrorf(op.line, "ADD /%s: cannot extract into /%s: it exists and is not a directory", m, dReal)
			}
			if dn == nil {
				if dReal, err = op.mkdirAll(dReal); err != nil {
					return err
				}
			}
			return op.untar(m, sn, kind, dReal)
		}
	}
	target := dReal
	if dn != nil && dn.typ == typeDir {
		target = joinPath(dReal, path.Base(m))
	}
	return op.putFile(target, sn)
}

// copyInline writes a heredoc source (COPY <<EOF /dest) as a 0644 file.
func (op *copyOp) copyInline(sc instructions.SourceContent, destRel string) error {
	data := []byte(sc.Data)
	n := &node{
		typ:  typeReg,
		mode: 0o644,
		size: int64(len(data)),
		open: func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
	}
	dReal, dn, err := resolvePath(op.idx, destRel, true)
	if err != nil {
		return userErrorf(op.line, "%s: destination /%s: %v", op.name, destRel, err)
	}
	target := dReal
	if dn != nil && dn.typ == typeDir {
		target = joinPath(dReal, path.Base(relPath(sc.Path)))
	}
	e := op.entry(n)
	if !op.chown {
		e.uid, e.gid = 0, 0
	}
	return op.putEntry(target, e)
}

// copyTree copies the contents of srcDir into dstDir. Nested directories
// always carry the source metadata (BuildKit overwrites it); symlinks are
// copied as links, never followed.
func (op *copyOp) copyTree(srcDir, rel, dstDir string) error {
	names, err := op.src.readDir(srcDir)
	if err != nil {
		return err
	}
	for _, name := range names {
		if err := op.b.checkCtx(); err != nil {
			return err
		}
		sp := joinPath(srcDir, name)
		n, err := op.src.lstat(sp)
		if err != nil {
			return err
		}
		if n == nil {
			continue
		}
		childRel := joinPath(rel, name)
		if ex, err := excludedBy(op.exclude, childRel, n.typ == typeDir); err != nil {
			return err
		} else if ex {
			continue
		}
		dp := joinPath(dstDir, name)
		existing, _ := op.idx.lstat(dp)
		if n.typ == typeDir {
			if existing != nil && existing.typ != typeDir {
				return userErrorf(op.line, "%s: cannot copy directory to /%s: it exists and is not a directory", op.name, dp)
			}
			op.put(dp, op.entry(n))
			if err := op.copyTree(sp, childRel, dp); err != nil {
				return err
			}
			continue
		}
		if existing != nil && existing.typ == typeDir {
			return userErrorf(op.line, "%s: cannot replace directory /%s with a file", op.name, dp)
		}
		op.put(dp, op.entry(n))
	}
	return nil
}

// putFile places a non-directory at target, refusing to replace a
// directory (as BuildKit does).
func (op *copyOp) putFile(target string, sn *node) error {
	return op.putEntry(target, op.entry(sn))
}

func (op *copyOp) putEntry(target string, e *node) error {
	if existing, _ := op.idx.lstat(target); existing != nil && existing.typ == typeDir {
		return userErrorf(op.line, "%s: cannot replace directory /%s with a file", op.name, target)
	}
	op.put(target, e)
	return nil
}

// entry applies --chown and --chmod to a source entry. Context files are
// always root-owned (a checkout's uid means nothing in an image); files
// from a stage or image keep their owner unless --chown says otherwise.
func (op *copyOp) entry(n *node) *node {
	e := *n
	switch {
	case op.chown:
		e.uid, e.gid = op.uid, op.gid
	case op.fromContext:
		e.uid, e.gid = 0, 0
	}
	if op.chmod != nil && e.typ != typeSymlink {
		e.mode = *op.chmod
	}
	return &e
}

func (op *copyOp) put(p string, n *node) {
	op.layer.put(p, n)
	op.idx.put(p, n)
}

// mkdirAll is `mkdir -p` inside the image being built: it follows existing
// symlinks (so /lib -> usr/lib works), leaves existing directories alone
// (their mode and owner are not ours to change), and creates missing ones
// as 0755, owned by the --chown user or root. It returns the real path.
func (op *copyOp) mkdirAll(p string) (string, error) {
	pending := splitPath(p)
	cur := ""
	hops := 0
	for len(pending) > 0 {
		part := pending[0]
		pending = pending[1:]
		if part == ".." {
			cur = parentPath(cur)
			continue
		}
		next := joinPath(cur, part)
		n, _ := op.idx.lstat(next)
		switch {
		case n == nil:
			op.put(next, &node{typ: typeDir, mode: 0o755, uid: op.parentUID, gid: op.parentGID})
		case n.typ == typeSymlink:
			hops++
			if hops > 255 {
				return "", userErrorf(op.line, "cannot create directory /%s: %v", p, errLoop)
			}
			if strings.HasPrefix(n.linkname, "/") {
				cur = ""
			}
			pending = append(splitPath(n.linkname), pending...)
			continue
		case n.typ != typeDir:
			return "", userErrorf(op.line, "cannot create directory /%s: /%s exists and is not a directory", p, next)
		}
		cur = next
	}
	return cur, nil
}

// fromSource resolves COPY --from: an earlier stage (by name or index) or
// an image reference. A bare word that is not a stage is treated as a
// mistyped stage name rather than pulled as docker.io/library/<word>:
// typos are far more common than tag-less image references, and a failed
// pull would be reported as an infrastructure error.
func (b *builder) fromSource(cur *stageState, from string, line int) (fsView, string, error) {
	if strings.Contains(from, "$") {
		return nil, "", userErrorf(line, "variable expansion is not supported for --from; define a stage with FROM using a global ARG instead")
	}
	if n, err := strconv.Atoi(from); err == nil {
		if n < 0 || n >= cur.index {
			return nil, "", userErrorf(line, "COPY --from=%d: there is no earlier stage with that index", n)
		}
		fsys, err := b.stageContent(n)
		return fsys, fmt.Sprintf("stage %d", n), err
	}
	if j, ok := b.stageIndex(from); ok {
		if j >= cur.index {
			return nil, "", userErrorf(line, "COPY --from=%s: stage %q must be defined before the stage that copies from it", from, from)
		}
		fsys, err := b.stageContent(j)
		return fsys, fmt.Sprintf("stage %q", from), err
	}
	if !strings.ContainsAny(from, "/:@") {
		return nil, "", userErrorf(line, "COPY --from=%s: no build stage named %q (stages: %s); to copy from an image, use a full reference such as %s:latest", from, from, b.stageNames(), from)
	}
	plat := cur.platform
	key := from + "|" + plat.String()
	if f, ok := b.imageFS[key]; ok {
		return f, fmt.Sprintf("image %s", from), nil
	}
	img, err := b.pull(from, plat, line)
	if err != nil {
		return nil, "", err
	}
	f, err := b.snapshot(img, true)
	if err != nil {
		return nil, "", fmt.Errorf("pull base image %s: read filesystem: %w", from, err)
	}
	b.imageFS[key] = f
	return f, fmt.Sprintf("image %s", from), nil
}

// stageContent builds stage j if needed and snapshots its filesystem with
// contents, once.
func (b *builder) stageContent(j int) (*imageFS, error) {
	st, err := b.buildStage(j)
	if err != nil {
		return nil, err
	}
	if st.content == nil {
		f, err := b.snapshot(st.final, true)
		if err != nil {
			return nil, fmt.Errorf("pull base image %s: read filesystem: %w", st.pullRef, err)
		}
		st.content = f
	}
	return st.content, nil
}
