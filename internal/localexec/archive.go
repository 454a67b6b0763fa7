package localexec

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"errors"
	"io"
	"path"
	"strings"

	"github.com/klauspost/compress/zstd"
)

// archive kinds ADD recognises by content, as docker does (the file name
// does not matter).
const (
	archiveNone = iota
	archiveTar
	archiveGzip
	archiveBzip2
	archiveZstd
	archiveXZ // recognised only to refuse it: there is no xz decoder here
)

var (
	magicGzip  = []byte{0x1f, 0x8b}
	magicBzip2 = []byte("BZh")
	magicZstd  = []byte{0x28, 0xb5, 0x2f, 0xfd}
	magicXZ    = []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}
)

// archiveKind reports whether ADD should extract n: its (decompressed)
// content must start with a valid tar header. Anything else is copied as
// a plain file, like docker does.
func archiveKind(n *node) (int, error) {
	if n.open == nil || n.size == 0 {
		return archiveNone, nil
	}
	rc, err := n.open()
	if err != nil {
		return archiveNone, err
	}
	defer rc.Close()
	br := bufio.NewReader(rc)
	head, _ := br.Peek(6)
	if bytes.HasPrefix(head, magicXZ) {
		return archiveXZ, nil
	}
	kind := detectCompression(head)
	r, closeFn, err := decompress(br, kind)
	if err != nil {
		return archiveNone, nil // corrupt compressed data: not an archive
	}
	defer closeFn()
	if _, err := tar.NewReader(r).Next(); err != nil {
		return archiveNone, nil
	}
	return kind, nil
}

func detectCompression(head []byte) int {
	switch {
	case bytes.HasPrefix(head, magicGzip):
		return archiveGzip
	case bytes.HasPrefix(head, magicBzip2):
		return archiveBzip2
	case bytes.HasPrefix(head, magicZstd):
		return archiveZstd
	}
	return archiveTar
}

// decompress wraps r according to kind.
func decompress(r io.Reader, kind int) (io.Reader, func(), error) {
	switch kind {
	case archiveGzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, err
		}
		return zr, func() { zr.Close() }, nil
	case archiveBzip2:
		return bzip2.NewReader(r), func() {}, nil
	case archiveZstd:
		// One goroutine is plenty here and keeps the build's footprint small.
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, nil, err
		}
		return zr, zr.Close, nil
	}
	return r, func() {}, nil
}

// untar extracts a local archive into dstDir for ADD, the way docker
// does: entries keep the archive's modes and owners (unless --chown),
// existing entries are replaced, and nothing may escape dstDir. Times are
// reset to the epoch like everything else.
func (op *copyOp) untar(src string, n *node, kind int, dstDir string) error {
	rc, err := n.open()
	if err != nil {
		return err
	}
	defer rc.Close()
	r, closeFn, err := decompress(bufio.NewReader(rc), kind)
	if err != nil {
		return userErrorf(op.line, "ADD /%s: %v", src, err)
	}
	defer closeFn()
	tr := tar.NewReader(r)
	for {
		if err := op.b.checkCtx(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return userErrorf(op.line, "ADD /%s: reading archive: %v", src, err)
		}
		if err := checkHeader(hdr); err != nil {
			return err
		}
		name := relPath(hdr.Name)
		if name == "" || strings.HasPrefix(path.Base(name), ".wh.") {
			continue // the root itself, and overlay whiteouts that mean nothing here
		}
		target := joinPath(dstDir, name)
		if err := op.b.addEntry(target); err != nil {
			return err
		}
		if err := op.archiveParents(src, dstDir, name); err != nil {
			return err
		}
		e := nodeFromHeader(hdr)
		switch hdr.Typeflag {
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old archives still use TypeRegA
			e.typ = typeReg
			if e.open, err = op.b.spool.write(tr, hdr.Size); err != nil {
				return userErrorf(op.line, "ADD /%s: reading archive: %v", src, err)
			}
		case tar.TypeLink:
			// A hard link becomes a copy of its target, which must be an
			// earlier entry of the same archive.
			t := op.layer.entries[joinPath(dstDir, relPath(hdr.Linkname))]
			if t == nil || t.typ != typeReg {
				return userErrorf(op.line, "ADD /%s: hard link %s points outside the archive", src, hdr.Name)
			}
			cp := *t
			e = &cp
		case tar.TypeDir, tar.TypeSymlink, tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		default:
			continue
		}
		if op.chown {
			e.uid, e.gid = op.uid, op.gid
		}
		// Existing entries are replaced and an existing directory takes the
		// archive's metadata, as docker's untar does.
		op.put(target, e)
	}
}

// archiveParents creates directories an archive implies but does not list,
// and refuses entries below a non-directory (e.g. through a symlink in the
// archive), which could otherwise write outside the destination.
func (op *copyOp) archiveParents(src, dstDir, name string) error {
	parts := splitPath(name)
	cur := dstDir
	for _, part := range parts[:len(parts)-1] {
		cur = joinPath(cur, part)
		n, _ := op.idx.lstat(cur)
		if n == nil {
			op.put(cur, &node{typ: typeDir, mode: 0o755, uid: op.parentUID, gid: op.parentGID})
			continue
		}
		if n.typ != typeDir {
			return userErrorf(op.line, "ADD /%s: archive entry %s is below /%s, which is not a directory", src, name, cur)
		}
	}
	return nil
}
