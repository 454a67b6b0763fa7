package fairq

import (
	"encoding/json"
	"testing"
	"time"
)

// A request's slots while an image index of it builds: its own key, the
// extras its handler took for the platforms, and — after its handler
// stopped — the keys kept for it. Its build on the kept keys may still
// be running: no kept key of it is free while another stands in for it,
// so the tenant's builds never outnumber its limit.

// slotOf reads key's value.
func (w *slotsWorld) slotOf(q *Queue, key string) (slotValue, bool) {
	e, err := q.Slots().Get(w.t.Context(), key)
	if err != nil {
		return slotValue{}, false
	}
	var v slotValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		w.t.Fatal(err)
	}
	return v, true
}

// A live key that stood in for a kept extra (TookExtra), handed back in
// its turn and taken again as the request's own, still stands in for
// that extra: the request's kept own key stays reserved for it.
func TestATakenKeyStillStandsInForTheExtraItWasTakenFrom(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	w.putSlot(q, "acme.0", slotValue{Holder: "gone/1", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq, TookExtra: true})
	w.putSlot(q, "acme.1", slotValue{Holder: "gone/2", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq})

	s, ok := q.acquireSlotFor(ctx, "acme", 2, seq)
	if !ok || !s.reserved || s.key != "acme.0" || s.reservedFor.QueueSeq != seq {
		t.Fatalf("premise: acme.0, kept for the request, offered to it: %+v, %v", s, ok)
	}
	if err := s.take(ctx); err != nil {
		t.Fatal(err)
	}
	defer s.release()
	if v, _ := w.slotOf(q, "acme.0"); !v.TookExtra || v.Extra {
		t.Fatalf("acme.0, taken from a key standing in for an extra, lost the mark: %+v", v)
	}
	other, ok := q.acquireSlot(ctx, "acme", 2)
	if !ok || !other.reserved || other.reservedFor.QueueSeq != seq {
		t.Fatalf("another request's look at acme's slots: %+v, %v; want the other kept key reserved for the request", other, ok)
	}
	q.KeepSlots(ctx)
	for _, key := range []string{"acme.0", "acme.1"} {
		if _, ok := w.slotOf(q, key); !ok {
			t.Errorf("KeepSlots freed %s, kept for a request whose build may run on it", key)
		}
	}
}

// A kept key that stood in for an extra is freed only once its request is
// finished — like the extra itself — not because its request runs on a
// live key again.
func TestAKeptStandInForAnExtraIsNotFreedByALiveKeyOfItsRequest(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	w.putSlot(q, "acme.0", slotValue{Holder: "gone/1", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq, TookExtra: true})
	w.putSlot(q, "acme.1", slotValue{Holder: "live/2", LeaseMs: 4000, Subject: subj, QueueSeq: seq}) // its new handler

	other, ok := q.acquireSlot(ctx, "acme", 2)
	if !ok || !other.reserved || other.key != "acme.0" {
		t.Fatalf("another request's look at acme's slots: %+v, %v; want acme.0 reserved for its request", other, ok)
	}
	q.KeepSlots(ctx)
	if _, ok := w.slotOf(q, "acme.0"); !ok {
		t.Fatal("KeepSlots freed a kept stand-in for an extra while its request runs")
	}
}

// A request's kept own key is free when the request runs on a live own
// key again, but not when only an extra of it is live: the handler that
// holds the extra builds a platform, and the build on the kept key may
// still be running.
func TestALiveExtraDoesNotFreeItsRequestsKeptOwnKey(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	w.putSlot(q, "acme.0", slotValue{Holder: "live/1", LeaseMs: 4000, Subject: subj, QueueSeq: seq, Extra: true})
	w.putSlot(q, "acme.1", slotValue{Holder: "gone/2", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq})

	other, ok := q.acquireSlot(ctx, "acme", 2)
	if !ok || !other.reserved || other.key != "acme.1" {
		t.Fatalf("another request's look at acme's slots: %+v, %v; want acme.1 reserved for its request", other, ok)
	}
	q.KeepSlots(ctx)
	if _, ok := w.slotOf(q, "acme.1"); !ok {
		t.Fatal("KeepSlots freed the kept own key of a request with only a live extra")
	}

	// The request runs on a live own key again: its kept own key is free.
	w.putSlot(q, "acme.0", slotValue{Holder: "live/3", LeaseMs: 4000, Subject: subj, QueueSeq: seq})
	q.KeepSlots(ctx)
	if _, ok := w.slotOf(q, "acme.1"); ok {
		t.Fatal("KeepSlots kept the own key of a request that runs on a live own key")
	}
}

// A request taking an extra slot takes the key kept for it before it
// creates a missing one: the kept key (its earlier handler's, whose
// build may still run) would otherwise sit idle, reserved for the
// request, while the tenant's limit counts it.
func TestAnExtraTakesItsRequestsKeptKeyBeforeAMissingOne(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	// acme.0 is missing; acme.1 is the extra the request's earlier
	// handler kept; acme.2 is the request's own live key.
	w.putSlot(q, "acme.1", slotValue{Holder: "gone/1", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq, Extra: true})
	w.putSlot(q, "acme.2", slotValue{Holder: "live/2", LeaseMs: 4000, Subject: subj, QueueSeq: seq})

	extras := q.extraSlots("acme", subj, seq)
	extras.limit = 3
	release, ok := extras.Take(ctx)
	if !ok {
		t.Fatal("the request took no extra slot, with one kept for it and one missing")
	}
	if v, _ := w.slotOf(q, "acme.1"); v.HandedBack || !v.Extra || v.QueueSeq != seq {
		t.Fatalf("acme.1, kept for the request, is still kept (%+v): the extra went elsewhere", v)
	}
	if _, ok := w.slotOf(q, "acme.0"); ok {
		t.Fatal("the extra created acme.0 and left the key kept for its request idle")
	}
	release()

	// With nothing kept for it, an extra creates the missing key.
	release, ok = extras.Take(ctx)
	if !ok {
		t.Fatal("the request took no extra slot, with acme.0 and acme.1 missing")
	}
	defer release()
	if _, ok := w.slotOf(q, "acme.0"); !ok {
		t.Fatal("an extra with no kept key did not create the first missing key")
	}
}
