package contexttar

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// Extract unpacks a tar.gz produced by Write (or any tar.gz) into dir, which
// must exist and should be empty. It assumes the archive is hostile:
//
//   - It refuses, with an error matching ErrUnsafePath, absolute names, names
//     whose ".." components leave dir, symlinks whose target is absolute or
//     resolves outside dir, any entry that would be created below a symlink
//     (so a symlink entry followed by a file "through" it fails, whatever
//     the link points at), hard links, and device and FIFO entries.
//   - A symlink target may start with ".." components but may not contain
//     ".." after a normal component ("a/../b"): the kernel resolves such a
//     ".." from wherever "a" points, not lexically, so combined with another
//     in-archive symlink it could escape even though it looks local.
//   - It stops with an error matching ErrTooLarge before writing a regular
//     file that would bring the total content over maxBytes (0 =
//     DefaultMaxBytes).
//
// All filesystem work goes through an os.Root opened on dir, so even a flaw
// in these checks cannot create anything outside dir. Only permission bits
// are applied (no setuid/setgid/sticky, owners or times). Later entries for
// the same path replace earlier ones, as with tar(1). Pre-existing symlinks
// in dir are never written through, but are not otherwise vetted.
//
// On error, dir may hold a partial extraction, which the caller should
// discard.
func Extract(ctx context.Context, r io.Reader, dir string, maxBytes int64) error {
	return ExtractVerified(ctx, r, dir, maxBytes, "")
}

// ErrDigestMismatch matches the error of ExtractVerified when the archive
// is not the one its digest names.
var ErrDigestMismatch = errors.New("contexttar: the context's bytes do not match its digest")

// ErrBadContext matches the error of ExtractVerified for an archive whose
// bytes are the ones its digest names but which cannot be unpacked (an
// unsafe or unsupported entry, too large, malformed): a fault of that
// context, the same for every request that names it. It wraps the cause.
var ErrBadContext = errors.New("contexttar: the context itself cannot be unpacked")

// maxTrailer bounds what ExtractVerified reads after the end of the
// archive (tar pads to 10 KiB records).
const maxTrailer = 1 << 20

// ExtractVerified is Extract that also hashes the uncompressed tar stream
// as it goes and, unless want is empty, fails with ErrDigestMismatch when
// it is not want ("sha256:<hex>", as Write reports it): the bytes built are
// the bytes whose digest the request named, whatever the object's name.
// On a mismatch dir holds an extraction to discard.
func ExtractVerified(ctx context.Context, r io.Reader, dir string, maxBytes int64, want string) error {
	maxBytes, err := limit(maxBytes)
	if err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("contexttar: extraction directory: %w", err)
	}
	defer root.Close()
	zr, err := gzip.NewReader(r)
	if err != nil {
		if want != "" {
			// Whatever it is, it is not the gzip of the tar want names.
			//nolint:errorlint // a verdict, the cause only text: wrapped, a short object's io.ErrUnexpectedEOF would make Fetch retry a mismatch
			return fmt.Errorf("%w: the object is not gzip (%v)", ErrDigestMismatch, err)
		}
		return fmt.Errorf("contexttar: read gzip header: %w", err)
	}
	defer zr.Close()

	x := &extractor{
		ctx:      ctx,
		root:     root,
		dirs:     make(map[string]bool),
		maxBytes: maxBytes,
		buf:      make([]byte, copyBufferSize),
	}
	h := sha256.New()
	tr := tar.NewReader(io.TeeReader(zr, h))
	// An archive refused part way (an unsafe entry, a size over the cap, a
	// malformed header) is a fault of the content only if it is the
	// content want names: hash the rest to tell, so that other bytes
	// under the request's name are a mismatch, never a build failure
	// others would share. The rest is bounded like the extraction.
	refuse := func(err error) error {
		if want == "" || ctx.Err() != nil {
			return err
		}
		n, derr := io.Copy(h, io.LimitReader(zr, maxBytes+(64<<20)))
		switch {
		case derr != nil:
			// The stream itself broke (a download cut short): nothing
			// can be told about the content, and another try may
			// succeed.
			return fmt.Errorf("contexttar: read archive: %w", derr)
		case n == maxBytes+(64<<20) || "sha256:"+hex.EncodeToString(h.Sum(nil)) != want:
			//nolint:errorlint // someone else's bytes: wrapped, the refusal would also match ErrBadContext, ErrTooLarge or io.ErrUnexpectedEOF (Fetch retries that)
			return fmt.Errorf("%w (%v)", ErrDigestMismatch, err)
		}
		return fmt.Errorf("%w: %w", ErrBadContext, err)
	}
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return refuse(fmt.Errorf("contexttar: read archive: %w", err))
		}
		if err := x.entry(hdr, tr); err != nil {
			return refuse(err)
		}
	}
	if want != "" {
		// The digest covers the whole stream, trailer included. A tar
		// writer pads the end to its record size; far more than that
		// after the end of the archive is not a context.
		n, err := io.Copy(h, io.LimitReader(zr, maxTrailer+1))
		if err != nil {
			return fmt.Errorf("contexttar: read archive: %w", err)
		}
		if n > maxTrailer {
			return fmt.Errorf("%w: more than %d bytes after the end of the archive", ErrDigestMismatch, maxTrailer)
		}
		if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != want {
			// Not the object's own digest: it would tell a prober what
			// someone else's object holds.
			return fmt.Errorf("%w: the object is not %s", ErrDigestMismatch, want)
		}
	}
	return x.finish()
}

// extractor carries the state of one Extract.
type extractor struct {
	ctx      context.Context
	root     *os.Root
	maxBytes int64
	total    int64
	entries  int
	buf      []byte

	// dirs holds the slash paths known to be real directories (not
	// symlinks) under root, so parents are checked once, not once per
	// entry. Paths leave it when an entry replaces them.
	dirs map[string]bool
	// late holds directories whose final mode lacks owner rwx: they keep
	// owner rwx until the end so their children can still be created.
	late []lateChmod
}

// lateChmod is a directory mode applied when extraction ends.
type lateChmod struct {
	rel  string
	mode fs.FileMode
}

// entry extracts one archive entry; r yields its content.
func (x *extractor) entry(hdr *tar.Header, r io.Reader) error {
	if hdr.Typeflag == tar.TypeXGlobalHeader {
		return nil // archive-wide PAX metadata, nothing to create
	}
	rel, err := entryPath(hdr.Name)
	if err != nil {
		return err
	}
	if x.entries++; x.entries > MaxEntries {
		return fmt.Errorf("%w: more than %d entries", ErrTooLarge, MaxEntries)
	}
	if d := strings.Count(rel, "/") + 1; d > MaxDepth {
		return fmt.Errorf("%w: %q is %d directories deep, more than %d", ErrTooLarge, truncateName(rel), d, MaxDepth)
	}
	if rel == "" {
		if hdr.Typeflag == tar.TypeDir {
			return nil // "./": dir itself, which exists and keeps its mode
		}
		return fmt.Errorf("%w: %q would replace the extraction directory", ErrUnsafePath, hdr.Name)
	}
	mode := fs.FileMode(hdr.Mode & 0o777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		return x.dir(rel, mode)
	case tar.TypeReg:
		return x.file(rel, mode, hdr.Size, r)
	case tar.TypeSymlink:
		return x.symlink(rel, hdr.Linkname)
	case tar.TypeLink:
		// A hard link shares its inode with its target, so a later write
		// through either name changes both: refused, and Write never makes
		// one.
		return fmt.Errorf("%w: hard link %q -> %q", ErrUnsafePath, hdr.Name, hdr.Linkname)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		return fmt.Errorf("%w: device or FIFO entry %q", ErrUnsafePath, hdr.Name)
	default:
		return fmt.Errorf("contexttar: entry %q has unsupported type %q", hdr.Name, hdr.Typeflag)
	}
}

// entryPath validates a tar name and returns it cleaned and relative ("" for
// dir itself). Names are slash-separated whatever the OS.
func entryPath(name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: entry with an empty name", ErrUnsafePath)
	}
	if path.IsAbs(name) {
		return "", fmt.Errorf("%w: absolute path %q", ErrUnsafePath, name)
	}
	clean := path.Clean(name)
	if clean == "." {
		return "", nil
	}
	if clean == ".." || strings.HasPrefix(clean, "../") || !filepath.IsLocal(filepath.FromSlash(clean)) {
		return "", fmt.Errorf("%w: %q leaves the extraction directory", ErrUnsafePath, name)
	}
	return clean, nil
}

// checkSymlinkTarget refuses a target for the symlink at rel unless it
// provably resolves inside the extraction directory: relative, with its ".."
// components all at the start (so they are resolved from the link's own
// directory, which is a real directory, never through another symlink) and
// no more of them than that directory is deep. The rest of the target only
// descends, and any symlink it meets was vetted the same way, so resolution
// stays inside.
func checkSymlinkTarget(rel, target string) error {
	if target == "" {
		return fmt.Errorf("contexttar: symlink %q has an empty target", rel)
	}
	if path.IsAbs(target) || filepath.IsAbs(target) {
		return fmt.Errorf("%w: symlink %q -> %q is absolute", ErrUnsafePath, rel, target)
	}
	depth := strings.Count(rel, "/") // directories between dir and the link
	up, descended := 0, false
	for _, c := range strings.Split(target, "/") {
		switch c {
		case "", ".":
		case "..":
			if descended {
				return fmt.Errorf("%w: symlink %q -> %q has \"..\" after a path component", ErrUnsafePath, rel, target)
			}
			up++
		default:
			descended = true
		}
	}
	if up > depth {
		return fmt.Errorf("%w: symlink %q -> %q resolves outside the extraction directory", ErrUnsafePath, rel, target)
	}
	return nil
}

// dir creates (or keeps) directory rel with mode.
func (x *extractor) dir(rel string, mode fs.FileMode) error {
	if err := x.ensureParents(rel); err != nil {
		return err
	}
	exists, err := x.clear(rel, true)
	if err != nil {
		return err
	}
	if !exists {
		if err := x.root.Mkdir(filepath.FromSlash(rel), 0o700); err != nil {
			return fmt.Errorf("contexttar: create directory %q: %w", rel, err)
		}
	}
	x.dirs[rel] = true
	if mode&0o700 != 0o700 {
		x.late = append(x.late, lateChmod{rel, mode})
		mode |= 0o700
	}
	if err := x.root.Chmod(filepath.FromSlash(rel), mode); err != nil {
		return fmt.Errorf("contexttar: chmod %q: %w", rel, err)
	}
	return nil
}

// file creates regular file rel with mode and size bytes from r.
func (x *extractor) file(rel string, mode fs.FileMode, size int64, r io.Reader) error {
	if size > x.maxBytes-x.total {
		return fmt.Errorf("%w: %q (%d bytes) brings extracted content to %d bytes, over the limit of %d",
			ErrTooLarge, rel, size, x.total+size, x.maxBytes)
	}
	if err := x.ensureParents(rel); err != nil {
		return err
	}
	if _, err := x.clear(rel, false); err != nil {
		return err
	}
	// O_EXCL: the path was just cleared, so anything there now (a symlink
	// planted concurrently) makes the open fail rather than be followed.
	f, err := x.root.OpenFile(filepath.FromSlash(rel), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("contexttar: create %q: %w", rel, err)
	}
	// The anonymous struct hides File.ReadFrom so the copy uses x.buf; the
	// LimitReader is belt and braces, tar.Reader already stops at size.
	n, err := io.CopyBuffer(struct{ io.Writer }{f}, io.LimitReader(ctxReader{x.ctx, r}, size), x.buf)
	x.total += n
	if err != nil {
		f.Close()
		return fmt.Errorf("contexttar: extract %q: %w", rel, err)
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("contexttar: chmod %q: %w", rel, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("contexttar: close %q: %w", rel, err)
	}
	return nil
}

// symlink creates symlink rel -> target after vetting target.
func (x *extractor) symlink(rel, target string) error {
	if err := checkSymlinkTarget(rel, target); err != nil {
		return err
	}
	if err := x.ensureParents(rel); err != nil {
		return err
	}
	if _, err := x.clear(rel, false); err != nil {
		return err
	}
	if err := x.root.Symlink(target, filepath.FromSlash(rel)); err != nil {
		return fmt.Errorf("contexttar: create symlink %q: %w", rel, err)
	}
	return nil
}

// ensureParents makes every ancestor of rel a real directory, creating
// missing ones (archives need not list them), and refuses to go through a
// symlink: that is how "symlink, then a file below it" attacks write
// outside, and no archive from a directory walk needs it.
func (x *extractor) ensureParents(rel string) error {
	parent := path.Dir(rel)
	if parent == "." || x.dirs[parent] {
		return nil
	}
	for i := 0; ; {
		j := strings.IndexByte(parent[i:], '/')
		p := parent
		if j >= 0 {
			p = parent[:i+j]
		}
		if !x.dirs[p] {
			if err := x.ensureDir(p, rel); err != nil {
				return err
			}
		}
		if j < 0 {
			return nil
		}
		i += j + 1
	}
}

// ensureDir makes sure p, a parent of entry rel, is a real directory.
func (x *extractor) ensureDir(p, rel string) error {
	fi, err := x.root.Lstat(filepath.FromSlash(p))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := x.root.Mkdir(filepath.FromSlash(p), 0o755); err != nil {
			return fmt.Errorf("contexttar: create directory %q: %w", p, err)
		}
		// Mkdir's mode went through the umask; set it exactly.
		if err := x.root.Chmod(filepath.FromSlash(p), 0o755); err != nil {
			return fmt.Errorf("contexttar: chmod %q: %w", p, err)
		}
	case err != nil:
		return fmt.Errorf("contexttar: stat %q: %w", p, err)
	case fi.Mode()&fs.ModeSymlink != 0:
		return fmt.Errorf("%w: %q would be created through symlink %q", ErrUnsafePath, rel, p)
	case !fi.IsDir():
		return fmt.Errorf("contexttar: %q: parent %q is not a directory", rel, p)
	}
	x.dirs[p] = true
	return nil
}

// clear removes whatever is at rel so a new entry can take its place, except
// that an existing directory is kept for a directory entry (reported by
// exists). Removal never follows symlinks.
func (x *extractor) clear(rel string, wantDir bool) (exists bool, err error) {
	fi, err := x.root.Lstat(filepath.FromSlash(rel))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("contexttar: stat %q: %w", rel, err)
	}
	if wantDir && fi.IsDir() {
		return true, nil
	}
	if fi.IsDir() {
		x.forget(rel)
	}
	if err := x.root.RemoveAll(filepath.FromSlash(rel)); err != nil {
		return false, fmt.Errorf("contexttar: replace %q: %w", rel, err)
	}
	return false, nil
}

// forget drops rel and everything below it from the known directories.
func (x *extractor) forget(rel string) {
	delete(x.dirs, rel)
	prefix := rel + "/"
	for d := range x.dirs {
		if strings.HasPrefix(d, prefix) {
			delete(x.dirs, d)
		}
	}
}

// finish applies the deferred directory modes, deepest first so a parent
// losing its owner write bit does not stop a child's chmod.
func (x *extractor) finish() error {
	for i := len(x.late) - 1; i >= 0; i-- {
		l := x.late[i]
		fi, err := x.root.Lstat(filepath.FromSlash(l.rel))
		if err != nil || !fi.IsDir() {
			continue // replaced by a later entry
		}
		if err := x.root.Chmod(filepath.FromSlash(l.rel), l.mode); err != nil {
			return fmt.Errorf("contexttar: chmod %q: %w", l.rel, err)
		}
	}
	return nil
}

// truncateName bounds a name quoted in an error.
func truncateName(s string) string {
	if len(s) > 120 {
		return s[:120] + "…"
	}
	return s
}

// ArchiveDigest reads the gzip-compressed context archive r to its end and
// returns the digest ("sha256:<hex>", as Write reports it) of its
// uncompressed bytes. An object that cannot be the archive of any context
// — not gzip, or far larger than a context of maxBytes could be — fails
// with an error matching ErrDigestMismatch; a stream that broke fails
// with any other error (another try may succeed). Nothing is unpacked.
func ArchiveDigest(ctx context.Context, r io.Reader, maxBytes int64) (string, error) {
	maxBytes, err := limit(maxBytes)
	if err != nil {
		return "", err
	}
	zr, err := gzip.NewReader(r)
	if err != nil {
		//nolint:errorlint // a verdict, the cause only text: wrapped, a short object's io.ErrUnexpectedEOF would also read as a broken stream
		return "", fmt.Errorf("%w: the object is not gzip (%v)", ErrDigestMismatch, err)
	}
	defer zr.Close()
	// A context's tar stream is its content plus headers and padding:
	// bounded like ExtractVerified's reading of a refused archive.
	bound := maxBytes + (64 << 20)
	h := sha256.New()
	n, err := io.Copy(h, io.LimitReader(ctxReader{ctx: ctx, r: zr}, bound+1))
	switch {
	case ctx.Err() != nil:
		return "", ctx.Err()
	case errors.Is(err, gzip.ErrChecksum) || errors.Is(err, gzip.ErrHeader):
		return "", fmt.Errorf("%w: the object is not a valid gzip stream (%w)", ErrDigestMismatch, err)
	case err != nil:
		return "", fmt.Errorf("contexttar: read archive: %w", err)
	case n > bound:
		return "", fmt.Errorf("%w: the object is larger than any context of at most %d bytes", ErrDigestMismatch, maxBytes)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// VerifyArchive is ArchiveDigest compared with want: nil when the
// archive's bytes are the ones want names, an error matching
// ErrDigestMismatch when they are not. The error never names the
// archive's own digest: it would tell a prober what someone else's object
// holds.
func VerifyArchive(ctx context.Context, r io.Reader, maxBytes int64, want string) error {
	if want == "" {
		return errors.New("contexttar: verify needs the context's digest")
	}
	got, err := ArchiveDigest(ctx, r, maxBytes)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("%w: the object is not %s", ErrDigestMismatch, want)
	}
	return nil
}
