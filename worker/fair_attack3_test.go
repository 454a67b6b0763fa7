package worker

// Third round of attacks on fair queueing (docs/design.md §2d), aimed at
// the fixes of 3fd2295. The comment tells the attack as it worked before
// its fix; the test asserts the fixed outcome and failed before it.

import (
	"context"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/fairq"
)

// A worker with a shorter --ack-wait joins while a queued request runs.
// wC (--ack-wait 6s) takes acme's r1 from buildq-q-normal-acme (AckWait
// 6 s) and heartbeats it every 2 s: heartbeat() fixes its ticker when the
// request is taken, from the AckWait known then. A worker with --ack-wait
// 1s starts (buildq-workers: 1 s). wC re-reads it and, on its next use of
// the consumer — at once: r1 itself, held, counts in the queue's view, so
// the dispatcher tries acme again — updates buildq-q-normal-acme to AckWait 1 s —
// which the server applies to r1, already pending. r1's ticker still beats
// every 2 s: the running request is redelivered, the very case the update
// was meant to prevent, without any new request (§2d "a worker with a shorter --ack-wait would
// otherwise have a running request redelivered").
func TestAttack3ConsumerAckWaitLoweredUnderRunningRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	e.startWorker("wC", func(c *Config) { withRegistry(tr)(c); c.AckWait = 6 * time.Second })
	time.Sleep(2500 * time.Millisecond) // wC reads buildq-workers' AckWait: 6 s
	r1 := tenantRequest("acme", "running")
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	time.Sleep(3 * time.Second) // r1 runs, heartbeated: not redelivered
	if _, _, redelivered := e.streamState(); redelivered > 0 {
		t.Fatal("premise: r1 redelivered before any AckWait changed")
	}
	// A worker with --ack-wait 1s starts.
	cfg := testConfig("starting")
	cfg.AckWait = time.Second
	w, err := New(e.nc, nil, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		c, err := e.js.Consumer(ctx, v1.QueueStream, fairq.DispatchConsumer("acme", v1.PriorityNormal))
		if err != nil {
			t.Fatal(err)
		}
		if c.CachedInfo().NumRedelivered > 0 {
			t.Fatalf("acme's running r1, alive and heartbeated by wC, was redelivered: %s was updated to AckWait %s "+
				"while r1's heartbeat ticker stayed at a third of the 6 s it was taken with",
				fairq.DispatchConsumer("acme", v1.PriorityNormal), c.CachedInfo().Config.AckWait)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
