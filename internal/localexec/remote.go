package localexec

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync/atomic"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// pulledImage serves a base image from the manifest and config fetched
// during the build and fetches layer blobs only when they are read.
//
// It exists because of contexts: reads during Build must stop when Build's
// context is cancelled, but the returned image still refers to base layers
// that the caller reads later (typically to push them), often after that
// context is gone. So blobs are fetched with Build's context while the
// build runs, and with only Options.Remote afterwards.
type pulledImage struct {
	repo        name.Repository
	opts        []remote.Option
	ctx         atomic.Pointer[context.Context] // Build's context while it runs
	rawManifest []byte
	rawConfig   []byte
	mediaType   types.MediaType
	layers      map[v1.Hash]pulledLayer // by blob digest
}

type pulledLayer struct {
	desc   v1.Descriptor
	diffID v1.Hash
}

// newPulledImage snapshots the metadata of img, which was fetched from
// repo with Build's context.
func newPulledImage(ctx context.Context, repo name.Repository, img v1.Image, opts []remote.Option) (*pulledImage, error) {
	rawManifest, err := img.RawManifest()
	if err != nil {
		return nil, err
	}
	rawConfig, err := img.RawConfigFile()
	if err != nil {
		return nil, err
	}
	mt, err := img.MediaType()
	if err != nil {
		return nil, err
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	if len(m.Layers) != len(cf.RootFS.DiffIDs) {
		return nil, fmt.Errorf("manifest lists %d layers but the config %d diff ids", len(m.Layers), len(cf.RootFS.DiffIDs))
	}
	p := &pulledImage{
		repo:        repo,
		opts:        slices.Clone(opts),
		rawManifest: rawManifest,
		rawConfig:   rawConfig,
		mediaType:   mt,
		layers:      map[v1.Hash]pulledLayer{},
	}
	for i, d := range m.Layers {
		p.layers[d.Digest] = pulledLayer{desc: d, diffID: cf.RootFS.DiffIDs[i]}
	}
	p.ctx.Store(&ctx)
	return p, nil
}

// detach switches blob fetches to Options.Remote only; Build calls it on
// return.
func (p *pulledImage) detach() { p.ctx.Store(nil) }

// image is the v1.Image view. Its layers are remote.MountableLayers so a
// push to the same registry mounts them instead of copying.
func (p *pulledImage) image() (v1.Image, error) {
	img, err := partial.CompressedToImage(p)
	if err != nil {
		return nil, err
	}
	return &mountableImage{Image: img, repo: p.repo}, nil
}

// RawConfigFile implements partial.CompressedImageCore.
func (p *pulledImage) RawConfigFile() ([]byte, error) { return p.rawConfig, nil }

// MediaType implements partial.CompressedImageCore.
func (p *pulledImage) MediaType() (types.MediaType, error) { return p.mediaType, nil }

// RawManifest implements partial.CompressedImageCore.
func (p *pulledImage) RawManifest() ([]byte, error) { return p.rawManifest, nil }

// LayerByDigest implements partial.CompressedImageCore.
func (p *pulledImage) LayerByDigest(h v1.Hash) (partial.CompressedLayer, error) {
	l, ok := p.layers[h]
	if !ok {
		return nil, fmt.Errorf("blob %s is not a layer of %s", h, p.repo)
	}
	return &pulledBlob{img: p, info: l}, nil
}

// pulledBlob is one base layer; everything but its bytes is known from
// the manifest and config.
type pulledBlob struct {
	img  *pulledImage
	info pulledLayer
}

func (b *pulledBlob) Digest() (v1.Hash, error)            { return b.info.desc.Digest, nil }
func (b *pulledBlob) DiffID() (v1.Hash, error)            { return b.info.diffID, nil }
func (b *pulledBlob) Size() (int64, error)                { return b.info.desc.Size, nil }
func (b *pulledBlob) MediaType() (types.MediaType, error) { return b.info.desc.MediaType, nil }

func (b *pulledBlob) Compressed() (io.ReadCloser, error) {
	opts := slices.Clone(b.img.opts)
	if ctx := b.img.ctx.Load(); ctx != nil {
		opts = append(opts, remote.WithContext(*ctx))
	}
	l, err := remote.Layer(b.img.repo.Digest(b.info.desc.Digest.String()), opts...)
	if err != nil {
		return nil, err
	}
	return l.Compressed()
}

// mountableImage marks base layers as mountable from their repository.
type mountableImage struct {
	v1.Image
	repo name.Repository
}

func (m *mountableImage) mountable(l v1.Layer) (v1.Layer, error) {
	d, err := l.Digest()
	if err != nil {
		return nil, err
	}
	return &remote.MountableLayer{Layer: l, Reference: m.repo.Digest(d.String())}, nil
}

func (m *mountableImage) Layers() ([]v1.Layer, error) {
	ls, err := m.Image.Layers()
	if err != nil {
		return nil, err
	}
	out := make([]v1.Layer, len(ls))
	for i, l := range ls {
		if out[i], err = m.mountable(l); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (m *mountableImage) LayerByDigest(h v1.Hash) (v1.Layer, error) {
	l, err := m.Image.LayerByDigest(h)
	if err != nil {
		return nil, err
	}
	return m.mountable(l)
}

func (m *mountableImage) LayerByDiffID(h v1.Hash) (v1.Layer, error) {
	l, err := m.Image.LayerByDiffID(h)
	if err != nil {
		return nil, err
	}
	return m.mountable(l)
}
