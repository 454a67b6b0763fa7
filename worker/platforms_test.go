package worker

// Multi-platform requests (platforms.go): each platform is a build of its
// own key, deduplicated and cached on its own; the request's own key runs
// no Job and pushes an OCI image index of the platforms' images.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	batchv1 "k8s.io/api/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/runs"
)

func platformKey(r *v1.Request, p string) string { return v1.BuildKey(platformRequest(r, p), kanikoID) }

func multiRequest(seed string, platforms ...string) *v1.Request {
	r := request(seed)
	r.Platforms = platforms
	return r
}

// Origin: issue 29, "one request, one index" and "each platform is its own build".
func TestMultiPlatformRequestPushesOneIndexOfItsPlatformsBuilds(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	events := e.events()
	ctx := context.Background()

	r := multiRequest("multi", "linux/arm64", "linux/amd64")
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	built := map[string]string{}
	for _, p := range []string{"linux/amd64", "linux/arm64"} {
		job := e.waitJob(kaniko.JobName(platformKey(r, p)))
		if got := job.Spec.Template.Spec.NodeSelector["kubernetes.io/arch"]; got != strings.TrimPrefix(p, "linux/") {
			t.Fatalf("%s's Job runs on arch %q", p, got)
		}
		built[p] = tr.push(t, destination(job))
		e.kubelet(job, 0, built[p])
	}
	res := oneResult(t, results, r.RequestID)
	d := res.Data
	if d.Status != v1.StatusSucceeded || d.Origin != v1.OriginBuild || d.Key != v1.BuildKey(r, kanikoID) {
		t.Fatalf("result %s, want succeeded from its own build under the request's key", mustJSON(t, res))
	}
	if len(d.Platforms) != 2 || d.Platforms["linux/amd64"] != built["linux/amd64"] || d.Platforms["linux/arm64"] != built["linux/arm64"] {
		t.Fatalf("result platforms %v, want %v", d.Platforms, built)
	}
	idx, err := tr.client.IndexPlatforms(ctx, d.Image)
	if err != nil {
		t.Fatal(err)
	}
	if len(idx) != 2 || idx["linux/amd64"] != built["linux/amd64"] || idx["linux/arm64"] != built["linux/arm64"] {
		t.Fatalf("the index at %s holds %v, want %v", d.Image, idx, built)
	}
	if head, err := tr.client.Head(ctx, d.ImageRef); err != nil || head != d.Digest {
		t.Fatalf("%s: %s, %v; want the index digest %s", d.ImageRef, head, err, d.Digest)
	}
	if _, ok := e.jobs()[kaniko.JobName(d.Key)]; ok || e.creates.total() != 2 {
		t.Fatalf("%d Jobs created (the index key's among them: %v), want one per platform", e.creates.total(), ok)
	}
	// Progress names each platform.
	eventually(t, 5*time.Second, "a progress event per platform", func() bool {
		seen := map[string]bool{}
		for _, ev := range events.decoded() {
			if ev.RequestID == r.RequestID && ev.Platform != "" {
				seen[ev.Platform] = true
			}
		}
		return seen["linux/amd64"] && seen["linux/arm64"]
	})

	t.Run("a request for one of its platforms is a cache hit", func(t *testing.T) {
		one := multiRequest("multi", "linux/arm64")
		one.RequestID = "one-platform"
		if _, err := e.pub.Publish(ctx, one); err != nil {
			t.Fatal(err)
		}
		got := oneResult(t, results, one.RequestID).Data
		if got.Status != v1.StatusSucceeded || got.Origin != v1.OriginCache || got.Digest != built["linux/arm64"] {
			t.Fatalf("result %+v, want linux/arm64's image from the cache", got)
		}
	})
	t.Run("another index sharing a platform builds only the new one", func(t *testing.T) {
		other := multiRequest("multi", "linux/amd64", "linux/386")
		other.RequestID = "shares-amd64"
		if _, err := e.pub.Publish(ctx, other); err != nil {
			t.Fatal(err)
		}
		job := e.waitJob(kaniko.JobName(platformKey(other, "linux/386")))
		d386 := tr.push(t, destination(job))
		e.kubelet(job, 0, d386)
		got := oneResult(t, results, other.RequestID).Data
		if got.Status != v1.StatusSucceeded || got.Platforms["linux/amd64"] != built["linux/amd64"] || got.Platforms["linux/386"] != d386 {
			t.Fatalf("result %+v, want amd64 from the cache and 386 built", got)
		}
		if n := e.creates.total(); n != 3 {
			t.Fatalf("%d Jobs created in all, want 3 (amd64 and arm64 once, then 386)", n)
		}
	})
}

// Mallory pushes an image of her own under the tag her repository's build
// of one platform would use, then asks for an image index of that content.
// An index is shared like any build (the index, its joiners, other
// tenants' copies), so its platforms must be buildq's own builds: the
// planted image is not taken, the platform is built (its Job pushes over
// the tag), and acme's request for the same index gets no planted image.
// Before asPlatformPart, the platform's preflight took the planted image
// and the index made of it entered the shared index.
//
// Origin: the fault simulation with tags pushed by hand ("hand-tags"),
// seed 17 (wrong-image: an index of no known content).
func TestAPlatformOfAnIndexTakesNoImageFoundAtItsTag(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	m := mallorys("planted-platform")
	m.Image = tr.host + "/mallory/evil"
	m.Platforms = []string{"linux/amd64", "linux/arm64"}
	evil := tr.push(t, m.Image+":"+v1.DefaultTag(platformKey(m, "linux/arm64")))
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	built := map[string]string{}
	for _, p := range m.Platforms {
		job := e.waitJob(kaniko.JobName(platformKey(m, p)))
		built[p] = tr.push(t, destination(job))
		e.kubelet(job, 0, built[p])
	}
	d := oneResult(t, results, m.RequestID).Data
	if d.Status != v1.StatusSucceeded || d.Platforms["linux/arm64"] != built["linux/arm64"] || d.Platforms["linux/amd64"] != built["linux/amd64"] {
		t.Fatalf("mallory's index %+v, want its platforms' builds %v (the planted image is %s)", d, built, evil)
	}
	if idx, err := tr.client.IndexPlatforms(ctx, d.Image); err != nil || idx["linux/arm64"] != built["linux/arm64"] {
		t.Fatalf("the index at %s holds %v (%v), want linux/arm64 %s", d.Image, idx, err, built["linux/arm64"])
	}

	a := multiRequest("planted-platform", "linux/amd64", "linux/arm64")
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	ad := oneResult(t, results, a.RequestID).Data
	if ad.Status != v1.StatusSucceeded || ad.Platforms["linux/arm64"] != built["linux/arm64"] {
		t.Fatalf("acme's index %+v, want linux/arm64 %s (the planted image is %s)", ad, built["linux/arm64"], evil)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want one per platform", n)
	}
}

// Origin: issue 29, "a failing platform fails the request with that
// platform named … the others' images stay in the cache".
func TestMultiPlatformFailureNamesThePlatformAndKeepsTheOthers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	r := multiRequest("fails-on-arm", "linux/amd64", "linux/arm64")
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	amd := e.waitJob(kaniko.JobName(platformKey(r, "linux/amd64")))
	arm := e.waitJob(kaniko.JobName(platformKey(r, "linux/arm64")))
	e.kubelet(arm, 1, "error building image: RUN make: exit status 2")
	amdDigest := tr.push(t, destination(amd))
	e.kubelet(amd, 0, amdDigest)

	d := oneResult(t, results, r.RequestID).Data
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonBuildFailed || !strings.HasPrefix(d.Message, "platform linux/arm64: ") || d.Digest != "" {
		t.Fatalf("result %+v, want BuildFailed naming linux/arm64", d)
	}
	if d.Platforms["linux/amd64"] != amdDigest || len(d.Platforms) != 1 {
		t.Fatalf("result platforms %v, want the image built for linux/amd64 only", d.Platforms)
	}
	one := multiRequest("fails-on-arm", "linux/amd64")
	one.RequestID = "amd64-alone"
	if _, err := e.pub.Publish(ctx, one); err != nil {
		t.Fatal(err)
	}
	if got := oneResult(t, results, one.RequestID).Data; got.Origin != v1.OriginCache || got.Digest != amdDigest {
		t.Fatalf("result %+v, want linux/amd64's image from the cache", got)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
}

// Two multi-platform requests sharing a platform, at once: the shared
// platform is built once, each gets its own index.
func TestConcurrentIndexesShareTheirCommonPlatform(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	a := multiRequest("shared", "linux/amd64", "linux/arm64")
	b := multiRequest("shared", "linux/amd64", "linux/386")
	b.RequestID = "second-index"
	for _, r := range []*v1.Request{a, b} {
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	digests := map[string]string{}
	for _, p := range []string{"linux/amd64", "linux/arm64", "linux/386"} {
		job := e.waitJob(kaniko.JobName(platformKey(a, p)))
		digests[p] = tr.push(t, destination(job))
		e.kubelet(job, 0, digests[p])
	}
	for _, tc := range []struct {
		r     *v1.Request
		plats []string
	}{{a, []string{"linux/amd64", "linux/arm64"}}, {b, []string{"linux/386", "linux/amd64"}}} {
		d := oneResult(t, results, tc.r.RequestID).Data
		if d.Status != v1.StatusSucceeded {
			t.Fatalf("%s: %+v", tc.r.RequestID, d)
		}
		var got []string
		for p, dg := range d.Platforms {
			got = append(got, p)
			if dg != digests[p] {
				t.Fatalf("%s: %s is %s, want %s", tc.r.RequestID, p, dg, digests[p])
			}
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.plats) {
			t.Fatalf("%s: platforms %v, want %v", tc.r.RequestID, got, tc.plats)
		}
	}
	if n := e.creates.total(); n != 3 {
		t.Fatalf("%d Jobs created, want 3 (linux/amd64 once)", n)
	}
}

// canceledIndex is an index request of linux/amd64 and linux/arm64 with
// both platforms' Jobs running, another request of the same content
// waiting on linux/amd64 alone, and the index canceled (its "canceled"
// result seen).
type canceledIndex struct {
	e        *env
	w1       *runningWorker
	tr       *testRegistry
	results  *resultCollector
	r, alone *v1.Request
	amd, arm *batchv1.Job
	amdKey   string
}

func cancelIndexWithAWaiter(t *testing.T, content string) canceledIndex {
	t.Helper()
	c := canceledIndex{e: setup(t), tr: newTestRegistry(t)}
	c.w1 = c.e.startWorker("w1", withRegistry(c.tr))
	c.results = c.e.collect()
	ctx := context.Background()
	c.r = multiRequest(content, "linux/amd64", "linux/arm64")
	if _, err := c.e.pub.Publish(ctx, c.r); err != nil {
		t.Fatal(err)
	}
	c.amdKey = platformKey(c.r, "linux/amd64")
	c.amd = c.e.waitJob(kaniko.JobName(c.amdKey))
	c.arm = c.e.waitJob(kaniko.JobName(platformKey(c.r, "linux/arm64")))
	c.alone = multiRequest(content, "linux/amd64")
	c.alone.RequestID = content + "-amd64-waits"
	if _, err := c.e.pub.Publish(ctx, c.alone); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the one-platform request waits on linux/amd64", func() bool {
		ws, err := c.w1.w.ledger.Waiters(ctx, c.amdKey)
		return err == nil && slices.ContainsFunc(ws, func(le *ledger.Entry) bool { return le.E.RequestID == c.alone.RequestID })
	})
	if rep := cancelRequest(t, c.e.nc, v1.APICancelSubject("acme"), c.r.RequestID); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	if d := oneResult(t, c.results, c.r.RequestID).Data; d.Status != v1.StatusCanceled {
		t.Fatalf("the canceled request: %+v", d)
	}
	return c
}

// A canceled multi-platform request stops the builds of its platforms
// that no other request waits on; one another request waits on goes on.
//
// Origin: issue 29 with the cancel rules of docs/design.md §2.
func TestCanceledIndexStopsItsUnsharedPlatformBuilds(t *testing.T) {
	t.Parallel()
	c := cancelIndexWithAWaiter(t, "cancel-index")
	e, tr, results, amd, arm, alone := c.e, c.tr, c.results, c.amd, c.arm, c.alone
	eventually(t, 10*time.Second, "linux/arm64's Job deleted", func() bool {
		_, ok := e.jobs()[arm.Name]
		return !ok
	})
	if _, ok := e.jobs()[amd.Name]; !ok {
		t.Fatal("linux/amd64's Job was deleted, though another request waits on it")
	}
	digest := tr.push(t, destination(amd))
	e.kubelet(amd, 0, digest)
	if d := oneResult(t, results, alone.RequestID).Data; d.Status != v1.StatusSucceeded || d.Digest != digest {
		t.Fatalf("the request waiting on linux/amd64: %+v", d)
	}
}

// A canceled index's platform build that another request waits on is
// finished by the index's own handler, for that request, on the index's
// slots: its run keeps its holder (the tenant's limit counts its Job as
// the canceled request's until the run ends), and is not let go for the
// waiter to queue for a slot of its own while the Job runs on.
//
// Origin: the fault simulation, seed 173 (concurrency-limit: a canceled
// index's shared platform run was let go with its Job running, the
// index's slots freed, and the tenant's next request ran a third Job
// under a limit of 2).
func TestCanceledIndexFinishesItsSharedPlatformBuildOnItsSlots(t *testing.T) {
	t.Parallel()
	c := cancelIndexWithAWaiter(t, "cancel-index-shared")
	ctx, r, w1, amdKey, amd, tr, e, results, alone := context.Background(), c.r, c.w1, c.amdKey, c.amd, c.tr, c.e, c.results, c.alone
	// The index's handler hears of the cancel and decides, then keeps
	// linux/amd64's run: its holder stays the canceled request.
	holder := RequestIndexKey(r.Tenant, r.RequestID)
	for deadline := time.Now().Add(1500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		cur, _, err := w1.w.runs.Get(ctx, amdKey)
		if err != nil {
			t.Fatal(err)
		}
		if cur == nil || cur.Final() || cur.Holder != holder || cur.Owner != "w1" {
			t.Fatalf("linux/amd64's run while its Job runs: %s; want it building, held by %s on w1", mustJSON(t, cur), holder)
		}
	}
	digest := tr.push(t, destination(amd))
	e.kubelet(amd, 0, digest)
	if d := oneResult(t, results, alone.RequestID).Data; d.Status != v1.StatusSucceeded || d.Digest != digest {
		t.Fatalf("the request waiting on linux/amd64: %+v", d)
	}
	eventually(t, 10*time.Second, "linux/amd64's Job deleted once its run ended", func() bool {
		_, ok := e.jobs()[amd.Name]
		return !ok
	})
}

// A shared platform build that a canceled index keeps for its waiters is
// let go when the worker stops, as any run it holds: its run is released
// (no owner), and the worker is done before its shutdown timeout, with
// nothing left in flight.
func TestAKeptPlatformBuildIsLetGoWhenItsWorkerStops(t *testing.T) {
	t.Parallel()
	c := cancelIndexWithAWaiter(t, "cancel-index-stop")
	ctx := context.Background()
	holder := RequestIndexKey(c.r.Tenant, c.r.RequestID)
	eventually(t, 10*time.Second, "linux/amd64's run kept by the index's handler", func() bool {
		cur, _, err := c.w1.w.runs.Get(ctx, c.amdKey)
		return err == nil && cur != nil && !cur.Final() && cur.Holder == holder && cur.Owner == "w1"
	})
	// Past the cancel's decision (stopCanceledPlatforms' wait for the
	// index run's end is at most 2 s).
	time.Sleep(2500 * time.Millisecond)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		c.w1.stop(t)
	}()
	select {
	case <-stopped:
	case <-time.After(4 * time.Second): // the harness's ShutdownTimeout is 5 s
		t.Fatal("the worker did not stop before its shutdown timeout: the kept build held its handler")
	}
	// Read beside the stopped worker, whose connection is closed.
	kv, err := c.e.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	store := runs.New()
	store.UseBucket(kv)
	cur, _, err := store.Get(ctx, c.amdKey)
	if err != nil {
		t.Fatal(err)
	}
	if cur == nil || cur.Final() || cur.Owner != "" {
		t.Fatalf("linux/amd64's run after its worker stopped: %s; want it let go (building, no owner)", mustJSON(t, cur))
	}
}

// buildq dev's local executor builds each platform of a Dockerfile
// without RUN, from each platform's base image, and the worker pushes
// the index.
//
// Origin: issue 29, "the local executor builds every platform".
func TestLocalExecutorBuildsAMultiPlatformIndex(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	// A base image of two platforms, each with a layer of its own.
	bases := map[string]ggcrv1.Image{}
	var adds []mutate.IndexAddendum
	for _, p := range []string{"linux/amd64", "linux/arm64"} {
		img, err := random.Image(64, 1)
		if err != nil {
			t.Fatal(err)
		}
		plat, _ := ggcrv1.ParsePlatform(p)
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		cf = cf.DeepCopy()
		cf.OS, cf.Architecture = plat.OS, plat.Architecture
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			t.Fatal(err)
		}
		bases[p] = img
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: ggcrv1.Descriptor{Platform: plat}})
	}
	baseRef := tr.host + "/library/base:1"
	ref, err := name.ParseReference(baseRef, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, mutate.AppendManifests(empty.Index, adds...), tr.client.RemoteOptions(ctx)...); err != nil {
		t.Fatal(err)
	}
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM " + baseRef + "\nCOPY app /app\n", "app": "hello"})
	r := tenantRequestFor("acme", digest)
	r.Platforms = []string{"linux/arm64", "linux/amd64"}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), withRegistry(tr))
	results := e.collect()
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	d := results.waitFor(t, 1, 30*time.Second)[0].Data
	if d.Status != v1.StatusSucceeded || len(d.Platforms) != 2 {
		t.Fatalf("result %+v, want an index of two platforms", d)
	}
	idx, err := tr.client.IndexPlatforms(ctx, d.ImageRef)
	if err != nil {
		t.Fatal(err)
	}
	for p, base := range bases {
		if idx[p] != d.Platforms[p] {
			t.Fatalf("the index names %s for %s, the result %s", idx[p], p, d.Platforms[p])
		}
		cref, _ := name.ParseReference(tr.host+"/acme/web@"+idx[p], name.Insecure)
		img, err := remote.Image(cref, tr.client.RemoteOptions(ctx)...)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.OS+"/"+cf.Architecture != p {
			t.Fatalf("%s's image config says %s/%s", p, cf.OS, cf.Architecture)
		}
		layers, _ := img.Layers()
		baseLayers, _ := base.Layers()
		ld, _ := layers[0].Digest()
		bd, _ := baseLayers[0].Digest()
		if len(layers) != 2 || ld != bd {
			t.Fatalf("%s's image has %d layers, the first %s; want %s's base layer %s and the COPY", p, len(layers), ld, p, bd)
		}
	}
}

// An image index runs its platforms' Jobs on its tenant's concurrency
// slots: at a limit of 1, one platform at a time; at 2, side by side.
//
// Origin: issue 29 with the concurrency limits of docs/design.md §2d.
func TestIndexPlatformsStayWithinTheTenantsConcurrencyLimit(t *testing.T) {
	t.Parallel()
	for _, limit := range []int{1, 2} {
		t.Run(fmt.Sprintf("limit %d", limit), func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			e.startWorker("w1", func(c *Config) {
				withRegistry(tr)(c)
				c.Fair.Concurrency = map[string]int{"acme": limit}
			})
			results := e.collect()
			r := multiRequest(fmt.Sprint("limited-", limit), "linux/amd64", "linux/arm64")
			if _, err := e.pub.Publish(context.Background(), r); err != nil {
				t.Fatal(err)
			}
			names := map[string]string{}
			for _, p := range r.Platforms {
				names[kaniko.JobName(platformKey(r, p))] = "acme"
			}
			eventually(t, 10*time.Second, "a platform's Job", func() bool { return e.running(names)["acme"] > 0 })
			if limit == 1 {
				neverTwoAtOnce(t, e, names, time.Second, "an image index's platforms on one slot")
			} else {
				eventually(t, 10*time.Second, "both platforms' Jobs at once", func() bool { return e.running(names)["acme"] == 2 })
			}
			for range r.Platforms {
				var job *batchv1.Job
				eventually(t, 10*time.Second, "a platform's Job to finish", func() bool {
					for name, j := range e.jobs() {
						if names[name] != "" && len(j.Status.Conditions) == 0 {
							job = j
							return true
						}
					}
					return false
				})
				e.kubelet(job, 0, tr.push(t, destination(job)))
				if limit == 1 {
					neverTwoAtOnce(t, e, names, 300*time.Millisecond, "an image index's platforms on one slot")
				}
			}
			if d := oneResult(t, results, r.RequestID).Data; d.Status != v1.StatusSucceeded || len(d.Platforms) != 2 {
				t.Fatalf("result %+v", d)
			}
		})
	}
}
