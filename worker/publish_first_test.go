package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// resultAtRecord watches a worker's writes of request id's ledger entry:
// at the first write of a decision it waits up to two seconds for the
// result to be out, and sends on the channel whether it was (recorded
// first, it cannot be: the publish waits for the record). It counts the
// writes of a decision.
type resultAtRecord struct {
	seen   chan bool
	writes atomic.Int32
}

// hook wraps w's ledger bucket; results is read when the hook runs.
func (r *resultAtRecord) hook(w *Worker, tenant, id string, results **resultCollector) {
	r.seen = make(chan bool, 1)
	lk := RequestIndexKey(tenant, id)
	w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) error {
		if k != lk || !bytes.Contains(value, []byte(`"result":`)) || r.writes.Add(1) != 1 {
			return nil
		}
		out := func() bool { return len((*results).pubsOf(tenant, id)) > 0 }
		for deadline := time.Now().Add(2 * time.Second); !out() && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		r.seen <- out()
		return nil
	}})
}

// buildOnce publishes req and plays a kubelet that pushes its image;
// it returns the first result.
func (e *env) buildOnce(t *testing.T, tr *testRegistry, results *resultCollector, req *v1.Request) v1.Result {
	t.Helper()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	return results.waitFor(t, 1, 10*time.Second)[0]
}

// A finished build's result goes out before any write: its decision is
// recorded after it, with its published mark, in one write (P2: the
// result's publish is the first thing after the Job completes).
func TestAFinishedBuildsResultGoesOutBeforeItsDecisionIsRecorded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var results *resultCollector
	req := request("publish-first")
	req.RequestID = "publish-first"
	lk := RequestIndexKey(req.Tenant, req.RequestID)
	var at resultAtRecord
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) { at.hook(w, req.Tenant, req.RequestID, &results) })
	results = e.collect()
	got := e.buildOnce(t, tr, results, req)
	if !<-at.seen {
		t.Fatal("the decision was recorded before the result went out")
	}
	if got.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s, want succeeded", mustJSON(t, got))
	}
	eventually(t, 5*time.Second, "the decision recorded, marked published", func() bool {
		le, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
		if err != nil {
			return false
		}
		ent, err := le.Get(context.Background(), lk)
		if err != nil {
			return false
		}
		var re v1.RequestEntry
		return json.Unmarshal(ent.Value(), &re) == nil && re.Result != nil && re.Published && re.Result.Digest == got.Data.Digest
	})
	if n := at.writes.Load(); n != 1 {
		t.Fatalf("%d writes of the decision, want one (the decision with its published mark)", n)
	}
}

// A cancel that reaches a request whose build's result was just stored,
// while its handler records it, says the request had finished: the
// stored result is the request's, and the entry ends holding it.
func TestACancelOfARequestWhoseResultWasPublishedFirstSaysItFinished(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var results *resultCollector
	req := request("cancel-after-first")
	req.RequestID = "cancel-after-first"
	lk := RequestIndexKey(req.Tenant, req.RequestID)
	blocked, release := make(chan struct{}), make(chan struct{})
	var once atomic.Bool
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) error {
			if k == lk && bytes.Contains(value, []byte(`"published":true`)) && once.CompareAndSwap(false, true) {
				close(blocked) // the handler's record of its stored result
				<-release
			}
			return nil
		}})
	})
	results = e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	<-blocked
	got := results.waitFor(t, 1, 10*time.Second)[0]
	replied := make(chan v1.CancelReply, 1)
	go func() { replied <- cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), req.RequestID) }()
	eventually(t, 5*time.Second, "the cancel's mark", func() bool {
		kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
		if err != nil {
			return false
		}
		ent, err := kv.Get(context.Background(), lk)
		var re v1.RequestEntry
		return err == nil && json.Unmarshal(ent.Value(), &re) == nil && re.Canceled
	})
	close(release)
	rep := <-replied
	if rep.Canceled {
		t.Fatalf("the cancel said canceled (%+v), and the request's stored result is %s", rep, mustJSON(t, got))
	}
	if got.Data.Status != v1.StatusSucceeded || len(results.pubsOf(req.Tenant, req.RequestID)) != 1 {
		t.Fatalf("results %+v, want the build's succeeded once", results.pubsOf(req.Tenant, req.RequestID))
	}
	kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	ent, err := kv.Get(context.Background(), lk)
	if err != nil {
		t.Fatal(err)
	}
	var re v1.RequestEntry
	if err := json.Unmarshal(ent.Value(), &re); err != nil || re.Result == nil || re.Result.Status != v1.StatusSucceeded || !re.Published {
		t.Fatalf("entry %s, want the stored succeeded, marked published", ent.Value())
	}
}

// Whoever sees a result published first and asks again before the run's
// end is stored joins the ended run: the same image, and no second
// build.
func TestAskingAgainBeforeARunsEndIsStoredGetsTheSameImage(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	release := make(chan struct{})
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(), onUpdate: func(_ string, value []byte) error {
			var r v1.BuildRecord
			if json.Unmarshal(value, &r) == nil && r.State == v1.StateSucceeded {
				<-release // the run's end held back
			}
			return nil
		}})
	})
	results := e.collect()
	first := request("ask-again")
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(first, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if rec := e.claim(key); rec == nil || rec.State != v1.StateBuilding {
		t.Fatalf("the run's record %+v when the result came, want it still building (its end held back)", rec)
	}
	again := request("ask-again")
	again.RequestID = "ask-again-2"
	if _, err := e.pub.Publish(context.Background(), again); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the second request meets the unended run
	close(release)
	all := results.waitFor(t, 2, 10*time.Second)
	second := all[1].Data
	if second.RequestID != again.RequestID || second.Status != v1.StatusSucceeded || second.Digest != got.Data.Digest || second.Origin == v1.OriginBuild {
		t.Fatalf("second result %+v, want succeeded with the first's digest %s and not a build of its own", second, got.Data.Digest)
	}
	if rec := e.claim(key); rec == nil || rec.State != v1.StateSucceeded || rec.Digest != got.Data.Digest {
		t.Fatalf("record after %+v, want the first run ended succeeded", rec)
	}
}
