package worker

// The key's claim sent by intake beside the request's entry create
// (intakeclaim.go): taken by the request's handler, withdrawn otherwise.

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/publisher"
)

// claimWorld is a worker whose build Pods check their tag (the claim-first
// path), with a hook on each create of the builds bucket and the ledger
// bucket.
func claimWorld(t *testing.T, onClaim, onEntry func(key string) error) (*env, *runningWorker, *resultCollector) {
	t.Helper()
	e := setup(t)
	tr := newTestRegistry(t)
	w, _ := e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, func(w *Worker) {
		withPresigner(w)
		w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(), onCreate: func(k string, _ []byte) error { return onClaim(k) }})
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onCreate: func(k string, _ []byte) error { return onEntry(k) }})
	})
	results := e.collect()
	return e, w, results
}

// A fresh key's request taken straight from intake is claimed while its
// ledger entry's create is still on its way: the claim no longer waits for
// it. Its handler builds under that claim, and the request is answered
// once.
func TestAFreshKeyIsClaimedBesideItsEntrysCreate(t *testing.T) {
	t.Parallel()
	req := request("claim-beside-create")
	req.RequestID = publisher.NewRequestID()
	key, lk := v1.BuildKey(req, kanikoID), RequestIndexKey("acme", req.RequestID)
	var claimed, beside atomic.Bool
	e, w, results := claimWorld(t,
		func(k string) error {
			if k == key {
				claimed.Store(true)
			}
			return nil
		},
		func(k string) error {
			if k != lk {
				return nil
			}
			// The entry's create is held until the key is claimed, for
			// up to 5 s: a claim made after the create cannot come.
			deadline := time.Now().Add(5 * time.Second)
			for !claimed.Load() && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			beside.Store(claimed.Load())
			return nil
		})
	waitIdle(t, w)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if !beside.Load() {
		t.Error("the key was not claimed while the request's entry was being created")
	}
	rec := e.claim(key)
	if rec == nil || rec.Run != job.Annotations[kaniko.AnnotationRun] || rec.Holder != lk {
		t.Fatalf("the key's record %+v, want the run of Job %s held by the request", rec, job.Name)
	}
	e.kubelet(job, 0, digestOf(req.RequestID))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r.Data))
	}
}

// A message that reuses an earlier request's id is no new request: the
// claim intake sent for its key is withdrawn, leaving the key absent, not
// building for a request nobody handles. A request of that key then
// builds under a run of its own.
func TestAClaimSentAheadForADuplicateIsWithdrawn(t *testing.T) {
	t.Parallel()
	first := request("claim-ahead-first")
	first.RequestID = publisher.NewRequestID()
	dup := request("claim-ahead-dup")
	dup.RequestID = first.RequestID
	dupKey := v1.BuildKey(dup, kanikoID)
	var dupClaimed atomic.Bool
	e, w, results := claimWorld(t, func(k string) error {
		if k == dupKey {
			dupClaimed.Store(true)
		}
		return nil
	}, func(string) error { return nil })
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(first))
	e.kubelet(job, 0, digestOf(first.RequestID))
	oneResult(t, results, first.RequestID)

	// Past the requests stream's duplicate window (narrowed to a second
	// here), the server stores a message of the same id again.
	ctx := context.Background()
	e.narrowDuplicateWindow(t, v1.RequestsStream)
	time.Sleep(1500 * time.Millisecond)
	waitIdle(t, w)
	if ack, err := e.pub.Publish(ctx, dup); err != nil || ack.Duplicate {
		t.Fatalf("publish of the reused id = %+v, %v; want it stored", ack, err)
	}
	eventually(t, 10*time.Second, "the duplicate's key claimed ahead", dupClaimed.Load)
	eventually(t, 10*time.Second, "the claim of the duplicate's key withdrawn", func() bool { return e.claim(dupKey) == nil })
	eventually(t, 10*time.Second, "the duplicate's message settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if rec := e.claim(dupKey); rec != nil {
		t.Fatalf("the duplicate's key holds %+v after its message was settled, want no record", rec)
	}

	next := request("claim-ahead-dup")
	next.RequestID = publisher.NewRequestID()
	if _, err := e.pub.Publish(context.Background(), next); err != nil {
		t.Fatal(err)
	}
	nj := e.waitJob(jobOf(next))
	e.kubelet(nj, 0, digestOf(next.RequestID))
	if r := oneResult(t, results, next.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r.Data))
	}
	if n := len(byID(results.snapshot())[first.RequestID]); n != 1 {
		t.Errorf("the first request answered %d times, want once (its duplicate gets no result of its own)", n)
	}
}

// A claim intake sent that no handler takes (its request was queued after
// all) is withdrawn after a moment. A request of the key that saw it
// meanwhile builds under a run of its own, never the withdrawn one taken
// over once its lease lapsed.
func TestAClaimSentAheadNobodyTakesIsWithdrawn(t *testing.T) {
	t.Parallel()
	req := request("claim-ahead-untaken")
	req.RequestID = publisher.NewRequestID()
	key := v1.BuildKey(req, kanikoID)
	var claims atomic.Int32
	e, w, results := claimWorld(t, func(k string) error {
		if k == key {
			claims.Add(1)
		}
		return nil
	}, func(string) error { return nil })
	b := w.w.builds
	repo, err := b.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	// Sent as intake sends it, for a message no handler will take.
	b.sendClaim(context.Background(), req, key, repo, naming.Destinations(repo, key, req.Tags), 1<<40)
	eventually(t, 10*time.Second, "the key claimed ahead", func() bool { return e.claim(key) != nil })
	untaken := e.claim(key)
	if untaken.State != v1.StateBuilding || untaken.Owner != "w1" {
		t.Fatalf("the claim sent ahead is %+v, want a run building, owned by w1", untaken)
	}
	// A request of the key comes while the claim stands (on a slow
	// machine, perhaps just after its withdrawal: it claims anew then).
	other := request("claim-ahead-untaken")
	other.RequestID = publisher.NewRequestID()
	if _, err := e.pub.Publish(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(other))
	if run := job.Annotations[kaniko.AnnotationRun]; run == untaken.Run {
		t.Fatalf("Job %s builds the withdrawn run %s, taken over; want a run of the request's own", job.Name, run)
	}
	if n := claims.Load(); n < 2 {
		t.Errorf("the key was claimed %d times, want the withdrawn claim and the request's own", n)
	}
	e.kubelet(job, 0, digestOf(other.RequestID))
	if r := oneResult(t, results, other.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r.Data))
	}
}

// sendClaimFor claims req's key as intake does for its message at seq, and
// waits until the claim is stored.
func sendClaimFor(t *testing.T, e *env, w *runningWorker, req *v1.Request, seq uint64) *v1.BuildRecord {
	t.Helper()
	b := w.w.builds
	key := v1.BuildKey(req, kanikoID)
	repo, err := b.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	b.sendClaim(context.Background(), req, key, repo, naming.Destinations(repo, key, req.Tags), seq)
	eventually(t, 10*time.Second, "the key claimed ahead", func() bool { return e.claim(key) != nil })
	return e.claim(key)
}

// A claim sent for another message of the request's id — a requeued
// request's new message, whose handler walks at its entry's first
// sequence — is withdrawn by the walk of that request, which would
// otherwise find its own claim and wait on it; the handler of a message
// that merely reuses the id (dropClaim) leaves it alone.
func TestAClaimSentForAnotherMessageOfTheIDIsWithdrawnByItsWalk(t *testing.T) {
	t.Parallel()
	req := request("claim-ahead-other-message")
	req.RequestID = publisher.NewRequestID()
	key := v1.BuildKey(req, kanikoID)
	e, w, _ := claimWorld(t, func(string) error { return nil }, func(string) error { return nil })
	sendClaimFor(t, e, w, req, 1<<40)
	w.w.builds.dropClaim(req, 7)
	if c := e.claim(key); c == nil {
		t.Fatal("a message reusing the id withdrew the claim of another message of it")
	}
	c, gone := w.w.builds.takeClaim(req, 7, true)
	if c != nil || gone == nil {
		t.Fatalf("takeClaim for another message of the id = %v, %v; want the claim withdrawn, not taken", c, gone)
	}
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the withdrawal was not written")
	}
	// Within lookAheadFresh of its sending: the withdrawal is the walk's,
	// not the timer's.
	if rec := e.claim(key); rec != nil {
		t.Fatalf("the key holds %+v after the walk's withdrawal", rec)
	}
}

// A worker that stops withdraws the claims it sent that no handler took,
// before it lets go of its connection: the requests it hands back must
// not find claims of theirs standing until the lease lapses.
func TestAStoppingWorkerWithdrawsTheClaimsItSentAhead(t *testing.T) {
	t.Parallel()
	req := request("claim-ahead-stopping")
	req.RequestID = publisher.NewRequestID()
	key := v1.BuildKey(req, kanikoID)
	e, w, _ := claimWorld(t, func(string) error { return nil }, func(string) error { return nil })
	sendClaimFor(t, e, w, req, 1<<40)
	w.stop(t)
	if rec := e.claim(key); rec != nil {
		t.Fatalf("the key holds %+v after its worker stopped, want the claim withdrawn", rec)
	}
}

// The entry intake created for a message stands for the check that the
// request is unanswered for lookAheadFresh only: a handler that reaches
// its walk later (a stall, a slow possession check) reads the entry, and
// a request answered meanwhile — its redelivered copy, elsewhere —
// claims nothing and builds nothing.
func TestAStaleEntryCreateIsNoAnsweredCheck(t *testing.T) {
	t.Parallel()
	e, w, _ := claimWorld(t, func(string) error { return nil }, func(string) error { return nil })
	b := w.w.builds
	ctx := context.Background()
	req := request("stale-entry-create")
	req.RequestID = publisher.NewRequestID()
	const seq = 7
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, State: string(v1.StatusSucceeded),
		Seq: seq, UpdatedAt: time.Now().UTC(),
		Result: &v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Status: v1.StatusSucceeded, Digest: digestOf("stale-entry-create")}}
	raw, _ := json.Marshal(entry)
	if _, err := w.w.ledger.Bucket().Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw); err != nil {
		t.Fatal(err)
	}
	key := b.keyOf(req)
	repo, err := b.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	// Created for this message, undecided, a second ago: what it said
	// then no longer stands.
	wr := &waiterReg{created: time.Now().Add(-time.Second)}
	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, _, _, err = b.build(bctx, req, key, repo, naming.Destinations(repo, key, req.Tags), seq, wr)
	if !errors.Is(err, errAnswered) {
		t.Fatalf("build of a request answered since its entry's create: %v, want errAnswered", err)
	}
	if rec := e.claim(key); rec != nil {
		t.Fatalf("an answered request claimed its key: %+v", rec)
	}
	if jobs := e.jobs(); len(jobs) != 0 {
		t.Fatalf("an answered request created %d Jobs", len(jobs))
	}
}

// afterCreateKV runs after each create that was stored.
type afterCreateKV struct {
	jetstream.KeyValue
	after func(key string)
}

func (k *afterCreateKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	rev, err := k.KeyValue.Create(ctx, key, value, opts...)
	if err == nil {
		k.after(key)
	}
	return rev, err
}

// A handler's own create of its entry (a request of a tenant with a
// limit: never taken straight from intake, so intake creates nothing for
// it) stands for nothing: a cancel can mark the entry before the handler
// has registered with the cancel service, and nothing tells the handler.
// Its walk reads the entry, finds the cancel's decision, and claims and
// builds nothing.
func TestACancelRightAfterAHandlersOwnCreateStopsItsBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("cancel-after-own-create")
	req.RequestID = publisher.NewRequestID()
	key, lk := v1.BuildKey(req, kanikoID), RequestIndexKey("acme", req.RequestID)
	var canceled atomic.Bool
	e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 4}
	}, nil, func(w *Worker) {
		withPresigner(w)
		w.ledger.UseBucket(&afterCreateKV{KeyValue: w.ledger.Bucket(), after: func(k string) {
			if k != lk || canceled.Swap(true) {
				return
			}
			if rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), req.RequestID); !rep.Canceled {
				t.Errorf("cancel reply %+v, want the request canceled", rep)
			}
		}})
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s, want the request canceled", mustJSON(t, r))
	}
	eventually(t, 10*time.Second, "the request's message settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created for a request canceled before its handler registered", n)
	}
	if rec := e.claim(key); rec != nil && rec.State == v1.StateBuilding {
		t.Fatalf("the key holds a run building for a canceled request: %+v", rec)
	}
}
