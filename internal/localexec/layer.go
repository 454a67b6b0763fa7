package localexec

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"maps"
	"os"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// layerBuilder collects the entries of one layer. Entries are keyed by
// path, so a later source overwriting an earlier one in the same
// instruction leaves one entry, as the copy on a real filesystem would.
type layerBuilder struct {
	entries map[string]*node
}

func newLayerBuilder() *layerBuilder {
	return &layerBuilder{entries: map[string]*node{}}
}

func (l *layerBuilder) put(p string, n *node) {
	if old, ok := l.entries[p]; ok && old.typ == typeDir && n.typ != typeDir {
		prefix := p + "/"
		for k := range l.entries {
			if strings.HasPrefix(k, prefix) {
				delete(l.entries, k)
			}
		}
	}
	l.entries[p] = n
}

// build writes the layer as a gzip-compressed tar: to a file in
// Options.LayerDir, or else to memory, so the returned image stays valid
// after Build's temp files are gone. Its bytes count against the spool
// limit. Everything that could vary between runs is pinned: entries are
// sorted (a parent always precedes its children), times are the epoch,
// owners are numeric with no user or group names, and gzip writes no name
// or time.
func (l *layerBuilder) build(b *builder, mt types.MediaType) (v1.Layer, error) {
	ctx := b.ctx
	keys := make([]string, 0, len(l.entries))
	for k := range l.entries {
		keys = append(keys, k)
	}
	sort.Strings(keys)

	var out io.Writer
	var buf bytes.Buffer
	var file *os.File
	if b.opts.LayerDir != "" {
		f, err := os.CreateTemp(b.opts.LayerDir, "layer-*.tar.gz")
		if err != nil {
			return nil, fmt.Errorf("localexec: %w", err)
		}
		defer f.Close()
		file, out = f, f
	} else {
		out = &buf
	}
	counted := &budgetWriter{w: out, b: b}
	gz, err := gzip.NewWriterLevel(counted, gzip.DefaultCompression)
	if err != nil {
		return nil, err
	}
	tw := tar.NewWriter(gz)
	for _, p := range keys {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n := l.entries[p]
		hdr := &tar.Header{
			Typeflag: n.typ,
			Name:     p,
			Mode:     n.mode,
			Uid:      n.uid,
			Gid:      n.gid,
			ModTime:  epoch,
			Linkname: n.linkname,
			Devmajor: n.devmajor,
			Devminor: n.devminor,
		}
		if n.typ == typeDir {
			hdr.Name += "/"
		}
		if n.typ == typeReg {
			hdr.Size = n.size
		}
		if len(n.xattrs) > 0 {
			hdr.PAXRecords = maps.Clone(n.xattrs)
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("add /%s to layer: %w", p, err)
		}
		if n.typ == typeReg && n.size > 0 {
			if n.open == nil {
				return nil, fmt.Errorf("add /%s to layer: content not available", p)
			}
			rc, err := n.open()
			if err != nil {
				return nil, fmt.Errorf("add /%s to layer: %w", p, err)
			}
			_, err = io.CopyN(tw, rc, n.size)
			rc.Close()
			if err != nil {
				return nil, fmt.Errorf("add /%s to layer (did it change during the build?): %w", p, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := gz.Close(); err != nil {
		return nil, err
	}
	if file != nil {
		name := file.Name()
		return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return os.Open(name) }, tarball.WithMediaType(mt))
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(mt))
}

// budgetWriter counts the bytes of a new layer against the spool limit.
type budgetWriter struct {
	w io.Writer
	b *builder
}

func (w *budgetWriter) Write(p []byte) (int, error) {
	if err := w.b.addSpooled(int64(len(p))); err != nil {
		return 0, err
	}
	return w.w.Write(p)
}
