package worker

// Builder (possession.go): possession across tenants. A request is
// answered from a build another tenant's request claimed — a cache hit,
// a join, a take-over — only when its own context object holds the bytes
// its contextDigest names (docs/design.md §2b). A review's test tells the
// attack as it worked before its fix; it asserts the fixed outcome.

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
)

// TestForeignBuildNeedsPossession: a tenant is answered from a build
// another tenant's request claimed — a cache hit or a join — only when its
// own context object holds the bytes its contextDigest names; the proof is
// read once and recorded. Issue 23: knowing a digest (results, logs and
// provenance carry them) was enough to have another tenant's image copied
// into one's own repository.
//
// Origin: issue 23, possession before a cross-tenant answer (98418f0).
func TestForeignBuildNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	withStore := func(c *Config) { withRegistry(tr)(c); c.Contexts = store }
	w1 := e.startWorker("w1", withStore)
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's"})
	_, other := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "mallory's"})
	store.put(s3store.TenantContextKey("acme", digest), archive)

	acme := tenantRequestFor("acme", digest)
	built := e.buildThrough(t, tr, results, acme, 1)
	if built.Data.Status != v1.StatusSucceeded || built.Data.Origin != v1.OriginBuild {
		t.Fatalf("acme's build: %s", mustJSON(t, built))
	}
	if n := store.reads(acme.Source.S3.Key); n != 1 {
		t.Fatalf("the worker read the claimer's own context %d times, want 1 (every request's tenant shows it holds the content, once)", n)
	}

	refused := func(t *testing.T, r *v1.Request, n int, reason string) {
		t.Helper()
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		got := byID(results.waitFor(t, n, 10*time.Second))[r.RequestID]
		if len(got) != 1 || got[0].Data.Status != v1.StatusFailed || got[0].Data.Reason != reason ||
			got[0].Data.Digest != "" || got[0].Data.Image != "" || got[0].Data.LogTail != "" {
			t.Fatalf("%s's request: %s, want one %s result with nothing of acme's build", r.Tenant, mustJSON(t, got), reason)
		}
		repo, err := name.NewRepository(tr.host+"/"+r.Tenant+"/web", name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if tags, err := remote.List(repo); err == nil && len(tags) > 0 {
			t.Fatalf("acme's image was copied into %s: %v", repo, tags)
		}
	}

	// Mallory knows the digest and holds no such object.
	t.Run("no object", func(t *testing.T) {
		refused(t, tenantRequestFor("mallory", digest), 2, v1.ReasonContextMissing)
	})
	// Mallory puts other bytes under the digest's name.
	t.Run("other bytes", func(t *testing.T) {
		m := tenantRequestFor("mallory", digest)
		store.put(m.Source.S3.Key, other)
		refused(t, m, 3, v1.ReasonContextMismatch)
	})

	// Globex holds the same bytes: answered from the index, its own copy.
	g := tenantRequestFor("globex", digest)
	store.put(g.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	gr := byID(results.waitFor(t, 4, 10*time.Second))[g.RequestID]
	if len(gr) != 1 || gr[0].Data.Status != v1.StatusSucceeded || gr[0].Data.Origin != v1.OriginCache ||
		gr[0].Data.Digest != built.Data.Digest || !strings.HasPrefix(gr[0].Data.Image, tr.host+"/globex/") {
		t.Fatalf("globex's request: %s", mustJSON(t, gr))
	}
	if n := store.reads(g.Source.S3.Key); n != 1 {
		t.Fatalf("globex's object read %d times, want 1", n)
	}
	// Shown once: neither this worker nor another one reads it again.
	w1.stop(t)
	e.startWorker("w2", withStore)
	g2 := tenantRequestFor("globex", digest)
	if _, err := e.pub.Publish(ctx, g2); err != nil {
		t.Fatal(err)
	}
	if r := byID(results.waitFor(t, 5, 10*time.Second))[g2.RequestID]; len(r) != 1 || r[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("globex's second request: %s", mustJSON(t, r))
	}
	if n := store.reads(g.Source.S3.Key); n != 1 {
		t.Fatalf("globex's object read %d times after its proof was recorded, want 1", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Fatalf("%d Jobs created, want 1", c)
	}
}

// A request that would join another tenant's build in flight is refused
// at once without the content: it does not park on the run, and gets
// neither the image nor the failure and log tail of the build.
//
// Origin: issue 23, possession before a cross-tenant answer (98418f0).
func TestJoiningAForeignBuildNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "in flight"})
	acme := tenantRequestFor("acme", digest)
	store.put(acme.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, acme); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(acme, kanikoID)))

	m := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	mr := results.waitFor(t, 1, 10*time.Second)[0]
	if mr.ID != m.RequestID || mr.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory's join: %s", mustJSON(t, mr))
	}
	e.kubelet(job, 1, "kaniko: acme's secret build output")
	ar := byID(results.waitFor(t, 2, 10*time.Second))
	if len(ar[acme.RequestID]) != 1 || len(ar[m.RequestID]) != 1 {
		t.Fatalf("results %s", mustJSON(t, ar))
	}
}

// A record with no tenant (written before records named their claimer's
// tenant, or by any other path) counts as another tenant's: mallory,
// holding nothing, is refused and gets nothing of it.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); refused there, kept as a regression test.
func TestTenantlessRecordNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, _ := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY x /x\n", "x": "old"})
	m := tenantRequestFor("mallory", digest)
	key := v1.BuildKey(m, kanikoID)
	img := tr.host + "/acme/web:" + v1.DefaultTag(key)
	d := tr.push(t, img)
	rec := v1.BuildRecord{Key: key, State: v1.StateSucceeded, Run: "old-run", Repository: tr.host + "/acme/web", Image: img,
		Pushed: []string{img}, Destinations: []string{img}, Digest: d, StartedAt: time.Now().UTC(), FinishedAt: time.Now().UTC()}
	b, _ := json.Marshal(rec)
	kv, err := e.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, key, b); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	r := oneResult(t, results, m.RequestID)
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMissing || r.Data.Digest != "" {
		t.Fatalf("mallory on a tenantless record: %s", mustJSON(t, r))
	}
	if tags := repoTags(t, tr, "mallory"); len(tags) > 0 {
		t.Fatalf("copied into mallory's repository: %v", tags)
	}
}

// A git request is answered from another tenant's build of the same tree
// only when its own tenant could fetch that tree: the worker packs it,
// with the tenant's own credentials, into the tenant's own context object,
// and that object is what shows possession. A tenant the repository
// refuses gets GitAuthFailed and nothing of the other tenant's build.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); reworked for issue
// 26, where git sources are packed by the worker and keyed by content.
func TestGitRequestIsAnsweredFromAForeignBuildOnlyWithItsOwnFetch(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	const private = "https://git.example.com/acme/private.git"
	git.push(private, "main", strings.Repeat("ab", 20), webTree)
	git.deny("mallory", private)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts, c.GitSources = store, git })
	results := e.collect()
	ctx := context.Background()

	a := gitRequest("acme", private, "main")
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	digest, _ := packDir(t, webTree)
	ajob := e.waitJob(kaniko.JobName(resolvedKey(a, &v1.SourceInfo{ContextDigest: digest}, "acme")))
	e.kubelet(ajob, 0, tr.push(t, destination(ajob)))
	ar := oneResult(t, results, a.RequestID)

	m := gitRequest("mallory", private, "main")
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	if r := oneResult(t, results, m.RequestID); r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonGitAuthFailed || r.Data.Digest != "" {
		t.Fatalf("mallory's git request: %s (acme's: %s)", mustJSON(t, r), mustJSON(t, ar))
	}
	if tags := repoTags(t, tr, "mallory"); len(tags) > 0 {
		t.Fatalf("copied into mallory's repository: %v", tags)
	}
	if n := store.reads(s3store.TenantContextKey("mallory", digest)); n != 0 {
		t.Fatalf("mallory's context was read %d times: she fetched nothing", n)
	}

	// globex may read the repository: its own fetch is packed into its
	// own object, which shows it holds the bytes, and it is answered
	// from acme's image.
	g := gitRequest("globex", private, "main")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	r := oneResult(t, results, g.RequestID)
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != ar.Data.Digest {
		t.Fatalf("globex's git request: %s, want acme's image from the cache", mustJSON(t, r))
	}
	if n := store.reads(s3store.TenantContextKey("globex", digest)); n != 1 {
		t.Fatalf("globex's own context read %d times, want once (its possession proof)", n)
	}
}

// A run let go by its owner (Owner empty: a worker stopped) is taken over
// by the next request for the key — never by one whose tenant does not
// hold the content.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); refused there, kept as a regression test.
func TestReleasedForeignRunIsNotTakenOverWithoutPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY x /x\n", "x": "released"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	key := v1.BuildKey(a, kanikoID)
	// acme's run, let go by its owner (as at shutdown).
	rec := v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "acme-run", Tenant: "acme", Name: "web", RequestID: "acme-req",
		Seq: 1, Holder: RequestIndexKey("acme", "acme-req"), LeaseMs: 2000, Repository: "registry.test:5000/acme/web",
		Destinations: []string{"registry.test:5000/acme/web:" + v1.DefaultTag(key)}, Source: &a.Source, StartedAt: time.Now().UTC()}
	b, _ := json.Marshal(rec)
	kv, err := e.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, key, b); err != nil {
		t.Fatal(err)
	}
	m := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	if r := oneResult(t, results, m.RequestID); r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory on acme's released run: %s", mustJSON(t, r))
	}
	if cur := e.claim(key); cur == nil || cur.Owner != "" || cur.Holder != rec.Holder {
		t.Fatalf("the run was taken over: %+v", cur)
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created", n)
	}
}

// Attack (possession bypass, park): mallory holds nothing of acme's
// content, but knows its digest. She claims the key herself (run r1 —
// her context object is missing, so r1 will fail) and sends a second
// request M2 for the key. M2's handler reads the record (mallory's own
// run: no possession check, tenants are checked only against foreign
// runs), then parks: it writes its waiter entry and reads the record
// again, and parks if the record is "building with an owner" — it never
// compares the run it read again with the run it checked (park.go:129).
// If, between the two reads, r1 fails and acme's request claims the
// key (run r2, acme's content), M2 parks on acme's run; when r2 succeeds,
// settleWaiter (park.go:269-300) answers every parked waiter from the
// record as it is, whatever run it parked on, without a possession check: mallory gets
// acme's digest and acme's image copied into her repository. The window
// is a few KV round trips; mallory may try as often as she likes (each
// try is one more request of hers). Here M2's handler is paused for that
// window (invariant 10: any interleaving). Breaks invariant 8 ("its
// answer can come only from a build of content the tenant itself holds").
//
// Origin: hostile-tenant review of 98418f0 (issue 23); failed there, fixed by 26b1795.
func TestParkingOnAnotherRunNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	pause := newStackPause(t, ".(*parking).park")
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store; c.Now = pause.now })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's unreleased app"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive) // acme holds the content; mallory holds nothing
	key := v1.BuildKey(a, kanikoID)

	// Mallory claims the key: run r1, hers.
	m1 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m1); err != nil {
		t.Fatal(err)
	}
	j1 := e.claimOrAnswer(results, key, m1.RequestID)
	if j1 == nil {
		return // refused before any claim: nothing to park on
	}
	r1 := e.claim(key)
	if r1 == nil || r1.Tenant != "mallory" {
		t.Fatalf("record %+v, want mallory's run", r1)
	}

	// M2 reads mallory's own run and is about to park on it.
	pause.armed.Store(true)
	m2 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m2); err != nil {
		t.Fatal(err)
	}
	pause.waitEntered(t)

	// r1 fails (mallory's object is missing); acme's request claims run r2.
	e.fetchFails(j1, kaniko.FetchExitRefused, "context object missing")
	if r := oneResult(t, results, m1.RequestID); r.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory's first request: %s", mustJSON(t, r))
	}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	var r2 *v1.BuildRecord
	eventually(t, 10*time.Second, "acme's run", func() bool {
		r2 = e.claim(key)
		return r2 != nil && r2.State == v1.StateBuilding && r2.Tenant == "acme" && r2.Run != r1.Run
	})
	j2 := e.runJob(key, r2.Run)

	// M2 goes on: it parks (or, fixed, does not).
	pause.open()
	eventually(t, 10*time.Second, "mallory's second request parked or answered", func() bool {
		return e.parkedAs(key, "mallory", m2.RequestID) || len(byID(results.snapshot())[m2.RequestID]) > 0
	})

	// acme's run succeeds.
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	ar := oneResult(t, results, a.RequestID)
	if ar.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's request: %s", mustJSON(t, ar))
	}
	mr := oneResult(t, results, m2.RequestID)
	if mr.Data.Status == v1.StatusSucceeded || mr.Data.Digest != "" || mr.Data.Image != "" || mr.Data.LogTail != "" {
		t.Errorf("mallory, who holds nothing of acme's content, was answered from acme's run: %s (acme's digest %s)",
			mustJSON(t, mr.Data), ar.Data.Digest)
	}
	if tags := repoTags(t, tr, "mallory"); len(tags) > 0 {
		t.Errorf("acme's image was copied into mallory's repository: tags %v", tags)
	}
}
