package attest

// Attacks on the SBOMs of fe61488 (internal/attest/sbom.go, Find in
// attach.go): a document the worker signs and attaches that no reader
// then takes, and referrers a tenant pushes to its own image that make
// FindSBOM — which the worker now runs before every SBOM it answers —
// hold far more than one bundle in memory. A failing test is a break.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// An SPDX document SBOMStatement accepts (under maxSBOMBytes) must make a
// bundle that readers take: the DSSE payload is the statement in base64
// (4/3 of it), so a document near 3 MiB makes a bundle over the 4 MiB
// readBundle reads. The worker attaches it and answers with it, and then
// FindSBOM passes over it (too large): `buildq verify` finds no SBOM, and
// every later request for the image scans and attaches it again.
func TestAttack_SBOMNearTheDocumentLimitIsAttachedButNeverFound(t *testing.T) {
	srv := httptest.NewServer(ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)), ggcrregistry.WithReferrersSupport(true)))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	ctx := context.Background()
	img := pushRandom(t, host, "acme/big")
	s := signers(t)["ecdsa-p256"]
	v, _ := NewVerifier(s.PublicKeyPEM())

	head := `{"spdxVersion":"SPDX-2.3","SPDXID":"SPDXRef-DOCUMENT","name":"acme/big","packages":[{"name":"app","versionInfo":"1.0"}],"comment":"`
	tail := `"}`
	doc := head + strings.Repeat("x", maxSBOMBytes-len(head)-len(tail)-64) + tail
	st, err := SBOMStatement(Subject{Name: img.Context().Name(), Digest: img.DigestStr()}, []byte(doc))
	if err != nil {
		t.Fatalf("a %d-byte document (under the %d limit) refused: %v", len(doc), maxSBOMBytes, err)
	}
	b, err := s.Sign(st)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := AttachAs(ctx, img, b, PredicateSPDX, time.Now(), nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := FindSBOM(ctx, img, v, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got == nil || got.Referrer != ref {
		t.Fatalf("SBOMStatement accepted a %d-byte document; its bundle (%d bytes, readers take %d) was attached as %s, "+
			"but FindSBOM finds %+v: the answer names an SBOM nobody can read, and the next request makes it again",
			len(doc), len(b), maxBundleBytes, ref, got)
	}
}

// countingHandler counts the bytes of blob bodies a registry serves.
type countingHandler struct {
	inner http.Handler
	blobs atomic.Int64
}

type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c countingWriter) Write(p []byte) (int, error) {
	c.n.Add(int64(len(p)))
	return c.ResponseWriter.Write(p)
}

func (h *countingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/") {
		w = countingWriter{ResponseWriter: w, n: &h.blobs}
	}
	h.inner.ServeHTTP(w, r)
}

// A tenant pushes to its own image many referrers that look like SBOM
// bundles (the bundle artifact type, the SPDX predicate annotation), all
// sharing one blob of the largest size readBundle takes. Find reads every
// one of them into memory before FindSBOM looks at any (and keeps them
// all): one request asking for an SBOM then makes the worker — 512 MiB of
// memory in deploy/base — read and hold N × 4 MiB. FindSBOM must bound
// what it reads for one image.
func TestAttack_SBOMFindReadsAndHoldsEveryReferrerATenantPushes(t *testing.T) {
	h := &countingHandler{inner: ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)), ggcrregistry.WithReferrersSupport(true))}
	srv := httptest.NewServer(h)
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	ctx := context.Background()
	img := pushRandom(t, host, "mallory/app")
	v, _ := NewVerifier(signers(t)["ecdsa-p256"].PublicKeyPEM())

	junk := static.NewLayer([]byte(strings.Repeat("A", maxBundleBytes)), types.MediaType(BundleMediaType))
	if err := remote.WriteLayer(img.Context(), junk); err != nil {
		t.Fatal(err)
	}
	layerDesc, err := descriptorOf(junk)
	if err != nil {
		t.Fatal(err)
	}
	cfg := static.NewLayer(emptyConfig, emptyMediaType)
	if err := remote.WriteLayer(img.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	cfgDesc, _ := descriptorOf(cfg)
	sub, err := remote.Head(img)
	if err != nil {
		t.Fatal(err)
	}
	const n = 40
	for i := range n {
		m := v1.Manifest{SchemaVersion: 2, MediaType: types.OCIManifestSchema1, ArtifactType: BundleMediaType,
			Config: cfgDesc, Layers: []v1.Descriptor{layerDesc},
			Subject: &v1.Descriptor{MediaType: sub.MediaType, Digest: sub.Digest, Size: sub.Size},
			Annotations: map[string]string{annotationPredicateType: PredicateSPDX, annotationContent: "dsse-envelope",
				annotationCreated: time.Unix(int64(i), 0).UTC().Format(time.RFC3339), "n": fmt.Sprint(i)}}
		raw, _ := json.Marshal(m)
		d, _, _ := v1.SHA256(strings.NewReader(string(raw)))
		if err := remote.Put(img.Context().Digest(d.String()), rawManifest{raw: raw, mt: types.OCIManifestSchema1}); err != nil {
			t.Fatal(err)
		}
	}
	h.blobs.Store(0)
	got, err := FindSBOM(ctx, img, v, nil)
	if err != nil || got != nil {
		t.Fatalf("FindSBOM: %+v, %v; want none (nothing is signed)", got, err)
	}
	if read, bound := h.blobs.Load(), int64(16*maxBundleBytes); read > bound {
		t.Fatalf("FindSBOM read %d MiB of %d referrers a tenant pushed to its own image (held in memory all at once by Find); "+
			"want it bounded (at most %d MiB)", read>>20, n, bound>>20)
	}
}
