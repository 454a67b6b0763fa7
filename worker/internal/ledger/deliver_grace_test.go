package ledger

import (
	"fmt"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// Another worker's recorded, unmarked decision: who publishes it, and when.

// Another worker's decision, recorded and not marked, may be being
// published by it right now: it is published only once it stayed
// unchanged for PublishGrace on this worker's clock, and then once, by
// the worker whose compare-and-swap names it the decision's worker.
func TestDeliverWaitsPublishGraceForAnotherWorkersUnmarkedDecision(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a := w.ledger("a", newClock(), grace)
	bClock := newClock()
	b := w.ledger("b", bClock, grace)

	// Worker a records its decision, and dies before publishing it.
	le := open(t, a, "acme", "r1")
	if _, err := a.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}

	// Worker b handles the redelivered message.
	pub := &publisher{}
	bLe, fresh, err := b.Open(ctx, "acme", "app", "r1", "key1", 1, msgTime)
	if err != nil || fresh {
		t.Fatalf("Open of the redelivery = fresh %v, %v", fresh, err)
	}
	for _, step := range []time.Duration{0, time.Second, grace - time.Second - time.Nanosecond} {
		bClock.Advance(step)
		got, err := b.Deliver(ctx, bLe, decision("acme", "r1", v1.StatusFailed), pub.delivery())
		if err != nil || got.Status != Later {
			t.Fatalf("Deliver %v into the grace = %v, %v; want Later", step, got.Status, err)
		}
		if got.Decision.Data.Status != v1.StatusSucceeded {
			t.Fatalf("Later's decision = %s, want a's", got.Decision.Data.Status)
		}
	}
	if pub.count() != 0 {
		t.Fatal("published another worker's decision within its grace")
	}
	if e := read(t, b, "acme", "r1").E; e.Worker != "a" || e.Published {
		t.Fatalf("entry within the grace = %+v, want a's, unmarked", e)
	}

	// The grace has passed on b's clock: b takes the decision over and
	// publishes it, once.
	bClock.Advance(time.Nanosecond)
	got, err := b.Deliver(ctx, bLe, decision("acme", "r1", v1.StatusFailed), pub.delivery())
	if err != nil || got.Status != Published {
		t.Fatalf("Deliver after the grace = %v, %v; want Published", got.Status, err)
	}
	if pub.count() != 1 || pub.got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("published %+v, want a's decision once", pub.got)
	}
	if e := read(t, b, "acme", "r1").E; e.Worker != "b" || !e.Published || e.Result.Status != v1.StatusSucceeded {
		t.Fatalf("entry after the take-over = %+v, want b's, marked, a's decision", e)
	}

	// Worker a was only slow: it finds the decision published.
	aPub := &publisher{}
	if got, err := a.Deliver(ctx, le, DecisionOf(le.E), aPub.delivery()); err != nil || got.Status != WasPublished || aPub.count() != 0 {
		t.Fatalf("the decider's Deliver = %v, %v after %d publishes; want WasPublished", got.Status, err, aPub.count())
	}
	if got, err := b.Deliver(ctx, bLe, DecisionOf(bLe.E), pub.delivery()); err != nil || got.Status != WasPublished || pub.count() != 1 {
		t.Fatalf("b's Deliver again = %v, %v after %d publishes; want WasPublished", got.Status, err, pub.count())
	}
}

// The grace runs from the entry's last change seen: a decider that wrote
// the entry meanwhile is alive.
func TestTheGraceStartsAgainWhenTheUnmarkedEntryChanges(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a := w.ledger("a", newClock(), grace)
	bClock := newClock()
	b := w.ledger("b", bClock, grace)
	le := open(t, a, "acme", "r1")
	if _, err := a.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	pub := &publisher{}
	// b's handler holds on to the entry it read first: Deliver reads it
	// again for itself.
	bLe := read(t, b, "acme", "r1")
	if got, _ := b.Deliver(ctx, bLe, DecisionOf(le.E), pub.delivery()); got.Status != Later {
		t.Fatalf("first look = %v, want Later", got.Status)
	}
	bClock.Advance(grace - time.Second)
	a.SpendRetry(ctx, le, 1, 5) // a writes the entry: a new revision
	bClock.Advance(time.Second)
	if got, _ := b.Deliver(ctx, bLe, DecisionOf(le.E), pub.delivery()); got.Status != Later {
		t.Fatalf("a grace after the first look, the entry changed since = %v, want Later", got.Status)
	}
	bClock.Advance(grace)
	if got, err := b.Deliver(ctx, bLe, DecisionOf(le.E), pub.delivery()); err != nil || got.Status != Published {
		t.Fatalf("a grace after the change = %v, %v; want Published", got.Status, err)
	}
	if pub.count() != 1 {
		t.Fatalf("published %d times, want once", pub.count())
	}
}

// The decider publishing within the grace leaves the other worker
// nothing to publish.
func TestAnotherWorkersDecisionMarkedWithinTheGraceIsNotPublishedAgain(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a := w.ledger("a", newClock(), grace)
	bClock := newClock()
	b := w.ledger("b", bClock, grace)
	le := open(t, a, "acme", "r1")
	d, err := a.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded))
	if err != nil {
		t.Fatal(err)
	}
	bPub := &publisher{}
	early := read(t, b, "acme", "r1") // recorded, not marked
	if got, _ := b.Deliver(ctx, early, DecisionOf(early.E), bPub.delivery()); got.Status != Later {
		t.Fatalf("b's first look = %v, want Later", got.Status)
	}
	// a comes back and publishes what it recorded (Record hands it its
	// own decision back, recorded).
	aPub := &publisher{}
	if got, err := a.Deliver(ctx, le, d, aPub.delivery()); err != nil || got.Status != Published {
		t.Fatalf("a's Deliver = %v, %v; want Published", got.Status, err)
	}
	// b, a grace later, on the entry it read before a's mark.
	bClock.Advance(2 * grace)
	if got, err := b.Deliver(ctx, early, DecisionOf(early.E), bPub.delivery()); err != nil || got.Status != WasPublished {
		t.Fatalf("b after a published = %v, %v; want WasPublished", got.Status, err)
	}
	if aPub.count() != 1 || bPub.count() != 0 {
		t.Fatalf("a published %d times and b %d; want 1 and 0", aPub.count(), bPub.count())
	}
}

func TestOnlyOneWorkerTakesOverAnUnmarkedDecision(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	a := w.ledger("a", newClock(), grace)
	bClock, cClock := newClock(), newClock()
	b := w.ledger("b", bClock, grace)
	f := &faultyKV{KeyValue: w.kv}
	c := w.ledger("c", cClock, grace, f)
	le := open(t, a, "acme", "r1")
	if _, err := a.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	bPub, cPub := &publisher{}, &publisher{}
	for _, x := range []struct {
		l   *Ledger
		pub *publisher
	}{{b, bPub}, {c, cPub}} {
		if got, _ := x.l.Deliver(ctx, read(t, x.l, "acme", "r1"), DecisionOf(le.E), x.pub.delivery()); got.Status != Later {
			t.Fatalf("first look = %v, want Later", got.Status)
		}
	}
	bClock.Advance(grace)
	cClock.Advance(grace)

	// c read the entry and is about to take it over when b does.
	var bGot Delivered
	f.onUpdate(func(string, uint64) error {
		f.onUpdate(nil)
		var err error
		bGot, err = b.Deliver(ctx, read(t, b, "acme", "r1"), DecisionOf(le.E), bPub.delivery())
		if err != nil {
			t.Errorf("b's Deliver: %v", err)
		}
		return nil
	})
	got, err := c.Deliver(ctx, read(t, c, "acme", "r1"), DecisionOf(le.E), cPub.delivery())
	if err != nil || got.Status != Later {
		t.Fatalf("c's Deliver, its take-over beaten = %v, %v; want Later", got.Status, err)
	}
	if bGot.Status != Published {
		t.Fatalf("b's Deliver = %v, want Published", bGot.Status)
	}
	if got, err := c.Deliver(ctx, read(t, c, "acme", "r1"), DecisionOf(le.E), cPub.delivery()); err != nil || got.Status != WasPublished {
		t.Fatalf("c's next look = %v, %v; want WasPublished", got.Status, err)
	}
	if bPub.count() != 1 || cPub.count() != 0 {
		t.Fatalf("b published %d times and c %d; want 1 and 0", bPub.count(), cPub.count())
	}
	if e := read(t, b, "acme", "r1").E; e.Worker != "b" || !e.Published {
		t.Fatalf("entry = %+v, want b's and marked", e)
	}
}

// The entry is read again once the request is held: a read from before
// may predate the mark of another goroutine of this worker.
func TestADecisionReadBeforeAnotherGoroutinesMarkIsNotPublishedAgain(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	if _, err := l.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	early := read(t, l, "acme", "r1") // recorded, not marked
	pub := &publisher{}
	if got, err := l.Deliver(ctx, read(t, l, "acme", "r1"), DecisionOf(early.E), pub.delivery()); err != nil || got.Status != Published {
		t.Fatalf("first Deliver = %v, %v; want Published", got.Status, err)
	}
	got, err := l.Deliver(ctx, early, DecisionOf(early.E), pub.delivery())
	if err != nil || got.Status != WasPublished || !got.Decision.PublishedBefore {
		t.Fatalf("Deliver on the read from before the mark = %v %+v, %v; want WasPublished", got.Status, got.Decision, err)
	}
	if pub.count() != 1 {
		t.Fatalf("published %d times, want once", pub.count())
	}
}

func TestUnmarkedWatchLapsesOnlyAfterTheGraceAtOneRevision(t *testing.T) {
	var u unmarkedWatch
	t0 := time.Unix(1000, 0)
	if u.lapsed("k", 5, t0, grace) {
		t.Fatal("lapsed at first sight")
	}
	if u.lapsed("k", 5, t0.Add(grace-1), grace) {
		t.Fatal("lapsed within the grace")
	}
	if u.lapsed("k", 6, t0.Add(grace), grace) {
		t.Fatal("lapsed at a new revision")
	}
	if u.lapsed("k", 6, t0.Add(2*grace-1), grace) {
		t.Fatal("lapsed within the grace of the new revision")
	}
	if !u.lapsed("k", 6, t0.Add(2*grace), grace) {
		t.Fatal("not lapsed a grace after the revision was first seen")
	}
	// Once lapsed, the watch starts again.
	if u.lapsed("k", 6, t0.Add(2*grace), grace) {
		t.Fatal("lapsed again without a new grace")
	}
	// Keys are watched apart.
	if u.lapsed("other", 6, t0.Add(3*grace), grace) {
		t.Fatal("another key lapsed at first sight")
	}
}

func TestUnmarkedWatchForgetsOldKeysWhenItGrowsLarge(t *testing.T) {
	var u unmarkedWatch
	t0 := time.Unix(1000, 0)
	for i := range 4096 {
		u.lapsed(fmt.Sprint("k", i), 1, t0, grace)
	}
	u.lapsed("fresh", 1, t0.Add(5*grace), grace)
	if n := len(u.m); n != 1 {
		t.Fatalf("watch holds %d keys, want the old ones dropped", n)
	}
}
