// Package contexttar packs a build-context directory into a normalized,
// reproducible tar.gz (Write) and unpacks such an archive safely (Extract).
//
// Producers call Write to upload a context to S3, and Digest (the same
// stream, hashed but not compressed) to key builds by the context's digest;
// the worker side calls Extract on archives it did not make itself, so
// Extract treats its input as hostile.
//
// # What goes into the archive
//
// The .dockerignore file at the root of the context is read with
// moby/patternmatcher/ignorefile and applied the way `docker build` applies
// it today (BuildKit's context sender, tonistiigi/fsutil), including `!`
// exceptions: an excluded directory is still walked when an exception could
// re-include something beneath it, and the parents of a re-included path are
// written even though they are themselves excluded. Like the docker CLI, the
// Dockerfile (Options.Dockerfile) and .dockerignore are kept even when
// .dockerignore excludes them.
//
// # Normalization policy
//
// The archive depends only on the names, contents, kinds and executable bits
// of what the walk keeps, so two copies of a directory with the same content
// give byte-identical output and the same digest whatever their mtimes,
// owners, umask or creation order:
//
//   - Entries are sorted bytewise by their tar name, where a directory's name
//     carries a trailing slash ("a.txt" < "a/" < "a/b"). Parents therefore
//     precede their children, and each directory's subtree is contiguous,
//     which lets Write stream the walk instead of collecting it.
//   - Names are relative and slash-separated, with no leading "./"; the root
//     directory itself has no entry. Directories get an entry of their own
//     (with the trailing slash), empty ones included.
//   - Modification, access and change times are the Unix epoch (0); uid and
//     gid are 0 and uname/gname are empty.
//   - Directories have mode 0755; regular files 0755 if any execute bit is
//     set, else 0644; symlinks 0777 with their target kept byte for byte.
//     Setuid, setgid and sticky bits are dropped.
//   - Sockets, devices and FIFOs are skipped. Hard links are not recorded as
//     such: each path is written as a regular file of its own, so that
//     Extract, which refuses hard links, can unpack every archive Write makes.
//   - The tar format is PAX (set explicitly); PAX records appear only where
//     USTAR cannot hold a value (long or non-ASCII names or link targets,
//     files over 8 GiB), and no record varies between runs (no atime/ctime).
//     The archive ends with the standard two zero blocks.
//   - Compression is gzip at a fixed level (gzip.BestSpeed) with no file
//     name, no comment and a zero modification time in the gzip header.
//
// Result.Digest is the sha256 of the uncompressed tar stream: it is the
// stable identity of a context. The compressed bytes are also deterministic
// for a given Go toolchain, but compress/flate's output may change between Go
// releases, so nothing should key on a digest of the .tar.gz.
package contexttar

import (
	"compress/gzip"
	"errors"
)

// DefaultMaxBytes is the cap on the total size of regular-file content that
// Write and Extract use when given 0: large enough for any sane build
// context, small enough that a runaway directory (a checked-in dataset, a
// forgotten node_modules) fails fast instead of filling S3 or a worker disk.
const DefaultMaxBytes int64 = 1 << 30

// MaxEntries and MaxDepth bound what Extract creates: entries in all, and
// path components in one name. A small archive can hold a huge number of
// tiny or deeply nested entries (a 480 KB gzip unpacks to 100,000 files;
// a 3,000-deep directory chain takes minutes to create and remove), so
// both are refused up front, with ErrTooLarge, before the disk fills.
const (
	MaxEntries = 50_000
	MaxDepth   = 64
)

// gzipLevel is the fixed compression level of the archives Write produces.
// It is fixed because the level changes the compressed bytes, and
// reproducible output is the point of this package. BestSpeed because on
// source trees it packs about five times faster than the default level
// (~135 vs ~25 MB/s on one core) for output about a quarter larger: packing
// large contexts is then bounded by disk and upload, not by deflate.
const gzipLevel = gzip.BestSpeed

// ErrTooLarge is returned (wrapped, with the offending path and the limit)
// when regular-file content exceeds the byte cap given to Write or Extract.
var ErrTooLarge = errors.New("contexttar: build context too large")

// ErrUnsafePath is returned (wrapped, with the offending entry) when Extract
// meets an entry that could write outside its directory or that it refuses on
// principle: absolute or escaping names, symlinks resolving outside the
// directory, entries below a symlink, hard links, devices and FIFOs.
var ErrUnsafePath = errors.New("contexttar: unsafe path in archive")

// limit turns a caller's byte cap into the one in force, rejecting negative
// caps, which are more likely a bug than a wish for "unlimited".
func limit(maxBytes int64) (int64, error) {
	switch {
	case maxBytes < 0:
		return 0, errors.New("contexttar: negative byte limit")
	case maxBytes == 0:
		return DefaultMaxBytes, nil
	default:
		return maxBytes, nil
	}
}
