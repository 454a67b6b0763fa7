package worker

// Cache hits taken from the queue (answer.go, docs/design.md §2d): a
// request that intake could not answer because its key was still building
// waits in its tenant's queue; when the queue's handler takes it and the
// build has ended, it is answered the way intake answers a hit — its ledger
// entry created with its decision (one write), one event for the take and
// one for the result, and no published mark unless its ack fails.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// entryWrites is how many times acme's entry of id was written.
func (e *env) entryWrites(t *testing.T, id string) int {
	t.Helper()
	kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	h, err := kv.History(context.Background(), RequestIndexKey("acme", id))
	if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatal(err)
	}
	return len(h)
}

// queuedBehindItsBuild publishes a build of seed and, while its Job runs
// on the worker's only slot, a second request of the same content: intake
// finds the key building and queues it behind the build. It then finishes
// the Job and returns the second request; published (nil: none) is told
// its id as soon as it has one.
func (e *env) queuedBehindItsBuild(t *testing.T, tr *testRegistry, results *resultCollector, seed string, published func(*v1.Request)) *v1.Request {
	t.Helper()
	first := request(seed)
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(first, "kaniko@"+testKaniko.ExecutorImage)))
	queued := e.queueLastSeq(t)
	hit := request(seed)
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	if published != nil {
		published(hit) // the publisher gave it its id; its ack comes after the build
	}
	eventually(t, 5*time.Second, "the second request queued behind the build", func() bool { return e.queueLastSeq(t) > queued })
	e.kubelet(job, 0, tr.push(t, destination(job)))
	if got := results.waitFor(t, 1, 10*time.Second)[0]; got.ID != first.RequestID || got.Data.Origin != v1.OriginBuild {
		t.Fatalf("first result %s", mustJSON(t, got))
	}
	return hit
}

func TestAQueuedCacheHitIsAnsweredWithOneWrite(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", patientLookups(func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1 // the hit waits for the build's slot
	}))
	results := e.collect()
	events := e.events()
	ingested := e.ingestCounter(t)

	hit := e.queuedBehindItsBuild(t, tr, results, "queued-hit", nil)
	second := results.waitFor(t, 2, 10*time.Second)[1]
	if second.ID != hit.RequestID || second.Data.Status != v1.StatusSucceeded || second.Data.Origin != v1.OriginCache {
		t.Fatalf("the queued hit %s", mustJSON(t, second))
	}
	// Settled: its queue message is gone.
	eventually(t, 5*time.Second, "the hit's message settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	time.Sleep(200 * time.Millisecond) // a mark written in the background would land by now
	if n := e.entryWrites(t, hit.RequestID); n != 1 {
		t.Errorf("the hit's ledger entry was written %d times, want once (created with its decision)", n)
	}
	le := e.ledgerEntry("acme", hit.RequestID)
	if le == nil || le.Result == nil || le.Published {
		t.Errorf("the hit's entry %+v: want its decision in it and no published mark (its ack was confirmed)", le)
	}
	if !events.has(hit.RequestID, v1.PhaseQueued) || !events.has(hit.RequestID, v1.PhaseFinished) {
		t.Error("the queued hit has no queued (taken) event or no finished event")
	}
	var phases []v1.Phase
	for _, ev := range events.decoded() {
		if ev.RequestID == hit.RequestID {
			phases = append(phases, ev.Phase)
		}
	}
	if len(phases) != 2 {
		t.Errorf("the queued hit's events %v, want exactly taken and finished", phases)
	}
	if n := ingested(hit.RequestID); n != 1 {
		t.Errorf("the hit's result was published %d times, want once", n)
	}
}

// Its ack lost, the hit's message comes again: the redelivery finds the
// result marked published and publishes nothing.
func TestAQueuedHitWhoseAckIsLostIsMarkedForItsRedelivery(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var lost atomic.Bool
	var target atomic.Value
	target.Store("")
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		// The queued hit's lookups must not give up on a loaded machine:
		// answered in full, it would be marked all the same.
		c.lookupWait = time.Minute
	}, nil, func(w *Worker) {
		w.faults = &faultHooks{loseAck: func(id string) bool { return id == target.Load() && lost.CompareAndSwap(false, true) }}
	})
	results := e.collect()
	ingested := e.ingestCounter(t)

	hit := e.queuedBehindItsBuild(t, tr, results, "queued-lost-ack", func(r *v1.Request) { target.Store(r.RequestID) })
	got := results.waitFor(t, 2, 10*time.Second)
	if got[1].ID != hit.RequestID || got[1].Data.Origin != v1.OriginCache {
		t.Fatalf("the hit %s", mustJSON(t, got[1]))
	}
	eventually(t, 5*time.Second, "the hit's ack lost", lost.Load)
	eventually(t, 5*time.Second, "the hit's entry marked published", func() bool {
		le := e.ledgerEntry("acme", hit.RequestID)
		return le != nil && le.Published
	})
	// Redelivered after AckWait (2 s) and settled.
	eventually(t, 15*time.Second, "the redelivery settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	time.Sleep(200 * time.Millisecond)
	if n := ingested(hit.RequestID); n != 1 {
		t.Errorf("the hit's result was published into the stream %d times, want once: the redelivery published it again", n)
	}
	if n := results.publishes(hit.RequestID); n != 1 {
		t.Errorf("subscribers saw the hit's result %d times, want once", n)
	}
}
