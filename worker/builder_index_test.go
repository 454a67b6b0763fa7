package worker

// Builder (build.go, index.go): the build index. A key built before is
// answered from the index — copied, not rebuilt — once the registry shows
// the indexed image is still there; concurrent checks of one image share
// one HEAD; and the index shares only what every input of the key made
// (docs/design.md §2 step 4, §2b).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

// Origin: dedupe end to end (d7f9faf).
func TestKnownKeyIsAnsweredFromTheIndex(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	first := e.buildThrough(t, tr, results, request("cached"), 1)
	if first.Data.Origin != v1.OriginBuild {
		t.Fatalf("first %s", mustJSON(t, first))
	}
	// Same content, same repository: no Job, origin cache.
	if _, err := e.pub.Publish(context.Background(), request("cached")); err != nil {
		t.Fatal(err)
	}
	second := results.waitFor(t, 2, 10*time.Second)[1]
	if second.Data.Origin != v1.OriginCache || second.Data.Digest != first.Data.Digest || second.Data.Status != v1.StatusSucceeded {
		t.Fatalf("second %s", mustJSON(t, second))
	}
	// Same content, another repository and an extra tag: copied, not rebuilt.
	other := request("cached")
	other.Image = tr.host + "/acme/elsewhere/app"
	other.Tags = []string{"stable"}
	if _, err := e.pub.Publish(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	third := results.waitFor(t, 3, 10*time.Second)[2]
	if third.Data.Origin != v1.OriginCache || third.Data.Digest != first.Data.Digest || third.Data.ImageRef != other.Image+"@"+first.Data.Digest {
		t.Fatalf("third %s", mustJSON(t, third))
	}
	for _, ref := range []string{third.Data.Image, other.Image + ":stable"} {
		r, err := name.ParseReference(ref, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		desc, err := remote.Head(r)
		if err != nil || desc.Digest.String() != first.Data.Digest {
			t.Errorf("%s: %v %v, want %s", ref, desc, err, first.Data.Digest)
		}
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

// Origin: dedupe end to end (d7f9faf).
func TestDeletedImageIsRebuilt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", patientLookups(withRegistry(tr)))
	results := e.collect()

	first := e.buildThrough(t, tr, results, request("deleted"), 1)
	// The index still says built; the registry says gone: build again.
	e.deleteBuilt(t, first)
	second := e.buildThrough(t, tr, results, request("deleted"), 2)
	if second.Data.Origin != v1.OriginBuild || second.Data.Status != v1.StatusSucceeded {
		t.Fatalf("second %s", mustJSON(t, second))
	}
	if c := e.creates.total(); c != 2 {
		t.Errorf("%d jobs created, want 2", c)
	}
}

// deleteBuilt deletes the image of a build's result as a registry GC
// would (its tag and its manifest), once the build's Job is cleaned up.
func (e *env) deleteBuilt(t *testing.T, built v1.Result) {
	t.Helper()
	for _, ref := range []string{built.Data.Image, built.Data.ImageRef} {
		r, err := name.ParseReference(ref, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Delete(r); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 5*time.Second, "the build's Job cleaned up", func() bool {
		_, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), built.Data.Job, metav1.GetOptions{})
		return err != nil
	})
}

// Labels change the image, so they are part of the build key.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestRequestsDifferingOnlyInLabelsBuildTwice(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	a, b := request("labels"), request("labels")
	b.Labels = map[string]string{"team": "other"}
	for _, r := range []*v1.Request{a, b} {
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "two jobs", func() bool { return e.creates.total() == 2 })
}

// gateRegistry is a Registry whose first Head blocks until released (a
// slow registry during the preflight); every Head answers from exists.
type gateRegistry struct {
	gate    bool
	entered chan struct{}
	release chan struct{}
	heads   atomic.Int32
	exists  map[string]string // ref → digest
}

func (g *gateRegistry) Head(ctx context.Context, ref string) (string, error) {
	if g.heads.Add(1) == 1 && g.gate {
		close(g.entered)
		select {
		case <-g.release:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	if d, ok := g.exists[ref]; ok {
		return d, nil
	}
	return "", fmt.Errorf("head %s: %w", ref, registry.ErrNotFound)
}

func (g *gateRegistry) Copy(context.Context, string, string) (string, error) {
	return "", errors.New("copy: not used in these tests")
}

func (g *gateRegistry) EnsureHarborProject(context.Context, string, string) error { return nil }
func (g *gateRegistry) PushIndex(context.Context, []registry.IndexChild, []string) (string, error) {
	return "", errors.New("gateRegistry: no index pushes here")
}

func newGateRegistry(gate bool) *gateRegistry {
	return &gateRegistry{gate: gate, entered: make(chan struct{}), release: make(chan struct{}), exists: map[string]string{}}
}

// TestCheckIndexedSharesOneHead: concurrent checks of one indexed image
// wait for a single HEAD and all get its answer; a check that gives up
// returns its own cause without failing the others, even when it started
// the HEAD; and nothing is remembered once the HEAD returns.
//
// Origin: concurrent cache hits of one image share one registry HEAD (b6cbbcf).
func TestCheckIndexedSharesOneHead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ref = "registry.test/acme/app@sha256:0123"
		reg := newGateRegistry(true)
		reg.exists[ref] = "sha256:0123"
		w := &builder{Worker: &Worker{registry: reg}}

		// The first check starts the HEAD, which the registry holds; its
		// caller then gives up.
		errGaveUp := errors.New("caller gave up")
		first, cancelFirst := context.WithCancelCause(context.Background())
		firstErr := make(chan error, 1)
		go func() { firstErr <- w.checkIndexed(first, ref) }()
		<-reg.entered

		const joiners = 8
		errs := make([]error, joiners)
		var wg sync.WaitGroup
		for i := range joiners {
			wg.Go(func() { errs[i] = w.checkIndexed(context.Background(), ref) })
		}
		synctest.Wait() // every joiner waits on the HEAD in flight
		cancelFirst(errGaveUp)
		if err := <-firstErr; !errors.Is(err, errGaveUp) {
			t.Fatalf("the check whose caller gave up returned %v, want its cause", err)
		}
		close(reg.release)
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("joiner %d: %v, want the shared HEAD's answer (present)", i, err)
			}
		}
		if n := reg.heads.Load(); n != 1 {
			t.Fatalf("%d HEADs for %d concurrent checks of one image, want 1", n, joiners+1)
		}

		// The registry's word answers the checks of the next second
		// (indexCheckFresh) without a HEAD; after it, a check asks
		// again, and sees the image gone.
		delete(reg.exists, ref)
		if err := w.checkIndexed(context.Background(), ref); err != nil {
			t.Fatalf("a check within a second of the HEAD returned %v, want its answer (present)", err)
		}
		if n := reg.heads.Load(); n != 1 {
			t.Fatalf("%d HEADs after a check within a second of the first, want 1", n)
		}
		time.Sleep(indexCheckFresh)
		if err := w.checkIndexed(context.Background(), ref); !errors.Is(err, registry.ErrNotFound) {
			t.Fatalf("a check a second later, after the image was deleted, returned %v, want ErrNotFound", err)
		}
		if n := reg.heads.Load(); n != 2 {
			t.Fatalf("%d HEADs after a later check, want 2", n)
		}
		// A not-found is never remembered: the image pushed again is
		// seen at once.
		reg.exists[ref] = "sha256:0123"
		if err := w.checkIndexed(context.Background(), ref); err != nil {
			t.Fatalf("a check after the image came back returned %v, want present", err)
		}
	})
}

// When the preflight found the image already in the registry it ended the
// run as succeeded and answered origin=cache; if the ledger write of that
// decision failed (a KV timeout), the redelivery found a succeeded record
// that was "mine" and answered origin=build, though nothing was built.
// Failed on 54e1b33..1902db9; fa71058 (preflight before the claim, its
// answer never recorded as the key's build) fixed it. Kept unguarded as a
// regression test.
//
// Origin: adversarial review of the issue-9 claim protocol, attack 9; fixed by fa71058.
func TestPreflightHitStaysACacheAnswerAfterARetry(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := newGateRegistry(false)
	req := request("preflight-origin")
	key := v1.BuildKey(req, kanikoID)
	reg.exists["registry.test:5000/acme/web:"+v1.DefaultTag(key)] = digestOf("already there")
	var failed atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) { c.Registry = reg }, nil, func(w *Worker) {
		w.ledger.UseBucket(&faultyKV{KeyValue: w.ledger.Bucket(), onUpdate: func(_ string, value []byte) string {
			if strings.Contains(string(value), `"result":`) && failed.CompareAndSwap(false, true) {
				return writeLost
			}
			return writePasses
		}})
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 15*time.Second)[0]
	if !failed.Load() {
		t.Fatal("the ledger write never failed")
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache {
		t.Fatalf("nothing was built, the image was in the registry; got %s", mustJSON(t, r.Data))
	}
}

// Mallory pushes an image of her own under the tag acme's build key will
// use, in her repository, and asks for that key: the tag answers her own
// request only. acme's request for the key is built, not answered with
// mallory's image.
//
// Origin: issue 10, tenants apart (fa71058).
func TestPlantedTagAnswersOnlyItsPusher(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	victimReq := request("shared-content")
	key := v1.BuildKey(victimReq, kanikoID)
	evil := tr.push(t, tr.host+"/mallory/evil:"+v1.DefaultTag(key))
	m := mallorys("shared-content") // the same content, so the same key
	m.Image = tr.host + "/mallory/evil"
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	mr := results.waitFor(t, 1, 10*time.Second)[0]
	if mr.Data.Status != v1.StatusSucceeded || mr.Data.Origin != v1.OriginCache || mr.Data.Digest != evil {
		t.Fatalf("mallory %s", mustJSON(t, mr))
	}
	if rec := e.claim(key); rec != nil {
		t.Fatalf("a tag found in the registry entered the shared index: %+v", rec)
	}
	vr := e.buildThrough(t, tr, results, victimReq, 2)
	if vr.Data.Digest == evil || vr.Data.Origin != v1.OriginBuild {
		t.Fatalf("acme got %s; mallory's planted image is %s", mustJSON(t, vr), evil)
	}
}

// tenantJob waits for a Job of tenant's (found by its label, whatever
// its key).
func (e *env) tenantJob(tenant string) *batchv1.Job {
	e.t.Helper()
	var job *batchv1.Job
	eventually(e.t, 10*time.Second, "a Job of "+tenant, func() bool {
		l, err := e.kube.BatchV1().Jobs(testNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: kaniko.LabelTenant + "=" + tenant})
		if err != nil || len(l.Items) == 0 {
			return false
		}
		job = &l.Items[0]
		return true
	})
	return job
}

// Attack (cache poisoning through the index): with --cache-repo
// 'REGISTRY/{tenant}/cache' (accepted by a multi-tenant worker:
// checkJobConfig asks only for {tenant}), each run's Job uses the cache
// repository of the tenant whose request claimed the key, and mallory
// may push into hers (her own part of the registry, her own Secret).
// kaniko takes a RUN step's layer from the cache repository when it holds
// one under the step's cache key, without running the step. The build
// key does not name the cache (executor identity only), so the index
// entry made by mallory's run — her content, but layers from her cache —
// answers acme's request for the same content: acme deploys mallory's
// layers. The per-tenant cache was required precisely so that "a RUN
// step could [not] poison the cache for all" (cmd/buildq/worker.go); the
// index shares what it produced. The kubelet here plays kaniko's cache: a
// run whose cache repository holds an image outputs that image. Breaks
// invariant 7 ("every input that changes the image is in the build key")
// across tenants, and DESIGN §9 ("treat every Dockerfile as untrusted").
//
// Origin: hostile-tenant review of 98418f0 (issue 23); failed there, fixed by 26b1795.
func TestPerTenantCacheIsNotSharedThroughTheIndex(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	kc := testKaniko
	kc.CacheRepo = tr.host + "/{tenant}/cache"
	e.startWorkerWith("w1", kc, func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	// A public context both hold (an open-source release, say).
	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM docker.io/library/alpine:3.20\nCOPY src /src\nRUN /src/build.sh\n", "src": "public v1.0"})
	m := tenantRequestFor("mallory", digest)
	a := tenantRequestFor("acme", digest)
	store.put(m.Source.S3.Key, archive)
	store.put(a.Source.S3.Key, archive)

	// Mallory plants a layer in her own cache repository.
	poisoned := tr.push(t, tr.host+"/mallory/cache:step-cache-key")

	// kaniko with --cache: a cached layer is taken as it is.
	kanikoRun := func(job *batchv1.Job) string {
		cache := ""
		for _, arg := range job.Spec.Template.Spec.Containers[0].Args {
			if c, ok := strings.CutPrefix(arg, "--cache-repo="); ok {
				cache = c
			}
		}
		dest := destination(job)
		if cache != "" {
			if cr, err := name.NewRepository(cache, name.Insecure); err == nil {
				if tags, err := remote.List(cr); err == nil && len(tags) > 0 {
					if d, err := tr.client.Copy(ctx, cache+":"+tags[0], dest); err == nil {
						return d
					}
				}
			}
		}
		return tr.push(t, dest)
	}

	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	job := e.tenantJob("mallory")
	e.kubelet(job, 0, kanikoRun(job))
	if r := oneResult(t, results, m.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Digest != poisoned {
		t.Fatalf("mallory's build: %s (her planted layer %s)", mustJSON(t, r), poisoned)
	}

	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's answer or its own Job", func() bool {
		if len(byID(results.snapshot())[a.RequestID]) > 0 {
			return true
		}
		l, err := e.kube.BatchV1().Jobs(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: kaniko.LabelTenant + "=acme"})
		if err == nil && len(l.Items) > 0 && l.Items[0].Status.Succeeded == 0 {
			e.kubelet(&l.Items[0], 0, kanikoRun(&l.Items[0]))
		}
		return false
	})
	ar := oneResult(t, results, a.RequestID)
	if ar.Data.Digest == poisoned {
		t.Errorf("acme's request was answered (%s) with the image mallory's run made from her own cache repository %s/mallory/cache",
			ar.Data.Origin, tr.host)
	}
}
