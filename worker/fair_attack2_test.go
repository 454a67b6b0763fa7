package worker

// Second round of attacks on fair queueing (docs/design.md §2d), aimed at
// the fixes of db0cecb. Each test fails while the defect it shows is
// present.
//
// Each test's comment tells the attack as it worked before its fix (the
// code it names may have changed since); the test asserts the outcome the
// fix gives, and failed before it.

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/fairq"
)

// Worker stopped while the cluster is busy (a rolling update under load,
// exactly when fair queueing matters). w1 runs acme's r1 (acme's limit: 1)
// and stops: the handler hands r1 back, its Job runs on, and slot.handBack
// marks acme.0 "handed back" — but nothing renews that key, and the bucket's
// TTL is the lease. w2, the other worker, has no free build slot, so its
// dispatcher does not look at acme for longer than a lease: the handed-back
// key aged out. When w2 freed a slot it found acme.0 free, created it
// (prefer ""), and takes acme's highest-priority request first — r2 (high),
// not the handed-back r1 (normal) — and creates r2's Job while r1's, handed
// back, still runs: acme runs two builds with a limit of 1, no worker
// paused. (Same with one worker whose replacement takes longer than the
// lease to start.)
func TestAttack2HandedBackSlotAgesOutWhileBuildRuns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(inFlight int) func(*Config) {
		return func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = inFlight
			c.Fair.Concurrency = map[string]int{"acme": 1}
		}
	}
	ctx := context.Background()
	// w2 (one build slot) is busy with globex's build.
	e.startWorker("w2", limit(1))
	g := tenantRequest("globex", "keeps-w2-busy")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	gj := e.waitJob(jobOf(g))
	w1 := e.startWorker("w1", limit(4))
	r1 := tenantRequest("acme", "handed-back-normal")
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	r2 := tenantRequest("acme", "next-high")
	r2.Priority = v1.PriorityHigh
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(3)
	w1.stop(t)
	kv, err := e.js.KeyValue(ctx, v1.SlotsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if en, err := kv.Get(ctx, "acme.0"); err != nil || !strings.Contains(string(en.Value()), `"handedBack":true`) {
		t.Fatalf("acme.0 after w1's stop: %v %v, want handed back", en, err)
	}
	// Longer than the lease (2 s) while w2 is busy: nobody takes the slot.
	time.Sleep(3 * time.Second)
	if _, ok := e.jobs()[jobOf(r1)]; !ok {
		t.Fatal("r1's Job is gone: the premise (its build runs on after the hand-back) does not hold")
	}
	// The workers keep a handed-back slot while its request is queued.
	if en, err := kv.Get(ctx, "acme.0"); err != nil || !strings.Contains(string(en.Value()), `"handedBack":true`) {
		t.Fatalf("acme.0 after a lease: %v %v, want still handed back", en, err)
	}
	e.kubelet(gj, 0, tr.push(t, destination(gj)))
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		js := e.jobs()
		_, j1 := js[jobOf(r1)]
		_, j2 := js[jobOf(r2)]
		if j1 && j2 {
			t.Fatalf("acme runs two builds at once (%s, handed back and still running, and %s), its concurrency limit is 1: "+
				"the handed-back slot aged out after one lease while no worker had a free build slot", jobOf(r1), jobOf(r2))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Workers with different --ack-wait, the case the fix of
// TestAttackDispatchAckWaitNotTheHeartbeatsOne is for. A dispatch consumer
// takes buildq-workers' AckWait as the creating worker saw it, once per
// process (the consumer is cached); heartbeats follow buildq-workers'
// AckWait as it is *now* (re-read every 2 s). wC (--ack-wait 6s) runs. A
// worker with --ack-wait 1s starts (buildq-workers: 1 s); wC runs an acme
// request and so creates buildq-q-normal-acme with AckWait 1 s. Then a
// worker with --ack-wait 6s starts (a rollback of the flag; buildq-workers:
// 6 s). wC's heartbeat goes to every 2 s; its cached consumer still has 1 s
// and is never updated. acme's next request, run by wC, alive and
// heartbeating, is redelivered every second.
func TestAttack2DispatchConsumerKeepsStaleAckWait(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	e.startWorker("wC", func(c *Config) { withRegistry(tr)(c); c.AckWait = 6 * time.Second })
	results := e.collect()
	setupWith := func(ackWait time.Duration) {
		cfg := testConfig("starting")
		cfg.AckWait = ackWait
		w, err := New(e.nc, nil, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Setup(ctx); err != nil {
			t.Fatal(err)
		}
	}
	setupWith(time.Second)              // a worker with --ack-wait 1s starts
	time.Sleep(2500 * time.Millisecond) // wC re-reads buildq-workers' AckWait: 1 s
	r1 := tenantRequest("acme", "first")
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	j1 := e.waitJob(jobOf(r1))
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	results.waitFor(t, 1, 10*time.Second)
	setupWith(6 * time.Second)          // a worker with --ack-wait 6s starts
	time.Sleep(2500 * time.Millisecond) // wC re-reads it: 6 s, heartbeats every 2 s
	r2 := tenantRequest("acme", "second")
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r2))
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if _, _, redelivered := e.streamState(); redelivered > 0 {
			c, err := e.js.Consumer(ctx, v1.QueueStream, fairq.DispatchConsumer("acme", v1.PriorityNormal))
			if err != nil {
				t.Fatal(err)
			}
			t.Fatalf("acme's running request, heartbeated every 2 s by wC (buildq-workers' AckWait is 6 s), was redelivered: "+
				"%s still has AckWait %s from when wC created it", fairq.DispatchConsumer("acme", v1.PriorityNormal), c.CachedInfo().Config.AckWait)
		}
		time.Sleep(50 * time.Millisecond)
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

// Hostile tenant, after the fix of TestAttackPoisonedIntakeShutsOtherTenantsOut.
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
func TestAttack2FatHeadersHoldIntakeAndShutOthersOut(t *testing.T) {
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
		info, err := qs.Info(ctx, jetstream.WithSubjectFilter(fairq.QueueSubject("globex", v1.PriorityNormal)))
		if err == nil && info.State.Subjects[fairq.QueueSubject("globex", v1.PriorityNormal)] == 1 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	ci, _ := cons.Info(ctx)
	t.Fatalf("globex's request not admitted 8 s after acme's %d fat-header requests: buildq-workers has %d ack pending "+
		"(MaxAckPending %d), %d not delivered; every fat request is Nak'd with a delay until --max-deliver",
		maxPending, ci.NumAckPending, maxPending, ci.NumPending)
}
