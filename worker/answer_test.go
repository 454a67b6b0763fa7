package worker

// Cache hits at intake (answer.go, docs/design.md §2d): a request whose
// image is built already is answered where it arrives — no queue hop, one
// ledger write, one progress event — and anything with work left goes to
// the fair queue untouched.

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/publisher"
)

// queueLastSeq is BUILDQ_QUEUE's last sequence: it moves whenever a
// request is queued.
func (e *env) queueLastSeq(t *testing.T) uint64 {
	t.Helper()
	st, err := e.js.Stream(context.Background(), v1.QueueStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

// intakeMark is where intake stood: BUILDQ_QUEUE's last sequence and the
// requests the workers ws took straight from intake (fairq's direct.go).
type intakeMark struct {
	e              *env
	queued, direct uint64
	ws             []*runningWorker
}

func (e *env) markIntake(t *testing.T, ws ...*runningWorker) intakeMark {
	t.Helper()
	return intakeMark{e: e, queued: e.queueLastSeq(t), direct: takenDirect(ws...), ws: ws}
}

// handedOn is how many requests intake handed on to a handler since the
// mark — queued, or taken straight from intake — rather than answering
// them itself.
func (m intakeMark) handedOn(t *testing.T) uint64 {
	t.Helper()
	return m.e.queueLastSeq(t) - m.queued + takenDirect(m.ws...) - m.direct
}

// takenDirect is how many requests ws took straight from intake.
func takenDirect(ws ...*runningWorker) uint64 {
	var n uint64
	for _, w := range ws {
		n += w.w.fq.TakenDirect()
	}
	return n
}

// ingestCounter counts every publish into the results stream by request id,
// stored or dropped as a duplicate.
func (e *env) ingestCounter(t *testing.T) func(id string) int {
	t.Helper()
	var mu sync.Mutex
	n := map[string]int{}
	sub, err := e.nc.Subscribe(v1.ResultsIngestPrefix+".>", func(m *nats.Msg) {
		var r v1.Result
		if json.Unmarshal(m.Data, &r) == nil {
			mu.Lock()
			n[r.ID]++
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return func(id string) int {
		mu.Lock()
		defer mu.Unlock()
		return n[id]
	}
}

// entryRevision is the revision of acme's request id's ledger entry.
func (e *env) entryRevision(t *testing.T, id string) uint64 {
	t.Helper()
	kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	got, err := kv.Get(context.Background(), RequestIndexKey("acme", id))
	if err != nil {
		t.Fatalf("ledger entry of %s: %v", id, err)
	}
	return got.Revision()
}

// ledgerWrites is the ledger bucket's last revision: it moves with every
// write.
func (e *env) ledgerWrites(t *testing.T) uint64 {
	t.Helper()
	st, err := e.js.Stream(context.Background(), "KV_"+v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

func TestACacheHitIsAnsweredAtIntakeWithOneWriteAndOneEvent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	events := e.events()

	first := e.buildThrough(t, tr, results, request("at-intake"), 1)
	if first.Data.Origin != v1.OriginBuild {
		t.Fatalf("first %s", mustJSON(t, first))
	}
	if !events.has(first.ID, v1.PhaseQueued) {
		t.Fatal("the build's request has no queued event: no handler took it")
	}
	eventually(t, 5*time.Second, "the build's request marked published", func() bool {
		le := e.ledgerEntry("acme", first.ID)
		return le != nil && le.Published
	})
	mark := e.markIntake(t, w1)
	writesBefore := e.ledgerWrites(t)

	hit := request("at-intake")
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	second := results.waitFor(t, 2, 10*time.Second)[1]
	if second.Data.Origin != v1.OriginCache || second.Data.Status != v1.StatusSucceeded || second.Data.Digest != first.Data.Digest ||
		second.Data.ImageRef != first.Data.ImageRef || second.Data.Key != first.Data.Key {
		t.Fatalf("the hit's result %s", mustJSON(t, second))
	}
	if n := mark.handedOn(t); n != 0 {
		t.Errorf("intake handed %d requests on to a handler: the hit was not answered at intake", n)
	}
	// One progress event, finished, comes before the result.
	var phases []v1.Phase
	for _, ev := range events.decoded() {
		if ev.RequestID == hit.RequestID {
			phases = append(phases, ev.Phase)
		}
	}
	if len(phases) != 1 || phases[0] != v1.PhaseFinished {
		t.Errorf("the hit's progress events: %v, want [finished]", phases)
	}
	// One write to the ledger: the entry created with its decision.
	le, rev := e.ledgerEntry("acme", hit.RequestID), e.entryRevision(t, hit.RequestID)
	if le == nil || le.Result == nil || decision(*le.Result) != decision(second.Data) || le.Worker != "w1" {
		t.Errorf("the hit's ledger entry %s, want the published decision", mustJSON(t, le))
	}
	if le.Published {
		t.Errorf("the hit's entry was marked published although its ack came back: %s", mustJSON(t, le))
	}
	eventually(t, 5*time.Second, "the hit's message acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if after := e.ledgerWrites(t); after != writesBefore+1 || rev != after {
		t.Errorf("the ledger's last write is %d after the hit, %d before (the hit's entry at revision %d): want exactly one write, the entry's",
			after, writesBefore, rev)
	}
	if n := results.publishes(hit.RequestID); n != 1 {
		t.Errorf("the hit's result was published %d times", n)
	}
}

// A hit with work left — a copy into another repository — is the queue's:
// it is taken from there, like any request, and answered from the cache.
func TestAHitThatNeedsACopyGoesThroughTheQueue(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", patientLookups(withRegistry(tr)))
	results := e.collect()
	events := e.events()

	first := e.buildThrough(t, tr, results, request("copy-queued"), 1)
	mark := e.markIntake(t, w1)
	other := request("copy-queued")
	other.Image = tr.host + "/acme/elsewhere/app"
	if _, err := e.pub.Publish(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 2, 10*time.Second)[1]
	if got.Data.Origin != v1.OriginCache || got.Data.Digest != first.Data.Digest || got.Data.ImageRef != other.Image+"@"+first.Data.Digest {
		t.Fatalf("the copy's result %s", mustJSON(t, got))
	}
	// The copy was made, whichever way the request went: a hit answered
	// without it would name an image its destination does not hold.
	if d, err := tr.client.Head(context.Background(), got.Data.ImageRef); err != nil || d != first.Data.Digest {
		t.Errorf("the copy's destination %s holds %q (%v), want %s", got.Data.ImageRef, d, err, first.Data.Digest)
	}
	if n := mark.handedOn(t); n != 1 {
		t.Errorf("intake handed %d requests on to a handler, want the copy (queued, or taken straight from intake)", n)
	}
	if !events.has(other.RequestID, v1.PhaseQueued) {
		t.Error("the copy has no queued event")
	}
}

// The ack of a hit answered at intake is lost: the result is marked
// published, so the redelivery — which goes to the queue — publishes
// nothing again and is acked.
func TestAHitWhoseAckIsLostIsMarkedForItsRedelivery(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	hit := request("lost-intake-ack")
	// The hook reads the id, not hit, which the publisher writes to (its
	// time of submission; its id when it has none).
	hit.RequestID = publisher.NewRequestID()
	hitID := hit.RequestID
	var lost atomic.Bool
	e.startWorkerHooked("w1", patientLookups(withRegistry(tr)), nil, func(w *Worker) {
		w.faults = &faultHooks{loseAck: func(id string) bool { return id == hitID && lost.CompareAndSwap(false, true) }}
	})
	results := e.collect()
	// Every publish into the results stream, stored or not: the mark is
	// what spares the redelivery a second one.
	ingested := e.ingestCounter(t)
	e.buildThrough(t, tr, results, request("lost-intake-ack"), 1)

	queued := e.queueLastSeq(t)
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	second := results.waitFor(t, 2, 10*time.Second)[1]
	if second.Data.Origin != v1.OriginCache {
		t.Fatalf("the hit %s", mustJSON(t, second))
	}
	eventually(t, 5*time.Second, "the hit's ack lost", lost.Load)
	eventually(t, 5*time.Second, "the hit's entry marked published", func() bool {
		le := e.ledgerEntry("acme", hit.RequestID)
		return le != nil && le.Published
	})
	// Redelivered after AckWait (2 s), through the queue, and acked.
	eventually(t, 15*time.Second, "the redelivery queued and settled", func() bool {
		msgs, pending, _ := e.streamState()
		return e.queueLastSeq(t) == queued+1 && msgs == 0 && pending == 0
	})
	time.Sleep(200 * time.Millisecond)
	if n := results.publishes(hit.RequestID); n != 1 {
		t.Errorf("subscribers saw the hit's result %d times, want once", n)
	}
	if n := ingested(hit.RequestID); n != 1 {
		t.Errorf("the hit's result was published into the stream %d times, want once: the redelivery published it again", n)
	}
	if got := results.snapshot(); len(got) != 2 {
		t.Errorf("%d results stored, want 2", len(got))
	}
}

// Two tenants may push to one repository (--allowed-destination): there a
// hit needs no copy, and intake answers it only for a tenant shown to hold
// the content. Mallory, who knows the digest and holds no such object,
// goes to the queue and is refused there, with nothing of acme's build.
func TestAHitInASharedRepositoryNeedsPossessionAtIntake(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	w1 := e.startWorker("w1", patientLookups(func(c *Config) {
		withRegistry(tr)(c)
		c.Contexts = store
		c.Naming.Allowed = []string{"{registry}/shared/**"}
	}))
	results := e.collect()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's"})
	store.put(s3store.TenantContextKey("acme", digest), archive)
	acme := tenantRequestFor("acme", digest)
	acme.Image = tr.host + "/shared/app"
	built := e.buildThrough(t, tr, results, acme, 1)
	if built.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's build: %s", mustJSON(t, built))
	}
	// Acme's own hit, answered at intake: its possession was shown.
	mark := e.markIntake(t, w1)
	again := tenantRequestFor("acme", digest)
	again.Image = acme.Image
	if _, err := e.pub.Publish(context.Background(), again); err != nil {
		t.Fatal(err)
	}
	if r := byID(results.waitFor(t, 2, 10*time.Second))[again.RequestID]; len(r) != 1 || r[0].Data.Origin != v1.OriginCache {
		t.Fatalf("acme's hit: %s", mustJSON(t, r))
	}
	if mark.handedOn(t) != 0 {
		t.Fatal("acme's hit in its shared repository was handed on to a handler, not answered at intake")
	}

	m := tenantRequestFor("mallory", digest)
	m.Image = acme.Image
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	got := byID(results.waitFor(t, 3, 10*time.Second))[m.RequestID]
	if len(got) != 1 || got[0].Data.Status != v1.StatusFailed || got[0].Data.Reason != v1.ReasonContextMissing || got[0].Data.Digest != "" {
		t.Fatalf("mallory's request: %s, want one ContextMissing result with nothing of acme's build", mustJSON(t, got))
	}
}

// The registry's word on an indexed image is remembered for a second
// (indexCheckFresh): an image deleted after a hit is noticed by the first
// request that comes later than that, and built again.
func TestAnImageDeletedAfterAHitIsNoticedWithinASecond(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	first := e.buildThrough(t, tr, results, request("deleted-after-hit"), 1)
	if _, err := e.pub.Publish(context.Background(), request("deleted-after-hit")); err != nil {
		t.Fatal(err)
	}
	if hit := results.waitFor(t, 2, 10*time.Second)[1]; hit.Data.Origin != v1.OriginCache {
		t.Fatalf("the hit %s", mustJSON(t, hit))
	}
	e.deleteBuilt(t, first)
	time.Sleep(indexCheckFresh + 100*time.Millisecond)
	again := e.buildThrough(t, tr, results, request("deleted-after-hit"), 3)
	if again.Data.Origin != v1.OriginBuild || again.Data.Status != v1.StatusSucceeded {
		t.Fatalf("the request after the deletion %s, want a new build", mustJSON(t, again))
	}
}
