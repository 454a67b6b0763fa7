package attest

import (
	"context"
	"io"
	"log"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	intoto "github.com/in-toto/attestation/go/v1"
	"google.golang.org/protobuf/encoding/protojson"
)

const testSPDX = `{"spdxVersion":"SPDX-2.3","SPDXID":"SPDXRef-DOCUMENT","name":"acme/app","packages":[{"name":"zlib","versionInfo":"1.3"},{"name":"busybox","versionInfo":"1.36"}]}`

func TestSBOMStatementIsAnInTotoStatementOfTheSPDXDocument(t *testing.T) {
	digest := "sha256:" + strings.Repeat("ab", 32)
	st, err := SBOMStatement(Subject{Name: "registry.test/acme/app", Digest: digest}, []byte(testSPDX))
	if err != nil {
		t.Fatal(err)
	}
	var s intoto.Statement
	if err := protojson.Unmarshal(st, &s); err != nil {
		t.Fatal(err)
	}
	if err := s.Validate(); err != nil || s.GetPredicateType() != PredicateSPDX {
		t.Fatalf("statement %s: %v", st, err)
	}
	got, err := ParseSBOMStatement(st)
	if err != nil {
		t.Fatal(err)
	}
	if got.SPDXVersion != "SPDX-2.3" || strings.Join(got.Packages, ",") != "zlib@1.3,busybox@1.36" || got.Subjects[0].Digest != digest {
		t.Fatalf("parsed %+v", got)
	}
	for _, bad := range []string{`[]`, `{"name":"not spdx"}`, `not json`} {
		if _, err := SBOMStatement(Subject{Name: "r/a", Digest: digest}, []byte(bad)); err == nil {
			t.Errorf("SBOMStatement accepted %q", bad)
		}
	}
	if _, err := SBOMStatement(Subject{Name: "r/a", Digest: digest}, []byte(`{"spdxVersion":"SPDX-2.3","pad":"`+strings.Repeat("x", maxSBOMBytes)+`"}`)); err == nil {
		t.Error("SBOMStatement accepted a document larger than an attachment holds")
	}
	// Provenance is not an SBOM, nor the other way round.
	prov, err := Statement(testBuild(digest))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ParseSBOMStatement(prov); err == nil {
		t.Error("provenance parsed as an SBOM")
	}
	if _, err := ParseStatement(st); err == nil {
		t.Error("an SBOM parsed as provenance")
	}
}

func TestFindSBOMTakesOnlyASignedSBOMAboutTheImage(t *testing.T) {
	srv := httptest.NewServer(ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)), ggcrregistry.WithReferrersSupport(true)))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	ctx := context.Background()
	img := pushRandom(t, host, "acme/app")
	s, mallory := signers(t)["ecdsa-p256"], signers(t)["ed25519"]
	v, _ := NewVerifier(s.PublicKeyPEM())
	attach := func(signer *Signer, predicate string, st []byte) string {
		t.Helper()
		b, err := signer.Sign(st)
		if err != nil {
			t.Fatal(err)
		}
		ref, err := AttachAs(ctx, img, b, predicate, time.Now(), nil)
		if err != nil {
			t.Fatal(err)
		}
		return ref
	}
	sbomOf := func(subject Subject) []byte {
		st, err := SBOMStatement(subject, []byte(testSPDX))
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	if got, err := FindSBOM(ctx, img, v, nil); err != nil || got != nil {
		t.Fatalf("an image with nothing attached: %+v, %v", got, err)
	}
	// Provenance, an SBOM under another key, and one about another
	// image are all passed over.
	prov, _ := Statement(testBuild(img.DigestStr()))
	attach(s, PredicateSLSAProvenance, prov)
	attach(mallory, PredicateSPDX, sbomOf(Subject{Name: img.Context().Name(), Digest: img.DigestStr()}))
	attach(s, PredicateSPDX, sbomOf(Subject{Name: img.Context().Name(), Digest: "sha256:" + strings.Repeat("0", 64)}))
	if got, err := FindSBOM(ctx, img, v, nil); err != nil || got != nil {
		t.Fatalf("found %+v (%v); want none of those", got, err)
	}
	want := attach(s, PredicateSPDX, sbomOf(Subject{Name: img.Context().Name(), Digest: img.DigestStr()}))
	got, err := FindSBOM(ctx, img, v, nil)
	if err != nil || got == nil || got.Referrer != want {
		t.Fatalf("found %+v (%v); want %s", got, err, want)
	}
	// Verify still finds the provenance among SBOMs.
	if p, err := Verify(ctx, img, v, nil); err != nil || p.InvocationID != "req-1" {
		t.Fatalf("provenance among SBOMs: %+v, %v", p, err)
	}
}
