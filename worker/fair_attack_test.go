package worker

// Attacks on fair queueing (docs/design.md §2d): a hostile tenant, a worker
// killed or stopped at the worst moment, a NATS hiccup. Each test fails
// while the defect it shows is present.
//
// Each test's comment tells the attack as it worked before its fix (the
// code it names may have changed since); the test asserts the outcome the
// fix gives, and failed before it.

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker/internal/fairq"
)

// rawRequest is what the publisher SDK sends for r, with extra headers.
func rawRequest(t *testing.T, r *v1.Request, extra map[string]string) *nats.Msg {
	t.Helper()
	r.APIVersion = v1.APIVersion
	if r.RequestID == "" {
		r.RequestID = publisher.NewRequestID()
	}
	r.SubmittedAt = time.Now().UTC()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(v1.RequestSubject(r.Tenant))
	m.Header.Set(v1.MsgIDHeader, v1.RequestMsgID(r.Tenant, r.RequestID, "nonce-"+r.RequestID))
	m.Header.Set("Content-Type", "application/json")
	for k, v := range extra {
		m.Header.Set(k, v)
	}
	m.Data = b
	return m
}

// Hostile tenant. Intake copies every header of the tenant's message onto
// the message it publishes to BUILDQ_QUEUE (only Buildq-Intake-* and
// Nats-Msg-Id are dropped). JetStream acts on publish headers: acme adds
// "Nats-Expected-Stream: BUILDQ_REQUESTS", which the server checks and
// accepts on the tenant's own publish (it IS stored in BUILDQ_REQUESTS),
// but which makes every intake republish to BUILDQ_QUEUE fail ("expected
// stream does not match"). admit Naks with a delay, forever (buildq-workers
// has MaxDeliver -1): the request never reaches a queue and never gets a
// result, and it sits in BUILDQ_REQUESTS for good. The same works with
// Nats-Expected-Last-Subject-Sequence / -Last-Sequence / -Last-Msg-Id.
// Before the commit the header was harmless (the message was handled
// straight from BUILDQ_REQUESTS).
func TestAttackJetStreamHeaderStrandsRequestInIntake(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	r := tenantRequest("acme", "expected-stream")
	m := rawRequest(t, r, map[string]string{"Nats-Expected-Stream": v1.RequestsStream})
	ack, err := e.js.PublishMsg(context.Background(), m)
	if err != nil {
		t.Fatalf("the tenant's publish was refused (then it would be harmless): %v", err)
	}
	if ack.Stream != v1.RequestsStream {
		t.Fatalf("stored in %s", ack.Stream)
	}
	// A valid request: a Job for it, or at least some result, is due.
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if _, ok := e.jobs()[jobOf(r)]; ok || len(results.snapshot()) > 0 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	msgs, _, redelivered := e.streamState()
	t.Fatalf("request %s has neither a Job nor a result after 8s: it is stuck in intake "+
		"(%d messages stored, %d redelivered; admit's publish to %s keeps failing on the tenant's Nats-Expected-Stream header)",
		r.RequestID, msgs, redelivered, v1.QueueStream)
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
func TestAttackLostIntakeAckAnswersAdmittedRequestQuotaExceeded(t *testing.T) {
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

// NATS hiccup during a slot renewal. renewSlot does
// Update(key, val, s.rev) and keeps s.rev when it gets an error. When the
// server applied the update but the reply was lost (a timeout, the
// connection dropping during a NATS restart), the key's revision is newer
// than s.rev: every later renewal fails with "wrong last sequence", forever,
// and the worker only logs it. The key ages out one lease later while the
// build still runs, and any dispatcher takes the same slot for the tenant's
// next request: acme (limit 1) runs two builds, with no worker paused.
// (The same happens after a NATS outage longer than 2/3 of the lease: the
// key expires at the restart and renewal never re-creates it.)
// Here the lost reply is played by writing the slot's key once with the
// same value, as the applied renewal would have.
func TestAttackSlotRenewalLostReplyExceedsLimit(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 1}
	})
	ctx := context.Background()
	names := map[string]string{}
	for i := range 2 {
		r := tenantRequest("acme", fmt.Sprint("renew-", i))
		names[jobOf(r)] = "acme"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			e.waitJob(jobOf(r))
		}
	}
	kv, err := e.js.KeyValue(ctx, v1.SlotsBucket)
	if err != nil {
		t.Fatal(err)
	}
	var holder []byte
	eventually(t, 5*time.Second, "acme's slot", func() bool {
		en, err := kv.Get(ctx, "acme.0")
		if err != nil {
			return false
		}
		holder = en.Value()
		return true
	})
	// The renewal the server applied and whose reply never came back.
	if _, err := kv.Put(ctx, "acme.0", holder); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.running(names)["acme"]; n > 1 {
			t.Fatalf("acme runs %d builds at once, its concurrency limit is 1 (no worker was paused)", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Worker stopped at the worst moment (a rolling update). At shutdown the
// handler of acme's running build hands its request back (Nak) and lets
// the run go, but the run's Job keeps running in the cluster, waiting to
// be taken over; the deferred tk.slot.release() frees acme's only slot
// (limit 1) at once all the same. Another worker's dispatcher takes the
// slot for acme's next request — a high-priority one is fetched before the
// handed-back normal one — and creates a second Job: acme runs two builds
// with a limit of 1, for as long as the new build takes, with no worker
// paused. (The commit's purpose: "nothing bounded a tenant's running
// builds".)
func TestAttackShutdownHandBackFreesSlotWhileJobRuns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 1}
	}
	w1 := e.startWorker("w1", limit)
	ctx := context.Background()
	names := map[string]string{}
	r1 := tenantRequest("acme", "handback-normal")
	names[jobOf(r1)] = "acme"
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	e.startWorker("w2", limit)
	r2 := tenantRequest("acme", "handback-high")
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	time.Sleep(300 * time.Millisecond)
	if n := e.running(names)["acme"]; n != 1 {
		t.Fatalf("acme runs %d builds before the shutdown", n)
	}
	w1.stop(t)
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		js := e.jobs()
		_, j1 := js[jobOf(r1)]
		_, j2 := js[jobOf(r2)]
		if j1 && j2 {
			t.Fatalf("acme runs two builds at once (%s, handed back but still running, and %s), its concurrency limit is 1",
				jobOf(r1), jobOf(r2))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Hostile tenant: a burst. intake fetches up to 16 requests at once and
// admits them in parallel goroutines, each counting acme's queue before any
// of them has published: all see the count below the limit and all are
// admitted. With ONE worker (design §2d speaks only of intakes "racing on
// other workers", "a few") acme, limited to 2 queued requests, gets 12
// queued by publishing 12 requests back to back while the worker is busy
// fetching — the quota is max(limit, 16 × workers), not the limit.
func TestAttackQueueLimitBypassedByBurstOnOneWorker(t *testing.T) {
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

// Hostile tenant, escalated: the poison header of
// TestAttackJetStreamHeaderStrandsRequestInIntake shuts every tenant out.
// Each poisoned request is Nak'd with a delay and redelivered forever, and
// a Nak'd message stays in buildq-workers' ack-pending set; the consumer
// has the server's default MaxAckPending (1000). acme publishes 1000
// requests with "Nats-Expected-Stream: BUILDQ_REQUESTS": were intake to
// hold them all, the server would deliver nothing new on buildq-workers,
// and globex's request would never be admitted, built or answered.
func TestAttackPoisonedIntakeShutsOtherTenantsOut(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	ctx := context.Background()
	cons, err := e.js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
	if err != nil {
		t.Fatal(err)
	}
	maxPending := cons.CachedInfo().Config.MaxAckPending
	if maxPending <= 0 || maxPending > 5000 {
		t.Skipf("buildq-workers MaxAckPending %d", maxPending)
	}
	for i := range maxPending {
		r := tenantRequest("acme", fmt.Sprint("poison-", i))
		if _, err := e.js.PublishMsgAsync(rawRequest(t, r, map[string]string{"Nats-Expected-Stream": v1.RequestsStream})); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-e.js.PublishAsyncComplete():
	case <-time.After(10 * time.Second):
		t.Fatal("publishing the burst took too long")
	}
	// The header does not reach the queue: every request is admitted and
	// intake holds none of them.
	eventually(t, 20*time.Second, "intake admitting every request", func() bool {
		ci, err := cons.Info(ctx)
		return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
	})
	g := tenantRequest("globex", "shut-out")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	// Admitted at once (every build slot is held by acme's builds, which
	// never end here: it runs when one frees).
	qs, err := e.js.Stream(ctx, v1.QueueStream)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 6*time.Second, "globex's request admitted to its queue", func() bool {
		info, err := qs.Info(ctx, jetstream.WithSubjectFilter(fairq.QueueSubject("globex", v1.PriorityNormal)))
		return err == nil && info.State.Subjects[fairq.QueueSubject("globex", v1.PriorityNormal)] == 1
	})
	if n := len(results.snapshot()); n != 0 {
		t.Fatalf("%d results, want none yet", n)
	}
}

// Workers with different --ack-wait (a rolling change of the flag; the
// worker reads buildq-workers' AckWait back every 2 s precisely because
// "workers started with different --ack-wait values share one consumer").
// The heartbeat of a queued request is still paced by buildq-workers'
// AckWait, but the message is held on a dispatch consumer whose AckWait is
// that of whichever worker last created it (lazily, once per process).
// wA (AckWait 1 s) starts, then wB (6 s): buildq-workers says 6 s, so wB
// heartbeats every 2 s. wB runs acme's request; then wA's dispatcher first
// needs acme's consumer and sets its AckWait to 1 s. wB's build, alive and
// heartbeating, is redelivered every second, and a dispatcher (in the run
// that was observed, wB's own: "seq 2, delivery 2") takes it into a second
// handler of the same request, which holds a build slot — and, with a
// limit, one of the tenant's slots — while the first still runs.
func TestAttackDispatchAckWaitNotTheHeartbeatsOne(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	e.startWorker("wA", func(c *Config) { withRegistry(tr)(c); c.MaxInFlight = 1; c.AckWait = time.Second })
	g := tenantRequest("globex", "keeps-wA-busy")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	gj := e.waitJob(jobOf(g))
	e.startWorker("wB", func(c *Config) { withRegistry(tr)(c); c.AckWait = 6 * time.Second })
	r := tenantRequest("acme", "long-build")
	if _, err := e.pub.Publish(ctx, r); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r))                 // wB runs it: wA has no free slot
	time.Sleep(2500 * time.Millisecond) // wA refreshed buildq-workers' AckWait (6 s)
	e.kubelet(gj, 0, tr.push(t, destination(gj)))
	// wA is free now and looks at acme's queue: it sets the consumer's AckWait.
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		if _, _, redelivered := e.streamState(); redelivered > 0 {
			c, err := e.js.Consumer(ctx, v1.QueueStream, fairq.DispatchConsumer("acme", v1.PriorityNormal))
			if err != nil {
				t.Fatal(err)
			}
			t.Fatalf("acme's running request, heartbeated by its handler on wB, was redelivered "+
				"(dispatch consumer AckWait %s, wB's heartbeat every %s)", c.CachedInfo().Config.AckWait, 2*time.Second)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
