package worker

// Parking (park.go): requeues. A parked request whose run ended without an
// answer for it is requeued, built with its own inputs, and handled once:
// a duplicate requeue, a ledger read that fails, a shutdown or an executor
// upgrade meanwhile loses it no answer (docs/design.md §2c).

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// A parked request whose run failed for a reason of its claimer's own
// request (here the claimer's shorter timeout) is requeued and built with
// its own inputs, not answered with the claimer's failure.
//
// Origin: parking, a request that joins a running build holds no slot (897c81b).
func TestParkedRequestIsRequeuedOnTheClaimersOwnFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	short := request("timeouts")
	short.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, short); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(short, "kaniko@"+testKaniko.ExecutorImage)
	first := e.waitJob(kaniko.JobName(key))
	long := request("timeouts")
	long.Timeout = v1.Duration{Duration: time.Hour}
	if _, err := e.pub.Publish(ctx, long); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		_, ackPending, _ := e.streamState()
		return ackPending == 1
	})
	// The first run ends past its deadline.
	deadlineExceeded(t, e, first)
	// No Pod shows the end: the backend waits its grace for one first.
	got := results.waitFor(t, 1, 30*time.Second)
	if got[0].Data.RequestID != short.RequestID || got[0].Data.Reason != v1.ReasonDeadlineExceeded {
		t.Fatalf("first result %s", mustJSON(t, got[0]))
	}
	// The parked request builds anew: a second Job of the key.
	var second = first
	eventually(t, 10*time.Second, "a new Job for the requeued request", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.UID == first.UID {
			return false
		}
		second = j
		return true
	})
	e.kubelet(second, 0, tr.push(t, destination(second)))
	got = results.waitFor(t, 2, 10*time.Second)
	if got[1].Data.RequestID != long.RequestID || got[1].Data.Status != v1.StatusSucceeded || got[1].Data.Origin != v1.OriginBuild {
		t.Fatalf("the parked request's result %s", mustJSON(t, got[1]))
	}
}

// Origin: adversarial review of parking (docs/design.md §2c), invariants 3 and 2; fixed by 9f3c611.
func TestRequeuedRequestsShareTheirOwnBuildsFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w := e.startWorker("w1", withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	short := request("requeued-fails")
	short.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, short); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(short, kanikoID)
	first := e.waitJob(kaniko.JobName(key))
	var longs []*v1.Request
	for range 3 {
		l := request("requeued-fails")
		l.Timeout = v1.Duration{Duration: time.Hour}
		if _, err := e.pub.Publish(ctx, l); err != nil {
			t.Fatal(err)
		}
		longs = append(longs, l)
	}
	eventually(t, 10*time.Second, "3 parked", func() bool { return parkedCount(t, w.w, key) == 3 })
	deadlineExceeded(t, e, first)
	var second = first
	eventually(t, 30*time.Second, "a new Job for a requeued request", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.UID == first.UID {
			return false
		}
		second = j
		return true
	})
	// The other two requeued requests park on the new run (a request
	// handled after the run failed would build again, as a new run).
	eventually(t, 20*time.Second, "2 parked on the new run", func() bool {
		run := e.claim(key)
		items, err := w.w.ledger.ListWaiters(ctx, key)
		if run == nil || err != nil {
			return false
		}
		n := 0
		for _, it := range items[key] {
			if it.V.Parked && it.V.Run == run.Run {
				n++
			}
		}
		return n == 2
	})
	// Its own build fails (content): every long request shares it.
	e.kubelet(second, 1, "")
	assertEnd(t, e, results, append([]*v1.Request{short}, longs...), 30*time.Second)
	if d := storedOf(results, "acme", short.RequestID)[0].Data; d.Reason != v1.ReasonDeadlineExceeded {
		t.Errorf("short: %s", decision(d))
	}
	for _, l := range longs {
		if d := storedOf(results, "acme", l.RequestID)[0].Data; d.Status != v1.StatusFailed || d.Reason == v1.ReasonDeadlineExceeded {
			t.Errorf("long %s: %s", l.RequestID, decision(d))
		}
	}
	if n := e.creates.total(); n != 2 {
		t.Errorf("%d Jobs created, want 2", n)
	}
}

// Rolling upgrade of the kaniko executor image: the old worker owns a run,
// a request is parked on it; the old worker stops (release, requeue). The
// new worker computes another build key for the requeued body than its
// ledger entry holds, and process() refuses it as a "duplicate": it is
// terminated without a result. The owner's own request (not a requeue)
// builds on under the new key.
//
// Origin: adversarial review of parking (docs/design.md §2c), invariant 3; fixed by 9f3c611.
func TestRequeueAcrossAnExecutorUpgradeIsAnswered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	old := e.startWorker("old", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	owner := request("upgrade")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(owner, kanikoID)
	e.waitJob(kaniko.JobName(key))
	parked := request("upgrade")
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a request parked", func() bool { return parkedCount(t, old.w, key) == 1 })

	kc := testKaniko
	kc.ExecutorImage = "gcr.io/kaniko-project/executor@sha256:" + hex64("executor-v2")
	e.startWorkerWith("new", kc, withRegistry(tr))
	old.stop(t)
	newKey := v1.BuildKey(owner, "kaniko@"+kc.ExecutorImage)
	job := e.waitJob(kaniko.JobName(newKey))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	eventually(t, 15*time.Second, "the owner's result", func() bool {
		return len(storedOf(results, "acme", owner.RequestID)) == 1
	})
	time.Sleep(3 * time.Second)
	if len(storedOf(results, "acme", parked.RequestID)) == 0 {
		msgs, pending, _ := e.streamState()
		t.Fatalf("STRANDED: the parked request %s has no result after the upgrade (queue msgs=%d pending=%d)",
			parked.RequestID, msgs, pending)
	}
}

// newRequeueMsg is the message requeue publishes for p under id.
func newRequeueMsg(p ledger.Waiter, id string) *nats.Msg {
	m := nats.NewMsg(p.Subject)
	m.Data = p.Body
	m.Header.Set(v1.MsgIDHeader, id)
	m.Header.Set(ledger.RequeueTokenHeader, p.Token)
	return m
}

// A requeue published twice for one waiter revision (two requeuers, or a
// retry after a lost PubAck) is one message: the second publish is a
// duplicate, the request is handled once and answered once.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestDuplicateRequeueIsOneRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
	rw := e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY q /q\n", "q": "requeued"})
	owner, parked := tenantRequestFor("acme", digest), tenantRequestFor("acme", digest)
	store.put(owner.Source.S3.Key, archive)
	key := v1.BuildKey(owner, kanikoID)
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "parked", func() bool { return e.parkedAs(key, "acme", parked.RequestID) })
	items, err := rw.w.ledger.ListWaiters(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var it *ledger.WaiterItem
	for i := range items[key] {
		if items[key][i].V.RequestID == parked.RequestID {
			it = &items[key][i]
		}
	}
	if it == nil {
		t.Fatal("no waiter entry")
	}
	// Two requeuers of the same revision: one message id.
	id := requeueMsgID(it.V, it.Rev)
	var dups atomic.Int32
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			m := newRequeueMsg(it.V, id)
			ack, err := e.js.PublishMsg(ctx, m)
			if err != nil {
				t.Error(err)
				return
			}
			if ack.Duplicate {
				dups.Add(1)
			}
		})
	}
	wg.Wait()
	if dups.Load() != 1 {
		t.Fatalf("%d of 2 publishes of one requeue id were duplicates, want 1", dups.Load())
	}
	e.kubelet(job, 0, digestOf("requeue"))
	if r := oneResult(t, results, parked.RequestID); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("parked: %s", mustJSON(t, r))
	}
	time.Sleep(300 * time.Millisecond)
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the requeued request was published %d times", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Fatalf("%d Jobs", c)
	}
}

// A parked request is requeued (its run's owner is dead); the handler of
// the requeued message reads the ledger to match its requeue token, and
// that read fails once (a KV timeout). requeuedEntry() returned nil on
// the error, process() took the requeued message for a duplicate and
// terminated it — and requeue() had already deleted the waiter entry:
// nobody ever answered the request.
//
// Origin: issue 24, defect 1 (a requeued parked request lost its result).
func TestRequeuedRequestSurvivesALedgerReadError(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := requeueWorld(t, "i24-requeue-read-error")
	var armed, fired atomic.Bool
	r := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onGet: func(_ context.Context, k string) error {
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && fired.CompareAndSwap(false, true) {
				return nats.ErrTimeout
			}
			return nil
		}})
	})
	results := e.collect()
	putDeadRun(t, r.w, tr, key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	waitParked(t, r.w, key, req.RequestID)
	armed.Store(true)
	res := playUntilAnswered(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if !fired.Load() {
		t.Fatal("premise: the requeued message's ledger read never failed")
	}
	if d := res.Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("requeued request answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
}

// The same requeued message, with the worker stopped (SIGTERM) while its
// handler reads the ledger between openEntry and requeuedEntry: the read
// ends with the work context's cancellation, and the message was
// terminated as a duplicate instead of handed back. Another worker must
// answer the request.
//
// Origin: issue 24, defect 1 (a requeued parked request lost its result).
func TestRequeuedRequestIsHandedBackAtShutdown(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := requeueWorld(t, "i24-requeue-sigterm")
	var armed atomic.Bool
	entered := make(chan struct{})
	var once atomic.Bool
	r := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onGet: func(ctx context.Context, k string) error {
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && once.CompareAndSwap(false, true) {
				close(entered)
				<-ctx.Done() // held until the worker stops
				return ctx.Err()
			}
			return nil
		}})
	})
	results := e.collect()
	putDeadRun(t, r.w, tr, key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	waitParked(t, r.w, key, req.RequestID)
	armed.Store(true)
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the requeued message was never handled")
	}
	r.stop(t)
	e.startWorker("w2", withRegistry(tr))
	res := playUntilAnswered(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if d := res.Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("requeued request answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
}
