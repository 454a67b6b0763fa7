package worker

// Intake's look carried to the handler (intakelook.go): the absence of a
// record intake read stands for a moment, and a worker with a slot free
// sends the preflight HEAD from intake, beside the queue's hop.

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// headCounter counts the registry HEADs of each reference.
type headCounter struct {
	Registry
	mu    sync.Mutex
	heads map[string]int
}

func (h *headCounter) Head(ctx context.Context, ref string) (string, error) {
	h.mu.Lock()
	if h.heads == nil {
		h.heads = map[string]int{}
	}
	h.heads[ref]++
	h.mu.Unlock()
	return h.Registry.Head(ctx, ref)
}

func (h *headCounter) count(ref string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.heads[ref]
}

// An idle worker sends a new build's preflight HEAD from intake: it is
// under way while the handler has not even begun its walk.
func TestAPreflightIsSentAheadFromIntake(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	reg := &headCounter{Registry: tr.client}
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	t.Cleanup(open)
	w1 := e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.Registry = reg }, nil, func(w *Worker) {
		w.faults = &faultHooks{beforeWalk: func(string) {
			select {
			case <-release:
			case <-time.After(10 * time.Second):
			}
		}}
	})
	results := e.collect()
	req := request("preflight-ahead")
	tag := tr.host + "/acme/web:" + v1.DefaultTag(v1.BuildKey(req, kanikoID))
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the preflight HEAD sent while the handler waits before its walk", func() bool { return reg.count(tag) > 0 })
	open()
	job := e.waitJob(jobOf(req))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

// A busy worker sends none: a request queued behind others would have its
// HEAD's answer stale by the time it is taken, and a backlog would cost a
// HEAD each for nothing.
func TestABusyWorkerSendsNoPreflightAhead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	reg := &headCounter{Registry: tr.client}
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Registry = reg; c.MaxInFlight = 1 })
	results := e.collect()
	r1, r2 := request("busy-ahead-1"), request("busy-ahead-2")
	tag2 := tr.host + "/acme/web:" + v1.DefaultTag(v1.BuildKey(r2, kanikoID))
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	j1 := e.waitJob(jobOf(r1))
	// The first request went straight from intake if the dispatcher was
	// idle by then, and through the queue if it was not: the second is
	// queued behind whichever it was.
	queued := e.queueLastSeq(t)
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the second request queued", func() bool { return e.queueLastSeq(t) == queued+1 })
	time.Sleep(300 * time.Millisecond)
	if n := reg.count(tag2); n != 0 {
		t.Fatalf("%d HEADs of the queued request's tag while the worker had no slot free", n)
	}
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	j2 := e.waitJob(jobOf(r2))
	if n := reg.count(tag2); n != 1 {
		t.Errorf("%d HEADs of the second request's tag once taken, want its handler's one", n)
	}
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	results.waitFor(t, 2, 10*time.Second)
}

// A tenant with a concurrency limit is never taken straight from intake:
// its requests wait in its queue, and intake sends no HEAD ahead for them
// even on an idle worker.
func TestALimitedTenantGetsNoPreflightAhead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	reg := &headCounter{Registry: tr.client}
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Registry = reg
		c.Fair.Concurrency = map[string]int{"acme": 1}
	})
	results := e.collect()
	r1, r2 := request("limited-ahead-1"), request("limited-ahead-2")
	tag2 := tr.host + "/acme/web:" + v1.DefaultTag(v1.BuildKey(r2, kanikoID))
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	j1 := e.waitJob(jobOf(r1))
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the second request queued", func() bool { return e.queueLastSeq(t) == 2 })
	time.Sleep(300 * time.Millisecond)
	if n := reg.count(tag2); n != 0 {
		t.Fatalf("%d HEADs of a request waiting at its tenant's limit", n)
	}
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	j2 := e.waitJob(jobOf(r2))
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	results.waitFor(t, 2, 10*time.Second)
}

// The absence of a record intake saw stands for lookAheadFresh only: a key
// built meanwhile (here by another worker, its record put) is a cache hit
// at intake once that moment has passed — and not before.
func TestAnAbsenceSeenAtIntakeStandsForAMomentOnly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", patientLookups(withRegistry(tr)))
	results := e.collect()
	req := request("absence")
	key := v1.BuildKey(req, kanikoID)
	repo := tr.host + "/acme/web"
	digest := tr.push(t, repo+":"+v1.DefaultTag(key))

	// Intake read the key a moment ago and found no record; the record
	// appears (another worker's build).
	w1.w.builds.looks.sawAbsent(key, time.Now())
	e.atkPutRecord(t, atkSucceeded(key, repo, digest, "acme"))
	mark := e.markIntake(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if got := oneResult(t, results, req.RequestID); got.Data.Status != v1.StatusSucceeded || got.Data.Digest != digest {
		t.Fatalf("the request within the moment: %s", decision(got.Data))
	}
	if mark.handedOn(t) != 1 {
		t.Error("within the moment the absence stands, the request was answered at intake without reading the record")
	}

	// Once the moment has passed, the record is read: a hit at intake.
	time.Sleep(lookAheadFresh + 50*time.Millisecond)
	mark = e.markIntake(t, w1)
	again := request("absence")
	if _, err := e.pub.Publish(context.Background(), again); err != nil {
		t.Fatal(err)
	}
	if got := oneResult(t, results, again.RequestID); got.Data.Status != v1.StatusSucceeded || got.Data.Digest != digest {
		t.Fatalf("the request after the moment: %s", decision(got.Data))
	}
	if n := mark.handedOn(t); n != 0 {
		t.Errorf("an absence older than %s kept a cache hit from intake (%d handed on)", lookAheadFresh, n)
	}
}

// readHeldUntil is a beforeRecordRead hook that holds intake's read of
// key's record until cond holds, for up to 150 ms — within intake's lookup
// deadline, so the request goes on as it would — and records in met that
// cond held meanwhile.
func readHeldUntil(key string, cond func() bool, met *atomic.Bool) func(string) {
	return func(k string) {
		if k != key {
			return
		}
		for deadline := time.Now().Add(150 * time.Millisecond); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if cond() {
				met.Store(true)
				return
			}
		}
	}
}

// An idle worker that knows no record of a new build's key sends its
// preflight HEAD beside intake's read of the record, not after it: the
// HEAD, the longest of the look, does not wait on the read.
func TestAPreflightAheadGoesBesideIntakesRecordRead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	reg := &headCounter{Registry: tr.client}
	req := request("preflight-beside-read")
	key := v1.BuildKey(req, kanikoID)
	tag := tr.host + "/acme/web:" + v1.DefaultTag(key)
	var beside atomic.Bool
	w1 := e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.Registry = reg }, nil, func(w *Worker) {
		// A HEAD sent after the read cannot come while it is held.
		w.faults = &faultHooks{beforeRecordRead: readHeldUntil(key, func() bool { return reg.count(tag) > 0 }, &beside)}
	})
	results := e.collect()
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if !beside.Load() {
		t.Error("no preflight HEAD was sent while intake read the record")
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if n := reg.count(tag); n != 1 {
		t.Errorf("%d HEADs of the request's tag, want the one sent ahead", n)
	}
}

// A key this worker knows built sends no HEAD beside the read: its hits,
// answered at intake, cost no HEAD of their tag each.
func TestHitsOfAKnownKeySendNoPreflightAhead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	reg := &headCounter{Registry: tr.client}
	w1 := e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Registry = reg })
	results := e.collect()
	req := request("hits-known-key")
	key := v1.BuildKey(req, kanikoID)
	tag := tr.host + "/acme/web:" + v1.DefaultTag(key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	results.waitFor(t, 1, 10*time.Second)
	eventually(t, 5*time.Second, "the key's succeeded record shown by the records' watch", func() bool {
		rec, _, ok := w1.w.room.watchedRecord(key)
		return ok && rec.State == v1.StateSucceeded
	})
	before := reg.count(tag)
	for range 3 {
		// Past lookAheadFresh: a HEAD sent before is not sent again
		// while it stands, so it would hide one sent for a hit.
		time.Sleep(lookAheadFresh)
		waitIdle(t, w1)
		if _, err := e.pub.Publish(context.Background(), request("hits-known-key")); err != nil {
			t.Fatal(err)
		}
	}
	got := results.waitFor(t, 4, 10*time.Second)
	for _, r := range got[1:] {
		if r.Data.Origin != v1.OriginCache {
			t.Fatalf("result %s, want a cache hit", mustJSON(t, r))
		}
	}
	if n := reg.count(tag) - before; n != 0 {
		t.Errorf("%d HEADs of the tag for 3 hits of a key the worker knows built, want 0", n)
	}
}
