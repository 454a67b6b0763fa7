package worker

// Attacks on "one publisher per recorded decision" (design §2 step 6): a
// stale read of a worker's own decision, a ledger write between the
// record and the mark, and the deliveries spent waiting for another
// worker's publish.

import (
	"bytes"
	"context"
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

// lateRead is a ledger whose first read of one entry that finds its
// decision recorded and not marked published is answered late: just
// after the decider's mark landed (a reply held up by a slow server, a GC
// pause of the reader between its read and its next step). The decider's
// mark is also held back a little, so that the read falls between the
// record and the mark. Both delays are far below the grace (2 leases).
type lateRead struct {
	jetstream.KeyValue
	key       string // ledger key
	markDelay time.Duration
	markArmed atomic.Bool
	readArmed atomic.Bool
	marked    chan struct{}
	lateReads atomic.Int32
}

func newLateRead(key string, markDelay time.Duration) *lateRead {
	l := &lateRead{key: key, markDelay: markDelay, marked: make(chan struct{})}
	l.markArmed.Store(true)
	l.readArmed.Store(true)
	return l
}

func (l *lateRead) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	mark := key == l.key && bytes.Contains(value, []byte(`"published":true`)) && l.markArmed.CompareAndSwap(true, false)
	if mark {
		time.Sleep(l.markDelay)
	}
	r, err := l.KeyValue.Update(ctx, key, value, rev)
	if mark && err == nil {
		close(l.marked)
	}
	return r, err
}

func (l *lateRead) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	ent, err := l.KeyValue.Get(ctx, key)
	if err == nil && key == l.key && bytes.Contains(ent.Value(), []byte(`"result":`)) &&
		!bytes.Contains(ent.Value(), []byte(`"published":true`)) && l.readArmed.CompareAndSwap(true, false) {
		select {
		case <-l.marked:
			time.Sleep(200 * time.Millisecond) // the decider lets go of the request
			l.lateReads.Add(1)
		case <-time.After(20 * time.Second):
		}
	}
	return ent, err
}

// §2 step 6, "One publisher per decision": "within one worker, one
// goroutine at a time decides and publishes a request", and it reads the
// entry again once it holds the request. Without that second read, a
// goroutine that read the decision recorded and not marked, and takes the
// request after the decider (a goroutine of the same worker) published,
// marked and let go, finds its own worker named as the decider ("its
// publish failed") and publishes the result a second time, at once. No
// stall near the grace is needed: here the mark is 3 s late and the
// read's reply a few seconds late, with a lease of 10 s (grace 20 s).
//
// The parked request's ack is lost; the run ends; the owner's settle
// pass records and publishes the parked request's result; the handler of
// the redelivered park message reads the ledger entry between that
// record and its mark, and its read is answered just after the mark.
func TestStaleReadOfOwnDecisionIsNotPublishedAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("poa-stale-read", "poa-owner", "poa-parked")
	var lost atomic.Bool
	lr := newLateRead(RequestIndexKey("acme", parked.RequestID), 3*time.Second)
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.AckWait = 2 * time.Second
		c.Lease = 10 * time.Second
	}, nil, func(w *Worker) {
		lr.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(lr)
		w.faults = &faultHooks{loseAck: func(id string) bool {
			return id == parked.RequestID && lost.CompareAndSwap(false, true) // the park's ack only
		}}
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the request parked, its ack lost", func() bool {
		return e.isParked(key, parked.RequestID) && lost.Load()
	})
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	time.Sleep(3 * time.Second)
	if lr.lateReads.Load() == 0 {
		t.Log("no read fell between the record and the mark (timing); the scenario did not happen")
	}
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times by one worker, with no stall near the grace (a read of the unmarked decision, answered after the decider's mark, took the lock after the decider let go)", n)
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
	w1 := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
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

// parkRace holds the second park of one request (the handler of its
// redelivered message writing its waiter entry again) until the request's
// decision is recorded by someone else, and then fails it (a KV timeout);
// the decider's published mark is 1 s late (far below the grace).
type parkRace struct {
	jetstream.KeyValue
	lk, wk    string
	putArmed  atomic.Bool
	markArmed atomic.Bool
	held      chan struct{}
	recorded  chan struct{}
	recOnce   atomic.Bool
}

func (p *parkRace) Put(ctx context.Context, key string, value []byte) (uint64, error) {
	if key == p.wk && p.putArmed.CompareAndSwap(true, false) {
		close(p.held)
		select {
		case <-p.recorded:
		case <-time.After(20 * time.Second):
		}
		return 0, nats.ErrTimeout
	}
	return p.KeyValue.Put(ctx, key, value)
}

func (p *parkRace) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if key == p.lk && bytes.Contains(value, []byte(`"published":true`)) && p.markArmed.CompareAndSwap(true, false) {
		time.Sleep(time.Second)
	}
	r, err := p.KeyValue.Update(ctx, key, value, rev)
	if err == nil && key == p.lk && bytes.Contains(value, []byte(`"result":`)) && p.recOnce.CompareAndSwap(false, true) {
		close(p.recorded)
	}
	return r, err
}

// The decider's published mark is a compare-and-swap on the revision it
// recorded. retryBudgetLeft (a handler of another message of the request
// counting a transient failure) writes the entry whether or not it is
// decided meanwhile. When that write falls between the decider's record
// and its mark, a mark that gave up on the changed revision would be lost
// for good, and the next reader (the worker's sweep of parked requests,
// or the handler's next delivery) would find the decision "recorded and
// not marked", its own worker's, and publish it again at once. The mark
// is written again over the entry as it is. No stall: the mark here is
// 1 s late with a grace of 4 s.
//
// The parked request's ack is lost; the handler of its redelivery parks
// it again, and that write of its waiter entry times out (transient)
// while the run ends and the owner's settle pass records, publishes and
// marks the parked request's result.
func TestBudgetCountBetweenRecordAndMarkDoesNotRepublish(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("poa-bump", "poa-owner-b", "poa-parked-b")
	pr := &parkRace{lk: RequestIndexKey("acme", parked.RequestID), wk: ledger.WaiterKey(key, "acme", parked.RequestID),
		held: make(chan struct{}), recorded: make(chan struct{})}
	pr.markArmed.Store(true)
	var lost atomic.Bool
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		pr.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(pr)
		w.faults = &faultHooks{loseAck: func(id string) bool {
			return id == parked.RequestID && lost.CompareAndSwap(false, true) // the park's ack only
		}}
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the request parked, its ack lost", func() bool {
		return e.isParked(key, parked.RequestID) && lost.Load()
	})
	pr.putArmed.Store(true)
	select {
	case <-pr.held:
	case <-time.After(20 * time.Second):
		t.Fatal("the redelivered park message never parked again")
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	time.Sleep(6 * time.Second) // the handler's retry comes after 4 s
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times, with no stall near the grace (the decider's mark lost to retryBudgetLeft's write)", n)
	}
}
