package worker

// Adversarial review of multi-platform requests (platforms.go, fd1f5b7):
// a hostile tenant, a worker stopped at the worst moment, a platform's Job
// failing or deleted, concurrency limits and cancels. A test whose name
// starts with TestAttack_ found a defect, since fixed (its comment says
// which, and the fix), and asserts the correct outcome; the others prove
// a rule the existing tests did not cover.

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// unfinishedJobs counts the Jobs of names (Job name → tenant) that exist
// and have not finished, by tenant.
func (e *env) unfinishedJobs(names map[string]string) map[string]int {
	out := map[string]int{}
	for name, j := range e.jobs() {
		if t, ok := names[name]; ok && len(j.Status.Conditions) == 0 {
			out[t]++
		}
	}
	return out
}

// platformJobNames maps the Job of each of r's platforms to r's tenant.
func platformJobNames(r *v1.Request, into map[string]string) map[string]string {
	if into == nil {
		into = map[string]string{}
	}
	for _, p := range r.Platforms {
		into[kaniko.JobName(platformKey(r, p))] = r.Tenant
	}
	return into
}

// finishJobs plays the node for every unfinished Job among names once,
// pushing an image to its destination.
func (e *env) finishJobs(t *testing.T, tr *testRegistry, names map[string]string, done map[string]bool) {
	t.Helper()
	for name, j := range e.jobs() {
		if _, ok := names[name]; !ok || len(j.Status.Conditions) > 0 || j.DeletionTimestamp != nil || done[string(j.UID)] {
			continue
		}
		done[string(j.UID)] = true
		e.kubelet(j, 0, tr.push(t, destination(j)))
	}
}

// waitResultPlaying waits up to timeout for id's result, playing the node
// for every Job of names meanwhile.
func (e *env) waitResultPlaying(t *testing.T, tr *testRegistry, results *resultCollector, names map[string]string, id string, timeout time.Duration) v1.Result {
	t.Helper()
	done := map[string]bool{}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if got := byID(results.snapshot())[id]; len(got) > 0 {
			return got[0]
		}
		e.finishJobs(t, tr, names, done)
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("no result for %s within %s", id, timeout)
	return v1.Result{}
}

// Found: an index run taken over by another tenant's request builds its
// platforms as b.Request narrowed (platforms.go buildPlatform): the run's
// request, runRequest — its claimer's tenant, but the taker's request id.
// So the taker's platform builds are claimed as, and indexed as waiters
// under, "<claimer's tenant>/<taker's id>", a ledger key that names no
// request: the cancel API does not see that the taker waits on them.
// Mallory, who claimed the index first and canceled her request, cancels
// by key the platform build acme's request now runs (she knows the key:
// her own request had it): the cancel finds no waiter, the run is hers by
// its record's tenant, and it is stopped — acme's Job deleted, its index
// run failed Canceled; acme's request, never canceled, recovers only
// because a taken-over run's Canceled failure is not shared, and builds
// the index again from the start. The same record, claimed as mallory's,
// is shown to her by the status API, with acme's request id.
// Fixed: a platform's build is the handler's own request (platformSub:
// its tenant, name and id, the run's inputs), pushed to its repository
// and copied into the run's for the index.
func TestAttack_ForeignTakerOfAnIndexKeepsItsPlatformBuildsAgainstTheClaimersCancel(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Contexts = store
		// One platform at a time: mallory's request builds one before
		// her cancel, acme's claims the other afresh.
		c.Fair.Concurrency = map[string]int{"acme": 1, "mallory": 1}
	})
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "both hold it"})
	m := tenantRequestFor("mallory", digest)
	m.Platforms, m.RequestID = []string{"linux/amd64", "linux/arm64"}, "m-index"
	a := tenantRequestFor("acme", digest)
	a.Platforms, a.RequestID = []string{"linux/amd64", "linux/arm64"}, "a-index"
	store.put(m.Source.S3.Key, archive)
	store.put(a.Source.S3.Key, archive)
	key := v1.BuildKey(a, kanikoID)
	if v1.BuildKey(m, kanikoID) != key {
		t.Fatal("premise: both requests have one key")
	}
	pkeys := map[string]string{}
	for _, p := range a.Platforms {
		pkeys[p] = platformKey(a, p)
	}

	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	var first, other string
	eventually(t, 30*time.Second, "mallory's first platform Job", func() bool {
		for p, k := range pkeys {
			if _, ok := e.jobs()[kaniko.JobName(k)]; ok {
				first = p
				return true
			}
		}
		return false
	})
	for p := range pkeys {
		if p != first {
			other = p
		}
	}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "acme's request parked on the index run", func() bool { return e.parkedAs(key, "acme", a.RequestID) })
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), m.RequestID); !rep.Canceled {
		t.Fatalf("mallory's cancel of her own request: %+v", rep)
	}
	if d := oneResult(t, results, m.RequestID).Data; d.Status != v1.StatusCanceled {
		t.Fatalf("mallory's request: %+v", d)
	}
	eventually(t, 30*time.Second, "acme's request took the index run over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Holder == RequestIndexKey("acme", a.RequestID)
	})
	// mallory's platform's Job ends; acme's request claims the other one.
	if j, ok := e.jobs()[kaniko.JobName(pkeys[first])]; ok {
		e.kubelet(j, 0, tr.push(t, destination(j)))
	}
	eventually(t, 30*time.Second, "acme's request building "+other, func() bool {
		r := e.claim(pkeys[other])
		_, job := e.jobs()[kaniko.JobName(pkeys[other])]
		return r != nil && r.State == v1.StateBuilding && r.RequestID == a.RequestID && job
	})
	// The build acme's request claimed is shown to mallory as hers, with
	// acme's request id in it.
	if m, err := tenantAPIRequest(e.nc, "mallory", v1.APIStatusSubject("mallory"), pkeys[other], 10*time.Second); err == nil {
		var st v1.StatusReply
		if json.Unmarshal(m.Data, &st) == nil && st.Build != nil {
			t.Errorf("mallory's status of key %s shows acme's request's build: %s", pkeys[other], mustJSON(t, st.Build))
		}
	}
	// Mallory cancels by key the platform build acme's request runs.
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), pkeys[other])
	if rep.Stopped || rep.Canceled {
		t.Errorf("mallory's cancel of key %s (%s), which only acme's request waits on: %+v; want nothing stopped", pkeys[other], other, rep)
	}
	names := platformJobNames(a, nil)
	d := e.waitResultPlaying(t, tr, results, names, a.RequestID, 60*time.Second).Data
	if d.Status != v1.StatusSucceeded || len(d.Platforms) != 2 {
		t.Fatalf("acme's request, which nobody canceled: %s", mustJSON(t, d))
	}
}

// One platform in two spellings ("linux/arm64" and "linux/arm64/v8", as
// image indexes match them) was accepted as two platforms: built twice
// under two keys, and pushed as an index with two descriptors for one
// platform. Now refused as listing a platform twice, by the SDK before it
// publishes and by the worker for a body published around the SDK.
//
// Origin: the multi-platform attack review (a hostile tenant's platform lists).
func TestOnePlatformInTwoSpellingsIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	r := multiRequest("arm64-twice", "linux/arm64", "linux/arm64/v8")
	r.RequestID = "arm64-twice"
	r.APIVersion = v1.APIVersion
	if _, err := e.pub.Publish(context.Background(), r); err == nil || !strings.Contains(err.Error(), "one platform, listed twice") {
		t.Fatalf("the SDK published it: %v", err)
	}
	body, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := publishRaw(e.js, v1.RequestSubject("acme"), map[string]string{v1.MsgIDHeader: "acme/" + r.RequestID}, body); err != nil {
		t.Fatal(err)
	}
	d := oneResult(t, results, r.RequestID).Data
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonInvalidRequest || !strings.Contains(d.Message, "one platform, listed twice") {
		t.Fatalf("result %s, want InvalidRequest naming the platform listed twice", mustJSON(t, d))
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created for a refused request", n)
	}
}

// Failure rule: one platform's Job deleted (by hand, by the cluster) while
// another builds: the index waits for the other, and fails once, naming
// the deleted platform, with the other's image listed and cached.
func TestDeletedPlatformJobFailsTheIndexOnceNamingIt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	r := multiRequest("deleted-platform", "linux/amd64", "linux/arm64")
	r.RequestID = "deleted-platform"
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	amd := e.waitJob(kaniko.JobName(platformKey(r, "linux/amd64")))
	arm := e.waitJob(kaniko.JobName(platformKey(r, "linux/arm64")))
	if err := e.kube.BatchV1().Jobs(testNamespace).Delete(ctx, arm.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if got := byID(results.snapshot())[r.RequestID]; len(got) != 0 {
		t.Fatalf("a result before linux/amd64 finished: %s", mustJSON(t, got))
	}
	amdDigest := tr.push(t, destination(amd))
	e.kubelet(amd, 0, amdDigest)
	d := oneResult(t, results, r.RequestID).Data
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonJobDeleted || !strings.HasPrefix(d.Message, "platform linux/arm64") ||
		len(d.Platforms) != 1 || d.Platforms["linux/amd64"] != amdDigest {
		t.Fatalf("result %s, want JobDeleted naming linux/arm64 with linux/amd64's image listed", mustJSON(t, d))
	}
}

// Possession rule for indexes: mallory, who knows the digest but holds no
// such object, asks for acme's index (built and in flight) and for one of
// its platforms alone: each is refused ContextMissing, nothing is copied
// into her repository, acme's index is not disturbed.
func TestIndexAndItsPlatformsNeedPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()
	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's only"})
	a := tenantRequestFor("acme", digest)
	a.Platforms, a.RequestID = []string{"linux/amd64", "linux/arm64"}, "acme-index"
	store.put(a.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	amd := e.waitJob(kaniko.JobName(platformKey(a, "linux/amd64")))
	arm := e.waitJob(kaniko.JobName(platformKey(a, "linux/arm64")))
	// While acme's platforms build: her index, and one platform of it.
	mi := tenantRequestFor("mallory", digest)
	mi.Platforms, mi.RequestID = []string{"linux/amd64", "linux/arm64"}, "m-index-inflight"
	mp := tenantRequestFor("mallory", digest)
	mp.Platforms, mp.RequestID = []string{"linux/arm64"}, "m-platform-inflight"
	for _, r := range []*v1.Request{mi, mp} {
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if d := oneResult(t, results, r.RequestID).Data; d.Reason != v1.ReasonContextMissing || d.Digest != "" || len(d.Platforms) != 0 {
			t.Fatalf("mallory's %s: %s, want ContextMissing and nothing of acme's build", r.RequestID, mustJSON(t, d))
		}
	}
	// Her cancels by the keys she knows stop nothing of acme's.
	for _, k := range []string{v1.BuildKey(a, kanikoID), platformKey(a, "linux/amd64"), platformKey(a, "linux/arm64")} {
		if rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), k); rep.Canceled || rep.Stopped {
			t.Fatalf("mallory's cancel of %s: %+v", k, rep)
		}
	}
	for _, j := range []*batchv1.Job{amd, arm} {
		e.kubelet(j, 0, tr.push(t, destination(j)))
	}
	if d := oneResult(t, results, a.RequestID).Data; d.Status != v1.StatusSucceeded || len(d.Platforms) != 2 {
		t.Fatalf("acme's index: %s", mustJSON(t, d))
	}
	// Built: the same, from the cache.
	for _, r := range []*v1.Request{mi, mp} {
		r.RequestID = strings.Replace(r.RequestID, "inflight", "built", 1)
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if d := oneResult(t, results, r.RequestID).Data; d.Reason != v1.ReasonContextMissing || d.Digest != "" || len(d.Platforms) != 0 {
			t.Fatalf("mallory's %s: %s, want ContextMissing and nothing of acme's build", r.RequestID, mustJSON(t, d))
		}
	}
	if tags := repoTags(t, tr, "mallory"); len(tags) > 0 {
		t.Fatalf("copied into mallory's repository: %v", tags)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want acme's 2", n)
	}
}

// Worker killed after its index's platforms were built and while its
// index push fails (the registry down): the redelivered request, on
// another worker, pushes the index from the platforms' images without
// building any again, and gets one result.
func TestIndexKilledBeforeItsPushIsPushedLaterWithoutRebuilding(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	r := multiRequest("killed-before-push", "linux/amd64", "linux/arm64")
	r.RequestID = "killed-before-push"
	built := map[string]string{}
	jobs := map[string]*batchv1.Job{}
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	for _, p := range r.Platforms {
		jobs[p] = e.waitJob(kaniko.JobName(platformKey(r, p)))
		built[p] = tr.push(t, destination(jobs[p]))
	}
	tr.fail.Store(true) // from here the index cannot be pushed
	for _, p := range r.Platforms {
		e.kubelet(jobs[p], 0, built[p])
	}
	eventually(t, 30*time.Second, "both platforms built", func() bool {
		for _, p := range r.Platforms {
			if rec := e.claim(platformKey(r, p)); rec == nil || rec.State != v1.StateSucceeded {
				return false
			}
		}
		return true
	})
	time.Sleep(300 * time.Millisecond) // the index push fails meanwhile
	killWorker(w1)
	e.startWorker("w2", withRegistry(tr))
	tr.fail.Store(false)
	var got []v1.Result
	eventually(t, 60*time.Second, "the index's result", func() bool {
		got = byID(results.snapshot())[r.RequestID]
		return len(got) > 0
	})
	d := got[0].Data
	if len(got) != 1 || d.Status != v1.StatusSucceeded || d.Platforms["linux/amd64"] != built["linux/amd64"] || d.Platforms["linux/arm64"] != built["linux/arm64"] {
		t.Fatalf("results %s, want one success with the images built", mustJSON(t, got))
	}
	idx, err := tr.client.IndexPlatforms(ctx, d.Image)
	if err != nil || len(idx) != 2 {
		t.Fatalf("the index at %s: %v %v", d.Image, idx, err)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
}

// Two requests of one index key on two workers at once: one runs the
// index, the other waits on it (parked); the platforms are built once and
// both get the same index.
func TestOneIndexKeyOnTwoWorkersIsBuiltOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	a := multiRequest("one-key-two-workers", "linux/amd64", "linux/arm64")
	a.RequestID = "first"
	b := multiRequest("one-key-two-workers", "linux/arm64", "linux/amd64")
	b.RequestID, b.Tags = "second", []string{"other-tag"}
	for _, r := range []*v1.Request{a, b} {
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	names := platformJobNames(a, nil)
	da := e.waitResultPlaying(t, tr, results, names, a.RequestID, 60*time.Second).Data
	db := e.waitResultPlaying(t, tr, results, names, b.RequestID, 60*time.Second).Data
	if da.Status != v1.StatusSucceeded || db.Status != v1.StatusSucceeded || da.Digest != db.Digest || len(db.Platforms) != 2 {
		t.Fatalf("results %s and %s, want one index for both", mustJSON(t, da), mustJSON(t, db))
	}
	if idx, err := tr.client.IndexPlatforms(ctx, tr.host+"/acme/web:other-tag"); err != nil || len(idx) != 2 {
		t.Fatalf("the second request's tag: %v %v", idx, err)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
}
