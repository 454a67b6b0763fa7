package worker

// Canceling an image index: its platforms' builds nobody else waits on
// are stopped, whatever state its handler is in; the others go on.
// Part of the multi-platform attack review (platforms_attack_test.go).

import (
	"context"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// Cancel rule: an index canceled while a platform waits for a slot
// (limit 1: one platform at a time) stops the platform that builds, never
// creates the other's Job, and gets one Canceled result; nothing is left
// running.
func TestCanceledIndexWaitingForASlotLeavesNoJobRunning(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 1}
	})
	results := e.collect()
	r := multiRequest("cancel-waiting-slot", "linux/amd64", "linux/arm64")
	r.RequestID = "cancel-waiting-slot"
	names := platformJobNames(r, nil)
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "one platform's Job", func() bool { return e.unfinishedJobs(names)["acme"] == 1 })
	time.Sleep(300 * time.Millisecond)
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), r.RequestID); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	if d := oneResult(t, results, r.RequestID).Data; d.Status != v1.StatusCanceled {
		t.Fatalf("result %+v, want canceled", d)
	}
	eventually(t, 30*time.Second, "no platform Job left", func() bool { return e.unfinishedJobs(names)["acme"] == 0 })
	time.Sleep(2 * time.Second)
	if n, c := e.unfinishedJobs(names)["acme"], e.creates.total(); n != 0 || c != 1 {
		t.Fatalf("%d platform Jobs running, %d created after the cancel, want 0 and 1", n, c)
	}
	for _, p := range r.Platforms {
		if rec := e.claim(platformKey(r, p)); rec != nil && rec.State == v1.StateBuilding {
			t.Fatalf("%s's run is still building after the cancel: %+v", p, rec)
		}
	}
}

// Cancel rule: an index canceled after one platform was built stops the
// other; the built one stays in the cache (a later request of it is a
// cache hit, no new Job).
func TestCanceledIndexAfterOnePlatformKeepsThatPlatformCached(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	r := multiRequest("cancel-after-one", "linux/amd64", "linux/arm64")
	r.RequestID = "cancel-after-one"
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	amd := e.waitJob(kaniko.JobName(platformKey(r, "linux/amd64")))
	arm := e.waitJob(kaniko.JobName(platformKey(r, "linux/arm64")))
	amdDigest := tr.push(t, destination(amd))
	e.kubelet(amd, 0, amdDigest)
	eventually(t, 30*time.Second, "linux/amd64 built", func() bool {
		rec := e.claim(platformKey(r, "linux/amd64"))
		return rec != nil && rec.State == v1.StateSucceeded
	})
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), r.RequestID); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	if d := oneResult(t, results, r.RequestID).Data; d.Status != v1.StatusCanceled {
		t.Fatalf("result %+v, want canceled", d)
	}
	eventually(t, 30*time.Second, "linux/arm64's Job deleted", e.jobGone(arm.Name))
	one := multiRequest("cancel-after-one", "linux/amd64")
	one.RequestID = "amd64-after-cancel"
	if _, err := e.pub.Publish(ctx, one); err != nil {
		t.Fatal(err)
	}
	if d := oneResult(t, results, one.RequestID).Data; d.Status != v1.StatusSucceeded || d.Origin != v1.OriginCache || d.Digest != amdDigest {
		t.Fatalf("linux/amd64 alone after the cancel: %+v, want a cache hit of %s", d, amdDigest)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
}

// Cancel rule across tenants: mallory, holding the content, claims one
// platform alone first; acme's index joins it. Her cancel of her own
// request does not stop the build acme's index waits on: acme's index gets
// that platform's image (the run, let go, is taken over), and no Job of
// it is deleted.
func TestForeignOnePlatformRequestsCancelSparesTheIndexWaitingOnIt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()
	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "shared"})
	m := tenantRequestFor("mallory", digest)
	m.Platforms, m.RequestID = []string{"linux/amd64"}, "m-amd64"
	a := tenantRequestFor("acme", digest)
	a.Platforms, a.RequestID = []string{"linux/amd64", "linux/arm64"}, "a-index"
	store.put(m.Source.S3.Key, archive)
	store.put(a.Source.S3.Key, archive)
	pkey := platformKey(a, "linux/amd64")
	if v1.BuildKey(m, kanikoID) != pkey {
		t.Fatal("premise: mallory's one-platform key is the index's linux/amd64 key")
	}
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	amd := e.waitJob(kaniko.JobName(pkey))
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	arm := e.waitJob(kaniko.JobName(platformKey(a, "linux/arm64")))
	eventually(t, 30*time.Second, "acme's index waiting on linux/amd64", func() bool {
		ws, err := e.ledgerWaiters(pkey)
		return err == nil && ws[RequestIndexKey("acme", a.RequestID)]
	})
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), m.RequestID); !rep.Canceled || rep.Stopped {
		t.Fatalf("mallory's cancel: %+v, want her request canceled and the build spared", rep)
	}
	if d := oneResult(t, results, m.RequestID).Data; d.Status != v1.StatusCanceled {
		t.Fatalf("mallory's request: %+v", d)
	}
	time.Sleep(500 * time.Millisecond)
	if _, ok := e.jobs()[amd.Name]; !ok {
		t.Fatal("linux/amd64's Job was deleted though acme's index waits on it")
	}
	amdDigest := tr.push(t, destination(amd))
	e.kubelet(amd, 0, amdDigest)
	e.kubelet(arm, 0, tr.push(t, destination(arm)))
	d := oneResult(t, results, a.RequestID).Data
	if d.Status != v1.StatusSucceeded || d.Platforms["linux/amd64"] != amdDigest {
		t.Fatalf("acme's index: %s, want linux/amd64 as %s", mustJSON(t, d), amdDigest)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
}

// ledgerWaiters lists the ledger keys of the requests indexed as waiting
// on key.
func (e *env) ledgerWaiters(key string) (map[string]bool, error) {
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return nil, err
	}
	keys, err := kv.ListKeysFiltered(ctx, "w."+key+".*")
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for k := range keys.Keys() {
		out[strings.TrimPrefix(k, "w."+key+".")] = true
	}
	return out, nil
}

// Found: an index whose worker was killed while its platforms built, then
// canceled before its request is redelivered: the cancel ends the index
// key's run (stopBuild: it has no Job to delete), but only the index's
// handler stops its platforms' builds (stopCanceledPlatforms), and there
// is none. The platforms' runs lapse with their Jobs running on, which
// nobody waits for; the redelivered request, canceled, is answered at once
// without stopping them either. A one-platform request canceled the same
// way has its Job deleted by the cancel.
// Fixed: the index run's record lists its platforms' keys
// (PlatformKeys), and the cancel that ends the run stops each platform
// build no request still waits on.
func TestAttack_CanceledIndexOfAKilledWorkerLeavesNoPlatformJobRunning(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	cfg := func(c *Config) {
		withRegistry(tr)(c)
		c.AckWait = 30 * time.Second // the killed handler's request is not redelivered before the cancel
	}
	w1 := e.startWorker("w1", cfg)
	results := e.collect()
	ctx := context.Background()
	r := multiRequest("cancel-after-kill", "linux/amd64", "linux/arm64")
	r.RequestID = "cancel-after-kill"
	names := platformJobNames(r, nil)
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "both platforms' Jobs", func() bool { return e.unfinishedJobs(names)["acme"] == 2 })
	killWorker(w1)
	e.startWorker("w2", cfg)
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), r.RequestID); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	eventually(t, 60*time.Second, "the canceled index's platform Jobs stopped", func() bool { return e.unfinishedJobs(names)["acme"] == 0 })
	if d := e.waitResultPlaying(t, tr, results, nil, r.RequestID, 60*time.Second).Data; d.Status != v1.StatusCanceled {
		t.Fatalf("result %+v, want canceled", d)
	}
}

// Cancel rule: a canceled index's platforms give their slots back only
// once their Jobs are gone. The cancel ends the platforms' runs, and each
// platform's build, finding its run ended from outside, returns at once;
// its extra slot went back then while the Job's delete was still on its
// way, and the tenant's next request, waiting at the limit, created its
// Job beside the two platforms' (the simulation's seed 173, frozen as
// concurrency-limit-173).
func TestACanceledIndexsPlatformSlotsComeBackOnceTheirJobsAreGone(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	slow := slowCreates{Interface: e.kube, holdDelete: func(string) { time.Sleep(500 * time.Millisecond) }}
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 2}
	}, slow, nil)
	results := e.collect()
	ctx := context.Background()
	idx := multiRequest("cancel-platform-slots", "linux/amd64", "linux/arm64")
	idx.RequestID = "index"
	names := platformJobNames(idx, nil)
	if _, err := e.pub.Publish(ctx, idx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "both platforms' Jobs, on the index's two slots", func() bool { return e.unfinishedJobs(names)["acme"] == 2 })
	next := tenantRequest("acme", "cancel-platform-next")
	next.RequestID = "next"
	names[jobOf(next)] = "acme"
	if _, err := e.pub.Publish(ctx, next); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	if _, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), idx.RequestID, 30*time.Second); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.unfinishedJobs(names)["acme"]; n > 2 {
			dumpSlots(t, e)
			t.Fatalf("acme runs %d builds at once (the canceled index's platforms, their deletes on the way, and %s), its concurrency limit is 2",
				n, jobOf(next))
		}
		if _, ok := e.jobs()[jobOf(next)]; ok {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, ok := e.jobs()[jobOf(next)]; !ok {
		t.Fatal("the next request's Job was not created once the canceled index's Jobs were gone")
	}
	if got := oneResult(t, results, idx.RequestID); got.Data.Status != v1.StatusCanceled {
		t.Errorf("the index's result: %s", decision(got.Data))
	}
}
