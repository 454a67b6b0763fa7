package contexttar

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/moby/patternmatcher"
)

const (
	// defaultDockerfile is the Dockerfile's name when Options leaves it
	// empty, as with `docker build` without -f.
	defaultDockerfile = "Dockerfile"
	// copyBufferSize is the size of the one buffer Write copies file content
	// through: big enough to amortize syscalls, and the only per-file memory.
	copyBufferSize = 128 << 10
)

// epoch is the fixed timestamp of every entry: the Unix epoch, so that
// mtimes never reach the digest.
var epoch = time.Unix(0, 0)

// Options for Write.
type Options struct {
	// Dockerfile is the Dockerfile's path relative to dir ("Dockerfile" when
	// empty). Like the docker CLI, the Dockerfile and .dockerignore are
	// always included even if .dockerignore excludes them. A missing
	// Dockerfile is not an error: Write packs directories, it does not
	// validate builds.
	Dockerfile string
	// MaxBytes caps the total size of regular-file content (0 =
	// DefaultMaxBytes = 1 GiB); exceeding it returns an error matching
	// ErrTooLarge. Excluded files do not count. Negative values are an error.
	MaxBytes int64
	// Progress, if non-nil, is called after each entry (file, symlink or
	// directory) with the running count of file bytes read and entries
	// written, so a CLI can show progress on large contexts. It is called on
	// Write's goroutine and must not block for long.
	Progress func(bytesRead int64, files int)
}

// Result describes the archive Write produced, or Digest would have.
type Result struct {
	// Digest is "sha256:<hex>" of the UNCOMPRESSED normalized tar stream:
	// the context's identity. It does not depend on the compressor, whose
	// output may change between Go releases (see package doc).
	Digest string
	// Size is the length in bytes of the uncompressed tar stream.
	Size int64
	// Files counts the entries written: regular files, symlinks and
	// directories.
	Files int
}

// Write walks dir, applies .dockerignore (moby/patternmatcher and
// patternmatcher/ignorefile, as docker does, including `!` exceptions and the
// directory-walk semantics described in the package doc), and writes a
// normalized, reproducible tar.gz to w. To only compute the digest, use
// Digest, which skips the compression.
//
// Write streams: memory stays bounded by one copy buffer, the compressor's
// state and the directory listings on the current walk path, whatever the
// size of the context. It never closes w. On error, w has received a partial
// archive that must be discarded.
//
// A file that changes size while it is being read is an error rather than a
// silently inconsistent archive.
func Write(ctx context.Context, dir string, w io.Writer, opts Options) (Result, error) {
	zw, err := gzip.NewWriterLevel(w, gzipLevel)
	if err != nil {
		return Result{}, fmt.Errorf("contexttar: gzip: %w", err)
	}
	res, err := writeTar(ctx, dir, zw, opts)
	if err != nil {
		return Result{}, err
	}
	if err := zw.Close(); err != nil {
		return Result{}, fmt.Errorf("contexttar: finish gzip: %w", err)
	}
	return res, nil
}

// Digest returns the Result that Write would for the same dir and opts,
// without producing the archive: it hashes the same uncompressed tar stream
// but does not compress it, which is most of Write's CPU time. Use it where
// only the digest (and the size and count) is needed, such as naming a
// context before deciding whether to upload it.
func Digest(ctx context.Context, dir string, opts Options) (Result, error) {
	return writeTar(ctx, dir, nil, opts)
}

// writeTar walks dir as Write describes and writes the normalized,
// uncompressed tar stream to w, or only hashes it when w is nil.
func writeTar(ctx context.Context, dir string, w io.Writer, opts Options) (Result, error) {
	maxBytes, err := limit(opts.MaxBytes)
	if err != nil {
		return Result{}, err
	}
	dockerfile, err := dockerfileName(opts.Dockerfile)
	if err != nil {
		return Result{}, err
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return Result{}, fmt.Errorf("contexttar: context directory: %w", err)
	}
	if !fi.IsDir() {
		return Result{}, fmt.Errorf("contexttar: context %q is not a directory", dir)
	}
	ignore, err := loadDockerignore(dir, dockerfile)
	if err != nil {
		return Result{}, err
	}

	digest := sha256.New()
	counted := &countingWriter{w: digest}
	var out io.Writer = counted
	if w != nil {
		out = io.MultiWriter(counted, w)
	}
	tw := tar.NewWriter(out)

	wk := &walker{
		ctx:      ctx,
		root:     dir,
		ignore:   ignore,
		tw:       tw,
		buf:      make([]byte, copyBufferSize),
		maxBytes: maxBytes,
		progress: opts.Progress,
	}
	if err := wk.walk("", patternmatcher.MatchInfo{}, false); err != nil {
		return Result{}, err
	}
	if err := tw.Close(); err != nil {
		return Result{}, fmt.Errorf("contexttar: finish tar: %w", err)
	}
	return Result{
		Digest: "sha256:" + hex.EncodeToString(digest.Sum(nil)),
		Size:   counted.n,
		Files:  wk.files,
	}, nil
}

// dockerfileName validates Options.Dockerfile and returns it in the
// slash-separated, cleaned form that .dockerignore patterns are matched
// against. A Dockerfile outside dir cannot be kept in the context, so it is
// refused rather than silently ignored.
func dockerfileName(p string) (string, error) {
	if p == "" {
		return defaultDockerfile, nil
	}
	if !filepath.IsLocal(p) {
		return "", fmt.Errorf("contexttar: Dockerfile %q must be a relative path inside the context directory", p)
	}
	return filepath.ToSlash(filepath.Clean(p)), nil
}

// loadDockerignore reads dir/.dockerignore (ParseIgnore); without one,
// nothing is excluded.
func loadDockerignore(dir, dockerfile string) (*Ignore, error) {
	f, err := os.Open(filepath.Join(dir, DockerignoreName))
	if errors.Is(err, fs.ErrNotExist) {
		return &Ignore{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("contexttar: open %s: %w", DockerignoreName, err)
	}
	defer f.Close()
	return ParseIgnore(f, dockerfile)
}

// walker carries the state of one Write's depth-first walk.
type walker struct {
	ctx      context.Context
	root     string
	ignore   *Ignore
	tw       *tar.Writer
	buf      []byte
	maxBytes int64
	progress func(bytesRead int64, files int)

	// pending holds the tar names of the directories on the current walk
	// path; pending[:emitted] have been written. A directory that
	// .dockerignore excludes is still descended into when an exception may
	// re-include something below it; its entry is written only once such a
	// descendant is, so the archive has no empty excluded directories and
	// every entry's parents precede it (as BuildKit sends them).
	pending []string
	emitted int

	bytesRead int64
	files     int
}

// dirEntry is a directory entry with its sort key.
type dirEntry struct {
	fs.DirEntry
	key string // the name, plus "/" for a directory: its tar name's last part
}

// walk writes the entries below the slash-separated relative directory rel
// ("" for the root). parent is rel's match state, which patternmatcher needs
// to evaluate children the way a full walk does; excluded says rel itself is
// excluded and is only being searched for exceptions.
func (w *walker) walk(rel string, parent patternmatcher.MatchInfo, excluded bool) error {
	list, err := os.ReadDir(w.abs(rel))
	if err != nil {
		if excluded && errors.Is(err, fs.ErrPermission) {
			// fsutil ignores unreadable excluded directories: users exclude
			// them precisely because they cannot or should not be read.
			return nil
		}
		return fmt.Errorf("contexttar: read directory %q: %w", w.abs(rel), err)
	}
	// Sorting by name plus "/" for directories makes the depth-first walk
	// emit names in global bytewise order (see package doc).
	entries := make([]dirEntry, len(list))
	for i, e := range list {
		entries[i] = dirEntry{DirEntry: e, key: e.Name()}
		if e.IsDir() {
			entries[i].key += "/"
		}
	}
	slices.SortFunc(entries, func(a, b dirEntry) int { return strings.Compare(a.key, b.key) })

	for _, e := range entries {
		if err := w.ctx.Err(); err != nil {
			return err
		}
		childRel := e.Name()
		if rel != "" {
			childRel = rel + "/" + childRel
		}
		typ := e.Type()

		skip, info, err := w.ignore.Match(childRel, parent)
		if err != nil {
			return err
		}

		switch {
		case skip:
			if !typ.IsDir() || !w.ignore.MayReinclude(childRel) {
				continue
			}
			if err := w.descend(childRel, info, true); err != nil {
				return err
			}
		case typ.IsDir():
			if err := w.descend(childRel, info, false); err != nil {
				return err
			}
		case typ.IsRegular():
			if err := w.flushPending(); err != nil {
				return err
			}
			if err := w.writeFile(childRel); err != nil {
				return err
			}
		case typ&fs.ModeSymlink != 0:
			if err := w.flushPending(); err != nil {
				return err
			}
			if err := w.writeSymlink(childRel); err != nil {
				return err
			}
		default:
			// Sockets, devices, FIFOs: not build inputs, and reading a FIFO
			// would block. Skipped, as the normalization policy says.
		}
	}
	return nil
}

// descend walks into directory rel, writing its entry first unless it is
// excluded (then it is written lazily, if a descendant is).
func (w *walker) descend(rel string, info patternmatcher.MatchInfo, excluded bool) error {
	w.pending = append(w.pending, rel+"/")
	defer func() {
		w.pending = w.pending[:len(w.pending)-1]
		w.emitted = min(w.emitted, len(w.pending))
	}()
	if !excluded {
		if err := w.flushPending(); err != nil {
			return err
		}
	}
	return w.walk(rel, info, excluded)
}

// flushPending writes the entries of the directories on the walk path that
// have not been written yet, outermost first.
func (w *walker) flushPending() error {
	for w.emitted < len(w.pending) {
		hdr := newHeader(w.pending[w.emitted], tar.TypeDir, 0o755)
		if err := w.tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("contexttar: write %q: %w", hdr.Name, err)
		}
		w.emitted++
		w.entryDone()
	}
	return nil
}

// writeFile writes the regular file rel, header and content.
func (w *walker) writeFile(rel string) error {
	f, err := openNoFollow(w.abs(rel))
	if err != nil {
		return fmt.Errorf("contexttar: open %q: %w", rel, err)
	}
	defer f.Close()
	// Stat the open file, not the path: what we read is what we describe,
	// even if the path was swapped since the directory was listed.
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("contexttar: stat %q: %w", rel, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("contexttar: %q stopped being a regular file during the walk", rel)
	}
	size := fi.Size()
	if size > w.maxBytes-w.bytesRead {
		return fmt.Errorf("%w: %q (%d bytes) brings regular-file content to %d bytes, over the limit of %d",
			ErrTooLarge, rel, size, w.bytesRead+size, w.maxBytes)
	}
	mode := int64(0o644)
	if fi.Mode().Perm()&0o111 != 0 {
		mode = 0o755
	}
	hdr := newHeader(rel, tar.TypeReg, mode)
	hdr.Size = size
	if err := w.tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("contexttar: write %q: %w", rel, err)
	}
	// The anonymous struct hides tar.Writer's ReadFrom, so the copy goes
	// through w.buf instead of allocating a buffer per file.
	n, err := io.CopyBuffer(struct{ io.Writer }{w.tw}, io.LimitReader(ctxReader{w.ctx, f}, size), w.buf)
	if err != nil {
		return fmt.Errorf("contexttar: copy %q: %w", rel, err)
	}
	if n < size {
		return fmt.Errorf("contexttar: %q shrank from %d to %d bytes while being read", rel, size, n)
	}
	var probe [1]byte
	if m, _ := f.Read(probe[:]); m > 0 {
		return fmt.Errorf("contexttar: %q grew past %d bytes while being read", rel, size)
	}
	w.bytesRead += size
	w.entryDone()
	return nil
}

// writeSymlink writes the symlink rel with its target unchanged: targets are
// content, and the walk never follows them.
func (w *walker) writeSymlink(rel string) error {
	target, err := os.Readlink(w.abs(rel))
	if err != nil {
		return fmt.Errorf("contexttar: readlink %q: %w", rel, err)
	}
	hdr := newHeader(rel, tar.TypeSymlink, 0o777)
	hdr.Linkname = target
	if err := w.tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("contexttar: write %q: %w", rel, err)
	}
	w.entryDone()
	return nil
}

// entryDone counts a written entry and reports progress.
func (w *walker) entryDone() {
	w.files++
	if w.progress != nil {
		w.progress(w.bytesRead, w.files)
	}
}

// abs turns the slash-separated relative path rel into a filesystem path.
func (w *walker) abs(rel string) string {
	return filepath.Join(w.root, filepath.FromSlash(rel))
}

// newHeader returns a header carrying only what the normalization policy
// keeps: every other field stays at its zero value (uid/gid 0, no user or
// group names, no atime/ctime) and ModTime is the epoch, so the same content
// always encodes to the same bytes.
func newHeader(name string, typ byte, mode int64) *tar.Header {
	return &tar.Header{
		Typeflag: typ,
		Name:     name,
		Mode:     mode,
		ModTime:  epoch,
		Format:   tar.FormatPAX,
	}
}

// countingWriter counts the bytes written through it, giving Result.Size
// without buffering the stream.
type countingWriter struct {
	w hash.Hash
	n int64
}

// Write implements io.Writer.
func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// ctxReader makes a long copy stop soon after its context is cancelled,
// instead of only between files.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

// Read implements io.Reader.
func (r ctxReader) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.r.Read(p)
}
