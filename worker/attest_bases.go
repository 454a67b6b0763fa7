package worker

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

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
// (a kaniko Job) was made from, for its provenance. The run's context is
// unpacked as the Job's fetch-context unpacks it (contexttar.
// ExtractVerified: its digest checked, names cleaned, later entries
// replacing earlier ones) and the Dockerfile read from it the way the
// executor reads it (symlinks followed, within the context): its digest
// is the one of the Dockerfile built. Its base images are resolved for
// the build's platform with the tenant's registry credentials (those the
// Job pulled with), only on registries the worker may contact
// (--allowed-registry). Only the image the build starts from is named:
// it is confirmed by its layers, which begin the built image's. Other
// bases (a builder stage's, a COPY --from image) cannot be confirmed
// after the fact — their tags may have moved since the Job pulled them —
// and are not named. When no base's layers begin the built image's (a
// tag moved), none is named rather than a wrong one.
func (w *builder) resolveBases(ctx context.Context, reg Registry, rreq *v1.Request, final *v1.BuildRecord) ([]BaseImage, string, error) {
	if w.cfg.Contexts == nil || rreq.Source.S3 == nil || rreq.ContextDigest == "" {
		return nil, "", errors.New("the worker reads no contexts (no S3 store configured)")
	}
	rr, ok := reg.(RemoteRegistry)
	if !ok {
		return nil, "", fmt.Errorf("the registry client %T cannot read base images", reg)
	}
	df, err := w.dockerfileOf(ctx, rreq)
	if err != nil {
		return nil, "", err
	}
	dfDigest := fmt.Sprintf("sha256:%x", sha256.Sum256(df))
	platform := platformOf(rreq)
	if platform == "" {
		platform = v1.DefaultPlatform
	}
	final0, err := localexec.FinalBase(df, rreq.BuildArgs, rreq.Target, platform)
	if err != nil {
		return nil, dfDigest, fmt.Errorf("parse the Dockerfile: %w", err)
	}
	if final0 == "" {
		return nil, dfDigest, nil // FROM scratch: no base
	}
	plat, err := ggcrv1.ParsePlatform(platform)
	if err != nil {
		return nil, dfDigest, err
	}
	r, err := rr.ParseReference(final0)
	if err != nil {
		// kaniko reads short names (Docker Hub); the worker's strict
		// parser does not: take go-containerregistry's defaults.
		if r, err = name.ParseReference(final0); err != nil {
			return nil, dfDigest, errors.New("the base image reference does not parse")
		}
	}
	if allowed := w.cfg.Naming.Registries; len(allowed) > 0 && !slices.ContainsFunc(allowed, func(a string) bool {
		return strings.EqualFold(a, r.Context().RegistryStr())
	}) {
		return nil, dfDigest, errors.New("the base image's registry is not one the worker contacts (--allowed-registry)")
	}
	opts := append(rr.RemoteOptions(ctx), remote.WithPlatform(*plat))
	built, err := layersOf(rr, final.Repository+"@"+final.Digest, opts)
	if err != nil {
		return nil, dfDigest, fmt.Errorf("read the built image: %w", err)
	}
	img, err := remote.Image(r, opts...)
	if err != nil {
		return nil, dfDigest, fmt.Errorf("resolve the base image: %w", err)
	}
	d, err := img.Digest()
	if err != nil {
		return nil, dfDigest, err
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, dfDigest, err
	}
	base := make([]ggcrv1.Hash, len(m.Layers))
	for i, l := range m.Layers {
		base[i] = l.Digest
	}
	if len(base) == 0 || len(base) > len(built) || !slices.Equal(built[:len(base)], base) {
		return nil, dfDigest, errBaseMoved
	}
	return []BaseImage{{Ref: final0, Digest: d.String()}}, dfDigest, nil
}

// dockerfileOf unpacks the run's context as the Job's fetch-context does
// and reads its Dockerfile as the executor does.
func (w *builder) dockerfileOf(ctx context.Context, rreq *v1.Request) ([]byte, error) {
	body, err := w.cfg.Contexts.Open(ctx, rreq.Source.S3.Bucket, rreq.Source.S3.Key)
	if err != nil {
		return nil, fmt.Errorf("read the context: %w", err)
	}
	defer body.Close()
	dir, err := os.MkdirTemp("", "buildq-provenance-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if err := contexttar.ExtractVerified(ctx, body, dir, w.cfg.MaxContextBytes, rreq.ContextDigest); err != nil {
		return nil, fmt.Errorf("unpack the context: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	f, err := root.Open(filepath.FromSlash(rreq.DockerfileOrDefault()))
	if err != nil {
		return nil, fmt.Errorf("the context has no readable %s", rreq.DockerfileOrDefault())
	}
	defer f.Close()
	df, err := io.ReadAll(io.LimitReader(f, maxDockerfileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", rreq.DockerfileOrDefault(), err)
	}
	if len(df) > maxDockerfileBytes {
		return nil, fmt.Errorf("%s is larger than %d bytes", rreq.DockerfileOrDefault(), maxDockerfileBytes)
	}
	return df, nil
}

// maxDockerfileBytes bounds the Dockerfile read for a provenance.
const maxDockerfileBytes = 1 << 20

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
