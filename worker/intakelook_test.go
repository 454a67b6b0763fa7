package worker

// Intake's look carried to the handler (intakelook.go): the absence of a
// record intake read stands for a moment, and a worker with a slot free
// sends the preflight HEAD from intake, beside the queue's hop.

import (
	"context"
	"sync"
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
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the second request queued", func() bool { return e.queueLastSeq(t) == 1 })
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
	w1 := e.startWorker("w1", withRegistry(tr))
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
