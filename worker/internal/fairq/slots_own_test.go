package fairq

import (
	"testing"
	"time"
)

// A slot this worker renews is live to it, whatever its reads show. A
// handler's own key whose renewals fail (KV writes refused: a stream
// without quorum still serves reads) while this worker's reads go on
// looks lapsed after 1.5 leases: "kept for its request". The same
// handler then takes an extra slot for a platform (ExtraSlots.Take, for
// its own request), which takes a key kept for its request first. It
// must not take the handler's own key, still carrying the request's
// first build: two builds would run on one key, and the missing key would
// stay free for another request (three builds under a limit of two).
// Found by an attack on the kept-key-first order.
func TestAnExtraNeverTakesItsOwnHandlersLiveKey(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	const lease = 10 * time.Second
	q := w.queue("w1", lease, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")

	// The dispatcher takes acme.0 for the request and records it.
	own, ok := q.acquireSlot(ctx, "acme", 2)
	if !ok || own.reserved || own.key != "acme.0" {
		t.Fatalf("premise: own slot %+v %v", own, ok)
	}
	if err := own.hold(ctx, subj, seq); err != nil {
		t.Fatal(err)
	}
	defer own.stopRenew()
	// Its renewals fail from here (no write reaches the bucket); this
	// worker keeps reading every third of its lease.
	for range 6 {
		q.KeepSlots(ctx)
		clk.Advance(lease / 3)
	}
	q.KeepSlots(ctx) // 20 s watched > 15 s: lapsed for this worker
	if v, ok := w.slotOf(q, "acme.0"); !ok || v.Holder != own.val.Holder {
		t.Fatalf("premise: acme.0 still the handler's own: %+v %v", v, ok)
	}

	extras := q.extraSlots("acme", subj, seq)
	extras.limit = 2
	release, ok := extras.Take(ctx)
	if ok {
		defer release()
	}
	v0, _ := w.slotOf(q, "acme.0")
	_, has1 := w.slotOf(q, "acme.1")
	if v0.Holder != own.val.Holder {
		// The handler's own key is now the extra's; acme.1 is free.
		other, okO := w.queue("w2", lease, clk).acquireSlot(ctx, "acme", 2)
		t.Errorf("the extra took the handler's own live key acme.0 (now %+v; acme.1 exists: %v) instead of creating acme.1; "+
			"another request then takes %v (ok %v, reserved %v): own build + platform on acme.0 + other on acme.1 = 3 builds under a limit of 2",
			v0, has1, keyOf(other), okO, okO && other.reserved)
	}
}

func keyOf(s *slot) string {
	if s == nil {
		return ""
	}
	return s.key
}

// The same with no missing key (limit 1): the extra must not take the
// handler's own live key, which would put two builds on the one key the
// limit allows.
func TestAnExtraNeverTakesItsOwnHandlersLiveKeyAtTheLimit(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	const lease = 10 * time.Second
	q := w.queue("w1", lease, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	own, ok := q.acquireSlot(ctx, "acme", 1)
	if !ok || own.reserved {
		t.Fatalf("premise: own slot %+v %v", own, ok)
	}
	if err := own.hold(ctx, subj, seq); err != nil {
		t.Fatal(err)
	}
	defer own.stopRenew()
	for range 7 {
		q.KeepSlots(ctx)
		clk.Advance(lease / 3)
	}
	q.KeepSlots(ctx)
	extras := q.extraSlots("acme", subj, seq)
	extras.limit = 1
	if release, ok := extras.Take(ctx); ok {
		defer release()
		v0, _ := w.slotOf(q, "acme.0")
		t.Errorf("at a limit of 1 the extra took the handler's own live key (%+v): two builds on one key", v0)
	}
}
