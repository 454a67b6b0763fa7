package ledger

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

const grace = 10 * time.Second

func TestDeliverRecordsThenPublishesThenMarks(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")

	pub := &publisher{}
	// At the publish, the decision is recorded and not yet marked.
	pub.hook = func(Decision) {
		e := read(t, l, "acme", "r1").E
		if e.Result == nil || e.Result.Status != v1.StatusSucceeded || e.Published {
			t.Errorf("entry at the publish = %+v, want the decision recorded and unmarked", e)
		}
	}
	got, err := l.Deliver(ctx, le, decision("acme", "r1", v1.StatusSucceeded), pub.delivery())
	if err != nil || got.Status != Published {
		t.Fatalf("Deliver = %v, %v; want Published", got.Status, err)
	}
	if pub.count() != 1 || pub.got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("published %+v, want the decision once", pub.got)
	}
	if e := read(t, l, "acme", "r1").E; !e.Published || e.Result == nil {
		t.Fatalf("entry after Deliver = %+v, want marked published", e)
	}
}

func TestDeliverOfAPublishedDecisionReportsWasPublishedAndDoesNotPublish(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	stale := *le
	pub := &publisher{}
	if _, err := l.Deliver(ctx, le, decision("acme", "r1", v1.StatusSucceeded), pub.delivery()); err != nil {
		t.Fatal(err)
	}

	// A redelivery's handler decides otherwise, on the entry as read
	// before: the first decision is the one, and it is not published
	// again.
	got, err := l.Deliver(ctx, &stale, decision("acme", "r1", v1.StatusFailed), pub.delivery())
	if err != nil || got.Status != WasPublished {
		t.Fatalf("second Deliver = %v, %v; want WasPublished", got.Status, err)
	}
	if got.Decision.Data.Status != v1.StatusSucceeded || !got.Decision.Recorded || !got.Decision.PublishedBefore {
		t.Fatalf("second Deliver's decision = %+v, want the first, recorded and published before", got.Decision)
	}
	// The same with the recorded decision handed in.
	cur := read(t, l, "acme", "r1")
	if got, err := l.Deliver(ctx, cur, DecisionOf(cur.E), pub.delivery()); err != nil || got.Status != WasPublished {
		t.Fatalf("Deliver of the recorded decision = %v, %v; want WasPublished", got.Status, err)
	}
	if pub.count() != 1 {
		t.Fatalf("published %d times, want once", pub.count())
	}
}

// One goroutine of a worker at a time delivers a request: another that
// came meanwhile would find the decision recorded and unmarked, and
// publish it again.
func TestDeliverReportsBusyForAConcurrentDeliveryInTheSameWorker(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	other := *le

	entered, release := make(chan struct{}), make(chan struct{})
	pub := &publisher{hook: func(Decision) {
		close(entered)
		<-release
	}}
	type result struct {
		d   Delivered
		err error
	}
	done := make(chan result, 1)
	go func() {
		d, err := l.Deliver(ctx, le, decision("acme", "r1", v1.StatusSucceeded), pub.delivery())
		done <- result{d, err}
	}()
	<-entered

	second := &publisher{}
	got, err := l.Deliver(ctx, &other, decision("acme", "r1", v1.StatusFailed), second.delivery())
	if err != nil || got.Status != Busy {
		t.Fatalf("concurrent Deliver = %v, %v; want Busy", got.Status, err)
	}
	if second.count() != 0 {
		t.Fatal("a Busy delivery published")
	}
	// Another request is not held by it.
	le2 := open(t, l, "acme", "r2")
	if got, err := l.Deliver(ctx, le2, decision("acme", "r2", v1.StatusSucceeded), second.delivery()); err != nil || got.Status != Published {
		t.Fatalf("Deliver of another request = %v, %v; want Published", got.Status, err)
	}

	close(release)
	if r := <-done; r.err != nil || r.d.Status != Published {
		t.Fatalf("first Deliver = %v, %v; want Published", r.d.Status, r.err)
	}
	// Released once marked: the next delivery finds it published.
	got, err = l.Deliver(ctx, &other, decision("acme", "r1", v1.StatusFailed), second.delivery())
	if err != nil || got.Status != WasPublished {
		t.Fatalf("Deliver after the first = %v, %v; want WasPublished", got.Status, err)
	}
	if pub.count() != 1 || second.count() != 1 {
		t.Fatalf("r1 published %d times by the first, r1+r2 %d by the others; want 1 and 1", pub.count(), second.count())
	}
}

// Handlers of one request racing in one worker, each with its own
// decision and its own read of the entry, publish one decision once.
func TestConcurrentDeliveriesInOneWorkerPublishOneDecisionOnce(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	base := open(t, l, "acme", "r1")

	pub := &publisher{}
	var wg sync.WaitGroup
	final := make([]Decision, 8)
	for i := range final {
		wg.Go(func() {
			le := *base
			st := v1.StatusSucceeded
			if i%2 == 1 {
				st = v1.StatusFailed
			}
			d := decision("acme", "r1", st)
			for {
				got, err := l.Deliver(ctx, &le, d, pub.delivery())
				if err != nil {
					t.Errorf("Deliver: %v", err)
					return
				}
				if got.Status == Published || got.Status == WasPublished {
					final[i] = got.Decision
					return
				}
				// Busy: the handler looks again later, with what it read.
				time.Sleep(time.Millisecond)
			}
		})
	}
	wg.Wait()
	if pub.count() != 1 {
		t.Fatalf("published %d times, want once", pub.count())
	}
	for i, d := range final {
		if d.Data.Status != pub.got[0].Data.Status {
			t.Errorf("handler %d ended with %s, the published decision is %s", i, d.Data.Status, pub.got[0].Data.Status)
		}
	}
}

// A decision this worker recorded and did not mark (its publish failed,
// or its mark was lost) is its own to publish again, at once.
func TestDeliverRepublishesItsOwnUnmarkedDecisionAtOnce(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	if _, err := l.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	pub := &publisher{}
	cur := read(t, l, "acme", "r1")
	got, err := l.Deliver(ctx, cur, DecisionOf(cur.E), pub.delivery())
	if err != nil || got.Status != Published || pub.count() != 1 {
		t.Fatalf("Deliver of its own unmarked decision = %v, %v after %d publishes; want Published once", got.Status, err, pub.count())
	}
	if e := read(t, l, "acme", "r1").E; !e.Published || e.Worker != "w1" {
		t.Fatalf("entry = %+v, want marked", e)
	}
}

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

func TestAPublishFailureIsAPublishErrorAndLeavesTheDecisionRecordedAndUnmarked(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	boom := errors.New("no PubAck")
	pub := &publisher{fail: boom}

	got, err := l.Deliver(ctx, le, decision("acme", "r1", v1.StatusSucceeded), pub.delivery())
	var pe *PublishError
	if !errors.As(err, &pe) || !errors.Is(err, boom) || got.Status != Failed {
		t.Fatalf("Deliver with a failing publish = %v, %v (%T); want Failed with a *PublishError wrapping the cause", got.Status, err, err)
	}
	if e := read(t, l, "acme", "r1").E; e.Result == nil || e.Result.Status != v1.StatusSucceeded || e.Published {
		t.Fatalf("entry after the failed publish = %+v, want the decision recorded and unmarked", e)
	}

	// The retry publishes the recorded decision, not its own.
	pub.fail = nil
	got, err = l.Deliver(ctx, le, decision("acme", "r1", v1.StatusFailed), pub.delivery())
	if err != nil || got.Status != Published {
		t.Fatalf("retried Deliver = %v, %v; want Published (the request is not left held)", got.Status, err)
	}
	if pub.count() != 1 || pub.got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("published %+v, want the recorded decision once", pub.got)
	}
	if e := read(t, l, "acme", "r1").E; !e.Published {
		t.Fatal("entry not marked after the retried publish")
	}
}

func TestUnrecordedDecidesWhetherARecordFailureStillPublishes(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), grace, f)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	boom := errors.New("ledger down")
	f.onUpdate(func(string, uint64) error { return boom })
	pub := &publisher{}
	d := decision("acme", "r1", v1.StatusSucceeded)

	var asked []error
	for _, c := range []struct {
		name       string
		unrecorded func(error) bool
	}{
		{"without Unrecorded", nil},
		{"Unrecorded saying no", func(err error) bool { asked = append(asked, err); return false }},
	} {
		got, err := l.Deliver(ctx, le, d, Delivery{Publish: pub.Publish, Unrecorded: c.unrecorded})
		if !errors.Is(err, boom) || got.Status != Failed {
			t.Fatalf("%s: Deliver = %v, %v; want Failed with the record's error", c.name, got.Status, err)
		}
		var pe *PublishError
		if errors.As(err, &pe) {
			t.Fatalf("%s: a record failure is reported as a publish failure", c.name)
		}
		if pub.count() != 0 {
			t.Fatalf("%s: published an unrecorded decision", c.name)
		}
	}
	if len(asked) != 1 || !errors.Is(asked[0], boom) {
		t.Fatalf("Unrecorded was asked %v, want once with the record's error", asked)
	}

	// The request's last try: published all the same (and the request is
	// not left held by the failed tries).
	got, err := l.Deliver(ctx, le, d, Delivery{Publish: pub.Publish, Unrecorded: func(error) bool { return true }})
	if err != nil || got.Status != Published || pub.count() != 1 {
		t.Fatalf("Deliver with Unrecorded saying yes = %v, %v after %d publishes; want Published once", got.Status, err, pub.count())
	}
	if e := read(t, l, "acme", "r1").E; e.Result != nil {
		t.Fatalf("entry = %+v, want no decision (its record failed)", e)
	}
}

func TestDeliverWithoutAnEntryPublishesWithoutARecord(t *testing.T) {
	l := New(Config{Worker: "w1", Now: newClock().Now, PublishGrace: grace}) // no bucket at all
	pub := &publisher{}
	d := decision("acme", "bad", v1.StatusFailed)
	d.Term = true
	for i := range 2 {
		got, err := l.Deliver(t.Context(), nil, d, pub.delivery())
		if err != nil || got.Status != Published {
			t.Fatalf("Deliver #%d without an entry = %v, %v; want Published", i+1, got.Status, err)
		}
	}
	if pub.count() != 2 || !pub.got[0].Term {
		t.Fatalf("published %+v, want the decision each time (nothing records it)", pub.got)
	}
}

func TestDeliverStampsFinishedAtFromTheLedgersClock(t *testing.T) {
	w := newWorld(t)
	clk := newClock()
	l := w.ledger("w1", clk, grace)
	ctx := t.Context()
	pub := &publisher{}
	if _, err := l.Deliver(ctx, open(t, l, "acme", "r1"), decision("acme", "r1", v1.StatusSucceeded), pub.delivery()); err != nil {
		t.Fatal(err)
	}
	if at := pub.got[0].Data.Timings.FinishedAt; !at.Equal(clk.Now()) {
		t.Fatalf("published FinishedAt = %v, want the ledger's now %v", at, clk.Now())
	}
	if at := read(t, l, "acme", "r1").E.Result.Timings.FinishedAt; !at.Equal(clk.Now()) {
		t.Fatalf("recorded FinishedAt = %v, want %v", at, clk.Now())
	}
	d := decision("acme", "r2", v1.StatusSucceeded)
	d.Data.Timings.FinishedAt = msgTime
	if _, err := l.Deliver(ctx, open(t, l, "acme", "r2"), d, pub.delivery()); err != nil {
		t.Fatal(err)
	}
	if at := pub.got[1].Data.Timings.FinishedAt; !at.Equal(msgTime) {
		t.Fatalf("published FinishedAt = %v, want the decision's own %v", at, msgTime)
	}
}

// An Async delivery returns once published, and holds the request until
// its mark is written: a handler of this worker that read the entry
// before the mark would publish again.
func TestAsyncDeliverHoldsTheRequestUntilItsMarkIsWritten(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), grace, f)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")

	unblock := make(chan struct{})
	var once sync.Once
	letMarkGo := func() { once.Do(func() { close(unblock) }) }
	t.Cleanup(letMarkGo)
	pub := &publisher{}
	pub.hook = func(Decision) {
		// The decision is recorded: hold the next write, the mark.
		f.onUpdate(func(string, uint64) error {
			f.onUpdate(nil)
			<-unblock
			return nil
		})
	}
	got, err := l.Deliver(ctx, le, decision("acme", "r1", v1.StatusSucceeded), Delivery{Publish: pub.Publish, Async: true})
	if err != nil || got.Status != Published {
		t.Fatalf("Async Deliver = %v, %v; want Published", got.Status, err)
	}
	pub.mu.Lock()
	pub.hook = nil
	pub.mu.Unlock()
	// The mark is not written yet; the request is still held.
	unmarked := read(t, l, "acme", "r1")
	if unmarked.E.Published {
		t.Fatal("marked before the mark's write went through")
	}
	if got, err := l.Deliver(ctx, unmarked, DecisionOf(unmarked.E), pub.delivery()); err != nil || got.Status != Busy {
		t.Fatalf("Deliver while the mark is pending = %v, %v; want Busy", got.Status, err)
	}
	letMarkGo()
	got.WaitMarked()
	if !read(t, l, "acme", "r1").E.Published {
		t.Fatal("not marked after WaitMarked")
	}
	if got, err := l.Deliver(ctx, unmarked, DecisionOf(unmarked.E), pub.delivery()); err != nil || got.Status != WasPublished {
		t.Fatalf("Deliver after the mark = %v, %v; want WasPublished", got.Status, err)
	}
	if pub.count() != 1 {
		t.Fatalf("published %d times, want once", pub.count())
	}
	// WaitMarked of a delivery that wrote no mark returns at once.
	Delivered{}.WaitMarked()
}

// The mark is written over any write that came between the decision and
// it: a recorded decision never changes.
func TestTheMarkIsWrittenOverALaterWrite(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), grace, f)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	pub := &publisher{}
	pub.hook = func(Decision) {
		// A retry's count lands between the record and the mark.
		cur := read(t, l, "acme", "r1")
		cur.E.TransientFailures = 4
		if _, err := w.kv.Update(ctx, cur.Key(), mustJSON(t, cur.E), cur.Rev); err != nil {
			t.Errorf("concurrent write: %v", err)
		}
	}
	if got, err := l.Deliver(ctx, le, decision("acme", "r1", v1.StatusSucceeded), pub.delivery()); err != nil || got.Status != Published {
		t.Fatalf("Deliver = %v, %v", got.Status, err)
	}
	if e := read(t, l, "acme", "r1").E; !e.Published || e.TransientFailures != 4 {
		t.Fatalf("entry = %+v, want marked with the concurrent write kept", e)
	}
}

func TestDeliverOfARecordedDecisionWhoseEntryCannotBeReadIsLater(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), grace, f)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	if _, err := l.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("read failed")
	f.failGet(boom)
	pub := &publisher{}
	got, err := l.Deliver(ctx, le, DecisionOf(le.E), pub.delivery())
	if got.Status != Later || !errors.Is(err, boom) || pub.count() != 0 {
		t.Fatalf("Deliver with the entry unreadable = %v, %v after %d publishes; want Later with the read's error", got.Status, err, pub.count())
	}
	f.failGet(nil)
	if got, err := l.Deliver(ctx, le, DecisionOf(le.E), pub.delivery()); err != nil || got.Status != Published {
		t.Fatalf("Deliver once readable = %v, %v; want Published (not left held)", got.Status, err)
	}
}

func TestAnAgedOutDecisionIsNotPublishedAgain(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), grace)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	if _, err := l.Record(ctx, le, decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	if err := w.kv.Delete(ctx, le.Key()); err != nil {
		t.Fatal(err)
	}
	pub := &publisher{}
	if got, err := l.Deliver(ctx, le, DecisionOf(le.E), pub.delivery()); err != nil || got.Status != WasPublished || pub.count() != 0 {
		t.Fatalf("Deliver of an aged-out decision = %v, %v after %d publishes; want WasPublished", got.Status, err, pub.count())
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

func TestKeyLocksHoldAKeyForOneHolder(t *testing.T) {
	var kl keyLocks
	rel, ok := kl.acquire("k")
	if !ok {
		t.Fatal("a free key was not acquired")
	}
	if _, ok := kl.acquire("k"); ok {
		t.Fatal("a held key was acquired again")
	}
	if r2, ok := kl.acquire("j"); !ok {
		t.Fatal("another key was held")
	} else {
		r2()
	}
	rel()
	rel2, ok := kl.acquire("k")
	if !ok {
		t.Fatal("a released key was not acquired")
	}
	rel() // a second release of the first hold releases nothing
	if _, ok := kl.acquire("k"); ok {
		t.Fatal("a stale release let go of the next holder's key")
	}
	rel2()
}
