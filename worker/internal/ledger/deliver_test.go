package ledger

import (
	"errors"
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
