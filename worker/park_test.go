package worker

// Parking (park.go): a request that joins a run in flight is parked and
// holds no slot; every parked request is answered once, from the run it
// parked on, when that run ends — also when its owner's worker stops or
// dies, or its Job is deleted (docs/design.md §2c).

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// The stall the issue describes: 3 workers × 2 slots, 6 identical
// requests, then one different one, the first Job held. Joiners park, so
// the different request is taken and built while the first build runs,
// and every duplicate gets its answer when that build ends.
//
// Origin: parking, a request that joins a running build holds no slot (897c81b).
func TestDuplicatesOfARunningBuildHoldNoSlot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for i := range 3 {
		e.startWorker(fmt.Sprintf("w%d", i), func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = 2
		})
	}
	results := e.collect()
	ctx := context.Background()
	for range 6 {
		if _, err := e.pub.Publish(ctx, request("held")); err != nil {
			t.Fatal(err)
		}
	}
	held := e.waitJob(kaniko.JobName(v1.BuildKey(request("held"), "kaniko@"+testKaniko.ExecutorImage)))
	// Every duplicate parks: nothing holds a message while the build runs
	// except its owner.
	eventually(t, 10*time.Second, "the duplicates parked, only the owner's message in flight", func() bool {
		_, ackPending, _ := e.streamState()
		return ackPending == 1
	})
	other := request("other")
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	otherJob := e.waitJob(kaniko.JobName(v1.BuildKey(other, "kaniko@"+testKaniko.ExecutorImage)))
	e.kubelet(otherJob, 0, tr.push(t, destination(otherJob)))
	got := results.waitFor(t, 1, 10*time.Second)
	if got[0].Data.Key != v1.BuildKey(other, "kaniko@"+testKaniko.ExecutorImage) || got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("the different request was not answered first: %s", mustJSON(t, got[0]))
	}

	e.kubelet(held, 0, tr.push(t, destination(held)))
	got = results.waitFor(t, 7, 15*time.Second)
	origins := map[v1.Origin]int{}
	for _, r := range got {
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if r.Data.Key == held.Annotations[kaniko.AnnotationKey] || r.Data.Key != got[0].Data.Key {
			origins[r.Data.Origin]++
		}
	}
	if origins[v1.OriginBuild] != 1 || origins[v1.OriginInflight] != 5 {
		t.Fatalf("held key's origins %v, want 1 build and 5 inflight", origins)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
	eventually(t, 10*time.Second, "the queue empty", func() bool {
		msgs, ackPending, _ := e.streamState()
		return msgs == 0 && ackPending == 0
	})
	time.Sleep(500 * time.Millisecond)
	for _, r := range got {
		if n := results.publishes(r.Data.RequestID); n != 1 {
			t.Fatalf("request %s published %d times", r.Data.RequestID, n)
		}
	}
}

// Origin: adversarial review of parking (docs/design.md §2c), invariants 3 and 1; fixed by 9f3c611.
func TestFiftyDuplicatesBuildOnceAndEachIsAnsweredOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var w *runningWorker
	for i := range 3 {
		r := e.startWorker(fmt.Sprintf("w%d", i), func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = 2
		})
		if w == nil {
			w = r
		}
	}
	results := e.collect()
	ctx := context.Background()
	var reqs []*v1.Request
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := request("fifty")
			if _, err := e.pub.Publish(ctx, r); err != nil {
				t.Error(err)
			}
			mu.Lock()
			reqs = append(reqs, r)
			mu.Unlock()
		}()
	}
	wg.Wait()
	key := v1.BuildKey(reqs[0], kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 20*time.Second, "49 parked", func() bool { return parkedCount(t, w.w, key) == 49 })
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, reqs, 30*time.Second)
	for _, r := range reqs {
		if d := storedOf(results, "acme", r.RequestID)[0].Data; d.Status != v1.StatusSucceeded {
			t.Errorf("request %s: %s", r.RequestID, decision(d))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Errorf("%d Jobs created, want 1", n)
	}
}

// The owner's worker is dead while requests are parked on its run (its
// claim is never renewed): the sweep sees the run lapse, lets it go and
// requeues the parked requests; one of them takes the run over, and all
// are answered by that one run.
//
// Origin: parking, a request that joins a running build holds no slot (897c81b).
func TestParkedRequestsOutliveADeadOwner(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	req := request("dead-owner")
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	w := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	dest := tr.host + "/acme/web:" + v1.DefaultTag(key)
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		RequestID: "gone", Tenant: "acme", Name: "web", Holder: "gone",
		Repository: tr.host + "/acme/web", Destinations: []string{dest}})
	if _, err := w.w.runs.Bucket().Put(ctx, key, rec); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := e.pub.Publish(ctx, request("dead-owner")); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "three requests parked", func() bool {
		items, err := w.w.ledger.ListWaiters(ctx, key)
		n := 0
		for _, it := range items[key] {
			if it.V.Parked {
				n++
			}
		}
		_, ackPending, _ := e.streamState()
		return err == nil && n == 3 && ackPending == 0
	})
	job := e.waitJob(kaniko.JobName(key)) // after the lapse: the run taken over
	if job.Annotations[kaniko.AnnotationRun] != "dead-run" {
		t.Fatalf("the take-over ran another run: %q", job.Annotations[kaniko.AnnotationRun])
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 3, 15*time.Second)
	for _, r := range got {
		if r.Data.Status != v1.StatusSucceeded || r.Data.Key != key {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d Jobs created, want 1", n)
	}
}

// Origin: adversarial review of parking (docs/design.md §2c), invariant 3; fixed by 9f3c611.
func TestParkedRequestsOutliveTheOwnersWorkerStopping(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ws := map[string]*runningWorker{}
	for _, id := range []string{"w1", "w2"} {
		ws[id] = e.startWorker(id, withRegistry(tr))
	}
	results := e.collect()
	ctx := context.Background()
	owner := request("sigterm")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(owner, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	reqs := []*v1.Request{owner}
	for range 4 {
		r := request("sigterm")
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	eventually(t, 10*time.Second, "4 parked", func() bool { return parkedCount(t, ws["w1"].w, key) == 4 })
	rec := e.claim(key)
	other := "w1"
	if rec.Owner == "w1" {
		other = "w2"
	}
	ws[rec.Owner].stop(t)
	eventually(t, 15*time.Second, "the run taken over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Owner == other
	})
	e.kubelet(e.waitJob(job.Name), 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, reqs, 20*time.Second)
	for _, r := range reqs {
		if d := storedOf(results, "acme", r.RequestID)[0].Data; d.Status != v1.StatusSucceeded {
			t.Errorf("request %s: %s", r.RequestID, decision(d))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Errorf("%d Jobs created, want 1", n)
	}
}

// Origin: adversarial review of parking (docs/design.md §2c), invariant 3; fixed by 9f3c611.
func TestParkedRequestsAreAnsweredWhenTheirJobIsDeleted(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w, watcher := e.startWorkerWith("w1", testKaniko, withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	owner := request("job-deleted")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(owner, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	reqs := []*v1.Request{owner}
	for range 3 {
		r := request("job-deleted")
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	eventually(t, 10*time.Second, "3 parked", func() bool { return parkedCount(t, w.w, key) == 3 })
	eventually(t, 5*time.Second, "cache has the job", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
	time.Sleep(300 * time.Millisecond)
	bg := metav1.DeletePropagationBackground
	if err := e.kube.BatchV1().Jobs(testNamespace).Delete(ctx, job.Name, metav1.DeleteOptions{PropagationPolicy: &bg}); err != nil {
		t.Fatal(err)
	}
	assertEnd(t, e, results, reqs, 30*time.Second)
	for _, r := range reqs {
		t.Logf("%s: %s", r.RequestID, decision(storedOf(results, "acme", r.RequestID)[0].Data))
	}
}

// Attack (possession bypass, settle): the same hole at its other end.
// Mallory's M2 parks on her own run r1 the ordinary way. r1 fails; the
// pass that answers r1's parked waiters reads the record only after
// listing them — and once a waiter is parked, settleWaiter answers it
// from whatever final record the key has, never checking the run it
// parked on (ledger.Waiter.Run is written, park.go:115, and never read) nor
// possession.
// If acme's request claims the key (run r2) before that pass reads the
// record, M2 stays parked on acme's run and is answered from it. The pass
// is slowed here by holding its per-key lock (mallory can slow it herself:
// the listing reads every waiter entry of the key, and she can park as
// many requests on her run as she likes). Breaks invariant 8.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); failed there, fixed by 26b1795.
func TestSettleAnswersAParkedRequestOnlyFromItsOwnRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	rw := e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store }, nil, nil)
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's other app"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	key := v1.BuildKey(a, kanikoID)

	m1 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m1); err != nil {
		t.Fatal(err)
	}
	j1 := e.claimOrAnswer(results, key, m1.RequestID)
	if j1 == nil {
		return // refused before any claim: nothing to park on
	}
	r1 := e.claim(key)
	m2 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "mallory's second request parked", func() bool { return e.parkedAs(key, "mallory", m2.RequestID) })

	// The settle pass of the key is slow.
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	mu := &rw.w.park.settling[h.Sum32()%uint32(len(rw.w.park.settling))]
	mu.Lock()
	locked := true
	unlock := func() {
		if locked {
			locked = false
			mu.Unlock()
		}
	}
	defer unlock()

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
	unlock()
	// Let the pass (and a sweep) run before acme's run ends.
	time.Sleep(300 * time.Millisecond)

	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	ar := oneResult(t, results, a.RequestID)
	if ar.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's request: %s", mustJSON(t, ar))
	}
	mr := oneResult(t, results, m2.RequestID)
	if mr.Data.Status == v1.StatusSucceeded || mr.Data.Digest != "" || mr.Data.Image != "" {
		t.Errorf("mallory's request parked on her own run r1 was answered from acme's run r2: %s (acme's digest %s)",
			mustJSON(t, mr.Data), ar.Data.Digest)
	}
	if tags := repoTags(t, tr, "mallory"); len(tags) > 0 {
		t.Errorf("acme's image was copied into mallory's repository: tags %v", tags)
	}
}

// A parked request whose park re-check finds a new run — another
// tenant's, whose content its own tenant holds (shown before) — parks on
// that run and is answered from it once, also when the worker running it
// stops at that moment and another takes over.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestParkRecheckOnANewForeignRunAcrossAWorkerStop(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newFaultyStore()
	pause := newStackPause(t, ".(*parking).park")
	w1 := e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store; c.Now = pause.now })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY p /p\n", "p": "shared"})
	a1, a2, g := tenantRequestFor("acme", digest), tenantRequestFor("acme", digest), tenantRequestFor("globex", digest)
	store.put(a1.Source.S3.Key, archive)
	store.put(g.Source.S3.Key, archive)
	key := v1.BuildKey(a1, kanikoID)

	if _, err := e.pub.Publish(ctx, a1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(kaniko.JobName(key))
	r1 := e.claim(key)
	// a2 reads a1's run r1 and stops just before parking on it.
	pause.armed.Store(true)
	if _, err := e.pub.Publish(ctx, a2); err != nil {
		t.Fatal(err)
	}
	pause.waitEntered(t)
	// acme cancels a1: nobody else waits, so r1 is stopped.
	if _, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), a1.RequestID, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if r := oneResult(t, results, a1.RequestID); r.Data.Status != v1.StatusCanceled {
		t.Fatalf("a1: %s", mustJSON(t, r))
	}
	// globex claims the key: run r2, globex's.
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	var r2 *v1.BuildRecord
	eventually(t, 10*time.Second, "globex's run", func() bool {
		r2 = e.claim(key)
		return r2 != nil && r2.State == v1.StateBuilding && r2.Tenant == "globex" && r2.Run != r1.Run
	})
	j2 := e.runJob(key, r2.Run)
	pause.open()
	eventually(t, 10*time.Second, "a2 parked on globex's run", func() bool {
		kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
		if err != nil {
			return false
		}
		ent, err := kv.Get(ctx, ledger.WaiterKey(key, "acme", a2.RequestID))
		if err != nil {
			return false
		}
		v, ok := ledger.ParseWaiter(ent.Value())
		return ok && v.Parked && v.Run == r2.Run
	})
	// w1 stops now; w2 goes on.
	w1.stop(t)
	e.startWorker("w2", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	gr := oneResult(t, results, g.RequestID)
	ar := oneResult(t, results, a2.RequestID)
	if gr.Data.Status != v1.StatusSucceeded || ar.Data.Status != v1.StatusSucceeded || ar.Data.Digest != gr.Data.Digest {
		t.Fatalf("globex %s\nacme %s", mustJSON(t, gr.Data), mustJSON(t, ar.Data))
	}
	if tags := repoTags(t, tr, "acme"); len(tags) == 0 {
		t.Fatal("nothing copied into acme's repository")
	}
	time.Sleep(200 * time.Millisecond)
	for _, id := range []string{a1.RequestID, a2.RequestID} {
		if n := results.publishes(id); n != 1 {
			t.Errorf("%s published %d times", id, n)
		}
	}
}

// A handler that parked a request and then finds the run gone unparks
// the entry only at the revision it wrote: another message of the same
// request (a redelivery, a requeue) that parked it again meanwhile keeps
// it parked, and the handler's own message is not acked as parked — it
// is tried again. An unconditional unpark turned the later park into a
// plain entry while every message of the request was acked: nobody
// answered the request (the simulation's "stuck", seeds 6, 88 and 102).
func TestAStaleUnparkNeverUndoesALaterPark(t *testing.T) {
	t.Parallel()
	e := setup(t)
	rw := e.startWorker("w1", nil)
	ctx := context.Background()
	req := request("unpark")
	req.RequestID = "r-unpark"
	key := v1.BuildKey(req, kanikoID)
	now := time.Now().UTC()
	// The run the handler parks on (run-1) was replaced by run-2, whose
	// owner is alive.
	if _, ok, err := rw.w.runs.Claim(ctx, &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-2", Owner: "w-other",
		LeaseMs: 60000, LeaseUntil: now.Add(time.Minute), Tenant: req.Tenant, RequestID: "other"}); err != nil || !ok {
		t.Fatalf("claim: ok %v, %v", ok, err)
	}
	le, _, err := rw.w.ledger.Open(ctx, req.Tenant, req.Name, req.RequestID, key, 7, now)
	if err != nil {
		t.Fatal(err)
	}
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	wr := &waiterReg{le: le, park: &ledger.Waiter{Tenant: req.Tenant, RequestID: req.RequestID,
		Subject: v1.RequestSubject(req.Tenant), MsgID: req.RequestID, Seq: 7, MsgTime: now, Body: body}}
	// Between this handler's write and its look at the run, a redelivery
	// of the request parks it on run-2.
	rw.w.park.afterPark = func(k, _, _ string) {
		later := *wr.park
		later.Parked, later.Run, later.ParkedAt, later.Token = true, "run-2", now, le.E.RequeueToken
		if err := rw.w.ledger.PutWaiter(ctx, k, later); err != nil {
			t.Error(err)
		}
	}
	cur := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-1", Owner: "w-gone"}
	parked, err := rw.w.park.park(ctx, wr, key, cur)
	if parked {
		t.Error("the handler's message would be acked as parked, but it unparked the entry")
	}
	if err == nil || !IsTransient(err) {
		t.Errorf("park: %v; want a transient error (the message is tried again)", err)
	}
	items, err := rw.w.ledger.ListWaiters(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, it := range items[key] {
		got = append(got, fmt.Sprintf("parked=%v run=%s", it.V.Parked, it.V.Run))
	}
	if len(got) != 1 || got[0] != "parked=true run=run-2" {
		t.Fatalf("waiter entries %v; want the later park on run-2 to stand", got)
	}
}
