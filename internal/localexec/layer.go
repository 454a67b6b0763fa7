package localexec

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"maps"
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

// build writes the layer as a gzip-compressed tar, held in memory so the
// returned image stays valid after Build's temp files are gone. Everything
// that could vary between runs is pinned: entries are sorted (a parent
// always precedes its children), times are the epoch, owners are numeric
// with no user or group names, and gzip writes no name or time.
func (l *layerBuilder) build(ctx context.Context, mt types.MediaType) (v1.Layer, error) {
	keys := make([]string, 0, len(l.entries))
	for k := range l.entries {
		keys = append(keys, k)
	}
	sort.Strings(keys)

	var buf bytes.Buffer
	gz, err := gzip.NewWriterLevel(&buf, gzip.DefaultCompression)
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
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(mt))
}
