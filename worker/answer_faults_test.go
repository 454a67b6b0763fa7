package worker

// Attacks on cache hits answered at intake (answer.go, docs/design.md
// §2d) at the worst moments: NATS failing between the steps of an answer
// (a create whose reply is lost, a publish refused), a worker killed
// between them, a worker stopped mid-answer, an answer outliving its
// message's AckWait. Nothing may be lost, and one decision is published
// once. The attacks on inputs and tenancy are in answer_attack_test.go.

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// The ledger create of a hit lands but its reply is lost: intake falls
// back to the queue, whose handler finds the decision in the entry and
// publishes exactly it, once.
func TestAttack_IntakeCreateWhoseReplyIsLostIsPublishedByTheQueue(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	hit := request("atk-create-lost")
	hit.RequestID = "atk-create-lost-hit"
	hk := RequestIndexKey("acme", hit.RequestID)
	var landed atomic.Bool
	w1 := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		inner := w.ledger.Bucket()
		w.ledger.UseBucket(&hookedKV{KeyValue: inner, onCreate: func(k string, value []byte) error {
			if k != hk || !landed.CompareAndSwap(false, true) {
				return nil
			}
			if _, err := inner.Create(context.Background(), k, value); err != nil {
				return err
			}
			return nats.ErrTimeout
		}})
	})
	results := e.collect()
	ingested := e.ingestCounter(t)
	e.buildThrough(t, tr, results, request("atk-create-lost"), 1)
	mark := e.markIntake(t, w1)
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	got := oneResult(t, results, hit.RequestID)
	if !landed.Load() {
		t.Fatal("the hit's entry was not created at intake")
	}
	if got.Data.Status != v1.StatusSucceeded || got.Data.Origin != v1.OriginCache {
		t.Fatalf("result %s", decision(got.Data))
	}
	e.atkSettled(t, 10*time.Second)
	if n := mark.handedOn(t); n != 1 {
		t.Errorf("requests handed on to a handler (queued, or taken straight from intake) since the hit was published: %d, want 1 (the hit whose create reply was lost)", n)
	}
	if d := e.atkEntryDecision(hit.RequestID); d != decision(got.Data) {
		t.Errorf("the entry holds %q, the result is %q", d, decision(got.Data))
	}
	time.Sleep(200 * time.Millisecond)
	if n := ingested(hit.RequestID); n != 1 {
		t.Errorf("published %d times, want once", n)
	}
}

// The results stream refuses the hit's result after its entry was created
// with the decision: intake falls back to the queue, whose handler
// publishes that same recorded decision once the stream takes it again.
func TestAttack_IntakePublishFailureLeavesTheRecordedDecisionToTheQueue(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	events := e.events()
	e.buildThrough(t, tr, results, request("atk-publish-fails"), 1)
	e.atkSettled(t, 5*time.Second)

	ctx := context.Background()
	st, err := e.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	orig := info.Config
	small := orig
	small.MaxMsgSize = 64 // every result is refused
	if _, err := e.js.UpdateStream(ctx, small); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if _, err := e.js.UpdateStream(ctx, orig); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(restore)

	mark := e.markIntake(t, w1)
	hit := request("atk-publish-fails")
	if _, err := e.pub.Publish(ctx, hit); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "intake's publish tried", func() bool { return events.has(hit.RequestID, v1.PhaseFinished) })
	eventually(t, 10*time.Second, "the hit handed on after its failed publish", func() bool { return mark.handedOn(t) > 0 })
	recorded := e.atkEntryDecision(hit.RequestID)
	if recorded == "" {
		t.Fatal("no decision recorded for the hit whose publish failed")
	}
	restore()
	got := oneResult(t, results, hit.RequestID)
	if decision(got.Data) != recorded || got.Data.Status != v1.StatusSucceeded {
		t.Fatalf("published %q, recorded %q", decision(got.Data), recorded)
	}
	e.atkSettled(t, 15*time.Second)
}

// ---- a worker killed between the steps ----

// atkKilled starts w1 with the hit's answer cut short where kill says
// (kill closes w1's NATS connection: the process is gone), then w2, which
// must take the request over: one result, the decision the entry holds.
func atkKilled(t *testing.T, seed string, hook func(hitID string, kill func()) func(w *Worker)) {
	e := setup(t)
	tr := newTestRegistry(t)
	hit := request(seed)
	hit.RequestID = seed + "-hit"
	killed := make(chan struct{})
	var once sync.Once
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		nc := w.nc
		hook(hit.RequestID, func() { once.Do(func() { nc.Close(); close(killed) }) })(w)
	})
	results := e.collect()
	first := e.buildThrough(t, tr, results, request(seed), 1)
	e.atkSettled(t, 5*time.Second)
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	select {
	case <-killed:
	case <-time.After(10 * time.Second):
		t.Fatal("w1 was not killed in the hit's answer")
	}
	e.startWorker("w2", withRegistry(tr))
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Digest != first.Data.Digest {
		t.Fatalf("result %s", decision(got.Data))
	}
	e.atkSettled(t, 20*time.Second)
	if d := e.atkEntryDecision(hit.RequestID); d != decision(got.Data) {
		t.Errorf("the entry holds %q, the result is %q", d, decision(got.Data))
	}
	if n := results.publishes(hit.RequestID); n != 1 {
		t.Errorf("subscribers saw %d results, want one", n)
	}
}

// Killed as the hit's entry is about to be created: nothing written; the
// redelivery is handled by w2.
func TestAttack_IntakeKilledBeforeTheCreateLosesNothing(t *testing.T) {
	t.Parallel()
	atkKilled(t, "atk-kill-before-create", func(id string, kill func()) func(*Worker) {
		return func(w *Worker) {
			hk := RequestIndexKey("acme", id)
			w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onCreate: func(k string, _ []byte) error {
				if k == hk {
					kill()
					return nats.ErrConnectionClosed
				}
				return nil
			}})
		}
	})
}

// Killed right after the entry was created with the decision, before
// anything is published: w2 publishes the recorded decision (after the
// publish grace), once.
func TestAttack_IntakeKilledAfterTheCreateLosesNothing(t *testing.T) {
	t.Parallel()
	atkKilled(t, "atk-kill-after-create", func(id string, kill func()) func(*Worker) {
		return func(w *Worker) {
			hk := RequestIndexKey("acme", id)
			inner := w.ledger.Bucket()
			w.ledger.UseBucket(&hookedKV{KeyValue: inner, onCreate: func(k string, value []byte) error {
				if k != hk {
					return nil
				}
				if _, err := inner.Create(context.Background(), k, value); err != nil {
					return err
				}
				kill()
				return nats.ErrConnectionClosed
			}})
		}
	})
}

// Killed after the result was published, before the ack (and so before
// any mark): w2 takes the redelivery, finds the decision recorded and
// unmarked, and publishes it again after the grace — the same decision,
// which the stream drops: subscribers see one result.
func TestAttack_IntakeKilledAfterPublishBeforeAckLosesNothing(t *testing.T) {
	t.Parallel()
	atkKilled(t, "atk-kill-after-publish", func(id string, kill func()) func(*Worker) {
		return func(w *Worker) {
			w.faults = &faultHooks{loseAck: func(rid string) bool {
				if rid == id {
					kill()
					return true
				}
				return false
			}}
		}
	})
}

// ---- the fair queue ----

type atkGatedRegistry struct {
	Registry
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (g *atkGatedRegistry) Head(ctx context.Context, ref string) (string, error) {
	if strings.Contains(ref, "@") && g.armed.CompareAndSwap(true, false) {
		close(g.entered)
		select {
		case <-g.release:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return g.Registry.Head(ctx, ref)
}

// atkHeldHit is a hit whose answer at intake waits in its registry HEAD
// until released: a worker w1 built seed's image, and the hit of the same
// content was published once the HEAD was armed.
type atkHeldHit struct {
	worker  *runningWorker
	results *resultCollector
	first   v1.Result
	hit     *v1.Request
	// mark is where intake stood before the hit.
	mark    intakeMark
	release func()
}

func (e *env) heldHit(t *testing.T, tr *testRegistry, seed string) atkHeldHit {
	t.Helper()
	g := &atkGatedRegistry{Registry: tr.client, entered: make(chan struct{}), release: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(release)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Registry = g
	})
	results := e.collect()
	first := e.buildThrough(t, tr, results, request(seed), 1)
	e.atkSettled(t, 5*time.Second)
	mark := e.markIntake(t, w1)
	g.armed.Store(true)
	hit := request(seed)
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	select {
	case <-g.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the hit's HEAD was not asked")
	}
	return atkHeldHit{worker: w1, results: results, first: first, hit: hit, mark: mark, release: release}
}

// A worker stopped while a hit waits at intake (its registry HEAD in
// flight) writes nothing for it and hands it back; the next worker
// answers it, once.
func TestAttack_IntakeStoppedMidAnswerLosesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	h := e.heldHit(t, tr, "atk-stop")
	w1, results, first, hit := h.worker, h.results, h.first, h.hit
	w1.stop(t)
	if le := e.ledgerEntry("acme", hit.RequestID); le != nil {
		t.Errorf("a hit whose answer the stop cut short has an entry: %s", mustJSON(t, le))
	}
	if n := len(resultFor(results, hit.RequestID)); n != 0 {
		t.Errorf("%d results of the hit before the next worker started", n)
	}
	e.startWorker("w2", withRegistry(tr))
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Origin != v1.OriginCache || got.Data.Digest != first.Data.Digest {
		t.Fatalf("result %s", decision(got.Data))
	}
	e.atkSettled(t, 10*time.Second)
}

// An answer at intake whose registry HEAD hangs (intake sends no
// heartbeat): intake gives the hit up after its lookup timeout, with
// nothing written, and hands it on — queued, or taken straight from
// intake by a handler — whose handler opens the entry and waits on the
// same shared HEAD. When the HEAD is released, the entry exists for
// anyone else that waited: one decision, one result.
func TestAttack_IntakeAnswerOutlivingAckWaitGivesOneResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	h := e.heldHit(t, tr, "atk-ackwait")
	results, first, hit, release := h.results, h.first, h.hit, h.release
	e.startWorker("w2", withRegistry(tr))
	eventually(t, 10*time.Second, "the hit handed on to a handler", func() bool { return h.mark.handedOn(t) > 0 })
	eventually(t, 5*time.Second, "the redelivery's handler opened the entry", func() bool { return e.ledgerEntry("acme", hit.RequestID) != nil })
	release()
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Digest != first.Data.Digest {
		t.Fatalf("result %s", decision(got.Data))
	}
	e.atkSettled(t, 10*time.Second)
	time.Sleep(300 * time.Millisecond)
	if n := results.publishes(hit.RequestID); n != 1 {
		t.Errorf("subscribers saw the hit's result %d times, want once", n)
	}
	if d := e.atkEntryDecision(hit.RequestID); d != decision(got.Data) {
		t.Errorf("the entry holds %q, the result is %q", d, decision(got.Data))
	}
}
