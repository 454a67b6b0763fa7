package worker

// Tenancy across components: one tenant's request never reads, writes,
// names or learns of another tenant's contexts, repositories, projects,
// request ids or builds (docs/design.md §2b). A review's test tells the
// attack as it worked before its fix; it asserts the fixed outcome.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

// A request may name only its own tenant's context objects.
//
// Origin: issue 10, second round of tenant attacks (1630b78).
func TestRequestCannotNameAnotherTenantsContext(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	m := mallorys("other-context")
	m.Source.S3.Key = "contexts/acme/sha256/" + hex64("acme's") + ".tar.gz"
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(r.Data.Message, "contexts/mallory/") {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
}

// With ContextBucket set, a context in any other bucket is refused before
// anything is created (the worker's keys may reach other buckets).
//
// Origin: tests for --context-bucket and the context prefix (b72e2fe).
func TestRequestCannotNameAnotherBucket(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.ContextBucket = "buildq" })
	results := e.collect()
	r := request("other-bucket")
	r.Source.S3.Bucket = "another-teams-bucket"
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if got.Data.Status != v1.StatusFailed || got.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(got.Data.Message, `contexts must be in bucket "buildq"`) {
		t.Fatalf("result %s", mustJSON(t, got))
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
}

// Attack: the local executor reads any object the worker's S3 credentials
// reach — the request's bucket and key are not confined to the tenant's
// prefix (contexts/<tenant>/) — and a digest mismatch quotes the digest the
// object actually holds. Mallory names an object of acme's (any name she
// can guess, e.g. one not named by its digest) with a wrong digest and
// reads the real one from her result's message; resubmitted with that
// digest, acme's context is built into mallory's repository (and the key
// tells her which of acme's builds she may now pull from the shared
// index). Breaks invariant 8 (her answer must hold nothing of acme's) and
// docs/design.md §2b (contexts per tenant).
//
// Origin: issue 10, second round of the hostile-tenant review; failed on f94e5fe, fixed by 1630b78.
func TestContextMismatchNeverQuotesAnotherTenantsDigest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's private app"})
	const acmeObject = "contexts/acme/release/latest.tar.gz"
	contexts := mapContexts{acmeObject: tgz}
	e.startLocalWorker("w1", NewLocalBackend(contexts, tr.client, t.TempDir(), 0), withRegistry(tr))
	results := e.collect()

	m := mallorys("probe")
	m.BuildArgs, m.Labels = nil, nil
	m.ContextDigest = "sha256:" + strings.Repeat("0", 64)
	m.Source = v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: acmeObject}}
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if strings.Contains(r.Data.Message+r.Data.LogTail, strings.TrimPrefix(digest, "sha256:")) {
		t.Errorf("mallory's result quotes the digest of acme's object %s: %s", acmeObject, r.Data.Message)
	}
	if r.Data.Status == v1.StatusFailed && r.Data.Reason == v1.ReasonInvalidRequest {
		return // refused before reading: fixed
	}
	// With the digest she read, mallory builds acme's context.
	m2 := mallorys("probe-2")
	m2.BuildArgs, m2.Labels = nil, nil
	m2.ContextDigest, m2.Source = digest, m.Source
	if _, err := e.pub.Publish(context.Background(), m2); err != nil {
		t.Fatal(err)
	}
	r2 := byID(results.waitFor(t, 2, 10*time.Second))[m2.RequestID]
	if len(r2) == 1 && r2[0].Data.Status == v1.StatusSucceeded {
		t.Errorf("mallory built acme's object %s into %s", acmeObject, r2[0].Data.ImageRef)
	}
}

// Mallory names acme's repository as her destination: refused before
// anything is created — no Job, no copy of a cached image, no tag moved.
//
// Origin: issue 10, tenants apart (fa71058).
func TestTenantCannotPushIntoAnotherTenantsRepository(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	// acme builds key K into its own repository.
	victim := e.buildThrough(t, tr, results, request("victim-web"), 1)
	if victim.Data.Status != v1.StatusSucceeded {
		t.Fatalf("victim %s", mustJSON(t, victim))
	}
	for _, seed := range []string{"mallory-new-key", "victim-web"} { // a new key, and K (cached)
		r := mallorys(seed)
		r.Image = tr.host + "/acme/web"
		r.Tags = []string{"latest"}
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	got := results.waitFor(t, 3, 10*time.Second)[1:]
	for _, r := range got {
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest ||
			!strings.Contains(r.Data.Message, tr.host+"/mallory/**") {
			t.Errorf("mallory's push into acme/web: %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Errorf("%d jobs created, want only acme's", n)
	}
	ref, _ := name.ParseReference(tr.host+"/acme/web:latest", name.Insecure)
	if _, err := remote.Head(ref); err == nil {
		t.Error("acme/web:latest exists: mallory's request moved a tag in acme's repository")
	}
}

// harborSpy is a Registry that records the Harbor projects it is asked to
// create and finds no image.
type harborSpy struct {
	mu       sync.Mutex
	projects []string
}

func (h *harborSpy) Head(context.Context, string) (string, error) { return "", registry.ErrNotFound }

func (h *harborSpy) Copy(context.Context, string, string) (string, error) {
	return "", errors.New("not used")
}

func (h *harborSpy) EnsureHarborProject(_ context.Context, _, project string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.projects = append(h.projects, project)
	return nil
}

func (h *harborSpy) PushIndex(context.Context, []registry.IndexChild, []string) (string, error) {
	return "", registry.ErrNotFound
}

// With Harbor, a request creates only its own tenant's project.
//
// Origin: issue 10, tenants apart (fa71058).
func TestHarborProjectIsOnlyTheTenantsOwn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	spy := &harborSpy{}
	e.startWorker("w1", func(c *Config) {
		c.Registry = spy
		c.Naming.Harbor = true
		c.Naming.Allowed = []string{"{registry}/**"} // an operator who lets anyone push anywhere
	})
	results := e.collect()
	m := mallorys("harbor")
	m.Image = "registry.test:5000/victim-project/web"
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	own := mallorys("harbor-own")
	if _, err := e.pub.Publish(context.Background(), own); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "two jobs", func() bool { return e.creates.total() == 2 })
	spy.mu.Lock()
	defer spy.mu.Unlock()
	if len(spy.projects) != 1 || spy.projects[0] != "mallory" {
		t.Fatalf("harbor projects created: %v, want only [mallory]", spy.projects)
	}
	_ = results
}

// Attack: mallory submits the same content as acme's build in flight (the
// key is predictable: public sources, or a digest she knows) and listens on
// her own event subject. The "waiting" event she gets names the request
// that claimed the build: acme's request id. Breaks invariant 8 ("its id
// ... are its tenant's alone"); ids are what JetStream dedupes on, so a
// leaked id also feeds TestForgedMsgIDHeaderNeverDropsAnotherTenantsRequest
// for acme's resubmissions.
//
// Origin: issue 10, second round of the hostile-tenant review; failed on f94e5fe, fixed by 1630b78.
func TestJoinEventNeverNamesTheClaimersRequestID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	events := e.events()
	results := e.collect()

	a := request("leak-id")
	a.RequestID = "acme-secret-request-id"
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	m := mallorys("leak-id")
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "mallory's request to join", func() bool { return events.has(m.RequestID, v1.PhaseWaiting) })
	e.kubelet(job, 0, digestOf("leak-id"))
	results.waitFor(t, 2, 10*time.Second)
	for _, raw := range events.all() {
		if strings.HasPrefix(string(raw), v1.EventsPrefix+".mallory.") && strings.Contains(string(raw), a.RequestID) {
			t.Errorf("mallory's event subject carried acme's request id: %s", raw)
		}
	}
}

// Keys that name a tenant (KeyIdentity) never equal another tenant's, nor
// a key without a tenant, for the same inputs: per-tenant scoping cannot
// make one tenant's request share, or answer, another's build.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestTenantScopedKeysNeverMeet(t *testing.T) {
	t.Parallel()
	seen := map[string]string{}
	for _, tenant := range []string{"acme", "mallory", "acme-mallory", "a"} {
		r := tenantRequestFor(tenant, digestOf("same"))
		for _, pt := range []bool{false, true} {
			id := KeyIdentity(kanikoID, r, pt)
			k := v1.BuildKey(r, id)
			what := fmt.Sprintf("%s perTenantCache=%v", tenant, pt)
			if scoped := strings.Contains(id, "+tenant="); scoped != pt {
				t.Errorf("%s: identity %q", what, id)
			}
			if prev, ok := seen[k]; ok && pt && !strings.HasPrefix(prev, tenant+" ") {
				t.Errorf("%s and %s share key %s", prev, what, k)
			}
			if _, ok := seen[k]; !ok {
				seen[k] = what
			}
		}
	}
}

// Attack (existence oracle): mallory holds nothing and asks for a key
// whose digest she guessed (a build arg, a commit, a release of acme's).
// When another tenant built it, she is refused at once, and the refusal
// says so ("this build key was built from another tenant's request",
// possession.go:150); when nobody did, her request claims the key, a Job
// is created and she sees "claimed" and "job-created" events and a
// failure of her build. Either way she learns whether acme built those
// exact inputs — an answer from a build of content she does not hold.
// Possession is checked only when the record is another tenant's
// (foreignRun), so whether it is checked at all depends on acme's build.
// Breaks invariant 8: the existence of another tenant's build is an
// answer from it.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); failed there, fixed by 26b1795.
func TestPossessionRefusalRevealsNoForeignBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	events := e.events()
	ctx := context.Background()

	built, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY v /v\n", "v": "release 7"})
	never, _ := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY v /v\n", "v": "release 8"})
	a := tenantRequestFor("acme", built)
	store.put(a.Source.S3.Key, archive)
	if r := e.buildThrough(t, tr, results, a, 1); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's build: %s", mustJSON(t, r))
	}

	// The same question twice: "release 7" (acme built it), "release 8"
	// (nobody did). Mallory holds neither.
	guess := func(digest string) v1.Result {
		m := tenantRequestFor("mallory", digest)
		if _, err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		var res v1.Result
		eventually(t, 15*time.Second, "mallory's answer", func() bool {
			if got := byID(results.snapshot())[m.RequestID]; len(got) > 0 {
				res = got[0]
				return true
			}
			// Her request may have claimed the key: its build fails on
			// her missing object, as in a real build Pod.
			l, err := e.kube.BatchV1().Jobs(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: kaniko.LabelTenant + "=mallory"})
			if err == nil {
				for i := range l.Items {
					if j := &l.Items[i]; j.Status.Failed == 0 && j.Status.Succeeded == 0 {
						e.fetchFails(j, kaniko.FetchExitRefused, "context object missing")
					}
				}
			}
			return false
		})
		return res
	}
	fingerprint := func(r v1.Result, digest string) string {
		var phases []string
		events.mu.Lock()
		for _, ev := range events.events {
			if ev.RequestID == r.ID {
				phases = append(phases, string(ev.Phase))
			}
		}
		events.mu.Unlock()
		msg := strings.ReplaceAll(r.Data.Message, strings.TrimPrefix(digest, "sha256:"), "<digest>")
		return strings.Join([]string{string(r.Data.Status), r.Data.Reason, msg, strings.Join(phases, ","),
			map[bool]string{true: "job", false: "no job"}[r.Data.Job != ""]}, " | ")
	}
	r7, r8 := guess(built), guess(never)
	time.Sleep(100 * time.Millisecond) // the last events
	f7, f8 := fingerprint(r7, built), fingerprint(r8, never)
	if f7 != f8 {
		t.Errorf("mallory, holding neither context, tells a key acme built from one nobody built:\n  acme built it: %s\n  nobody did:    %s", f7, f8)
	}
}
