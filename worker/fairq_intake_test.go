package worker

// Fair queue (worker/internal/fairq), intake: every valid request reaches
// its tenant's queue, whatever headers its tenant put on it, and no tenant
// can hold intake to shut the others out (docs/design.md §2d). A review's
// test tells the attack as it worked before its fix (the code it names may
// have changed since); it asserts the fixed outcome, and failed before it.

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strings"
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
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestJetStreamHeaderNeverStrandsARequestInIntake(t *testing.T) {
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

// Hostile tenant, escalated: the poison header of
// TestJetStreamHeaderNeverStrandsARequestInIntake shuts every tenant out.
// Each poisoned request is Nak'd with a delay and redelivered forever, and
// a Nak'd message stays in buildq-workers' ack-pending set; the consumer
// has the server's default MaxAckPending (1000). acme publishes 1000
// requests with "Nats-Expected-Stream: BUILDQ_REQUESTS": were intake to
// hold them all, the server would deliver nothing new on buildq-workers,
// and globex's request would never be admitted, built or answered.
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestPoisonedRequestsDoNotShutOtherTenantsOutOfIntake(t *testing.T) {
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
	// intake holds none of them. The first few are taken straight from
	// intake onto w1's free slots (fairq's direct.go), whose handlers
	// hold their messages while their builds run: no more than its slots.
	eventually(t, 20*time.Second, "intake admitting every request", func() bool {
		ci, err := cons.Info(ctx)
		return err == nil && ci.NumAckPending <= testConfig("w1").MaxInFlight && ci.NumPending == 0 && e.admittedAll(uint64(maxPending))
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

// headerSize is the size of m's header block on the wire
// ("NATS/1.0\r\n", "Key: value\r\n" per value, "\r\n").
func headerSize(m *nats.Msg) int {
	n := len("NATS/1.0\r\n") + 2
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + 2 + len(v) + 2
		}
	}
	return n
}

// fatRequest is acme's valid request r with a padding header that brings
// its header block to just under JetStream's 64 KiB header limit: stored
// by BUILDQ_REQUESTS, while intake's copy (the same headers plus four
// Buildq-Intake-* ones, ~130 bytes) is over it.
func fatRequest(t *testing.T, r *v1.Request) *nats.Msg {
	t.Helper()
	m := rawRequest(t, r, nil)
	pad := math.MaxUint16 - 48 - headerSize(m) - len("X-Pad: \r\n")
	m.Header.Set("X-Pad", strings.Repeat("p", pad))
	if h := headerSize(m); h > math.MaxUint16-40 || h < math.MaxUint16-60 {
		t.Fatalf("header block %d bytes", h)
	}
	return m
}

// Hostile tenant, after the fix of TestPoisonedRequestsDoNotShutOtherTenantsOutOfIntake.
// Nats-* headers are dropped now, but a request can still be one the queue
// refuses every time: a header block just under JetStream's 64 KiB limit
// (the 64 KiB request limit is checked on the body only) is stored in
// BUILDQ_REQUESTS, and intake's copy, ~130 bytes of Buildq-Intake-*
// headers bigger, is refused ("header size exceeds maximum allowed of
// 64k", an APIError). The fix answers it only after --max-deliver
// deliveries, Nak'd with retryDelay in between (2+4+8+16 s = 30 s at the
// default 5), and a Nak'd message stays in buildq-workers' ack-pending
// set. acme publishes MaxAckPending (1000) such requests: for half a
// minute the server delivers nothing new to intake, and globex's request
// is not admitted; acme repeats every 30 s (≈ 2 MB/s) and every other
// tenant is shut out for as long as it likes.
//
// Origin: second adversarial review of fair queueing; failed on db0cecb, fixed by 3fd2295.
func TestFatHeadersDoNotShutOtherTenantsOutOfIntake(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	ctx := context.Background()
	cons, err := e.js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
	if err != nil {
		t.Fatal(err)
	}
	maxPending := cons.CachedInfo().Config.MaxAckPending
	if maxPending <= 0 || maxPending > 5000 {
		t.Skipf("buildq-workers MaxAckPending %d", maxPending)
	}
	// One first, synchronously: the tenant's publish is accepted.
	if _, err := e.js.PublishMsg(ctx, fatRequest(t, tenantRequest("acme", "fat-0"))); err != nil {
		t.Fatalf("the tenant's publish was refused (then it would be harmless): %v", err)
	}
	for i := 1; i < maxPending; i++ {
		if _, err := e.js.PublishMsgAsync(fatRequest(t, tenantRequest("acme", fmt.Sprint("fat-", i)))); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-e.js.PublishAsyncComplete():
	case <-time.After(10 * time.Second):
		t.Fatal("publishing the burst took too long")
	}
	events := e.events()
	g := tenantRequest("globex", "shut-out")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	qs, err := e.js.Stream(ctx, v1.QueueStream)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		// Queued, or taken by a handler straight from intake (w1 has
		// its slots free: fairq's direct.go).
		info, err := qs.Info(ctx, jetstream.WithSubjectFilter(fairq.QueueSubject("globex", v1.PriorityNormal)))
		if (err == nil && info.State.Subjects[fairq.QueueSubject("globex", v1.PriorityNormal)] == 1) || events.has(g.RequestID, v1.PhaseQueued) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	ci, _ := cons.Info(ctx)
	t.Fatalf("globex's request not admitted 8 s after acme's %d fat-header requests: buildq-workers has %d ack pending "+
		"(MaxAckPending %d), %d not delivered; every fat request is Nak'd with a delay until --max-deliver",
		maxPending, ci.NumAckPending, maxPending, ci.NumPending)
}
