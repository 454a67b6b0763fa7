package localexec

import (
	"archive/tar"
	"io"
	"os"
	"strings"
)

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
