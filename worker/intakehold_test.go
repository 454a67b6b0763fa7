package worker

// Requests held at intake (intakehold.go, docs/design.md §2d): a request
// whose key is being built for another request, or is queued to be built
// by a request of its tenant at its priority or higher, waits at intake
// — unqueued, nothing written for it — and is answered from the cache
// when the build ends, or admitted to the queue when the answer is not a
// plain one or the hold lasted its limit.

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// heldAtIntake reports whether the events show id held at intake.
func heldAtIntake(events *eventLog, id string) bool {
	for _, ev := range events.decoded() {
		if ev.RequestID == id && ev.Phase == v1.PhaseWaiting && strings.HasPrefix(ev.Message, "held at intake") {
			return true
		}
	}
	return false
}

// jobOf waits for the Job of req's key.
func (e *env) jobOf(req *v1.Request) string {
	return kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage))
}

func TestRequestsOfAKeyBeingBuiltAreHeldAtIntakeAndAnsweredFromTheCache(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = 2 * time.Minute
	})
	results := e.collect()
	events := e.events()
	ingested := e.ingestCounter(t)

	first := request("held-building")
	e.publishOrFail(t, first)
	job := e.waitJob(e.jobOf(first))
	mark := e.markIntake(t, w1)
	var dupes []*v1.Request
	for range 3 {
		d := request("held-building")
		e.publishOrFail(t, d)
		dupes = append(dupes, d)
	}
	eventually(t, 5*time.Second, "the three later requests held at intake", func() bool {
		for _, d := range dupes {
			if !heldAtIntake(events, d.RequestID) {
				return false
			}
		}
		return true
	})
	if n := mark.handedOn(t); n != 0 {
		t.Errorf("%d later requests were queued or handed to a handler; want all held at intake", n)
	}
	for _, d := range dupes {
		if le := e.ledgerEntry("acme", d.RequestID); le != nil {
			t.Errorf("held request %s has a ledger entry before its answer: %+v", d.RequestID, le)
		}
	}

	e.succeed(t, tr, job)
	got := results.waitFor(t, 4, 10*time.Second)
	for _, r := range got {
		switch r.ID {
		case first.RequestID:
			if r.Data.Origin != v1.OriginBuild || r.Data.Status != v1.StatusSucceeded {
				t.Errorf("the build's own result %s", mustJSON(t, r))
			}
		default:
			if r.Data.Origin != v1.OriginCache || r.Data.Status != v1.StatusSucceeded {
				t.Errorf("a held request's result %s: want succeeded from the cache", mustJSON(t, r))
			}
			if n := e.entryWrites(t, r.ID); n != 1 {
				t.Errorf("held request %s: its entry was written %d times, want once (created with its decision)", r.ID, n)
			}
		}
		// The counter's core subscription may see the publish a moment
		// after the collector saw the stored result (a loaded machine).
		eventually(t, 5*time.Second, r.ID+"'s publish counted", func() bool { return ingested(r.ID) > 0 })
		if n := ingested(r.ID); n != 1 {
			t.Errorf("%s: result published %d times, want once", r.ID, n)
		}
	}
	if n := mark.handedOn(t); n != 0 {
		t.Errorf("%d requests were queued after the build; want the held ones answered at intake", n)
	}
	eventually(t, 5*time.Second, "every message settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// A request of a key with no record yet, while a request of its tenant
// is queued to build it (behind another build on the only slot), is held
// on that request's pending mark: only the builder is queued.
func TestRequestsQueuedBehindTheirKeysBuilderAreHeldNotQueued(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = 2 * time.Minute
	})
	results := e.collect()
	events := e.events()

	other := request("held-blocker")
	e.publishOrFail(t, other)
	otherJob := e.waitJob(e.jobOf(other))
	mark := e.markIntake(t, w1)
	builder := request("held-pending")
	e.publishOrFail(t, builder)
	eventually(t, 5*time.Second, "the builder queued", func() bool { return mark.handedOn(t) == 1 })
	var dupes []*v1.Request
	for range 2 {
		d := request("held-pending")
		e.publishOrFail(t, d)
		dupes = append(dupes, d)
	}
	eventually(t, 5*time.Second, "the later requests held", func() bool {
		return heldAtIntake(events, dupes[0].RequestID) && heldAtIntake(events, dupes[1].RequestID)
	})
	if heldAtIntake(events, builder.RequestID) {
		t.Error("the key's first request was held: it builds the key, it must be queued")
	}
	e.succeed(t, tr, otherJob)
	job := e.waitJob(e.jobOf(builder))
	e.succeed(t, tr, job)
	got := results.waitFor(t, 4, 10*time.Second)
	origins := map[string]v1.Origin{}
	for _, r := range got {
		origins[r.ID] = r.Data.Origin
	}
	if origins[builder.RequestID] != v1.OriginBuild {
		t.Errorf("the builder's result origin %q, want build", origins[builder.RequestID])
	}
	for _, d := range dupes {
		if origins[d.RequestID] != v1.OriginCache {
			t.Errorf("held request %s: origin %q, want cache", d.RequestID, origins[d.RequestID])
		}
	}
	if n := mark.handedOn(t); n != 1 {
		t.Errorf("%d requests of the key were queued; want only its builder", n)
	}
}

// A build that fails lets its held requests go to the queue at once,
// where their handler decides them by the usual rules (not a hold limit
// later).
func TestAHeldRequestIsQueuedAtOnceWhenItsBuildFails(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = time.Hour
		// A record that stopped changing lets its held requests go after
		// its lapse (15 s here): the failure must do it sooner.
		c.Lease = 10 * time.Second
	})
	results := e.collect()
	events := e.events()

	first, dupe, job, mark := e.holdBehindBuild(t, w1, events, "held-fails")
	e.kubelet(job, 1, "error building image: RUN exited 1")
	got := results.waitFor(t, 1, 10*time.Second)
	if got[0].ID != first.RequestID || got[0].Data.Status != v1.StatusFailed {
		t.Fatalf("first result %s: want the build's own failure", mustJSON(t, got[0]))
	}
	// Released to the queue; its handler, finding the key failed for
	// inputs it shares, builds it again (or answers by the rules): in
	// any case it is handed on, not held for the hour.
	eventually(t, 10*time.Second, "the held request handed on to a handler", func() bool { return mark.handedOn(t) >= 1 })
	// Its handler builds the key again (a new Job, completed here) or
	// answers it from the failure.
	eventually(t, 10*time.Second, "the held request answered or built again", func() bool {
		if len(results.snapshot()) >= 2 {
			return true
		}
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), e.jobOf(dupe), metav1.GetOptions{})
		if err == nil && j.Annotations[kaniko.AnnotationRun] != job.Annotations[kaniko.AnnotationRun] && len(j.Status.Conditions) == 0 {
			e.succeed(t, tr, j)
			return true
		}
		return false
	})
	r := results.waitFor(t, 2, 10*time.Second)[1]
	if r.ID != dupe.RequestID {
		t.Fatalf("second result %s: want the held request's", mustJSON(t, r))
	}
}

// A request held on a pending mark whose build never comes is admitted
// to the queue when its hold reaches --hold-at-intake, and built there.
// (The worker's only slot is busy: a request its idle dispatcher would
// take at once is built at once, never held on a mark.)
func TestAHeldRequestIsQueuedWhenItsHoldEnds(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = 2 * time.Second
	})
	results := e.collect()
	events := e.events()
	blocker := e.occupySlot(t, "held-no-builder-blocker")
	req := request("held-no-builder")
	e.markPendingByHand(t, req, ledger.Pending{Tenant: "acme", RequestID: "never-published", Priority: v1.PriorityNormal})
	mark := e.markIntake(t, w1)
	e.publishOrFail(t, req)
	eventually(t, 5*time.Second, "the request held on the mark", func() bool { return heldAtIntake(events, req.RequestID) })
	if n := mark.handedOn(t); n != 0 {
		t.Fatalf("%d requests handed on while held", n)
	}
	eventually(t, 10*time.Second, "the request queued when its hold ended", func() bool { return mark.handedOn(t) == 1 })
	e.succeed(t, tr, blocker)
	job := e.waitJob(e.jobOf(req))
	e.succeed(t, tr, job)
	eventually(t, 10*time.Second, "the request built after its hold", func() bool {
		r, ok := resultOf(results, req.RequestID)
		return ok && r.Data.Origin == v1.OriginBuild
	})
}

// A pending mark of another tenant's request, or of a lower priority than
// the request's own, holds nothing: held, the request would wait behind
// another tenant's queue or a lower priority.
func TestAPendingMarkOfAnotherTenantOrALowerPriorityHoldsNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		mark ledger.Pending
		prio string
	}{
		{"another tenant", ledger.Pending{Tenant: "globex", RequestID: "theirs", Priority: v1.PriorityHigh}, ""},
		{"a lower priority", ledger.Pending{Tenant: "acme", RequestID: "mine", Priority: v1.PriorityLow}, v1.PriorityHigh},
		{"its own tenant and priority (the control)", ledger.Pending{Tenant: "acme", RequestID: "mine", Priority: v1.PriorityNormal}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			w1 := e.startWorker("w1", func(c *Config) {
				withRegistry(tr)(c)
				c.MaxInFlight = 1
				c.HoldAtIntake = time.Hour
			})
			events := e.events()
			e.occupySlot(t, "held-blocker-"+tc.name)
			mark := e.markIntake(t, w1)
			req := request("held-" + tc.name)
			req.Priority = tc.prio
			e.markPendingByHand(t, req, tc.mark)
			e.publishOrFail(t, req)
			control := tc.mark.Tenant == "acme" && tc.mark.Priority == v1.PriorityNormal
			if control {
				eventually(t, 5*time.Second, "the control request held", func() bool { return heldAtIntake(events, req.RequestID) })
				return
			}
			eventually(t, 5*time.Second, "the request queued", func() bool { return mark.handedOn(t) == 1 })
			if heldAtIntake(events, req.RequestID) {
				t.Errorf("the request was held on %+v", tc.mark)
			}
		})
	}
}

// occupySlot publishes a request of seed and waits for its Job: a worker
// with one slot is busy until the test completes it.
func (e *env) occupySlot(t *testing.T, seed string) *batchv1.Job {
	t.Helper()
	r := request(seed)
	e.publishOrFail(t, r)
	return e.waitJob(e.jobOf(r))
}

// Held requests are handed back when their worker stops, and another
// worker answers them.
func TestHeldRequestsAreHandedBackWhenTheirWorkerStops(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = time.Hour
		// Not handed back, the held request would come again only after
		// this AckWait, past the test's wait.
		c.AckWait = 30 * time.Second
	})
	results := e.collect()
	events := e.events()
	first := request("held-stop")
	e.publishOrFail(t, first)
	e.waitJob(e.jobOf(first))
	dupe := request("held-stop")
	e.publishOrFail(t, dupe)
	eventually(t, 5*time.Second, "the later request held", func() bool { return heldAtIntake(events, dupe.RequestID) })
	w1.stop(t)
	e.startWorker("w2", withRegistry(tr))
	// w2 takes the build over (its Job adopted) and the handed-back
	// request comes to it as a redelivery.
	job := e.waitJob(e.jobOf(first))
	e.succeed(t, tr, job)
	got := results.waitFor(t, 2, 20*time.Second)
	ids := map[string]bool{}
	for _, r := range got {
		ids[r.ID] = true
		if r.Data.Status != v1.StatusSucceeded {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	if !ids[first.RequestID] || !ids[dupe.RequestID] {
		t.Errorf("results for %v, want both requests", ids)
	}
}

// markPendingByHand writes req's key's pending mark naming p.
func (e *env) markPendingByHand(t *testing.T, req *v1.Request, p ledger.Pending) {
	t.Helper()
	kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(p)
	if _, err := kv.Put(context.Background(), ledger.PendingKey(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)), b); err != nil {
		t.Fatal(err)
	}
}

// A request held on a run whose record sits unchanged past its lease (its
// owner gone) goes to the queue, whose handler takes the run over — not
// held until its limit.
func TestAHeldRequestOnALapsedRunIsQueued(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.HoldAtIntake = time.Hour
	})
	results := e.collect()
	events := e.events()
	req := request("held-lapsed")
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	kv, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "gone", Holder: "acme/another",
		LeaseMs: 1000, Tenant: "acme", StartedAt: time.Now().UTC()})
	if _, err := kv.Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
	mark := e.markIntake(t, w1)
	e.publishOrFail(t, req)
	eventually(t, 5*time.Second, "the request held on the run", func() bool { return heldAtIntake(events, req.RequestID) })
	eventually(t, 10*time.Second, "the request handed on once the run lapsed", func() bool { return mark.handedOn(t) == 1 })
	job := e.waitJob(e.jobOf(req))
	e.succeed(t, tr, job)
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s: want the request built by the run's take-over", mustJSON(t, r))
	}
}

// A request held on a pending mark whose request was decided without a
// record of the key (here: it built another key) goes to the queue at the
// mark's next check, not at its limit.
func TestAHeldRequestOnADecidedMarkIsQueued(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = time.Hour
	})
	results := e.collect()
	events := e.events()
	decided := request("held-mark-decided")
	e.publishOrFail(t, decided)
	dj := e.waitJob(e.jobOf(decided))
	e.succeed(t, tr, dj)
	results.waitFor(t, 1, 10*time.Second)
	blocker := e.occupySlot(t, "held-mark-blocker")
	req := request("held-mark-waiter")
	e.markPendingByHand(t, req, ledger.Pending{Tenant: "acme", RequestID: decided.RequestID, Priority: v1.PriorityNormal})
	mark := e.markIntake(t, w1)
	e.publishOrFail(t, req)
	eventually(t, 5*time.Second, "the request held on the mark", func() bool { return heldAtIntake(events, req.RequestID) })
	eventually(t, 10*time.Second, "the request queued once the mark's request showed decided", func() bool { return mark.handedOn(t) == 1 })
	e.succeed(t, tr, blocker)
	job := e.waitJob(e.jobOf(req))
	e.succeed(t, tr, job)
	eventually(t, 10*time.Second, "the request built", func() bool {
		r, ok := resultOf(results, req.RequestID)
		return ok && r.Data.Status == v1.StatusSucceeded
	})
}

// A run of another tenant holds nothing: queued, the request is parked by
// its handler in the waiter index, where that tenant's cancel sees it and
// spares the build for it.
func TestAnotherTenantsRunHoldsNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.HoldAtIntake = time.Hour
	})
	events := e.events()
	first := request("held-other-tenant")
	e.publishOrFail(t, first)
	e.waitJob(e.jobOf(first))
	mark := e.markIntake(t, w1)
	theirs := request("held-other-tenant")
	theirs.Tenant = "globex"
	theirs.Source.S3.Key = strings.Replace(theirs.Source.S3.Key, "contexts/acme/", "contexts/globex/", 1)
	e.publishOrFail(t, theirs)
	eventually(t, 5*time.Second, "globex's request handed on", func() bool { return mark.handedOn(t) == 1 })
	if heldAtIntake(events, theirs.RequestID) {
		t.Error("globex's request was held on acme's run")
	}
}

// fakeHeldMsg is a request message for the room's release, with nothing
// behind it: what release does with it is recorded.
type fakeHeldMsg struct {
	jetstream.Msg
	data       []byte
	naks, beat atomic.Int32
}

func (m *fakeHeldMsg) Data() []byte         { return m.data }
func (m *fakeHeldMsg) Subject() string      { return v1.RequestSubject("acme") }
func (m *fakeHeldMsg) Headers() nats.Header { return nats.Header{} }
func (m *fakeHeldMsg) InProgress() error    { m.beat.Add(1); return nil }
func (m *fakeHeldMsg) Nak() error           { m.naks.Add(1); return nil }
func (m *fakeHeldMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: 1, Timestamp: time.Now()}, nil
}

// A held request whose heartbeats stopped for two thirds of the AckWait
// (a pause, a NATS outage) may have been delivered again: released, it is
// neither answered nor admitted — its redelivery is the request now.
func TestAHeldRequestWhoseBeatsLapsedIsLeftToItsRedelivery(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", func(c *Config) { c.HoldAtIntake = time.Hour })
	body, _ := json.Marshal(request("held-lapsed-beats"))
	var admitted atomic.Int32
	room := w1.w.room
	eventually(t, 5*time.Second, "the room open", func() bool { return room.room() })
	stale := &heldReq{msg: &fakeHeldMsg{data: body}, since: time.Now().Add(-time.Minute), beat: time.Now().Add(-time.Minute),
		admit: func(context.Context) { admitted.Add(1) }}
	fresh := &heldReq{msg: &fakeHeldMsg{data: body}, since: time.Now(), beat: time.Now(),
		admit: func(context.Context) { admitted.Add(1) }}
	room.mu.Lock()
	room.n += 2
	room.mu.Unlock()
	room.release([]*heldReq{stale}, true)
	room.release([]*heldReq{fresh}, true)
	eventually(t, 5*time.Second, "the fresh request admitted", func() bool { return admitted.Load() >= 1 })
	time.Sleep(200 * time.Millisecond)
	if n := admitted.Load(); n != 1 {
		t.Fatalf("%d requests admitted, want only the one still beaten (the other's delivery may have lapsed)", n)
	}
	room.mu.Lock()
	n := room.n
	room.mu.Unlock()
	if n != 0 {
		t.Errorf("the room still counts %d requests after both were let go", n)
	}
}

// A tenant with a queue-length limit has nothing held: held requests would
// not count against the limit, which the queue keeps.
func TestATenantWithAQueueLimitHasNothingHeld(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.HoldAtIntake = time.Hour
		c.Fair = FairConfig{QueueLimit: map[string]int{"acme": 100}}
	})
	events := e.events()
	first := request("held-queue-limit")
	e.publishOrFail(t, first)
	e.waitJob(e.jobOf(first))
	mark := e.markIntake(t, w1)
	dupe := request("held-queue-limit")
	e.publishOrFail(t, dupe)
	eventually(t, 5*time.Second, "the request handed on", func() bool { return mark.handedOn(t) == 1 })
	if heldAtIntake(events, dupe.RequestID) {
		t.Error("a request of a tenant with a queue limit was held")
	}
}

// publishOrFail publishes r.
func (e *env) publishOrFail(t *testing.T, r *v1.Request) {
	t.Helper()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
}

// succeed completes job with an image pushed to its destination.
func (e *env) succeed(t *testing.T, tr *testRegistry, job *batchv1.Job) {
	t.Helper()
	e.kubelet(job, 0, tr.push(t, destination(job)))
}

// holdBehindBuild publishes a request of seed and waits for its Job, then
// publishes a second of the same key and waits until w holds it at
// intake; mark is where intake stood before the second.
func (e *env) holdBehindBuild(t *testing.T, w *runningWorker, events *eventLog, seed string) (first, dupe *v1.Request, job *batchv1.Job, mark intakeMark) {
	t.Helper()
	first = request(seed)
	e.publishOrFail(t, first)
	job = e.waitJob(e.jobOf(first))
	mark = e.markIntake(t, w)
	dupe = request(seed)
	e.publishOrFail(t, dupe)
	eventually(t, 5*time.Second, "the later request held", func() bool { return heldAtIntake(events, dupe.RequestID) })
	return first, dupe, job, mark
}

// resultOf is id's result among those collected so far.
func resultOf(results *resultCollector, id string) (v1.Result, bool) {
	for _, r := range results.snapshot() {
		if r.ID == id {
			return r, true
		}
	}
	return v1.Result{}, false
}

// A request held several AckWaits long is heartbeaten: its message is not
// delivered again meanwhile, and the build's end answers it where it was
// held.
func TestAHeldRequestIsHeartbeatenAcrossAckWaits(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.HoldAtIntake = time.Hour // AckWait: the harness's 2 s
	})
	results := e.collect()
	events := e.events()
	_, dupe, job, mark := e.holdBehindBuild(t, w1, events, "held-beaten")
	time.Sleep(7 * time.Second) // three AckWaits and more
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Errorf("%d requests delivered again while held: the hold missed its heartbeats", redelivered)
	}
	if n := mark.handedOn(t); n != 0 {
		t.Errorf("%d requests handed on while held", n)
	}
	e.succeed(t, tr, job)
	eventually(t, 10*time.Second, "the held request answered from the cache", func() bool {
		r, ok := resultOf(results, dupe.RequestID)
		return ok && r.Data.Origin == v1.OriginCache
	})
	if n := e.entryWrites(t, dupe.RequestID); n != 1 {
		t.Errorf("the held request's entry was written %d times, want once", n)
	}
}

// A key seen building whose record is gone when the room looks again (a
// claim sent ahead and withdrawn, intakeclaim.go, whose delete came
// before the requests were held on it; the bucket's TTL) lets its held
// requests go: no run is left to end and let them go. A key never seen
// building keeps them: its build has not started yet.
func TestHeldRequestsOfAKeyWhoseRecordWentAreLetGo(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := e.startWorker("w1", func(c *Config) { c.HoldAtIntake = time.Hour })
	r := w.w.room
	msgs := map[string]*fakeHeldMsg{"seen-building": {}, "not-started": {}}
	var admitted sync.Map
	hold := func(key string, building bool) {
		now := time.Now()
		hk := &heldKey{building: building, changed: now, lapse: time.Hour, checked: now,
			reqs: []*heldReq{{msg: msgs[key], since: now, beat: now, admit: func(context.Context) { admitted.Store(key, true) }}}}
		r.mu.Lock()
		r.byKey[key] = hk
		r.n++
		r.mu.Unlock()
	}
	// Let go: answered, admitted, or handed back (a room not open yet).
	letGo := func(key string) bool {
		_, ok := admitted.Load(key)
		return ok || msgs[key].naks.Load() > 0
	}
	hold("seen-building", true)
	hold("not-started", false)
	r.recheck("seen-building")
	r.recheck("not-started")
	eventually(t, 10*time.Second, "the request held on the key seen building let go", func() bool { return letGo("seen-building") })
	time.Sleep(300 * time.Millisecond)
	if letGo("not-started") {
		t.Fatal("a request held on a key never seen building was let go when the key had no record")
	}
}
