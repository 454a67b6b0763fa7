package worker

// Fair queue (worker/internal/fairq), heartbeats: a running request is
// never redelivered, however long its build and whatever --ack-wait the
// workers were started with; the dispatch consumers' AckWait only rises
// (docs/design.md §2 step 1, §2d). A review's test tells the attack as it
// worked before its fix; it asserts the fixed outcome.

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/fairq"
)

// lowerWorkersAckWait sets buildq-workers' AckWait to d by hand, as an
// operator would (`nats consumer edit`): a worker never lowers it.
func (e *env) lowerWorkersAckWait(t *testing.T, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	c, err := e.js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.CachedInfo().Config
	cfg.AckWait = d
	if _, err := e.js.UpdateConsumer(ctx, v1.RequestsStream, cfg); err != nil {
		t.Fatal(err)
	}
}

// queuedAcme keeps acme's requests on the queue's path: with a queue
// limit, none is taken straight from intake (fairq's direct.go).
func queuedAcme(c *Config) { c.Fair.QueueLimit = map[string]int{"acme": 100} }

// Origin: the build pipeline spine (0bdb2cd).
func TestLongBuildIsNotRedelivered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.AckWait = time.Second; c.Lease = time.Second })
	results := e.collect()

	req := request("slow")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	// Outlast AckWait (and the lease) several times over.
	time.Sleep(3500 * time.Millisecond)
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d redeliveries during a long build", redelivered)
	}
	e.kubelet(job, 0, digestOf("slow"))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Attempts != 1 || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

// A worker whose --ack-wait is longer than the consumer's (set lower by
// hand: workers only ever raise it) heartbeats often enough that its
// requests are not redelivered mid-build.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestHeartbeatFollowsTheConsumersAckWait(t *testing.T) {
	t.Parallel()
	e := setup(t)
	long := e.startWorker("long", func(c *Config) { c.AckWait = 6 * time.Second })
	e.lowerWorkersAckWait(t, time.Second)
	eventually(t, 10*time.Second, "the long worker to learn the consumer's AckWait", func() bool {
		return long.w.heartbeatEvery() < time.Second
	})
	results := e.collect()
	req := request("ack-wait")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	time.Sleep(4 * time.Second) // four AckWaits of the consumer
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d redeliveries during the build", redelivered)
	}
	e.kubelet(job, 0, digestOf("ack-wait"))
	results.waitFor(t, 1, 10*time.Second)
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
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestDispatchAckWaitIsTheHeartbeatsOne(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	e.startWorker("wA", func(c *Config) { withRegistry(tr)(c); queuedAcme(c); c.MaxInFlight = 1; c.AckWait = time.Second })
	g := tenantRequest("globex", "keeps-wA-busy")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	gj := e.waitJob(jobOf(g))
	e.startWorker("wB", func(c *Config) { withRegistry(tr)(c); queuedAcme(c); c.AckWait = 6 * time.Second })
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

// Workers with different --ack-wait, the case the fix of
// TestDispatchAckWaitIsTheHeartbeatsOne is for. A dispatch consumer
// takes buildq-workers' AckWait as the creating worker saw it, once per
// process (the consumer is cached); heartbeats follow buildq-workers'
// AckWait as it is *now* (re-read every 2 s). wC (--ack-wait 6s) runs.
// buildq-workers goes to 1 s (then by a worker started with --ack-wait 1s;
// workers no longer lower it, so here by hand); wC runs an acme
// request and so creates buildq-q-normal-acme with AckWait 1 s. Then a
// worker with --ack-wait 6s starts (a rollback of the flag; buildq-workers:
// 6 s). wC's heartbeat goes to every 2 s; its cached consumer still has 1 s
// and is never updated. acme's next request, run by wC, alive and
// heartbeating, is redelivered every second.
//
// Origin: second adversarial review of fair queueing; failed on db0cecb, fixed by 3fd2295.
func TestDispatchConsumerFollowsALaterAckWait(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	e.startWorker("wC", func(c *Config) { withRegistry(tr)(c); queuedAcme(c); c.AckWait = 6 * time.Second })
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
	e.lowerWorkersAckWait(t, time.Second) // an operator lowers it to 1 s
	time.Sleep(2500 * time.Millisecond)   // wC re-reads buildq-workers' AckWait: 1 s
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

// buildq-workers' AckWait drops while a queued request runs (then by a
// worker started with a shorter --ack-wait; workers no longer lower it,
// so here by hand). wC (--ack-wait 6s) takes acme's r1 from
// buildq-q-normal-acme (AckWait 6 s) and heartbeats it every 2 s:
// heartbeat() fixes its ticker when the request is taken, from the
// AckWait known then. buildq-workers goes to 1 s. wC re-reads it and, on its next use of
// the consumer — at once: r1 itself, held, counts in the queue's view, so
// the dispatcher tries acme again — updates buildq-q-normal-acme to AckWait 1 s —
// which the server applies to r1, already pending. r1's ticker still beats
// every 2 s: the running request is redelivered, the very case the update
// was meant to prevent, without any new request (§2d "a worker with a shorter --ack-wait would
// otherwise have a running request redelivered").
//
// Origin: third adversarial review of fair queueing; failed on 3fd2295, fixed by cb91567.
func TestConsumerAckWaitIsNotLoweredUnderARunningRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	e.startWorker("wC", func(c *Config) { withRegistry(tr)(c); queuedAcme(c); c.AckWait = 6 * time.Second })
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
	// buildq-workers goes to 1 s (by hand: a worker started with
	// --ack-wait 1s no longer lowers it).
	e.lowerWorkersAckWait(t, time.Second)
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

// beatCounter is a message that counts its heartbeats.
type beatCounter struct {
	jetstream.Msg
	beats atomic.Int32
}

func (m *beatCounter) InProgress() error { m.beats.Add(1); return nil }

// A running request's heartbeat follows the consumer's AckWait as the
// worker learns it, not only the one it had when the request was taken: a
// request held on buildq-workers (taken straight from intake) whose
// AckWait an operator lowers by hand is beaten at the new pace within a
// second or two, instead of every third of the old AckWait — which would
// have it redelivered, again and again, while it runs.
func TestAHeartbeatFollowsALoweredAckWaitWhileItRuns(t *testing.T) {
	t.Parallel()
	w := &Worker{cfg: Config{AckWait: 6 * time.Second}, log: zaptest.NewLogger(t)}
	w.ackWait.Store(int64(6 * time.Second))
	m := &beatCounter{}
	stop := w.heartbeat(m, 0)
	defer stop()
	time.Sleep(500 * time.Millisecond)
	w.ackWait.Store(int64(600 * time.Millisecond)) // learned: lowered to 600 ms
	time.Sleep(1500 * time.Millisecond)            // a look at the pace comes within a second
	before := m.beats.Load()
	time.Sleep(time.Second)
	if n := m.beats.Load() - before; n < 3 {
		t.Fatalf("%d heartbeats in the second after the AckWait went to 600 ms, want one every 200 ms", n)
	}
}
