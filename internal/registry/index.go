package registry

import (
	"context"
	"errors"
	"fmt"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// IndexChild is one platform's image of an image index: Ref is repo@digest
// in the repository the index is pushed to, Platform os/arch[/variant].
type IndexChild struct {
	Ref      string
	Platform string
}

// PushIndex assembles an OCI image index of children, in their order, each
// descriptor naming its platform, writes it under every ref in refs (all
// repo:tag) and returns its digest. Every child must be an image (not an
// index) already stored in the repository of each ref: the index only
// references them. The same children in the same order make the same
// index, byte for byte, so a run that pushes it again changes nothing.
func (c *Client) PushIndex(ctx context.Context, children []IndexChild, refs []string) (string, error) {
	if len(children) == 0 {
		return "", errors.New("registry: push index: no platform images")
	}
	if len(refs) == 0 {
		return "", errors.New("registry: push index: no references")
	}
	opts := c.RemoteOptions(ctx)
	images := make([]IndexImage, 0, len(children))
	for _, ch := range children {
		r, err := c.ParseReference(ch.Ref)
		if err != nil {
			return "", err
		}
		desc, err := remote.Get(r, opts...)
		if err != nil {
			return "", wrapErr("push index: get", ch.Ref, err)
		}
		if !desc.MediaType.IsImage() {
			return "", fmt.Errorf("registry: push index: %s is a %s, not an image", ch.Ref, desc.MediaType)
		}
		img, err := desc.Image()
		if err != nil {
			return "", fmt.Errorf("registry: push index: %s: %w", ch.Ref, err)
		}
		images = append(images, IndexImage{Image: img, Platform: ch.Platform})
	}
	idx, err := NewIndex(images)
	if err != nil {
		return "", fmt.Errorf("registry: push index: %w", err)
	}
	digest, err := idx.Digest()
	if err != nil {
		return "", fmt.Errorf("registry: push index: %w", err)
	}
	written := map[string]bool{}
	for _, ref := range refs {
		t, err := c.parseTag(ref)
		if err != nil {
			return "", err
		}
		if written[t.Context().Name()] {
			// Its children and the index are there: a tag is a manifest PUT.
			err = remote.Tag(t, idx, opts...)
		} else {
			err = remote.WriteIndex(t, idx, opts...)
		}
		if err != nil {
			return "", fmt.Errorf("registry: push index %s: %w", ref, err)
		}
		written[t.Context().Name()] = true
	}
	return digest.String(), nil
}

// IndexImage is one platform's image of an index being made.
type IndexImage struct {
	Image    v1.Image
	Platform string
}

// NewIndex is the OCI image index of images, in their order: each
// descriptor has the image's media type, digest and size, and its
// platform. The same images in the same order make the same bytes.
func NewIndex(images []IndexImage) (v1.ImageIndex, error) {
	adds := make([]mutate.IndexAddendum, 0, len(images))
	for _, im := range images {
		plat, err := v1.ParsePlatform(im.Platform)
		if err != nil || plat.OS == "" || plat.Architecture == "" {
			return nil, fmt.Errorf("%q is not a platform (os/arch[/variant])", im.Platform)
		}
		mt, err := im.Image.MediaType()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", im.Platform, err)
		}
		adds = append(adds, mutate.IndexAddendum{Add: im.Image, Descriptor: v1.Descriptor{MediaType: mt, Platform: plat}})
	}
	return mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), adds...), nil
}

// IndexPlatforms reads the image index at ref and returns each platform's
// image digest (os/arch[/variant] → sha256:…), for checks and tests.
func (c *Client) IndexPlatforms(ctx context.Context, ref string) (map[string]string, error) {
	r, err := c.ParseReference(ref)
	if err != nil {
		return nil, err
	}
	idx, err := remote.Index(r, c.RemoteOptions(ctx)...)
	if err != nil {
		return nil, wrapErr("index", ref, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("registry: index %s: %w", ref, err)
	}
	out := map[string]string{}
	for _, d := range m.Manifests {
		if d.Platform != nil {
			out[d.Platform.String()] = d.Digest.String()
		}
	}
	return out, nil
}
