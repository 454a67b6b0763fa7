package attest

// Attacks on the verifier (Find, Verify, Open, ParseStatement): what
// `buildq verify` accepts and what it is kept from accepting. A failing
// test is a break; its message says what went wrong.

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/dsse"
)

func attackRegistry(t *testing.T, referrersAPI bool) string {
	t.Helper()
	srv := httptest.NewServer(ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)), ggcrregistry.WithReferrersSupport(referrersAPI)))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// signedFor attaches a valid bundle of s about img and returns its
// referrer digest.
func signedFor(t *testing.T, s *Signer, img name.Digest, finished time.Time) string {
	t.Helper()
	b := testBuild(img.DigestStr())
	b.FinishedOn = finished
	st, err := Statement(b)
	if err != nil {
		t.Fatal(err)
	}
	bundleJSON, err := s.Sign(st)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := Attach(context.Background(), img, bundleJSON, finished, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ref
}

// putReferrer writes a referrer manifest of img with the given layers
// (uploaded unless missing) and returns its digest.
func putReferrer(t *testing.T, img name.Digest, layers []v1.Layer, missing []v1.Descriptor) string {
	t.Helper()
	ctx := context.Background()
	sub, err := remote.Head(img)
	if err != nil {
		t.Fatal(err)
	}
	cfg := static.NewLayer(emptyConfig, emptyMediaType)
	cfgDesc, _ := descriptorOf(cfg)
	cfgDesc.Data = emptyConfig
	if err := remote.WriteLayer(img.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	var descs []v1.Descriptor
	for _, l := range layers {
		if err := remote.WriteLayer(img.Context(), l); err != nil {
			t.Fatal(err)
		}
		d, err := descriptorOf(l)
		if err != nil {
			t.Fatal(err)
		}
		descs = append(descs, d)
	}
	descs = append(descs, missing...)
	m := v1.Manifest{SchemaVersion: 2, MediaType: types.OCIManifestSchema1, ArtifactType: BundleMediaType, Config: cfgDesc, Layers: descs,
		Subject: &v1.Descriptor{MediaType: sub.MediaType, Digest: sub.Digest, Size: sub.Size}}
	raw, _ := json.Marshal(m)
	h, _, _ := v1.SHA256(bytes.NewReader(raw))
	if err := remote.Put(img.Context().Digest(h.String()), rawManifest{raw: raw, mt: types.OCIManifestSchema1}, remote.WithContext(ctx)); err != nil {
		t.Fatal(err)
	}
	return h.String()
}

// One referrer that cannot be read — a bundle over the 4 MiB bound, or a
// manifest whose bundle blob is gone (garbage collected, a referrers tag
// that still lists a deleted manifest) — makes Find fail as a whole, and
// so Verify and `buildq verify` fail for an image whose valid, signed
// attestation is right there. Anyone who can push a referrer to the
// repository (or a registry that lost one blob) denies verification.
// An unreadable referrer should be skipped and named in the reasons, as
// one that does not verify is.
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_OneUnreadableReferrerDoesNotHideAValidAttestation(t *testing.T) {
	for _, mode := range []string{"oversized", "missing-blob"} {
		t.Run(mode, func(t *testing.T) {
			host := attackRegistry(t, true)
			img := pushRandom(t, host, "acme/app")
			s := signers(t)["ecdsa-p256"]
			v, _ := NewVerifier(s.PublicKeyPEM())
			good := signedFor(t, s, img, time.Date(2026, 12, 1, 10, 1, 0, 0, time.UTC))
			switch mode {
			case "oversized":
				big := bytes.Repeat([]byte("x"), maxBundleBytes+1)
				if _, err := Attach(context.Background(), img, big, time.Date(2026, 12, 1, 11, 0, 0, 0, time.UTC), nil); err != nil {
					t.Fatal(err)
				}
			case "missing-blob":
				gone := static.NewLayer([]byte(`{"never":"uploaded"}`), types.MediaType(BundleMediaType))
				d, _ := descriptorOf(gone)
				putReferrer(t, img, nil, []v1.Descriptor{d})
			}
			p, err := Verify(context.Background(), img, v, nil)
			if err != nil {
				t.Fatalf("the valid attestation %s is not found because of another referrer: %v", good, err)
			}
			if p.Referrer != good {
				t.Fatalf("verified %s, want %s", p.Referrer, good)
			}
		})
	}
}

// A statement signed with the deployment's key about the image, but of
// another predicate type, does not verify as its provenance.
func TestAttack_VerifyRefusesAnotherPredicateType(t *testing.T) {
	host := attackRegistry(t, false)
	img := pushRandom(t, host, "acme/app")
	s := signers(t)["ed25519"]
	v, _ := NewVerifier(s.PublicKeyPEM())
	st, err := Statement(testBuild(img.DigestStr()))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(st, &m); err != nil {
		t.Fatal(err)
	}
	m["predicateType"] = "https://slsa.dev/provenance/v0.2"
	other, _ := json.Marshal(m)
	b, err := s.Sign(other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Attach(context.Background(), img, b, time.Now(), nil); err != nil {
		t.Fatal(err)
	}
	if p, err := Verify(context.Background(), img, v, nil); !errors.Is(err, ErrNotVerified) || !strings.Contains(err.Error(), "predicate type") {
		t.Fatalf("a statement of another predicate type: %+v, %v", p, err)
	}
}

// A DSSE envelope signed by the deployment's key with another payload
// type (the signature covers it) is not an in-toto statement of it.
func TestAttack_VerifyRefusesAnotherPayloadType(t *testing.T) {
	host := attackRegistry(t, true)
	img := pushRandom(t, host, "acme/app")
	k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	s, err := NewSigner(k)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := NewVerifier(s.PublicKeyPEM())
	sv, err := signature.LoadECDSASignerVerifier(k, crypto.SHA256)
	if err != nil {
		t.Fatal(err)
	}
	st, err := Statement(testBuild(img.DigestStr()))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := dsse.WrapSigner(sv, "application/json").SignMessage(bytes.NewReader(st))
	if err != nil {
		t.Fatal(err)
	}
	var env envelope
	if err := json.Unmarshal(raw, &env); err != nil {
		t.Fatal(err)
	}
	bjson, _ := json.Marshal(bundle{MediaType: BundleMediaType, DSSEEnvelope: env})
	if _, err := Attach(context.Background(), img, bjson, time.Now(), nil); err != nil {
		t.Fatal(err)
	}
	if p, err := Verify(context.Background(), img, v, nil); !errors.Is(err, ErrNotVerified) {
		t.Fatalf("a bundle of payload type application/json verified: %+v, %v", p, err)
	}
}

// A referrer manifest holding the valid bundle beside another layer is
// not read as an attestation (only a one-layer bundle manifest is): the
// image has no provenance.
func TestAttack_VerifyIgnoresAReferrerWithMoreLayers(t *testing.T) {
	host := attackRegistry(t, true)
	img := pushRandom(t, host, "acme/app")
	s := signers(t)["ecdsa-p256"]
	v, _ := NewVerifier(s.PublicKeyPEM())
	st, err := Statement(testBuild(img.DigestStr()))
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Sign(st)
	if err != nil {
		t.Fatal(err)
	}
	putReferrer(t, img, []v1.Layer{
		static.NewLayer(b, types.MediaType(BundleMediaType)),
		static.NewLayer([]byte("payload"), types.MediaType("application/octet-stream")),
	}, nil)
	if p, err := Verify(context.Background(), img, v, nil); !errors.Is(err, ErrNotVerified) {
		t.Fatalf("a two-layer referrer was read as the attestation: %+v, %v", p, err)
	}
}
