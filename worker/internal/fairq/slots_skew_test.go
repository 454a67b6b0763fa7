package fairq

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// deleteHookKV runs before, once, ahead of the first Delete of key.
type deleteHookKV struct {
	jetstream.KeyValue
	key    string
	before func()
	done   bool
}

func (k *deleteHookKV) Delete(ctx context.Context, key string, opts ...jetstream.KVDeleteOpt) error {
	if key == k.key && !k.done {
		k.done = true
		k.before()
	}
	return k.KeyValue.Delete(ctx, key, opts...)
}

// Two own keys of one request q, each judged by another reader: acme.0,
// whose holder H1 died (q was redelivered and taken on a free key), and
// acme.1, where its new handler H2 runs. W1 watched acme.0 from H1's
// death and sees it lapsed; W3 started watching it later and sees it
// live. W1 reads acme.1 live and frees acme.0; before its delete lands,
// H2 hands q back (its worker stops) and W3 reads acme.0 live and
// acme.1 handed back, and frees acme.1. Freed each on the strength of
// the other, q's build would run on with no key at all, and two more
// requests would take the tenant's limit of 2: three builds. A kept own
// key is freed only by a live own key written after it (liveOwn), so the
// second free does not happen (found by an attack on the slot rules).
func TestTwoOwnKeysOfARequestAreNeverFreedEachOnTheOther(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	w1 := w.queue("w1", 10*time.Second, clk)
	w3 := w.queue("w3", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	const lease = 4000
	w.putSlot(w1, "acme.0", slotValue{Holder: "h1/dead", LeaseMs: lease, Subject: subj, QueueSeq: seq})
	h2 := slotValue{Holder: "h2/live", LeaseMs: lease, Subject: subj, QueueSeq: seq}
	w.putSlot(w1, "acme.1", h2)

	// W1 watches from H1's death; H2 renews acme.1.
	for range 2 {
		w1.KeepSlots(ctx)
		clk.Advance(3 * time.Second)
		w.putSlot(w1, "acme.1", h2) // H2's renewal
	}
	// Now (6 s = 1.5 leases) acme.0 is lapsed for W1. W3 starts watching.
	w3.KeepSlots(ctx)
	for _, k := range []string{"acme.0", "acme.1"} {
		if _, ok := w.slotOf(w1, k); !ok {
			t.Fatalf("premise: %s freed early", k)
		}
	}

	// W1's scan reads acme.1 live and acme.0 lapsed; before its delete of
	// acme.0 lands, H2 hands q back (the worker stops) and W3 scans.
	orig := w1.Slots()
	w1.UseSlots(&deleteHookKV{KeyValue: orig, key: "acme.0", before: func() {
		hb := h2
		hb.HandedBack = true
		w.putSlot(w3, "acme.1", hb)
		w3.KeepSlots(ctx)
	}})
	w1.KeepSlots(ctx)
	w1.UseSlots(orig)

	_, ok0 := w.slotOf(w1, "acme.0")
	_, ok1 := w.slotOf(w1, "acme.1")
	if _, err := w1.queue.GetMsg(ctx, seq); err != nil {
		t.Fatalf("premise: q is still queued (handed back, its build running): %v", err)
	}
	if !ok0 && !ok1 {
		// Two other requests now take both slots.
		fresh := w.queue("w4", 10*time.Second, clk)
		a, okA := fresh.acquireSlot(ctx, "acme", 2)
		b, okB := fresh.acquireSlot(ctx, "acme", 2)
		t.Errorf("both own keys of q freed while q is handed back with its build running (no key kept for it); "+
			"two more requests then take slots: %v %v (reserved %v %v) — 3 builds under a limit of 2",
			okA, okB, okA && a.reserved, okB && b.reserved)
	}
}
