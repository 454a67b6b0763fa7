package worker

// Fair queue (worker/internal/fairq), the queue-length quota: a tenant's
// requests beyond its queue limit are refused with one
// failed/QuotaExceeded each, and a request admitted once — or requeued by
// parking — is never refused after (docs/design.md §2d). A review's test
// tells the attack as it worked before its fix; it asserts the fixed
// outcome.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/fairq"
)

// A tenant's queue-length limit refuses requests beyond it with one clear
// failed/QuotaExceeded result each; other tenants are not affected, and
// the tenant may submit again once its queue shrinks.
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
func TestQueueLimitRefusesWithQuotaExceeded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.Fair.QueueLimit = map[string]int{"acme": 2}
	})
	results := e.collect()
	ctx := context.Background()
	var acme []*v1.Request
	for i := range 4 {
		r := tenantRequest("acme", fmt.Sprint("quota-", i))
		acme = append(acme, r)
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if i < 2 {
			e.waitAdmitted(uint64(i + 1))
		}
	}
	got := results.waitFor(t, 2, 10*time.Second)
	for _, r := range got {
		if r.Data.Tenant != "acme" || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonQuotaExceeded ||
			!strings.Contains(r.Data.Message, "limit is 2") {
			t.Fatalf("result %s, want failed/QuotaExceeded", mustJSON(t, r))
		}
		if r.Data.RequestID != acme[2].RequestID && r.Data.RequestID != acme[3].RequestID {
			t.Fatalf("refused %s, one of the first two admitted", r.Data.RequestID)
		}
	}
	other := tenantRequest("globex", "quota")
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		var job *batchv1.Job
		eventually(t, 10*time.Second, "a Job", func() bool {
			for _, j := range e.jobs() {
				if len(j.Status.Conditions) == 0 {
					job = j
					return true
				}
			}
			return false
		})
		e.kubelet(job, 0, tr.push(t, destination(job)))
	}
	got = results.waitFor(t, 5, 15*time.Second)
	ok := 0
	for _, r := range got[2:] {
		if r.Data.Status == v1.StatusSucceeded {
			ok++
		}
	}
	if ok != 3 {
		t.Fatalf("want acme's 2 admitted and globex's request built: %+v", got)
	}
	// acme's queue is empty again: a new request is admitted.
	again := tenantRequest("acme", "again")
	if _, err := e.pub.Publish(ctx, again); err != nil {
		t.Fatal(err)
	}
	aj := e.waitJob(jobOf(again))
	e.kubelet(aj, 0, tr.push(t, destination(aj)))
	got = results.waitFor(t, 6, 10*time.Second)
	if got[5].Data.RequestID != again.RequestID || got[5].Data.Status != v1.StatusSucceeded {
		t.Fatalf("last result %s", mustJSON(t, got[5]))
	}
}

// Hostile tenant: a burst. intake fetches up to 16 requests at once and
// admits them in parallel goroutines, each counting acme's queue before any
// of them has published: all see the count below the limit and all are
// admitted. With ONE worker (design §2d speaks only of intakes "racing on
// other workers", "a few") acme, limited to 2 queued requests, gets 12
// queued by publishing 12 requests back to back while the worker is busy
// fetching — the quota is max(limit, 16 × workers), not the limit.
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestQueueLimitHoldsAgainstABurstOnOneWorker(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	sw, err := New(e.nc, nil, testConfig("setup"))
	if err != nil {
		t.Fatal(err)
	}
	if err := sw.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	results := e.collect()
	const burst = 12
	for i := range burst {
		if _, err := e.pub.Publish(ctx, tenantRequest("acme", fmt.Sprint("burst-", i))); err != nil {
			t.Fatal(err)
		}
	}
	e.startWorker("w1", func(c *Config) {
		c.MaxInFlight = 1
		c.Fair.QueueLimit = map[string]int{"acme": 2}
	})
	eventually(t, 10*time.Second, "intake drained", e.intakeEmpty)
	time.Sleep(500 * time.Millisecond)
	refused := 0
	for _, r := range results.snapshot() {
		if r.Data.Reason == v1.ReasonQuotaExceeded {
			refused++
		}
	}
	if admitted := burst - refused; admitted > 2+1 {
		t.Fatalf("acme (queue limit 2) got %d of %d requests admitted on a single worker; %d refused", admitted, burst, refused)
	}
}

// Worker killed between intake's publish to BUILDQ_QUEUE and its ack of
// the intake message (or the ack is lost). The design says the redelivery
// "is dropped by the queue's duplicate window" — but the quota check comes
// first, and the count it reads includes the request's own queued copy.
// acme (queue limit 1) submits ONE request: the crashed intake queued it,
// the dispatcher runs it (Job created), and the redelivered intake message
// then finds acme at 1 >= 1 queued, is handled with QuotaExceeded, and —
// the ledger entry being the same request's (same sequence and time) —
// records and publishes failed/QuotaExceeded. The build that is running
// for it is answered "quota exceeded"; its success is never published.
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestLostIntakeAckNeverRefusesAnAdmittedRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	sw, err := New(e.nc, nil, testConfig("setup"))
	if err != nil {
		t.Fatal(err)
	}
	if err := sw.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	results := e.collect()
	r := tenantRequest("acme", "lost-intake-ack")
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	// The "crashed" worker: intake's admit up to its publish, no ack.
	cons, err := e.js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var msg jetstream.Msg
	for m := range batch.Messages() {
		msg = m
	}
	if msg == nil {
		t.Fatal("no request fetched")
	}
	meta, _ := msg.Metadata()
	out := nats.NewMsg(fairq.QueueSubject("acme", v1.PriorityNormal))
	out.Data = msg.Data()
	for k, vs := range msg.Headers() {
		if k != v1.MsgIDHeader {
			out.Header[k] = vs
		}
	}
	out.Header.Set(fairq.HdrIntakeSubject, msg.Subject())
	out.Header.Set(fairq.HdrIntakeSeq, strconv.FormatUint(meta.Sequence.Stream, 10))
	out.Header.Set(fairq.HdrIntakeTime, meta.Timestamp.UTC().Format(time.RFC3339Nano))
	out.Header.Set(fairq.HdrIntakeMsgID, msg.Headers().Get(v1.MsgIDHeader))
	qid := fmt.Sprintf("intake-%d-%d", meta.Sequence.Stream, meta.Timestamp.UnixNano())
	if _, err := e.js.PublishMsg(ctx, out, jetstream.WithMsgID(qid)); err != nil {
		t.Fatal(err)
	}
	// ... and it dies here: the intake message is redelivered after AckWait.

	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.QueueLimit = map[string]int{"acme": 1}
	})
	job := e.waitJob(jobOf(r))
	// Let intake's redelivery (AckWait 2 s) happen while the build runs.
	eventually(t, 10*time.Second, "the intake message settled", e.intakeEmpty)
	time.Sleep(300 * time.Millisecond)
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 1, 10*time.Second)
	if d := got[0].Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("acme's only request, admitted and built, was answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
}

// acme (queue limit 1) has one request running when its parked request
// is requeued; intake, at the limit, reads the ledger to recognize the
// requeue, and the read fails once. requeuedEntry() returned nil, and the
// parked request — admitted long before — was answered QuotaExceeded.
//
// Origin: issue 24, defect 2 (a requeued request was refused at the queue limit).
func TestRequeueAtTheQueueLimitSurvivesALedgerReadError(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := requeueWorld(t, "i24-requeue-at-limit")
	var armed, fired atomic.Bool
	r := e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.QueueLimit = map[string]int{"acme": 1}
	}, nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onGet: func(_ context.Context, k string) error {
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && calledFrom(".admit") && fired.CompareAndSwap(false, true) {
				return nats.ErrTimeout
			}
			return nil
		}})
	})
	results := e.collect()
	putDeadRun(t, r.w, tr, key)
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	waitParked(t, r.w, key, req.RequestID)
	// The parked request leaves the queue when its message is acked, just
	// after its ledger entry says parked: until then it counts against
	// acme's limit of 1.
	eventually(t, 10*time.Second, "the parked request's queue message settled", func() bool {
		msgs, _, _ := e.streamState()
		return msgs == 0
	})
	// acme's queue is at its limit when the parked request comes back.
	other := request("i24-fills-the-queue")
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	otherJob := e.waitJob(kaniko.JobName(v1.BuildKey(other, kanikoID)))
	armed.Store(true)
	res := playUntilAnswered(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if !fired.Load() {
		t.Fatal("premise: intake's ledger read of the requeue never failed")
	}
	if d := res.Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("the parked request, requeued, was answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
	e.kubelet(otherJob, 0, tr.push(t, destination(otherJob)))
}

// acme (queue limit 1) has one request running; its next one is refused
// QuotaExceeded, and writing the refusal to the ledger fails (first the
// entry's creation, then the decision). The handler Nak'd the message,
// and intake checks the limit on a first delivery only: the redelivery
// was admitted and built over the limit.
//
// Origin: issue 24, a suspicion its review raised (a refusal whose record failed was admitted on redelivery).
func TestRefusalWhoseRecordFailsIsNotAdmitted(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	refused := request("i24-refused")
	refused.RequestID = "i24-refused"
	lk := RequestIndexKey("acme", refused.RequestID)
	var createFailed, updateFailed atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.QueueLimit = map[string]int{"acme": 1}
	}, nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(),
			onCreate: func(k string, _ []byte) error {
				if k == lk && createFailed.CompareAndSwap(false, true) {
					return nats.ErrTimeout
				}
				return nil
			},
			onUpdate: func(k string, value []byte) error {
				if k == lk && strings.Contains(string(value), v1.ReasonQuotaExceeded) && updateFailed.CompareAndSwap(false, true) {
					return nats.ErrTimeout
				}
				return nil
			}})
	})
	results := e.collect()
	ctx := context.Background()
	running := request("i24-running")
	if _, err := e.pub.Publish(ctx, running); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(running, kanikoID)))
	if _, err := e.pub.Publish(ctx, refused); err != nil {
		t.Fatal(err)
	}
	refusedJob := kaniko.JobName(v1.BuildKey(refused, kanikoID))
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, ok := e.jobs()[refusedJob]; ok {
			t.Fatal("the request refused at acme's queue limit was admitted and built after its refusal could not be recorded")
		}
		if rs := storedOf(results, "acme", refused.RequestID); len(rs) > 0 {
			if d := rs[0].Data; d.Status != v1.StatusFailed || d.Reason != v1.ReasonQuotaExceeded {
				t.Fatalf("the request over acme's queue limit was answered %s/%s", d.Status, d.Reason)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the request over the limit got no result")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !createFailed.Load() {
		t.Fatal("premise: the refusal's ledger entry was never written")
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
}
