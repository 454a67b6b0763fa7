package worker

// Attestations (issue 30): every image built carries signed provenance
// that names what it was built from — the context, the Dockerfile by
// digest, each base image by the digest pulled, the executor — and a
// cache hit, in the build's repository or copied to another, is answered
// with the build's attestation.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/kaniko"
)

func testSigner(t *testing.T) (*attest.Signer, *attest.Verifier) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := attest.NewSigner(k)
	if err != nil {
		t.Fatal(err)
	}
	v, err := attest.NewVerifier(s.PublicKeyPEM())
	if err != nil {
		t.Fatal(err)
	}
	return s, v
}

// verifyAt checks the provenance attached to repo@digest.
func verifyAt(t *testing.T, tr *testRegistry, v *attest.Verifier, repo, digest string) *attest.Provenance {
	t.Helper()
	ref, err := name.NewDigest(repo+"@"+digest, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	p, err := attest.Verify(context.Background(), ref, v, tr.client.RemoteOptions(context.Background()))
	if err != nil {
		t.Fatalf("the provenance of %s does not verify: %v", ref, err)
	}
	return p
}

func dependency(p *attest.Provenance, role string) []attest.Dependency {
	var out []attest.Dependency
	for _, d := range p.Dependencies {
		if d.Name == role {
			out = append(out, d)
		}
	}
	return out
}

// pushBase pushes a random image as a base and returns its reference and
// digest.
func pushBase(t *testing.T, tr *testRegistry, repoTag string) (ggcrv1.Image, string) {
	t.Helper()
	img, err := random.Image(64, 1)
	if err != nil {
		t.Fatal(err)
	}
	d, err := tr.client.Push(context.Background(), img, []string{tr.host + "/" + repoTag})
	if err != nil {
		t.Fatal(err)
	}
	return img, d
}

func TestEveryLocalBuildIsAttestedAndACacheHitCarriesItsAttestation(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	ctx := context.Background()
	_, baseDigest := pushBase(t, tr, "library/base:1")
	dockerfile := "FROM " + tr.host + "/library/base:1\nCOPY app /app\n"
	digest, tgz := packDir(t, map[string]string{"Dockerfile": dockerfile, "app": "hello"})
	r := tenantRequestFor("acme", digest)
	r.BuildArgs = map[string]string{"TOKEN": "s3cr3t"}
	r.SecretBuildArgs = []string{"TOKEN"}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		c.Attestor = &SigningAttestor{Signer: signer, BuilderID: "https://builder.test/buildq"}
	})
	results := e.collect()
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	d := results.waitFor(t, 1, 30*time.Second)[0].Data
	if d.Status != v1.StatusSucceeded || d.Attestation == "" {
		t.Fatalf("result %s, want a success with its attestation", mustJSON(t, d))
	}
	repo := strings.SplitN(d.ImageRef, "@", 2)[0]
	p := verifyAt(t, tr, verifier, repo, d.Digest)
	if p.Referrer != d.Attestation {
		t.Fatalf("the result names attestation %s, the registry holds %s", d.Attestation, p.Referrer)
	}
	if strings.Contains(string(p.Statement), "s3cr3t") {
		t.Fatal("a secret build argument's value is in the statement")
	}
	if p.InvocationID != r.RequestID || p.BuilderID != "https://builder.test/buildq" || p.Worker != "w1" || p.BuildKey != d.Key {
		t.Fatalf("run details: %+v", p)
	}
	if got := p.External["dockerfile"].(map[string]any)["digest"]; got != fmt.Sprintf("sha256:%x", sha256.Sum256([]byte(dockerfile))) {
		t.Fatalf("dockerfile digest %v", got)
	}
	if ctxDeps := dependency(p, "context"); len(ctxDeps) != 1 || ctxDeps[0].Digest != digest {
		t.Fatalf("context dependency %+v, want %s", ctxDeps, digest)
	}
	if bases := dependency(p, "base"); len(bases) != 1 || bases[0].Digest != baseDigest || bases[0].URI != tr.host+"/library/base:1" {
		t.Fatalf("base images %+v, want %s", bases, baseDigest)
	}
	if ex := dependency(p, "executor"); len(ex) != 1 || !strings.HasPrefix(ex[0].Digest, "sha256:") {
		t.Fatalf("executor %+v", ex)
	}

	// The same content again: a cache hit, answered with the build's
	// attestation; into another repository, the attestation comes along.
	// Once the run's end is stored: the result is published first, and a
	// request in between joins the run (origin inflight).
	eventually(t, 10*time.Second, "the run's end stored", func() bool {
		rec := e.claim(d.Key)
		return rec != nil && rec.State == v1.StateSucceeded
	})
	again := tenantRequestFor("acme", digest)
	again.BuildArgs, again.SecretBuildArgs = r.BuildArgs, r.SecretBuildArgs
	other := tenantRequestFor("acme", digest)
	other.BuildArgs, other.SecretBuildArgs = r.BuildArgs, r.SecretBuildArgs
	other.Image = tr.host + "/acme/elsewhere"
	for _, q := range []*v1.Request{again, other} {
		if _, err := e.pub.Publish(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	got := results.waitFor(t, 3, 30*time.Second)
	for _, res := range got[1:] {
		if res.Data.Origin != v1.OriginCache || res.Data.Attestation != d.Attestation {
			t.Fatalf("cache hit %s, want the build's attestation %s", mustJSON(t, res.Data), d.Attestation)
		}
	}
	if q := verifyAt(t, tr, verifier, tr.host+"/acme/elsewhere", d.Digest); q.Referrer != d.Attestation {
		t.Fatalf("the copy's attestation is %s, want %s", q.Referrer, d.Attestation)
	}
}

// A kaniko Job reports only the digest it pushed: the worker reads the
// Dockerfile from the context (checked against its digest) and resolves
// the base images, confirming the one the image starts from by its
// layers. A base tag that moved since the build is not named.
func TestKanikoBuildProvenanceNamesTheBaseByTheLayersItStartsFrom(t *testing.T) {
	t.Parallel()
	for _, moved := range []bool{false, true} {
		t.Run(fmt.Sprintf("moved=%v", moved), func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			store := newObjectStore()
			signer, verifier := testSigner(t)
			ctx := context.Background()
			base, baseDigest := pushBase(t, tr, "library/base:1")
			dockerfile := "FROM " + tr.host + "/library/base:1\nRUN make\n"
			digest, archive := packDir(t, map[string]string{"Dockerfile": dockerfile})
			r := tenantRequestFor("acme", digest)
			store.put(r.Source.S3.Key, archive)
			e.startWorker("w1", func(c *Config) {
				withRegistry(tr)(c)
				c.Contexts = store
				c.Attestor = &SigningAttestor{Signer: signer}
			})
			results := e.collect()
			if _, err := e.pub.Publish(ctx, r); err != nil {
				t.Fatal(err)
			}
			job := e.waitJob(kaniko.JobName(v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage)))
			layer, err := random.Layer(64, "application/vnd.docker.image.rootfs.diff.tar.gzip")
			if err != nil {
				t.Fatal(err)
			}
			built, err := mutate.AppendLayers(base, layer)
			if err != nil {
				t.Fatal(err)
			}
			pushed, err := tr.client.Push(ctx, built, []string{destination(job)})
			if err != nil {
				t.Fatal(err)
			}
			if moved {
				pushBase(t, tr, "library/base:1")
			}
			e.kubelet(job, 0, pushed)
			d := results.waitFor(t, 1, 30*time.Second)[0].Data
			if d.Status != v1.StatusSucceeded || d.Attestation == "" {
				t.Fatalf("result %s", mustJSON(t, d))
			}
			p := verifyAt(t, tr, verifier, strings.SplitN(d.ImageRef, "@", 2)[0], d.Digest)
			if got := p.External["dockerfile"].(map[string]any)["digest"]; got != fmt.Sprintf("sha256:%x", sha256.Sum256([]byte(dockerfile))) {
				t.Fatalf("dockerfile digest %v", got)
			}
			bases := dependency(p, "base")
			switch {
			case moved && len(bases) != 0:
				t.Fatalf("a base whose tag moved since the build is named: %+v", bases)
			case !moved && (len(bases) != 1 || bases[0].Digest != baseDigest):
				t.Fatalf("base images %+v, want %s", bases, baseDigest)
			}
			if ex := dependency(p, "executor"); len(ex) != 1 || "kaniko@"+ex[0].URI+"@"+ex[0].Digest != "kaniko@"+testKaniko.ExecutorImage {
				t.Fatalf("executor %+v, want %s", ex, testKaniko.ExecutorImage)
			}
		})
	}
}

// flakyAttestor fails its first calls, then attests through inner.
type flakyAttestor struct {
	inner Attestor
	fail  atomic.Int32
	calls atomic.Int32
}

func (f *flakyAttestor) Attest(ctx context.Context, reg Registry, ref string, b attest.Build) (string, error) {
	f.calls.Add(1)
	if f.fail.Add(-1) >= 0 {
		return "", fmt.Errorf("registry hiccup")
	}
	return f.inner.Attest(ctx, reg, ref, b)
}

func (f *flakyAttestor) Copy(ctx context.Context, reg Registry, src, dst string) error {
	return f.inner.Copy(ctx, reg, src, dst)
}

// An attestation that cannot be attached at once is tried again: the
// request is not answered without one.
func TestAnAttestationThatFailsIsRetriedNotSkipped(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	fa := &flakyAttestor{inner: &SigningAttestor{Signer: signer}}
	fa.fail.Store(attestTries + 1) // more than one run's tries
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "x"})
	r := tenantRequestFor("acme", digest)
	backend := NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0)
	e.startLocalWorker("w1", backend, func(c *Config) { withRegistry(tr)(c); c.Attestor = fa })
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	d := results.waitFor(t, 1, 60*time.Second)[0].Data
	if d.Status != v1.StatusSucceeded || d.Attestation == "" {
		t.Fatalf("result %s, want a success with its attestation", mustJSON(t, d))
	}
	if n := fa.calls.Load(); n < attestTries+2 {
		t.Fatalf("%d attempts at attesting, want more than one run's %d", n, attestTries)
	}
	verifyAt(t, tr, verifier, strings.SplitN(d.ImageRef, "@", 2)[0], d.Digest)
	if img, err := remote.Image(mustDigest(t, d.ImageRef), tr.client.RemoteOptions(context.Background())...); err != nil || img == nil {
		t.Fatalf("the image: %v", err)
	}
}

func mustDigest(t *testing.T, ref string) name.Digest {
	t.Helper()
	d, err := name.NewDigest(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Attack: another tenant answered from a build — it holds the same
// content — gets a statement of its own: about the image in its own
// repository, naming its own request, signed by the deployment. The
// builder tenant's statement (its request id, its source) is never
// copied into the other tenant's repository or named in its result.
func TestAnotherTenantsAnswerIsAttestedForItsOwnRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	ctx := context.Background()
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "shared"})
	a := tenantRequestFor("acme", digest)
	b := tenantRequestFor("globex", digest)
	results := startTwoTenantAttestor(t, e, tr, signer, tgz, a, b)
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	built := results.waitFor(t, 1, 30*time.Second)[0].Data
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	hit := results.waitFor(t, 2, 30*time.Second)[1].Data
	if hit.Status != v1.StatusSucceeded || hit.Origin != v1.OriginCache || hit.Digest != built.Digest {
		t.Fatalf("globex: %s", mustJSON(t, hit))
	}
	if hit.Attestation == "" || hit.Attestation == built.Attestation {
		t.Fatalf("globex's answer names attestation %q, the build's is %q: want one of its own", hit.Attestation, built.Attestation)
	}
	repoB := strings.SplitN(hit.ImageRef, "@", 2)[0]
	p := verifyAt(t, tr, verifier, repoB, hit.Digest)
	if p.InvocationID != b.RequestID || p.Subjects[0].Name != repoB || strings.Contains(string(p.Statement), a.RequestID) {
		t.Fatalf("globex's statement: invocation %s, subject %v (acme's request %s must not appear)", p.InvocationID, p.Subjects, a.RequestID)
	}
	ref, err := name.NewDigest(repoB+"@"+hit.Digest, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	found, err := attest.Find(ctx, ref, tr.client.RemoteOptions(ctx))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range found {
		if f.Digest == built.Attestation {
			t.Fatal("acme's statement was copied into globex's repository")
		}
	}
	pa := verifyAt(t, tr, verifier, strings.SplitN(built.ImageRef, "@", 2)[0], built.Digest)
	if pa.InvocationID != a.RequestID {
		t.Fatalf("acme's statement names %s", pa.InvocationID)
	}
}

// A run whose attestation could not be attached is released, its Job
// finished: the claimer's retry takes the run over, adopts the Job's
// outcome and attests; another worker reconciling the Job meanwhile
// does not end the run unattested.
func TestARunReleasedForItsAttestationIsAttestedOnRetry(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	signer, verifier := testSigner(t)
	fa := &flakyAttestor{inner: &SigningAttestor{Signer: signer}}
	fa.fail.Store(attestTries) // the first run's tries all fail
	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "x"})
	r := tenantRequestFor("acme", digest)
	store.put(r.Source.S3.Key, archive)
	for _, id := range []string{"w1", "w2"} {
		// Two workers: the one not running the build reconciles its
		// Job. A short lease: it looks at the released run before the
		// claimer's retry comes back (2 s later).
		e.startWorker(id, func(c *Config) {
			withRegistry(tr)(c)
			c.Contexts = store
			c.Attestor = fa
			c.Lease = time.Second
		})
	}
	results := e.collect()
	got := e.buildThrough(t, tr, results, r, 1)
	if d := got.Data; d.Status != v1.StatusSucceeded || d.Attestation == "" {
		t.Fatalf("result %s, want a success with its attestation", mustJSON(t, d))
	}
	verifyAt(t, tr, verifier, strings.SplitN(got.Data.ImageRef, "@", 2)[0], got.Data.Digest)
	if n := fa.calls.Load(); n <= attestTries {
		t.Fatalf("%d attempts at attesting, want a retry after the first run's %d", n, attestTries)
	}
}

// The reconciler ends an ownerless run with its Job's outcome; for a
// worker that attests, a run that succeeded is left to a request that
// takes it over (the record does not hold the inputs its statement
// needs): never ended unattested.
func TestAReleasedRunIsNotEndedUnattestedByTheReconciler(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	ctx := context.Background()
	signer, _ := testSigner(t)
	put := func(key string) {
		rec := v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-1", LeaseMs: 2000,
			RequestID: "r1", Seq: 1, Tenant: "acme", Name: "api", Repository: "registry.test/acme/api", StartedAt: time.Now().UTC()}
		raw, _ := json.Marshal(rec)
		if _, err := w.runs.Bucket().Put(ctx, key, raw); err != nil {
			t.Fatal(err)
		}
	}
	out := Outcome{Run: "run-1", Succeeded: true, Digest: "sha256:" + strings.Repeat("a", 64)}

	w.cfg.Attestor = &SigningAttestor{Signer: signer}
	put("attesting")
	w.builds.finishOrphan(ctx, "attesting", out)
	if got, _, err := w.runs.Get(ctx, "attesting"); err != nil || got.State != v1.StateBuilding {
		t.Fatalf("a worker that attests ended a released run unattested: %+v (%v)", got, err)
	}

	w.cfg.Attestor = nil
	put("plain")
	w.builds.finishOrphan(ctx, "plain", out)
	if got, _, err := w.runs.Get(ctx, "plain"); err != nil || got.State != v1.StateSucceeded {
		t.Fatalf("without attestations the reconciler ends the run with its Job's outcome: %+v (%v)", got, err)
	}
}

// startTwoTenantAttestor runs a local worker that attests with signer and
// holds the context tgz under the objects of requests a and b (two
// tenants'), and collects the results.
func startTwoTenantAttestor(t *testing.T, e *env, tr *testRegistry, signer *attest.Signer, tgz []byte, a, b *v1.Request) *resultCollector {
	t.Helper()
	store := newObjectStore()
	store.put(a.Source.S3.Key, tgz)
	store.put(b.Source.S3.Key, tgz)
	backend := NewLocalBackend(mapContexts{a.Source.S3.Key: tgz, b.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0)
	e.startLocalWorker("w1", backend, func(c *Config) {
		withRegistry(tr)(c)
		c.Contexts = store
		c.Attestor = &SigningAttestor{Signer: signer}
	})
	return e.collect()
}
