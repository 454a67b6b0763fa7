package ledger

import (
	"context"
	"sync"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// stream plays the results stream: the first result published under a
// request id is stored, and a later publish of that id is answered as its
// duplicate with the stored result's sequence.
type stream struct {
	mu     sync.Mutex
	seqs   map[string]uint64 // request id → sequence
	stored []v1.ResultData   // sequence-1 → result
	sent   []Decision        // every publish, stored or not
	finds  int
	// atPublish runs inside Publish, before the result is stored.
	atPublish func(d Decision)
}

func newStream() *stream { return &stream{seqs: map[string]uint64{}} }

func (s *stream) Publish(_ context.Context, d Decision) (Ack, error) {
	if s.atPublish != nil {
		s.atPublish(d)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, d)
	if seq, ok := s.seqs[d.Data.RequestID]; ok {
		return Ack{Duplicate: true, Seq: seq}, nil
	}
	s.stored = append(s.stored, d.Data)
	s.seqs[d.Data.RequestID] = uint64(len(s.stored))
	return Ack{Seq: uint64(len(s.stored))}, nil
}

func (s *stream) Stored(_ context.Context, seq uint64) (v1.ResultData, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stored[seq-1], nil
}

func (s *stream) Find(_ context.Context, _, _, id string, _ time.Time) (*v1.ResultData, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.finds++
	if seq, ok := s.seqs[id]; ok {
		d := s.stored[seq-1]
		return &d, nil
	}
	return nil, nil
}

// firstAge is how young the tests' requests must be to be published
// first, on clk as the server's clock: msgTime is 4 min 5 s before
// newClock's time, so a request is young until the clock moves 55 s on.
const firstAge = 5 * time.Minute

// firstLedger is worker's ledger with the results stream s, judging
// requests young by clk.
func (w *world) firstLedger(worker string, clk *clock, s *stream) *Ledger {
	l := w.ledger(worker, clk, grace)
	l.cfg.Results = s
	l.cfg.Young = func(msgTime time.Time) bool { return clk.Now().Sub(msgTime) < firstAge }
	return l
}

// A young request's decision is published before anything is written,
// then recorded with its published mark in one write.
func TestAFirstDeliveryPublishesBeforeItRecordsAndRecordsOnce(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	l := w.firstLedger("w1", newClock(), s)
	le := open(t, l, "acme", "r1")
	rev := le.Rev
	s.atPublish = func(Decision) {
		if e := read(t, l, "acme", "r1"); e.E.Result != nil || e.Rev != rev {
			t.Errorf("entry at the publish = %+v (rev %d), want it as opened (rev %d)", e.E, e.Rev, rev)
		}
	}
	d := decision("acme", "r1", v1.StatusSucceeded)
	got, err := l.Deliver(t.Context(), le, d, Delivery{First: s.Publish, Publish: s.Publish})
	if err != nil || got.Status != Published {
		t.Fatalf("Deliver = %v, %v; want Published", got.Status, err)
	}
	e := read(t, l, "acme", "r1")
	if e.E.Result == nil || !SameResult(*e.E.Result, d.Data) || !e.E.Published || e.Rev != rev+1 {
		t.Fatalf("entry after = %+v (rev %d), want the decision marked published in one write (rev %d)", e.E, e.Rev, rev+1)
	}
	if len(s.sent) != 1 || s.finds != 0 {
		t.Fatalf("%d publishes and %d looks, want one publish and no look", len(s.sent), s.finds)
	}
}

// A first publish answered as a duplicate of another result — a cancel's
// "canceled", stored first — adopts that result: the entry holds it, and
// the cancel's record in the entry gives way to nothing else.
func TestAFirstDeliveryAnsweredAsADuplicateAdoptsTheStoredResult(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	clk := newClock()
	l := w.firstLedger("w1", clk, s)
	canceler := w.firstLedger("w2", clk, s)
	le := open(t, l, "acme", "r1")
	// The cancel marks, records and publishes "canceled" first.
	ce := read(t, canceler, "acme", "r1")
	if ok, err := canceler.MarkCanceled(t.Context(), ce); !ok || err != nil {
		t.Fatalf("MarkCanceled = %v, %v", ok, err)
	}
	c, err := canceler.Deliver(t.Context(), ce, decision("acme", "r1", v1.StatusCanceled), Delivery{Publish: s.Publish, Now: true})
	if err != nil || c.Status != Published {
		t.Fatalf("cancel's Deliver = %v, %v; want Published", c.Status, err)
	}
	// The build's handler, holding the entry as it opened it, publishes
	// its "succeeded" first.
	d := decision("acme", "r1", v1.StatusSucceeded)
	d.CleanupKey, d.CleanupRun = "key1", "run1"
	got, err := l.Deliver(t.Context(), le, d, Delivery{First: s.Publish, Publish: s.Publish})
	if err != nil || got.Status != WasPublished {
		t.Fatalf("Deliver = %v, %v; want WasPublished", got.Status, err)
	}
	if got.Decision.Data.Status != v1.StatusCanceled || got.Decision.CleanupRun != "run1" {
		t.Fatalf("decision after = %+v, want the stored canceled, with its own run's cleanup", got.Decision)
	}
	if e := read(t, l, "acme", "r1").E; e.Result == nil || e.Result.Status != v1.StatusCanceled || !e.Published {
		t.Fatalf("entry after = %+v, want the stored canceled, marked published", e)
	}
}

// A cancel that comes after a finished build's result was stored, and
// before the handler recorded it, finds its "canceled" a duplicate: it
// adopts the stored result, and the entry ends holding it.
func TestACancelAfterAFirstPublishAdoptsTheBuildsResult(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	clk := newClock()
	canceler := w.firstLedger("w2", clk, s)
	l := w.firstLedger("w1", clk, s)
	le := open(t, l, "acme", "r1")
	// The handler's first publish is stored; its record is not written yet.
	d := decision("acme", "r1", v1.StatusSucceeded)
	if _, err := s.Publish(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	ce := read(t, canceler, "acme", "r1")
	if ok, err := canceler.MarkCanceled(t.Context(), ce); !ok || err != nil {
		t.Fatalf("MarkCanceled = %v, %v", ok, err)
	}
	cancelDone, err := canceler.Deliver(t.Context(), ce, decision("acme", "r1", v1.StatusCanceled), Delivery{Publish: s.Publish, Now: true})
	if err != nil || cancelDone.Status != WasPublished || cancelDone.Decision.Data.Status != v1.StatusSucceeded {
		t.Fatalf("cancel's Deliver = %v %+v, %v; want WasPublished with the stored succeeded", cancelDone.Status, cancelDone.Decision.Data, err)
	}
	// The handler's record of its stored result comes last.
	if err := l.recordStored(t.Context(), le, d); err != nil {
		t.Fatal(err)
	}
	if e := read(t, l, "acme", "r1").E; e.Result == nil || !SameResult(*e.Result, d.Data) || !e.Published || !e.Canceled {
		t.Fatalf("entry after = %+v, want the stored succeeded, published, with the cancel's mark", e)
	}
}

// A request old enough that a result published first may have left the
// duplicate window is never published blind: its publish looks for a
// stored result first and adopts it.
func TestAnOldRequestsPublishLooksForAStoredResultFirst(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	clk := newClock()
	l := w.firstLedger("w1", clk, s)
	le := open(t, l, "acme", "r1")
	stored := decision("acme", "r1", v1.StatusSucceeded)
	if _, err := s.Publish(t.Context(), stored); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute) // past firstAge
	got, err := l.Deliver(t.Context(), le, decision("acme", "r1", v1.StatusFailed), Delivery{First: s.Publish, Publish: s.Publish})
	if err != nil || got.Status != WasPublished || !SameResult(got.Decision.Data, stored.Data) {
		t.Fatalf("Deliver = %v %+v, %v; want WasPublished with the stored result", got.Status, got.Decision.Data, err)
	}
	if len(s.sent) != 1 || s.finds != 1 {
		t.Fatalf("%d publishes and %d looks, want none beyond the stored one and one look", len(s.sent)-1, s.finds)
	}
	if e := read(t, l, "acme", "r1").E; e.Result == nil || !SameResult(*e.Result, stored.Data) || !e.Published {
		t.Fatalf("entry after = %+v, want the stored result, published", e)
	}
}

// Young, a request's publish looks for nothing: the duplicate window
// answers a second publish.
func TestAYoungRequestsRecordedPublishDoesNotLook(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	l := w.firstLedger("w1", newClock(), s)
	le := open(t, l, "acme", "r1")
	got, err := l.Deliver(t.Context(), le, decision("acme", "r1", v1.StatusFailed), Delivery{Publish: s.Publish})
	if err != nil || got.Status != Published || s.finds != 0 {
		t.Fatalf("Deliver = %v, %v with %d looks; want Published and none", got.Status, err, s.finds)
	}
}

// A first publish that fails leaves whether it was stored unknown: the
// decision is then recorded and published again, and a copy stored by
// the failed publish answers it as a duplicate.
func TestAFailedFirstPublishIsRecordedAndPublishedAgain(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	l := w.firstLedger("w1", newClock(), s)
	le := open(t, l, "acme", "r1")
	lost := func(ctx context.Context, d Decision) (Ack, error) {
		_, _ = s.Publish(ctx, d) // stored, and its PubAck lost
		return Ack{}, context.DeadlineExceeded
	}
	d := decision("acme", "r1", v1.StatusSucceeded)
	got, err := l.Deliver(t.Context(), le, d, Delivery{First: lost, Publish: s.Publish})
	if err != nil || got.Status != Published {
		t.Fatalf("Deliver = %v, %v; want Published", got.Status, err)
	}
	if len(s.stored) != 1 || len(s.sent) != 2 {
		t.Fatalf("%d stored of %d sent, want the one result stored of two publishes", len(s.stored), len(s.sent))
	}
	if e := read(t, l, "acme", "r1").E; e.Result == nil || !SameResult(*e.Result, d.Data) || !e.Published {
		t.Fatalf("entry after = %+v, want the decision, published", e)
	}
}
