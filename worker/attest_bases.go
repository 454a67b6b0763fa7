package worker

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/localexec"
)

// errBaseMoved: a base image's tag no longer names the image the build
// was made from.
var errBaseMoved = errors.New("no base image's layers begin the built image: a base tag moved since the build pulled it")

// resolveBases finds what a build that its backend did not describe
// (a kaniko Job) was made from, for its provenance: the Dockerfile, read
// from the run's context and checked against its digest, and each base
// image it names resolved to the digest of its manifest for the build's
// platform, with the tenant's registry credentials (those the Job pulled
// with). The image the built one starts from is confirmed by its layers:
// the built image's layers begin with that base's. When no base's layers
// do (a tag moved after the build pulled it), no base is named rather
// than a wrong one.
func (w *builder) resolveBases(ctx context.Context, reg Registry, rreq *v1.Request, final *v1.BuildRecord) ([]BaseImage, string, error) {
	if w.cfg.Contexts == nil || rreq.Source.S3 == nil || rreq.ContextDigest == "" {
		return nil, "", errors.New("the worker reads no contexts (no S3 store configured)")
	}
	rr, ok := reg.(RemoteRegistry)
	if !ok {
		return nil, "", fmt.Errorf("the registry client %T cannot read base images", reg)
	}
	body, err := w.cfg.Contexts.Open(ctx, rreq.Source.S3.Bucket, rreq.Source.S3.Key)
	if err != nil {
		return nil, "", fmt.Errorf("read the context: %w", err)
	}
	df, err := contexttar.ReadFileVerified(ctx, body, w.cfg.MaxContextBytes, rreq.DockerfileOrDefault(), rreq.ContextDigest)
	_ = body.Close()
	if err != nil {
		return nil, "", fmt.Errorf("read the Dockerfile from the context: %w", err)
	}
	if df == nil {
		return nil, "", fmt.Errorf("the context has no %s", rreq.DockerfileOrDefault())
	}
	dfDigest := fmt.Sprintf("sha256:%x", sha256.Sum256(df))
	platform := platformOf(rreq)
	if platform == "" {
		platform = v1.DefaultPlatform
	}
	refs, err := localexec.BaseImages(df, rreq.BuildArgs, rreq.Target, platform)
	if err != nil {
		return nil, dfDigest, fmt.Errorf("parse the Dockerfile: %w", err)
	}
	plat, err := ggcrv1.ParsePlatform(platform)
	if err != nil {
		return nil, dfDigest, err
	}
	opts := append(rr.RemoteOptions(ctx), remote.WithPlatform(*plat))
	built, err := layersOf(rr, final.Repository+"@"+final.Digest, opts)
	if err != nil {
		return nil, dfDigest, fmt.Errorf("read the built image: %w", err)
	}
	var (
		bases     []BaseImage
		confirmed bool
	)
	for _, ref := range refs {
		r, err := rr.ParseReference(ref)
		if err != nil {
			// kaniko reads short names (Docker Hub); the worker's strict
			// parser does not: take go-containerregistry's defaults.
			if r, err = name.ParseReference(ref); err != nil {
				return nil, dfDigest, fmt.Errorf("base image %s: %w", ref, err)
			}
		}
		img, err := remote.Image(r, opts...)
		if err != nil {
			return nil, dfDigest, fmt.Errorf("resolve the base image %s: %w", ref, err)
		}
		d, err := img.Digest()
		if err != nil {
			return nil, dfDigest, err
		}
		ls, err := img.Layers()
		if err != nil {
			return nil, dfDigest, err
		}
		var digests []ggcrv1.Hash
		for _, l := range ls {
			h, err := l.Digest()
			if err != nil {
				return nil, dfDigest, err
			}
			digests = append(digests, h)
		}
		if len(digests) > 0 && len(digests) <= len(built) && slices.Equal(built[:len(digests)], digests) {
			confirmed = true
		}
		bases = append(bases, BaseImage{Ref: ref, Digest: d.String()})
	}
	if !confirmed && len(bases) > 0 && len(built) > 0 && startsFromAnImage(refs, rreq, df) {
		return nil, dfDigest, errBaseMoved
	}
	return bases, dfDigest, nil
}

// startsFromAnImage reports whether the built image's stage starts from
// an image (not scratch): then one base's layers must begin the built
// image's.
func startsFromAnImage(refs []string, rreq *v1.Request, df []byte) bool {
	final, err := localexec.FinalBase(df, rreq.BuildArgs, rreq.Target, platformOf(rreq))
	return err == nil && final != "" && slices.Contains(refs, final)
}

// layersOf lists the layer digests of the image at ref.
func layersOf(rr RemoteRegistry, ref string, opts []remote.Option) ([]ggcrv1.Hash, error) {
	r, err := rr.ParseReference(ref)
	if err != nil {
		return nil, err
	}
	img, err := remote.Image(r, opts...)
	if err != nil {
		return nil, err
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, err
	}
	out := make([]ggcrv1.Hash, len(m.Layers))
	for i, l := range m.Layers {
		out[i] = l.Digest
	}
	return out, nil
}
