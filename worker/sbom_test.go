package worker

// SBOMs (issue 30, item 3): a request that asks for one gets a signed
// SPDX SBOM attached to its image — made once per image, reused on cache
// hits — and a deployment without a scanner refuses such a request before
// it builds anything; a scanner's failure is the request's SBOMFailed.

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
)

// fakeScanner stands in for syft: it counts its scans and answers with
// an SPDX document naming the image (or with err).
type fakeScanner struct {
	scans atomic.Int32
	err   error
	panic bool
}

func (f *fakeScanner) Scan(_ context.Context, img ggcrv1.Image, name, version string) ([]byte, error) {
	f.scans.Add(1)
	if f.panic {
		panic("scanner bug")
	}
	if f.err != nil {
		return nil, f.err
	}
	d, err := img.Digest()
	if err != nil {
		return nil, err
	}
	if d.String() != version {
		return nil, errors.New("scanned " + d.String() + ", asked for " + version)
	}
	return []byte(`{"spdxVersion":"SPDX-2.3","SPDXID":"SPDXRef-DOCUMENT","name":"` + name + `","packages":[{"name":"app","versionInfo":"1.0"}]}`), nil
}

// sbomAt is the verified SBOM attached to repo@digest (nil: none).
func sbomAt(t *testing.T, tr *testRegistry, v *attest.Verifier, repo, digest string) *attest.SBOM {
	t.Helper()
	ref, err := name.NewDigest(repo+"@"+digest, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	s, err := attest.FindSBOM(context.Background(), ref, v, tr.client.RemoteOptions(context.Background()))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// sbomWorld is a local worker that attests with a fresh key and makes
// SBOMs with scanner (nil: none), building a context of one file whose
// content is app; r is a request of acme for it.
type sbomWorld struct {
	e        *env
	tr       *testRegistry
	verifier *attest.Verifier
	results  *resultCollector
	digest   string
}

func newSBOMWorld(t *testing.T, app string, scanner SBOMScanner) *sbomWorld {
	t.Helper()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": app})
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{tenantRequestFor("acme", digest).Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		att := &SigningAttestor{Signer: signer}
		c.Attestor = att
		if scanner != nil {
			att.Scanner = scanner
			c.SBOM = att
		}
	})
	return &sbomWorld{e: e, tr: tr, verifier: verifier, results: e.collect(), digest: digest}
}

// submit publishes a request of acme (asking for an SBOM or not) and
// returns the n-th result stored.
func (w *sbomWorld) submit(t *testing.T, sbom bool, n int) v1.ResultData {
	t.Helper()
	r := tenantRequestFor("acme", w.digest)
	r.SBOM = sbom
	if _, err := w.e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	return w.results.waitFor(t, n, 30*time.Second)[n-1].Data
}

func TestAnSBOMIsMadeOncePerImageForTheRequestsThatAskForIt(t *testing.T) {
	t.Parallel()
	scanner := &fakeScanner{}
	w := newSBOMWorld(t, "hello", scanner)

	// Not asked: no SBOM, no scan.
	d := w.submit(t, false, 1)
	if d.Status != v1.StatusSucceeded || d.SBOM != "" || scanner.scans.Load() != 0 {
		t.Fatalf("result %s after %d scans; want a success without an SBOM, and no scan", mustJSON(t, d), scanner.scans.Load())
	}
	repo := strings.SplitN(d.ImageRef, "@", 2)[0]
	if s := sbomAt(t, w.tr, w.verifier, repo, d.Digest); s != nil {
		t.Fatalf("an SBOM %s is attached that nobody asked for", s.Referrer)
	}

	// Asked, on a cache hit: made now, signed, attached beside the
	// provenance, which still verifies. The result is published before
	// the run's end is stored: a request sent before that would join the
	// run, not hit.
	eventually(t, 10*time.Second, "the first run's end stored", func() bool {
		rec := w.e.claim(d.Key)
		return rec != nil && rec.State == v1.StateSucceeded
	})
	a := w.submit(t, true, 2)
	if a.Status != v1.StatusSucceeded || a.SBOM == "" || a.Origin != v1.OriginCache {
		t.Fatalf("result %s; want a cache hit with its SBOM", mustJSON(t, a))
	}
	s := sbomAt(t, w.tr, w.verifier, repo, d.Digest)
	if s == nil || s.Referrer != a.SBOM || s.SPDXVersion != "SPDX-2.3" || len(s.Packages) != 1 || s.Packages[0] != "app@1.0" {
		t.Fatalf("attached SBOM %+v; want the result's %s listing app@1.0", s, a.SBOM)
	}
	if len(s.Subjects) != 1 || s.Subjects[0].Digest != d.Digest || s.Subjects[0].Name != repo {
		t.Fatalf("the SBOM is about %+v, want %s@%s", s.Subjects, repo, d.Digest)
	}
	if p := verifyAt(t, w.tr, w.verifier, repo, d.Digest); p.Referrer != d.Attestation {
		t.Fatalf("provenance %s after the SBOM, want %s", p.Referrer, d.Attestation)
	}

	// Asked again: the SBOM attached is the answer; nothing is scanned.
	if g := w.submit(t, true, 3); g.SBOM != a.SBOM || scanner.scans.Load() != 1 {
		t.Fatalf("second SBOM request: %s after %d scans; want %s from one scan", mustJSON(t, g), scanner.scans.Load(), a.SBOM)
	}
}

func TestARequestForAnSBOMIsRefusedByADeploymentWithoutAScanner(t *testing.T) {
	t.Parallel()
	w := newSBOMWorld(t, "unscanned", nil)
	d := w.submit(t, true, 1)
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonInvalidRequest || !strings.Contains(d.Message, "--sbom-scanner") {
		t.Fatalf("result %s; want InvalidRequest naming --sbom-scanner", mustJSON(t, d))
	}
	if tags := repoTags(t, w.tr, "acme"); len(tags) > 0 {
		t.Fatalf("an image was built for a refused request: tags %v", tags)
	}
}

func TestAScannerFailureIsTheRequestsSBOMFailed(t *testing.T) {
	t.Parallel()
	scanner := &fakeScanner{err: errors.New("syft: exit status 1: unable to catalog: boom")}
	w := newSBOMWorld(t, "unscannable", scanner)
	d := w.submit(t, true, 1)
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonSBOMFailed || !strings.Contains(d.Message, "unable to catalog: boom") || d.Digest != "" {
		t.Fatalf("result %s; want SBOMFailed in the scanner's words", mustJSON(t, d))
	}
	if n := scanner.scans.Load(); n != 1 {
		t.Fatalf("%d scans; a scanner's failure is not retried", n)
	}
}

// A scanner that panics (it runs on a goroutine shared by the requests
// for one image) fails the request once; the worker goes on.
func TestAScannerPanicFailsTheRequestAndTheWorkerGoesOn(t *testing.T) {
	t.Parallel()
	w := newSBOMWorld(t, "panics", &fakeScanner{panic: true})
	d := w.submit(t, true, 1)
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonInfrastructureError || !strings.Contains(d.Message, "scanner bug") {
		t.Fatalf("result %s; want one InfrastructureError naming the panic", mustJSON(t, d))
	}
	if a := w.submit(t, false, 2); a.Status != v1.StatusSucceeded {
		t.Fatalf("the next request: %s; want the worker still answering", mustJSON(t, a))
	}
}
