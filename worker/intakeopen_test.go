package worker

// The ledger entry opened beside intake's read (intakeopen.go).

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
)

// An idle worker that knows no record of a new build's key creates the
// request's ledger entry beside intake's read of the record, and its
// handler builds on that entry.
func TestTheLedgerEntryIsOpenedBesideIntakesRecordRead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	req := request("open-beside-read")
	req.RequestID = publisher.NewRequestID()
	id, key := req.RequestID, v1.BuildKey(req, kanikoID)
	var beside atomic.Bool
	w1 := e.startWorkerHooked("w1", nil, nil, func(w *Worker) {
		// An entry created after the read cannot come while it is held.
		w.faults = &faultHooks{beforeRecordRead: readHeldUntil(key, func() bool { return e.ledgerEntry("acme", id) != nil }, &beside)}
	})
	results := e.collect()
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if !beside.Load() {
		t.Error("the request's ledger entry was not created while intake read the record")
	}
	e.kubelet(job, 0, digestOf("open-beside-read"))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Attempts != 1 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	// Published first: the decision is recorded a moment after the result.
	eventually(t, 10*time.Second, "the request's decision in its ledger entry", func() bool {
		le := e.ledgerEntry("acme", id)
		return le != nil && le.Result != nil && le.Result.Status == v1.StatusSucceeded
	})
}

// A hit of a key the worker had not seen has its entry opened ahead like a
// build's; it is answered once, from the cache, with its decision recorded
// on that entry.
func TestAHitOnAnEntryOpenedAheadIsAnsweredOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	first := request("open-ahead-hit")
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(first))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	results.waitFor(t, 1, 10*time.Second)
	w1.stop(t)
	// A worker started after the build knows nothing of its key.
	w2 := e.startWorker("w2", withRegistry(tr))
	waitIdle(t, w2)
	hit := request("open-ahead-hit")
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 2, 10*time.Second)[1]
	if got.ID != hit.RequestID || got.Data.Status != v1.StatusSucceeded || got.Data.Origin != v1.OriginCache {
		t.Fatalf("result %s, want the hit answered from the cache", mustJSON(t, got))
	}
	time.Sleep(300 * time.Millisecond)
	if n := len(results.snapshot()); n != 2 {
		t.Fatalf("%d results, want one per request", n)
	}
	if le := e.ledgerEntry("acme", hit.RequestID); le == nil || le.Result == nil || le.Result.Origin != v1.OriginCache {
		t.Fatalf("ledger entry %s, want the hit's decision", mustJSON(t, le))
	}
	eventually(t, 5*time.Second, "the hit's message acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// A cancel that marks the entry intake created ahead, before the handler
// took that create, reaches the handler: the request is answered canceled
// at once and no Job is created for it. Here the cancel's record of its
// "canceled" is lost, so its mark and its notice to the handler are all
// that stop the build (a recorded decision would stop it anyway: the
// handler looks for one before claiming).
func TestACancelBetweenTheCreateAheadAndItsHandlerStopsTheRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	req := request("cancel-open-ahead")
	req.RequestID = publisher.NewRequestID()
	id, key := req.RequestID, v1.BuildKey(req, kanikoID)
	ready, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	var created atomic.Bool
	untilCreated := readHeldUntil(key, func() bool { return e.ledgerEntry("acme", id) != nil }, &created)
	lk := RequestIndexKey("acme", id)
	var lost atomic.Bool
	w1 := e.startWorkerHooked("w1", nil, nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) error {
			if k == lk && bytes.Contains(value, []byte(`"result":`)) && lost.CompareAndSwap(false, true) {
				return errors.New("the cancel's record is lost")
			}
			return nil
		}})
		w.faults = &faultHooks{beforeRecordRead: func(k string) {
			if k != key {
				return
			}
			// Intake's read waits for the entry created beside it, and
			// then for the cancel, within intake's lookup deadline.
			untilCreated(k)
			once.Do(func() { close(ready) })
			select {
			case <-proceed:
			case <-time.After(200 * time.Millisecond):
			}
		}}
	})
	results := e.collect()
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ready:
	case <-time.After(5 * time.Second):
		t.Fatal("intake never read the record")
	}
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), id)
	close(proceed)
	if !rep.Canceled {
		t.Fatalf("cancel reply %+v, want the request canceled (its entry was created ahead)", rep)
	}
	r := results.waitFor(t, 1, 3*time.Second)[0]
	if r.ID != id || r.Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s, want the request canceled", mustJSON(t, r))
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created for a request canceled before its handler took it", n)
	}
}

// A hit whose look took longer than lookAheadFresh (a loaded machine) is
// still decided on the entry intake opened for it: its compare-and-swap
// finds whatever changed the entry since, so age does not matter, and
// without it the hit would find its own entry and go to the queue.
func TestAHitIsDecidedOnItsOpenedEntryOfAnyAge(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", patientLookups(nil))
	req := request("opened-hit-age")
	req.RequestID = publisher.NewRequestID()
	key := v1.BuildKey(req, kanikoID)
	at := time.Now()
	w1.w.builds.sendOpen(context.Background(), req, key, 7, at)
	time.Sleep(lookAheadFresh + 50*time.Millisecond)
	le, opened, ok := w1.w.openedHit(context.Background(), req, 7)
	if !opened || !ok || le == nil || le.E.RequestID != req.RequestID || le.E.Seq != 7 {
		t.Fatalf("opened %v ok %v entry %+v, want the entry intake created", opened, ok, le)
	}
	// Taken once: nobody else finds it after.
	if o := w1.w.builds.takeOpen(req.Tenant, req.RequestID, 7, false); o != nil {
		t.Fatal("the create was taken twice")
	}
}
