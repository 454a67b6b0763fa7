package worker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/worker/internal/buildlog"
)

// Attestor signs the provenance of an image the worker built and attaches
// it to the image (cmd/buildq wires internal/attest with the deployment's
// key). nil in Config: images are not attested.
type Attestor interface {
	// Attest attaches the signed statement of b to the image at ref
	// (repo@digest), writing with reg (the tenant's registry client), and
	// returns the attached referrer's digest.
	Attest(ctx context.Context, reg Registry, ref string, b attest.Build) (string, error)
	// Copy carries the attestation src (repo@digest of the referrer) to
	// the repository of dst (repo:tag), where a copy of its image now is.
	Copy(ctx context.Context, reg Registry, src, dst string) error
}

// attestTries bounds the attempts at attaching one attestation before
// the run counts as failed for now (and is retried as a whole);
// attachTimeout bounds each attempt.
const (
	attestTries   = 3
	attachTimeout = 2 * time.Minute
)

// attestRun signs and attaches the provenance of a run that succeeded:
// what the run built (final), from the run's own inputs (rreq, the
// claimer's source and tenant), with what the backend saw (out). It
// returns the attestation's digest ("" when the worker attests nothing)
// and what the build used, which the run's record keeps.
func (w *builder) attestRun(ctx context.Context, rreq *v1.Request, final *v1.BuildRecord, out Outcome, log *buildlog.Writer) (string, *v1.BuildProvenance, error) {
	if w.cfg.Attestor == nil || !out.Succeeded || final.Digest == "" {
		return "", nil, nil
	}
	reg, err := w.tenantRegistry(rreq.Tenant)
	if err != nil {
		return "", nil, err
	}
	if reg == nil {
		return "", nil, errors.New("attesting an image needs a registry client")
	}
	if !multiPlatform(rreq) && out.Bases == nil && out.DockerfileDigest == "" {
		// The backend did not say what it built from (a kaniko Job):
		// the worker finds out, from the context and the registry.
		bases, dfDigest, err := w.resolveBases(ctx, reg, rreq, final)
		out.Bases, out.DockerfileDigest = bases, dfDigest
		if err != nil {
			if ctx.Err() != nil {
				return "", nil, ctx.Err()
			}
			// A base reference may hold a secret build argument's
			// value: masked in both logs, as in the statement.
			why := maskSecrets(err.Error(), secretValues(rreq, final))
			w.log.Warn("the provenance names no base images", zap.String("key", final.Key), zap.String("error", why))
			if log != nil {
				_ = log.Own(ctx, "provenance: base images not named: "+why)
			}
		}
	}
	facts := &v1.BuildProvenance{Worker: w.cfg.ID, DockerfileDigest: out.DockerfileDigest}
	for _, b := range out.Bases {
		facts.Bases = append(facts.Bases, v1.ImageDigest{Ref: b.Ref, Digest: b.Digest})
	}
	ex := out.Executor
	if ed, ok := w.backend.(ExecutorDescriber); ok && ex.Digest == "" {
		ex = ed.Executor()
	}
	if ex.Digest != "" && !multiPlatform(rreq) {
		// An index has no executor of its own: its platforms' builds
		// (each attested) had one.
		facts.Executor = &v1.ImageDigest{Ref: ex.URI, Digest: ex.Digest}
	}
	b := provenanceOf(rreq, final, facts, final.SourceInfo, final.RequestID, final.Repository)
	d, err := w.attach(ctx, reg, final.Repository+"@"+final.Digest, b, final.Key)
	return d, facts, err
}

// attach signs b and attaches it to ref, trying again a few times.
func (w *Worker) attach(ctx context.Context, reg Registry, ref string, b attest.Build, key string) (string, error) {
	var last error
	for i := range attestTries {
		if i > 0 {
			select {
			case <-ctx.Done():
				return "", ctx.Err()
			case <-time.After(time.Duration(i) * 500 * time.Millisecond):
			}
		}
		actx, cancel := context.WithTimeout(ctx, attachTimeout)
		d, err := w.cfg.Attestor.Attest(actx, reg, ref, b)
		cancel()
		if err == nil {
			w.cfg.Metrics.attested()
			return d, nil
		}
		last = err
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		w.log.Warn("attaching the provenance failed", zap.String("key", key), zap.Int("attempt", i+1), zap.Error(err))
	}
	return "", Transient(fmt.Errorf("attest %s: %w", ref, last))
}

// attestAnswer is the attestation of a request answered from rec in its
// repository repo, when the build's own cannot serve: another tenant's
// build (a cache hit or a build joined), or a build that was not attested
// (made before the deployment had a key). It is a statement of its own,
// about the image in the request's repository, naming its own source
// (content it was shown to hold, the same as the build's) and its own
// request, with the build's facts from the record — never the builder
// tenant's git url, request id or repository. An image index's platform
// images in repo get one each too.
func (w *Worker) attestAnswer(ctx context.Context, req *v1.Request, rec *v1.BuildRecord, repo string) (string, error) {
	reg, err := w.tenantRegistry(req.Tenant)
	if err != nil {
		return "", err
	}
	if reg == nil {
		return "", errors.New("attesting an image needs a registry client")
	}
	for _, p := range slices.Sorted(maps.Keys(rec.Platforms)) {
		prec := w.platformRecord(ctx, rec, p)
		pr := platformRequest(req, p)
		b := provenanceOf(pr, prec, prec.Provenance, w.sourceInfo.get(req.Tenant, req.RequestID), req.RequestID, repo)
		b.SecretBuildArgs = append(slices.Clone(req.SecretBuildArgs), prec.SecretBuildArgs...)
		if _, err := w.attach(ctx, reg, repo+"@"+prec.Digest, b, prec.Key); err != nil {
			return "", err
		}
	}
	b := provenanceOf(req, rec, rec.Provenance, w.sourceInfo.get(req.Tenant, req.RequestID), req.RequestID, repo)
	b.SecretBuildArgs = append(slices.Clone(req.SecretBuildArgs), rec.SecretBuildArgs...)
	return w.attach(ctx, reg, repo+"@"+rec.Digest, b, rec.Key)
}

// platformRecord is the record of platform p's build of the index rec: its
// own when still indexed with that digest, else one made of what the
// index knows (no facts of its build).
func (w *Worker) platformRecord(ctx context.Context, rec *v1.BuildRecord, p string) *v1.BuildRecord {
	digest := rec.Platforms[p]
	if key := rec.PlatformKeys[p]; key != "" {
		if prec, _, err := w.runs.Get(ctx, key); err == nil && prec != nil && prec.State == v1.StateSucceeded && prec.Digest == digest {
			return prec
		}
	}
	return &v1.BuildRecord{Key: rec.PlatformKeys[p], State: v1.StateSucceeded, Repository: rec.Repository, Digest: digest,
		SecretBuildArgs: rec.SecretBuildArgs, StartedAt: rec.StartedAt, FinishedAt: rec.FinishedAt}
}

// answerAttestation is the attestation the answer of req from rec names:
// the build's own for its tenant, a statement of the answer's own for
// another tenant or for a build not attested (attestAnswer); none for an
// image buildq did not build (found at the destination, no run) or when
// the worker attests nothing.
func (w *Worker) answerAttestation(ctx context.Context, req *v1.Request, rec *v1.BuildRecord, repo string) (string, error) {
	switch {
	case w.cfg.Attestor == nil || rec.Run == "":
		return rec.Attestation, nil
	case rec.Attestation != "" && (rec.Tenant == "" || rec.Tenant == req.Tenant):
		return rec.Attestation, nil
	}
	return w.attestAnswer(ctx, req, rec, repo)
}

// provenanceOf is what a statement says of a build, about its image in
// repo: the inputs of its build key as req gives them (every request of
// the key gives the same), the source as src and req name it, the run's
// times and platforms, and what the build used (facts).
func provenanceOf(req *v1.Request, rec *v1.BuildRecord, facts *v1.BuildProvenance, src *v1.SourceInfo, invocation, repo string) attest.Build {
	b := attest.Build{
		Subjects:        []attest.Subject{{Name: repo, Digest: rec.Digest}},
		Key:             rec.Key,
		Dockerfile:      req.DockerfileOrDefault(),
		BuildArgs:       req.BuildArgs,
		SecretBuildArgs: rec.SecretBuildArgs,
		Target:          req.Target,
		Platforms:       req.PlatformsOrDefault(),
		InvocationID:    invocation,
		StartedOn:       rec.StartedAt,
		FinishedOn:      rec.FinishedAt,
	}
	b.Source.ContextDigest = req.ContextDigest
	if src != nil {
		b.Source.GitURL, b.Source.GitRef, b.Source.GitCommit, b.Source.GitSubPath = src.GitURL, src.Ref, src.Commit, src.SubPath
		if src.ContextDigest != "" {
			b.Source.ContextDigest = src.ContextDigest
		}
	}
	if facts != nil {
		b.Worker, b.DockerfileDigest = facts.Worker, facts.DockerfileDigest
		for _, base := range facts.Bases {
			b.Bases = append(b.Bases, attest.Dependency{URI: base.Ref, Digest: base.Digest, Name: "base"})
		}
		if facts.Executor != nil {
			b.Executor = attest.Dependency{URI: facts.Executor.Ref, Digest: facts.Executor.Digest, Name: "executor"}
		}
	}
	for _, p := range slices.Sorted(maps.Keys(rec.Platforms)) {
		b.PlatformImages = append(b.PlatformImages, attest.Dependency{URI: repo + "@" + rec.Platforms[p], Digest: rec.Platforms[p], Name: p})
	}
	return b
}

// BaseImage is a base image a build pulled, by digest.
type BaseImage struct {
	// Ref is the reference as the Dockerfile names it (resolved).
	Ref    string
	Digest string
}

// ExecutorOf names an executor image "repo@sha256:…" as a dependency;
// an image not pinned by digest gives none.
func ExecutorOf(image string) attest.Dependency {
	repo, digest, ok := strings.Cut(image, "@")
	if !ok {
		return attest.Dependency{}
	}
	return attest.Dependency{URI: repo, Digest: digest, Name: "executor"}
}

// ExecutorDescriber is a Backend that names its executor for the
// provenance of what it builds.
type ExecutorDescriber interface {
	Executor() attest.Dependency
}

// RemoteRegistry is a Registry that go-containerregistry can read and
// write through (internal/registry.Client): attestations are attached,
// and base images resolved, with it. A Registry given to a worker that
// attests must be one.
type RemoteRegistry interface {
	RemoteOptions(ctx context.Context) []remote.Option
	ParseReference(ref string) (name.Reference, error)
}

// SigningAttestor is the Attestor of a deployment: statements signed with
// its key, attached through the tenant's registry client.
type SigningAttestor struct {
	Signer *attest.Signer
	// BuilderID is the deployment's builder id (attest.DefaultBuilderID
	// when empty).
	BuilderID string
	// Scanner makes the SBOMs of images (nil: SBOM makes none); the
	// worker makes them when Config.SBOM is set.
	Scanner SBOMScanner
}

// Attest implements Attestor.
func (a *SigningAttestor) Attest(ctx context.Context, reg Registry, ref string, b attest.Build) (string, error) {
	rr, ok := reg.(RemoteRegistry)
	if !ok {
		return "", fmt.Errorf("the registry client %T cannot attach attestations", reg)
	}
	r, err := rr.ParseReference(ref)
	if err != nil {
		return "", err
	}
	d, ok := r.(name.Digest)
	if !ok {
		return "", fmt.Errorf("attest: %s is not a digest reference", ref)
	}
	b.BuilderID = a.BuilderID
	st, err := attest.Statement(b)
	if err != nil {
		return "", err
	}
	bundle, err := a.Signer.Sign(st)
	if err != nil {
		return "", err
	}
	return attest.Attach(ctx, d, bundle, b.FinishedOn, rr.RemoteOptions(ctx))
}

// Copy implements Attestor.
func (a *SigningAttestor) Copy(ctx context.Context, reg Registry, src, dst string) error {
	rr, ok := reg.(RemoteRegistry)
	if !ok {
		return fmt.Errorf("the registry client %T cannot copy attestations", reg)
	}
	r, err := rr.ParseReference(src)
	if err != nil {
		return err
	}
	d, ok := r.(name.Digest)
	if !ok {
		return fmt.Errorf("attest: %s is not a digest reference", src)
	}
	dr, err := rr.ParseReference(dst)
	if err != nil {
		return err
	}
	opts := rr.RemoteOptions(ctx)
	return attest.Copy(ctx, d, dr.Context(), opts, opts)
}
