package worker

// Fair queue (worker/internal/fairq/direct.go): a request taken straight
// from intake. A worker whose dispatcher waits with a build slot free and
// nothing to take runs a new request there and then, past the tenant's
// queue; a busy worker, a tenant with a concurrency or queue limit, and a
// redelivery go through the queue as before (docs/design.md §2d).

import (
	"context"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// waitIdle waits until w's dispatcher waits with a slot free and nothing
// to take: a request published now is taken straight from intake (the
// dispatcher leaves that wait only for a moment, to look at the queue
// again every idle poll).
func waitIdle(t *testing.T, w *runningWorker) {
	t.Helper()
	eventually(t, 5*time.Second, w.w.cfg.ID+"'s dispatcher idle", w.w.fq.Idle)
}

// An idle worker runs a new request on a free slot without queueing it:
// nothing is written to BUILDQ_QUEUE, and the request's own message is
// held, heartbeaten and acked like a queued one.
func TestAnIdleWorkerTakesARequestStraightFromIntake(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", nil)
	results := e.collect()
	events := e.events()
	req := request("direct")
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if n := takenDirect(w1); n != 1 {
		t.Fatalf("w1 took %d requests straight from intake, want 1", n)
	}
	if q := e.queueLastSeq(t); q != 0 {
		t.Fatalf("BUILDQ_QUEUE's last sequence is %d: the request was queued", q)
	}
	if !events.has(req.RequestID, v1.PhaseQueued) {
		t.Error("the request has no queued event (taken by w1)")
	}
	// Held while it runs, past the AckWait (2 s): heartbeaten, never
	// redelivered.
	time.Sleep(3 * time.Second)
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d requests redelivered while the build ran", redelivered)
	}
	e.kubelet(job, 0, digestOf("direct"))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Attempts != 1 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	eventually(t, 5*time.Second, "the request's message acked", func() bool {
		msgs, held, _ := e.streamState()
		return msgs == 0 && held == 0
	})
}

// A worker with no slot free queues what it cannot run at once; the
// queued request runs when the slot frees.
func TestABusyWorkerQueuesWhatItCannotTakeAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", func(c *Config) { c.MaxInFlight = 1 })
	results := e.collect()
	r1, r2 := request("busy-1"), request("busy-2")
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	j1 := e.waitJob(jobOf(r1))
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the second request queued", func() bool { return e.queueLastSeq(t) == 1 })
	if n := takenDirect(w1); n != 1 {
		t.Fatalf("w1 took %d requests straight from intake, want only the first", n)
	}
	e.kubelet(j1, 0, digestOf("busy-1"))
	j2 := e.waitJob(jobOf(r2))
	e.kubelet(j2, 0, digestOf("busy-2"))
	got := byID(results.waitFor(t, 2, 10*time.Second))
	for _, r := range []*v1.Request{r1, r2} {
		if res := got[r.RequestID]; len(res) != 1 || res[0].Data.Status != v1.StatusSucceeded {
			t.Errorf("%s: %s", r.RequestID, mustJSON(t, res))
		}
	}
}

// A tenant with a concurrency or a queue limit is counted by its queue's
// messages and its slots: its requests are always queued, even on an
// idle worker.
func TestALimitedTenantIsNeverTakenStraightFromIntake(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		limit func(*Config)
	}{
		{"concurrency", func(c *Config) { c.Fair.Concurrency = map[string]int{"acme": 2} }},
		{"queue length", func(c *Config) { c.Fair.QueueLimit = map[string]int{"acme": 5} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			w1 := e.startWorker("w1", tc.limit)
			results := e.collect()
			req := request("limited")
			waitIdle(t, w1)
			if _, err := e.pub.Publish(context.Background(), req); err != nil {
				t.Fatal(err)
			}
			job := e.waitJob(jobOf(req))
			if n := takenDirect(w1); n != 0 {
				t.Fatalf("w1 took %d of a limited tenant's requests straight from intake", n)
			}
			if q := e.queueLastSeq(t); q != 1 {
				t.Fatalf("BUILDQ_QUEUE's last sequence is %d, want 1", q)
			}
			e.kubelet(job, 0, digestOf("limited"))
			if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded {
				t.Fatalf("result %s", mustJSON(t, r))
			}
		})
	}
}

// A request taken straight from intake and handed back (its worker stops)
// comes back through the queue — a redelivery is never taken straight
// from intake: its queued copy may exist already — and counts both
// deliveries.
func TestARequestTakenStraightFromIntakeAndHandedBackIsQueued(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", nil)
	results := e.collect()
	req := request("direct-handed-back")
	waitIdle(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if n := takenDirect(w1); n != 1 {
		t.Fatalf("premise: w1 took %d requests straight from intake, want 1", n)
	}
	// w2 waits idle first: the redelivery reaches a dispatcher that
	// would take it straight from intake, were it a first delivery.
	w2 := e.startWorker("w2", nil)
	waitIdle(t, w2)
	w1.stop(t)
	eventually(t, 5*time.Second, "the handed-back request queued", func() bool { return e.queueLastSeq(t) == 1 })
	if n := takenDirect(w2); n != 0 {
		t.Fatalf("w2 took the redelivered request straight from intake (%d)", n)
	}
	e.kubelet(job, 0, digestOf("direct-handed-back"))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
		t.Fatalf("result %s, want success on the second attempt", mustJSON(t, r))
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d Jobs created, want 1 (adopted)", c)
	}
}

// buildq-workers' AckWait is only raised: a worker started with a shorter
// --ack-wait while a request taken straight from intake runs (held on
// buildq-workers, heartbeaten every third of the AckWait it was taken
// with) does not have it redelivered.
func TestAStartingWorkerDoesNotLowerTheSharedAckWait(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	e.startWorker("w1", func(c *Config) { c.AckWait = 6 * time.Second })
	time.Sleep(2500 * time.Millisecond) // w1 reads buildq-workers' AckWait: 6 s
	results := e.collect()
	req := request("ack-wait-kept")
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	cfg := testConfig("starting")
	cfg.AckWait = time.Second
	w, err := New(e.nc, nil, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	c, err := e.js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.CachedInfo().Config.AckWait; got != 6*time.Second {
		t.Fatalf("buildq-workers' AckWait is %s after a worker with --ack-wait 1s started, want 6s kept", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if _, _, redelivered := e.streamState(); redelivered > 0 {
			t.Fatal("the running request was redelivered")
		}
		time.Sleep(50 * time.Millisecond)
	}
	e.kubelet(job, 0, digestOf("ack-wait-kept"))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 1 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}
