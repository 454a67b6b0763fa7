package worker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
)

// SBOMMaker attaches a signed SBOM to an image (a SigningAttestor with a
// Scanner). nil in Config: the worker makes no SBOMs, and refuses the
// requests that ask for one.
type SBOMMaker interface {
	// SBOM returns the digest of a signed SBOM attached to the image at
	// ref (repo@digest): the newest one already there under the
	// deployment's key, or one made now. Reading and writing go through
	// reg, the tenant's registry client. An error that is an
	// *SBOMFailure is the scanner's: trying again will not help.
	SBOM(ctx context.Context, reg Registry, ref string) (string, error)
}

// SBOMScanner makes the SPDX JSON SBOM of an image (internal/sbom runs
// syft). It is given the image's content, never a registry or its
// credentials.
type SBOMScanner interface {
	Scan(ctx context.Context, img ggcrv1.Image, name, version string) ([]byte, error)
}

// SBOMFailure is an SBOM the scanner could not make of an image, or made
// in a form that cannot be attached: the request's answer is SBOMFailed.
type SBOMFailure struct{ Err error }

func (e *SBOMFailure) Error() string { return e.Err.Error() }
func (e *SBOMFailure) Unwrap() error { return e.Err }

// SBOM implements SBOMMaker: a deployment's attestor with a Scanner.
func (a *SigningAttestor) SBOM(ctx context.Context, reg Registry, ref string) (string, error) {
	if a.Scanner == nil {
		return "", errors.New("this worker has no SBOM scanner")
	}
	rr, ok := reg.(RemoteRegistry)
	if !ok {
		return "", fmt.Errorf("the registry client %T cannot attach SBOMs", reg)
	}
	r, err := rr.ParseReference(ref)
	if err != nil {
		return "", err
	}
	d, ok := r.(name.Digest)
	if !ok {
		return "", fmt.Errorf("sbom: %s is not a digest reference", ref)
	}
	ver, err := attest.NewVerifier(a.Signer.PublicKeyPEM())
	if err != nil {
		return "", err
	}
	opts := rr.RemoteOptions(ctx)
	have, err := attest.FindSBOM(ctx, d, ver, opts)
	if err != nil {
		return "", err
	}
	if have != nil {
		return have.Referrer, nil
	}
	desc, err := remote.Get(d, append(opts, remote.WithContext(ctx))...)
	if err != nil {
		return "", fmt.Errorf("sbom: read %s: %w", d, err)
	}
	if !desc.MediaType.IsImage() {
		// An index (pushed to the destination by hand, not built here):
		// reading it as an image would pick one of its platforms, and the
		// SBOM signed for the index would describe that one alone.
		return "", &SBOMFailure{Err: fmt.Errorf("%s is %s, not one image: an SBOM is made of each image buildq builds", d, desc.MediaType)}
	}
	img, err := desc.Image()
	if err != nil {
		return "", fmt.Errorf("sbom: read %s: %w", d, err)
	}
	got, err := img.Digest()
	if err != nil {
		return "", fmt.Errorf("sbom: read %s: %w", d, err)
	}
	if got.String() != d.DigestStr() {
		return "", &SBOMFailure{Err: fmt.Errorf("%s reads as %s, not the image asked for", d, got)}
	}
	doc, err := a.Scanner.Scan(ctx, img, d.Context().Name(), d.DigestStr())
	if err != nil {
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		return "", &SBOMFailure{Err: err}
	}
	st, err := attest.SBOMStatement(attest.Subject{Name: d.Context().Name(), Digest: d.DigestStr()}, doc)
	if err != nil {
		return "", &SBOMFailure{Err: err}
	}
	bundle, err := a.Signer.Sign(st)
	if err != nil {
		return "", err
	}
	if len(bundle) > attest.MaxBundleBytes {
		// Attached, it could never be read back (FindSBOM, buildq verify).
		return "", &SBOMFailure{Err: fmt.Errorf("the signed SBOM is %d bytes, more than the %d an attachment holds", len(bundle), attest.MaxBundleBytes)}
	}
	return attest.AttachAs(ctx, d, bundle, attest.PredicateSPDX, time.Now(), opts)
}

// sbomSlack is what the SBOM of one image may take beyond its scan's own
// bound (a scanner that says it, ScanTimeout): the lookup, the read and
// the attachment. A scan that runs out of its own time is the scanner's
// failure (SBOMFailed); the outer bound is only a backstop.
const (
	sbomSlack          = 5 * time.Minute
	defaultScanTimeout = 10 * time.Minute
)

// sbomTimeout bounds the SBOM of one image.
func (w *Worker) sbomTimeout() time.Duration {
	scan := defaultScanTimeout
	if a, ok := w.cfg.SBOM.(*SigningAttestor); ok {
		if st, ok := a.Scanner.(interface{ ScanTimeout() time.Duration }); ok {
			scan = st.ScanTimeout()
		}
	}
	return scan + sbomSlack
}

// answerSBOM gives v, the answer of req from rec (a success in repo),
// the SBOMs req asks for: one of the image, or for an index one of each
// platform's image. One per image and tenant is made per worker at a
// time; the others in flight wait for it. A scanner's failure fails the answer
// (SBOMFailed); registry trouble is transient.
func (w *Worker) answerSBOM(ctx context.Context, v verdict, req *v1.Request, rec *v1.BuildRecord, repo string) (verdict, error) {
	if !req.SBOM {
		return v, nil
	}
	if w.cfg.SBOM == nil {
		// Refused when it was taken (processRequest); a record answered
		// since the deployment changed gets the same words.
		return sbomRefused(v), nil
	}
	reg, err := w.tenantRegistry(req.Tenant)
	if err != nil {
		return v, err
	}
	one := func(digest string) (string, error) {
		ref := repo + "@" + digest
		// The scan goes on when this answer stops waiting (a shutdown):
		// what it attaches answers the request's next delivery.
		// Shared by the requests of one tenant only: the scan reads and
		// attaches with that tenant's registry client.
		ch := w.sboms.DoChan(req.Tenant+"\n"+ref, func() (_ any, err error) {
			// A panic is carried to each caller's handler (one failed
			// result), as a shared HEAD's is (index.go).
			defer func() {
				if p := recover(); p != nil {
					err = headPanic{p}
				}
			}()
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.sbomTimeout())
			defer cancel()
			return w.cfg.SBOM.SBOM(ctx, reg, ref)
		})
		select {
		case r := <-ch:
			if p, ok := errors.AsType[headPanic](r.Err); ok {
				panic(p.v)
			}
			if r.Err != nil {
				return "", r.Err
			}
			return r.Val.(string), nil
		case <-ctx.Done():
			return "", context.Cause(ctx)
		}
	}
	var failed *SBOMFailure
	fail := func(err error, image string) (verdict, error) {
		if errors.As(err, &failed) {
			w.log.Warn("no SBOM could be made", zap.String("requestId", req.RequestID), zap.String("image", image), zap.Error(err))
			v.Data.Status, v.Data.Reason = v1.StatusFailed, v1.ReasonSBOMFailed
			v.Data.Message = fmt.Sprintf("the image %s was built, but its SBOM could not be made: %v", image, failed.Err)
			v.Data.Image, v.Data.Digest, v.Data.ImageRef, v.Data.Attestation = "", "", "", ""
			v.Data.Platforms, v.Data.SBOM, v.Data.SBOMs = nil, "", nil
			v.Term = true
			return v, nil
		}
		// Registry trouble, or the answer's time ran out (a shutdown, a
		// settling pass's bound): tried again, never a terminal failure.
		return v, Transient(fmt.Errorf("attach the SBOM of %s: %w", image, err))
	}
	if len(rec.Platforms) == 0 {
		d, err := one(rec.Digest)
		if err != nil {
			return fail(err, repo+"@"+rec.Digest)
		}
		v.Data.SBOM = d
		return v, nil
	}
	v.Data.SBOMs = map[string]string{}
	for _, p := range slices.Sorted(maps.Keys(rec.Platforms)) {
		d, err := one(rec.Platforms[p])
		if err != nil {
			return fail(err, repo+"@"+rec.Platforms[p]+" ("+p+")")
		}
		v.Data.SBOMs[p] = d
	}
	return v, nil
}

// sbomRefused fails v: the request asks for an SBOM of a deployment that
// makes none.
func sbomRefused(v verdict) verdict {
	v.Data.Status, v.Data.Reason = v1.StatusFailed, v1.ReasonInvalidRequest
	v.Data.Message = "the request asks for an SBOM, and this deployment makes none (its workers run without --sbom-scanner)"
	v.Data.Image, v.Data.Digest, v.Data.ImageRef, v.Data.Attestation = "", "", "", ""
	v.Data.Platforms = nil
	v.Term = true
	return v
}
