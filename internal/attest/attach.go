package attest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Annotations of an attached bundle (cosign reads the predicate type
// from them; the others say what the referrer holds).
const (
	annotationContent       = "dev.sigstore.bundle.content"
	annotationPredicateType = "dev.sigstore.bundle.predicateType"
	annotationCreated       = "org.opencontainers.image.created"
)

// emptyConfig is the OCI 1.1 empty descriptor's content: an artifact
// manifest's config when the artifact has none.
var emptyConfig = []byte("{}")

const emptyMediaType types.MediaType = "application/vnd.oci.empty.v1+json"

// Attach attaches bundleJSON to the image or index at subject as an OCI
// 1.1 referrer: a manifest of artifactType BundleMediaType whose one
// layer is the bundle and whose subject is the image. On a registry
// without the referrers API, go-containerregistry keeps the referrers
// tag (sha256-<hex>) up to date instead. created (the build's end) is
// the manifest's creation annotation, so attaching the same bundle twice
// writes one manifest. It returns the referrer manifest's digest. The
// bundle is taken to hold SLSA provenance; AttachAs names another
// predicate type.
func Attach(ctx context.Context, subject name.Digest, bundleJSON []byte, created time.Time, opts []remote.Option) (string, error) {
	return AttachAs(ctx, subject, bundleJSON, PredicateSLSAProvenance, created, opts)
}

// AttachAs is Attach of a bundle whose statement has predicateType.
func AttachAs(ctx context.Context, subject name.Digest, bundleJSON []byte, predicateType string, created time.Time, opts []remote.Option) (string, error) {
	opts = append(opts, remote.WithContext(ctx))
	sub, err := remote.Head(subject, opts...)
	if err != nil {
		return "", fmt.Errorf("attest: attach: read the subject %s: %w", subject, err)
	}
	// One Pusher for the blobs and the manifest: the repository is
	// pinged and authorised once.
	pusher, err := remote.NewPusher(opts...)
	if err != nil {
		return "", fmt.Errorf("attest: attach: %w", err)
	}
	layer := static.NewLayer(bundleJSON, types.MediaType(BundleMediaType))
	cfg := static.NewLayer(emptyConfig, emptyMediaType)
	for _, l := range []v1.Layer{cfg, layer} {
		if err := pusher.Upload(ctx, subject.Context(), l); err != nil {
			return "", fmt.Errorf("attest: attach: upload to %s: %w", subject.Context(), err)
		}
	}
	layerDesc, err := descriptorOf(layer)
	if err != nil {
		return "", err
	}
	cfgDesc, err := descriptorOf(cfg)
	if err != nil {
		return "", err
	}
	cfgDesc.Data = emptyConfig
	m := v1.Manifest{
		SchemaVersion: 2,
		MediaType:     types.OCIManifestSchema1,
		ArtifactType:  BundleMediaType,
		Config:        cfgDesc,
		Layers:        []v1.Descriptor{layerDesc},
		Subject:       &v1.Descriptor{MediaType: sub.MediaType, Digest: sub.Digest, Size: sub.Size},
		Annotations: map[string]string{
			annotationContent:       "dsse-envelope",
			annotationPredicateType: predicateType,
			annotationCreated:       created.UTC().Format(time.RFC3339),
		},
	}
	raw, err := json.Marshal(m)
	if err != nil {
		return "", err
	}
	h, _, err := v1.SHA256(bytes.NewReader(raw))
	if err != nil {
		return "", err
	}
	ref := subject.Context().Digest(h.String())
	if err := pusher.Put(ctx, ref, rawManifest{raw: raw, mt: types.OCIManifestSchema1}); err != nil {
		return "", fmt.Errorf("attest: attach: write the referrer to %s: %w", subject.Context(), err)
	}
	return h.String(), nil
}

func descriptorOf(l v1.Layer) (v1.Descriptor, error) {
	d, err := l.Digest()
	if err != nil {
		return v1.Descriptor{}, err
	}
	size, err := l.Size()
	if err != nil {
		return v1.Descriptor{}, err
	}
	mt, err := l.MediaType()
	if err != nil {
		return v1.Descriptor{}, err
	}
	return v1.Descriptor{MediaType: mt, Digest: d, Size: size}, nil
}

// rawManifest is a manifest written as it is (remote.Taggable).
type rawManifest struct {
	raw []byte
	mt  types.MediaType
}

func (r rawManifest) RawManifest() ([]byte, error)        { return r.raw, nil }
func (r rawManifest) MediaType() (types.MediaType, error) { return r.mt, nil }

// Attached is one bundle attached to an image.
type Attached struct {
	// Digest is the referrer manifest's.
	Digest string
	Bundle []byte
	// Err is why the bundle could not be read (Bundle is nil then): one
	// referrer that is too large or lost a blob does not hide the others.
	Err error
}

// errNotBundle: a referrer that is not a Sigstore bundle.
var errNotBundle = errors.New("not an attached Sigstore bundle")

// MaxBundleBytes bounds what is read of one attached bundle; nothing
// larger is attached.
const MaxBundleBytes = maxBundleBytes

const maxBundleBytes = 4 << 20

// maxReferrers bounds the referrers of one image that are read: a tenant
// can attach any number to its own image, and each is a download.
const maxReferrers = 16

// Find returns the bundles attached to subject (through the referrers
// API, or the referrers tag where the registry has none), newest first,
// at most maxReferrers of them. An image with none gives an empty list,
// not an error; a bundle that cannot be read is listed with its Err.
func Find(ctx context.Context, subject name.Digest, opts []remote.Option) ([]Attached, error) {
	var out []Attached
	err := walk(ctx, subject, opts, "", func(a Attached) bool {
		out = append(out, a)
		return false
	})
	return out, err
}

// walk hands the bundles attached to subject to fn one at a time, newest
// first, until fn returns true, reading at most maxReferrers (a bundle is
// read only when its turn comes, and nothing of it is kept here).
// predicateType, when set, passes over referrers whose annotation names
// another predicate type.
func walk(ctx context.Context, subject name.Digest, opts []remote.Option, predicateType string, fn func(Attached) bool) error {
	opts = append(opts, remote.WithContext(ctx))
	// Not filtered by the registry: some report a referrer's config
	// media type as its artifactType (the OCI 1.1 empty type here).
	idx, err := remote.Referrers(subject, opts...)
	if err != nil {
		return fmt.Errorf("attest: list the referrers of %s: %w", subject, err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return fmt.Errorf("attest: list the referrers of %s: %w", subject, err)
	}
	read := 0
	for i := len(im.Manifests) - 1; i >= 0 && read < maxReferrers; i-- {
		d := im.Manifests[i]
		if d.ArtifactType != BundleMediaType && d.ArtifactType != string(emptyMediaType) {
			continue
		}
		if pt, ok := d.Annotations[annotationPredicateType]; ok && predicateType != "" && pt != predicateType {
			continue
		}
		read++
		b, err := readBundle(subject.Context().Digest(d.Digest.String()), opts)
		if errors.Is(err, errNotBundle) {
			continue
		}
		if err != nil && ctx.Err() != nil {
			return err
		}
		if fn(Attached{Digest: d.Digest.String(), Bundle: b, Err: err}) {
			return nil
		}
	}
	return nil
}

// Get returns the bundle of the referrer at ref (repo@digest).
func Get(ctx context.Context, ref name.Digest, opts []remote.Option) ([]byte, error) {
	return readBundle(ref, append(opts, remote.WithContext(ctx)))
}

func readBundle(ref name.Digest, opts []remote.Option) ([]byte, error) {
	img, err := remote.Image(ref, opts...)
	if err != nil {
		return nil, fmt.Errorf("attest: read %s: %w", ref, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, fmt.Errorf("attest: read %s: %w", ref, err)
	}
	if len(m.Layers) != 1 || string(m.Layers[0].MediaType) != BundleMediaType {
		return nil, fmt.Errorf("attest: %s: %w", ref, errNotBundle)
	}
	if m.Layers[0].Size > maxBundleBytes {
		return nil, fmt.Errorf("attest: the bundle of %s is %d bytes, more than %d", ref, m.Layers[0].Size, maxBundleBytes)
	}
	l, err := remote.Layer(ref.Context().Digest(m.Layers[0].Digest.String()), opts...)
	if err != nil {
		return nil, fmt.Errorf("attest: read the bundle of %s: %w", ref, err)
	}
	rc, err := l.Compressed()
	if err != nil {
		return nil, fmt.Errorf("attest: read the bundle of %s: %w", ref, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, maxBundleBytes+1))
	if err != nil {
		return nil, fmt.Errorf("attest: read the bundle of %s: %w", ref, err)
	}
	if len(b) > maxBundleBytes {
		return nil, fmt.Errorf("attest: the bundle of %s is larger than %d bytes", ref, maxBundleBytes)
	}
	return b, nil
}

// Copy writes the referrer at src (repo@digest) into dst, the repository
// an image was copied to: its subject's digest is the same there, so it
// refers to the copy. read and write are the options of each side.
func Copy(ctx context.Context, src name.Digest, dst name.Repository, read, write []remote.Option) error {
	desc, err := remote.Get(src, append(read, remote.WithContext(ctx))...)
	if err != nil {
		return fmt.Errorf("attest: copy %s: %w", src, err)
	}
	if !desc.MediaType.IsImage() {
		return errors.New("attest: copy " + src.String() + ": not an artifact manifest")
	}
	img, err := desc.Image()
	if err != nil {
		return fmt.Errorf("attest: copy %s: %w", src, err)
	}
	if err := remote.Write(dst.Digest(desc.Digest.String()), img, append(write, remote.WithContext(ctx))...); err != nil {
		return fmt.Errorf("attest: copy %s to %s: %w", src, dst, err)
	}
	return nil
}
