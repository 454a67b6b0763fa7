package worker

// Attacks on the SBOMs of fe61488 (worker/sbom.go, answerSBOM in
// resultVerdict, its use by park.go's settleWaiter): a hostile tenant, a
// worker answering a parked request, a registry in trouble, an image
// index. A failing test is a break; its message says what went wrong.

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// syftLike stands in for the real scanner (internal/sbom.Syft): it scans
// whatever image it is handed and names it as told, checking nothing. It
// records what it scanned.
type syftLike struct {
	mu    sync.Mutex
	scans []string // "asked=<version> scanned=<digest>"
}

func (s *syftLike) Scan(_ context.Context, img ggcrv1.Image, name, version string) ([]byte, error) {
	d, err := img.Digest()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.scans = append(s.scans, "asked="+version+" scanned="+d.String())
	s.mu.Unlock()
	return []byte(`{"spdxVersion":"SPDX-2.3","SPDXID":"SPDXRef-DOCUMENT","name":"` + name + `","comment":"made from ` + d.String() + `","packages":[]}`), nil
}

func (s *syftLike) mismatched() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, sc := range s.scans {
		var asked, scanned string
		if _, err := fmt.Sscanf(sc, "asked=%s scanned=%s", &asked, &scanned); err != nil || asked != scanned {
			out = append(out, sc)
		}
	}
	return out
}

// pushIndex pushes an index of two platform images (linux/amd64 and
// linux/arm64) to ref and returns its digest and its children's.
func pushIndex(t *testing.T, tr *testRegistry, ref string) (string, map[string]string) {
	t.Helper()
	idx := ggcrv1.ImageIndex(empty.Index)
	children := map[string]string{}
	for _, arch := range []string{"amd64", "arm64"} {
		img, err := random.Image(512, 1)
		if err != nil {
			t.Fatal(err)
		}
		d, _ := img.Digest()
		children["linux/"+arch] = d.String()
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: ggcrv1.Descriptor{
			Platform: &ggcrv1.Platform{OS: "linux", Architecture: arch}}})
	}
	tag, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(tag, idx, tr.client.RemoteOptions(context.Background())...); err != nil {
		t.Fatal(err)
	}
	d, _ := idx.Digest()
	return d.String(), children
}

// A tenant pushes an image index by hand to its request's default tag;
// the request (one platform, asking for an SBOM) is answered from that
// tag (preflight) with the index's digest and no platforms. The worker
// read repo@<index> as an image — go-containerregistry resolves an index
// to its linux/amd64 child — scanned that child alone, and signed an SBOM
// whose subject is the index: a verifier of the index was told it holds
// only what the amd64 image holds. Now the request fails SBOMFailed, and
// nothing is scanned or signed.
func TestAttack_SBOMOfAnIndexAtTheDestinationIsMadeOfOneChild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	scanner := &syftLike{}
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "index-by-hand"})
	req := tenantRequestFor("acme", digest)
	req.SBOM = true
	backend := NewLocalBackend(mapContexts{req.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0)
	e.startLocalWorker("w1", backend, func(c *Config) {
		withRegistry(tr)(c)
		att := &SigningAttestor{Signer: signer, Scanner: scanner}
		c.Attestor, c.SBOM = att, att
	})
	results := e.collect()
	key := v1.BuildKey(req, KeyIdentity(backend.Identity(), req, false))
	repo, err := naming.Policy{Registry: tr.host}.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	idx, children := pushIndex(t, tr, repo+":"+v1.DefaultTag(key))

	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	d := results.waitFor(t, 1, 30*time.Second)[0].Data
	// The index was not built here: no SBOM is made of one of its
	// children in its name; the request says why.
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonSBOMFailed || !strings.Contains(d.Message, "not one image") {
		t.Fatalf("result %s; want SBOMFailed: the index at the default tag (%s) is not one image", mustJSON(t, d), idx)
	}
	if s := sbomAt(t, tr, verifier, repo, idx); s != nil {
		t.Fatalf("an SBOM %s about %+v is attached to the index", s.Referrer, s.Subjects)
	}
	if bad := scanner.mismatched(); len(bad) > 0 {
		var found string
		if s := sbomAt(t, tr, verifier, repo, idx); s != nil {
			found = fmt.Sprintf("%s about %+v", s.Referrer, s.Subjects)
		}
		t.Fatalf("the scanner was handed an image other than the one named (%v): the result (status %s, digest %s) names SBOM %q, "+
			"signed about the index %s (verified SBOM there: %s), made of one child of %v",
			bad, d.Status, d.Digest, d.SBOM, idx, found, children)
	}
	if d.Status == v1.StatusSucceeded && len(d.SBOMs) != len(children) {
		t.Fatalf("result %s: an index answered with sboms %v; want one per platform image %v", mustJSON(t, d), d.SBOMs, children)
	}
}

// sbomRuleWorker is a worker set up (buckets and streams) but not running,
// with tr's naming and registry and sbom as its SBOM maker.
func sbomRuleWorker(t *testing.T, e *env, tr *testRegistry, sbom SBOMMaker) *Worker {
	t.Helper()
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	withRegistry(tr)(&cfg)
	cfg.SBOM = sbom
	w, err := New(e.nc, NewLocalBackend(mapContexts{}, tr.client, t.TempDir(), 0), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(context.Background()); err != nil {
		t.Fatal(err)
	}
	return w
}

// parkOnFinishedRun writes what a parked request of acme asking for an
// SBOM leaves when the run it waits on ended with an image in its
// repository: the run's final record, the request's ledger entry and its
// parked waiter entry. It returns the key and the image's digest.
func parkOnFinishedRun(t *testing.T, w *Worker, tr *testRegistry, id string) (*v1.Request, string, string, string) {
	t.Helper()
	ctx := context.Background()
	req := tenantRequestFor("acme", "sha256:"+hex64(id))
	req.RequestID, req.SBOM, req.APIVersion = id, true, v1.APIVersion
	key := v1.BuildKey(req, "local")
	repo, err := w.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	dest := repo + ":" + v1.DefaultTag(key)
	digest := tr.push(t, dest)
	now := time.Now().UTC()
	if _, ok, err := w.runs.Claim(ctx, &v1.BuildRecord{Key: key, State: v1.StateSucceeded, Run: "run-1", Repository: repo,
		Image: dest, Pushed: []string{dest}, Digest: digest, Tenant: "acme", RequestID: "the-claimer",
		StartedAt: now, FinishedAt: now}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	le, _, err := w.ledger.Open(ctx, req.Tenant, req.Name, req.RequestID, key, 7, now)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(req)
	if err := w.ledger.PutWaiter(ctx, key, ledger.Waiter{Tenant: req.Tenant, RequestID: req.RequestID, Parked: true, Run: "run-1",
		Subject: v1.RequestSubject(req.Tenant), MsgID: v1.MsgID(req.Tenant, req.RequestID), Seq: 7, MsgTime: now, Body: body,
		ParkedAt: now, Token: le.E.RequeueToken}); err != nil {
		t.Fatal(err)
	}
	return req, key, repo, digest
}

// settle runs what answerWaiters and the sweep run (on goroutines of
// their own, with no recover) for key, and reports a panic that escaped.
func settle(w *Worker, key string) (escaped any) {
	defer func() { escaped = recover() }()
	ctx := context.Background()
	items, err := w.ledger.ListWaiters(ctx, key)
	if err != nil {
		return err
	}
	w.park.settleWaiters(ctx, key, items[key], false)
	return nil
}

// panickingSBOM is an SBOM maker that panics (a scanner bug on one image).
type panickingSBOM struct{}

func (panickingSBOM) SBOM(context.Context, Registry, string) (string, error) { panic("scanner bug") }

// A parked request asking for an SBOM is answered by settleWaiter, on
// answerWaiters' goroutine or the sweep's, neither of which recovers. The
// SBOM's shared goroutine carries a scanner's panic back to its caller
// and panics again there (for safeProcess to turn into one failed
// result): on those goroutines it kills the worker — every tenant's
// requests in flight with it — and the next worker that settles the
// waiter dies the same way.
func TestAttack_SBOMScannerPanicWhileAnsweringAParkedRequestKillsTheWorker(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w := sbomRuleWorker(t, e, tr, panickingSBOM{})
	_, key, _, _ := parkOnFinishedRun(t, w, tr, "r-parked-panic")
	if p := settle(w, key); p != nil {
		t.Fatalf("settling a parked request that asked for an SBOM panicked (%v): on answerWaiters' or the sweep's goroutine "+
			"this crashes the worker process", p)
	}
}

// Regression: a parked request asking for an SBOM, whose run ended, is
// answered by the settling pass with the SBOM made of its image.
func TestAttack_SBOMParkedRequestIsAnsweredWithItsSBOM(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	w := sbomRuleWorker(t, e, tr, &SigningAttestor{Signer: signer, Scanner: &fakeScanner{}})
	results := e.collect()
	req, key, repo, digest := parkOnFinishedRun(t, w, tr, "r-parked-sbom")
	if p := settle(w, key); p != nil {
		t.Fatal(p)
	}
	d := results.waitFor(t, 1, 10*time.Second)[0].Data
	if d.RequestID != req.RequestID || d.Status != v1.StatusSucceeded || d.Digest != digest || d.SBOM == "" {
		t.Fatalf("parked request answered %s; want a success with its SBOM", mustJSON(t, d))
	}
	s := sbomAt(t, tr, verifier, repo, digest)
	if s == nil || s.Referrer != d.SBOM || len(s.Subjects) != 1 || s.Subjects[0].Digest != digest {
		t.Fatalf("SBOM at %s@%s: %+v; want the result's %s about that image", repo, digest, s, d.SBOM)
	}
}

// Regression: an image index's answer carries one SBOM per platform
// image, each attached to that image and about it; none is named for the
// index itself, and the scanner is only ever handed the image it names.
func TestAttack_SBOMEachPlatformImageOfAnIndexGetsItsOwn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	scanner := &syftLike{}
	w := sbomRuleWorker(t, e, tr, &SigningAttestor{Signer: signer, Scanner: scanner})
	req := tenantRequestFor("acme", "sha256:"+hex64("index-sboms"))
	req.SBOM = true
	repo, _ := w.cfg.Naming.Repository(req)
	idx, children := pushIndex(t, tr, repo+":multi")
	rec := &v1.BuildRecord{State: v1.StateSucceeded, Repository: repo, Digest: idx, Platforms: children}
	v, err := w.answerSBOM(context.Background(), verdict{}, req, rec, repo)
	if err != nil {
		t.Fatal(err)
	}
	if v.Term || v.Data.SBOM != "" || len(v.Data.SBOMs) != len(children) {
		t.Fatalf("answer %s; want sboms for %v and no sbom for the index", mustJSON(t, v.Data), children)
	}
	for p, d := range children {
		s := sbomAt(t, tr, verifier, repo, d)
		if s == nil || s.Referrer != v.Data.SBOMs[p] || s.Subjects[0].Digest != d {
			t.Errorf("%s: SBOM at %s is %+v; want %s about it", p, d, s, v.Data.SBOMs[p])
		}
	}
	if bad := scanner.mismatched(); len(bad) > 0 {
		t.Errorf("scanned another image than named: %v", bad)
	}
}

// Regression: a registry in trouble while the SBOM is looked for is
// transient — tried again — never the request's SBOMFailed, and the
// answer names no SBOM.
func TestAttack_SBOMRegistryTroubleIsTransientNotSBOMFailed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, _ := testSigner(t)
	scanner := &fakeScanner{}
	w := sbomRuleWorker(t, e, tr, &SigningAttestor{Signer: signer, Scanner: scanner})
	req := tenantRequestFor("acme", "sha256:"+hex64("registry-down"))
	req.SBOM = true
	repo, _ := w.cfg.Naming.Repository(req)
	digest := tr.push(t, repo+":x")
	tr.fail.Store(true)
	v, err := w.answerSBOM(context.Background(), verdict{}, req, &v1.BuildRecord{State: v1.StateSucceeded, Repository: repo, Digest: digest}, repo)
	tr.fail.Store(false)
	if err == nil || !IsTransient(err) || v.Term || v.Data.Reason == v1.ReasonSBOMFailed || v.Data.SBOM != "" {
		t.Fatalf("answer %s, error %v; want a transient error and no SBOM", mustJSON(t, v.Data), err)
	}
	if n := scanner.scans.Load(); n != 0 {
		t.Fatalf("%d scans while the registry was down", n)
	}
	if !strings.Contains(err.Error(), "SBOM") {
		t.Errorf("error %v does not say it was the SBOM", err)
	}
}
