package worker

// Ledger (worker/internal/ledger): another worker's decision that is not
// marked published is that worker's to publish; it is taken over only
// after it stayed unchanged for the grace (2 leases), and waiting spends
// none of the request's retry budget (docs/design.md §2 step 6).

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// Another worker's decision that is not marked published yet is that
// worker's to publish: a worker that reads it publishes nothing at once
// (the decider may only be slow), and takes it over only after it stayed
// unchanged for the grace. The mutant "publish-unmarked-at-once" broke
// this rule.
//
// Origin: issue 24, mutation testing: a unit test for the mutant publish-unmarked-at-once (29b7ec1).
func TestAnotherWorkersUnmarkedDecisionIsNotPublishedAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	ctx := context.Background()

	req := request("unmarked-elsewhere")
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, State: string(v1.StatusSucceeded),
		Seq: 3, Worker: "w2", UpdatedAt: time.Now().UTC(),
		Result: &v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Status: v1.StatusSucceeded, Digest: digestOf("unmarked-elsewhere")}}
	raw, _ := json.Marshal(entry)
	rev, err := w.ledger.Bucket().Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw)
	if err != nil {
		t.Fatal(err)
	}
	le := &ledger.Entry{E: entry, Rev: rev}
	published := 0
	res, err := w.ledger.Deliver(ctx, le, ledger.DecisionOf(entry), ledger.Delivery{Publish: func(context.Context, ledger.Decision) (ledger.Ack, error) {
		published++
		return ledger.Ack{}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != ledger.Later || published != 0 {
		t.Fatalf("w1 delivered w2's unmarked decision at once (status %d, %d publishes), want later and none", res.Status, published)
	}
	got, err := w.ledger.Get(ctx, req.Tenant, req.RequestID)
	if err != nil || got == nil || got.E.Worker != "w2" {
		t.Fatalf("the decision changed hands at the first look: %+v (%v)", got, err)
	}
}

// The same race between two workers: every worker sweeps the waiter index
// every lease/2, and the sweep on another worker finds a parked request
// whose run ended while the owner's settle pass is between recording the
// decision and marking it published (the natural window is the owner's
// pass from the run's end to its mark, registry copies of every parked
// request's tags included). No fault but a slow write (shorter than the
// grace, 2 leases) is needed. The sweep must leave it to the owner.
//
// Origin: review of one publisher per recorded decision (1ba6b6a).
func TestSweepOnAnotherWorkerDoesNotRepublishAParkedResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("po-two-workers", "po-owner2", "po-parked2")
	armed := &atomic.Bool{}
	armed.Store(true)
	hook := func(w *Worker) {
		w.ledger.UseBucket(&slowMark{KeyValue: w.ledger.Bucket(), key: RequestIndexKey("acme", parked.RequestID), delay: 3 * time.Second, armed: armed})
	}
	e.startWorkerHooked("w1", withRegistry(tr), nil, hook)
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held by w1", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	e.startWorkerHooked("w2", withRegistry(tr), nil, hook)
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		_, ackPending, _ := e.streamState()
		return e.isParked(key, parked.RequestID) && ackPending == 1
	})
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	time.Sleep(4 * time.Second) // past the slow mark
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times (the owner's settle pass, and another worker's sweep)", n)
	}
}

// stallAfterDecision passes every ledger write through, but the write
// that records the decision of one request's entry, once stored, never
// returns (a decider that hangs, or dies, between recording a result and
// publishing it) until the test ends.
type stallAfterDecision struct {
	jetstream.KeyValue
	key     string
	armed   *atomic.Bool
	stalled chan struct{}
	end     <-chan struct{}
}

func (s *stallAfterDecision) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	r, err := s.KeyValue.Update(ctx, key, value, rev)
	if err == nil && key == s.key && bytes.Contains(value, []byte(`"result":`)) && s.armed.CompareAndSwap(true, false) {
		close(s.stalled)
		<-s.end
		return 0, errors.New("stalled decider")
	}
	return r, err
}

// A decision whose decider stops between recording and publishing it is
// published by another worker once it stayed unmarked for the grace (2
// leases), exactly once, and the ledger names the taker.
//
// Origin: review of one publisher per recorded decision (1ba6b6a).
func TestUnpublishedDecisionOfAStalledWorkerIsTakenOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("po-takeover", "po-owner3", "po-parked3")
	armed := &atomic.Bool{}
	armed.Store(true)
	end := make(chan struct{})
	t.Cleanup(func() { close(end) })
	stall := &stallAfterDecision{key: RequestIndexKey("acme", parked.RequestID), armed: armed, stalled: make(chan struct{}), end: end}
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		stall.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(stall)
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held by w1", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	e.startWorkerHooked("w2", withRegistry(tr), nil, nil)
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		return e.isParked(key, parked.RequestID)
	})
	e.kubelet(job, 0, tr.push(t, destination(job)))
	select {
	case <-stall.stalled:
	case <-time.After(20 * time.Second):
		t.Fatal("w1 never recorded the parked request's decision")
	}
	stalledAt := time.Now()
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	if waited := time.Since(stalledAt); waited < 4*time.Second {
		t.Fatalf("the stalled decider's result was published by another worker after %v, before the grace of 2 leases (4s)", waited)
	}
	time.Sleep(2 * time.Second) // anything more would come now
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times, want once", n)
	}
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	ent, err := kv.Get(ctx, RequestIndexKey("acme", parked.RequestID))
	if err != nil {
		t.Fatal(err)
	}
	var got v1.RequestEntry
	if err := json.Unmarshal(ent.Value(), &got); err != nil {
		t.Fatal(err)
	}
	if got.Worker != "w2" || !got.Published || got.Result == nil {
		t.Fatalf("ledger entry after the take-over: worker %q, published %v, decided %v; want w2, true, true", got.Worker, got.Published, got.Result != nil)
	}
}

// failResultPublishes fails the first n result publishes of one request
// (a results stream briefly without a leader, a slow PubAck).
type failResultPublishes struct {
	jetstream.JetStream
	msgID string
	n     atomic.Int32
}

func (f *failResultPublishes) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	if strings.HasPrefix(m.Subject, v1.ResultsPrefix+".") && m.Header.Get(v1.MsgIDHeader) == f.msgID && f.n.Add(-1) >= 0 {
		return nil, nats.ErrTimeout
	}
	return f.JetStream.PublishMsg(ctx, m, opts...)
}

// §2: "--max-deliver bounds transient failures, not deliveries", and
// every accepted request gets its one result. The handler that waits for
// another worker's unmarked decision Naks its message (grace/2) until
// the grace has passed; each of those Naks is a delivery, and the
// publish that follows the take-over counts deliveries: a single failed
// publish after the wait is "the last delivery", and the request is
// dead-lettered and terminated without any result.
//
// Here: w1's first write of the decision is lost (a timeout), its second
// lands but w1 sees a timeout again, and w1 dies. w2 waits for the grace
// (deliveries 3 and 4), takes over on delivery 5, and its one publish
// fails (one PubAck timeout). Three transient failures in all, with a
// budget of 5: before the grace, w2 published on delivery 3 and retried
// its failed publish on delivery 4.
//
// Origin: second review of one publisher per recorded decision (917c47f).
func TestWaitingForAnUnmarkedDecisionDoesNotSpendTheDeliveryBudget(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("poa-budget")
	req.RequestID = "poa-budget"
	key := v1.BuildKey(req, kanikoID)
	lk := RequestIndexKey("acme", req.RequestID)
	var decisionWrites atomic.Int32
	landed := make(chan struct{})
	w1 := e.startWorkerHooked("w1", both(withRegistry(tr), recordFirst), nil, func(w *Worker) {
		w.ledger.UseBucket(&faultyKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) string {
			if k != lk || !bytes.Contains(value, []byte(`"result":`)) || bytes.Contains(value, []byte(`"published":true`)) {
				return writePasses
			}
			switch decisionWrites.Add(1) {
			case 1:
				return writeLost
			case 2:
				close(landed)
				return writeLanded
			}
			return writePasses
		}})
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	select {
	case <-landed:
	case <-time.After(30 * time.Second):
		t.Fatal("w1 never wrote the decision a second time")
	}
	time.Sleep(200 * time.Millisecond) // w1's handler Naks
	w1.stop(t)                         // and w1 dies
	fr := &failResultPublishes{msgID: v1.MsgID("acme", req.RequestID)}
	fr.n.Store(1)
	e.startWorkerHooked("w2", withRegistry(tr), nil, func(w *Worker) {
		fr.JetStream = w.js
		w.js = fr
	})
	deadline := time.Now().Add(40 * time.Second)
	for len(storedOf(results, "acme", req.RequestID)) == 0 {
		if time.Now().After(deadline) {
			dl := uint64(0)
			if st, err := e.js.Stream(ctx, v1.DeadLetterStream); err == nil {
				if info, err := st.Info(ctx); err == nil {
					dl = info.State.Msgs
				}
			}
			msgs, pending, _ := e.streamState()
			t.Fatalf("no result for the request after 40 s (dead-lettered copies: %d; request messages left: %d, pending %d): it had 3 transient failures with a budget of 5, but the deliveries spent waiting for the grace made its one failed publish the last delivery", dl, msgs, pending)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
