package fairq

import (
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// slotsWorld is an embedded NATS server with JetStream, BUILDQ_QUEUE and
// the real slots bucket.
type slotsWorld struct {
	t  *testing.T
	js jetstream.JetStream
	nc *nats.Conn
}

func newSlotsWorld(t *testing.T) *slotsWorld {
	t.Helper()
	_, nc, js := testnats.JetStream(t)
	return &slotsWorld{t: t, js: js, nc: nc}
}

// clock is a test clock that moves only when told.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// queue returns worker id's queue, set up, with its lease and clock.
func (w *slotsWorld) queue(id string, lease time.Duration, clk *clock) *Queue {
	q := New(w.js, w.nc, nil, Options{ID: id, Lease: lease, Now: clk.Now, MaxInFlight: 1})
	if err := q.Setup(w.t.Context(), jetstream.FileStorage, 1, time.Minute); err != nil {
		w.t.Fatal(err)
	}
	return q
}

// enqueue puts a request message in tenant's queue and returns its
// sequence in BUILDQ_QUEUE.
func (w *slotsWorld) enqueue(tenant string) (string, uint64) {
	subj := QueueSubject(tenant, v1.PriorityNormal)
	ack, err := w.js.Publish(w.t.Context(), subj, []byte("{}"))
	if err != nil {
		w.t.Fatal(err)
	}
	return subj, ack.Sequence
}

// putSlot writes a slot key as a holder would have left it.
func (w *slotsWorld) putSlot(q *Queue, key string, v slotValue) {
	b, _ := json.Marshal(v)
	if _, err := q.Slots().Put(w.t.Context(), key, b); err != nil {
		w.t.Fatal(err)
	}
}

func TestATenantsSlotsAreAtMostItsLimit(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	a := w.queue("a", 30*time.Second, clk)
	b := w.queue("b", 30*time.Second, clk)
	ctx := t.Context()

	s1, ok1 := a.acquireSlot(ctx, "acme", 2)
	s2, ok2 := b.acquireSlot(ctx, "acme", 2)
	if !ok1 || !ok2 || s1.reserved || s2.reserved || s1.key == s2.key {
		t.Fatalf("the first two slots of a limit of 2: %+v %v, %+v %v", s1, ok1, s2, ok2)
	}
	if s, ok := b.acquireSlot(ctx, "acme", 2); ok {
		t.Fatalf("a third slot of a limit of 2 was taken: %+v", s)
	}
	// Another tenant's slots are its own.
	if _, ok := b.acquireSlot(ctx, "other", 1); !ok {
		t.Fatal("another tenant's slot was not taken")
	}
	s1.release()
	s3, ok := b.acquireSlot(ctx, "acme", 2)
	if !ok || s3.key != s1.key {
		t.Fatalf("after a release: %+v, %v; want the released key %s", s3, ok, s1.key)
	}
	if _, ok := a.acquireSlot(ctx, "acme", 2); ok {
		t.Fatal("a third slot was taken after the release was reused")
	}
}

// A holder that stopped renewing keeps its key until a reader watched it
// unchanged for 1.5 of the holder's leases, on the reader's own clock.
func TestALapsedSlotIsFreeOnlyAfterTheReaderWatchedItOneAndAHalfLeases(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	const lease = 10 * time.Second
	q := w.queue("reader", lease, clk)
	ctx := t.Context()
	// A dead holder's key naming no request; its holder's lease is 4s.
	w.putSlot(q, "acme.0", slotValue{Holder: "dead/1", LeaseMs: 4000})

	for _, step := range []time.Duration{0, 2 * time.Second, 2 * time.Second, 2*time.Second - time.Millisecond} {
		clk.Advance(step)
		if s, ok := q.acquireSlot(ctx, "acme", 1); ok {
			t.Fatalf("the slot was taken %v into the watch: %+v", clk.Now().Sub(time.Unix(1000, 0)), s)
		}
	}
	clk.Advance(time.Millisecond) // 6s: 1.5 of the holder's 4s lease
	s, ok := q.acquireSlot(ctx, "acme", 1)
	if !ok || s.reserved || s.key != "acme.0" {
		t.Fatalf("the lapsed slot after 1.5 leases: %+v, %v; want it taken", s, ok)
	}
}

// A gap in the reader's watch (it could not read: the holder could not
// renew either) starts the watch again.
func TestAGapInTheWatchStartsItAgain(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	const lease = 10 * time.Second
	q := w.queue("reader", lease, clk)
	ctx := t.Context()
	w.putSlot(q, "acme.0", slotValue{Holder: "dead/1", LeaseMs: 4000})

	q.acquireSlot(ctx, "acme", 1)
	clk.Advance(lease + time.Millisecond) // longer than the gap allowed: max(4s, 10s)
	if _, ok := q.acquireSlot(ctx, "acme", 1); ok {
		t.Fatal("the slot was taken after a gap in the watch")
	}
	clk.Advance(5 * time.Second)
	if _, ok := q.acquireSlot(ctx, "acme", 1); ok {
		t.Fatal("the slot was taken 5s into the new watch")
	}
	clk.Advance(time.Second)
	if _, ok := q.acquireSlot(ctx, "acme", 1); !ok {
		t.Fatal("the slot was not taken 6s into the new watch")
	}
}

// A lapsed or handed-back key whose request is still in the queue is kept
// for that request: it is offered reserved for it, never taken for
// another; once the request is finished, it is free.
func TestAKeptSlotIsReservedForItsRequestUntilThatRequestIsFinished(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	w.putSlot(q, "acme.0", slotValue{Holder: "gone/1", LeaseMs: 4000, HandedBack: true, RetryMs: 2000, Subject: subj, QueueSeq: seq})

	s, ok := q.acquireSlot(ctx, "acme", 1)
	if !ok || !s.reserved || s.reservedFor.QueueSeq != seq || s.reservedFor.Subject != subj || s.reservedFor.RetryMs != 2000 {
		t.Fatalf("a handed-back slot of a queued request: %+v, %v; want it reserved for the request", s, ok)
	}
	s.release() // a reserved slot is not the caller's: releasing it does nothing
	s.handBack(subj, seq, 0)
	if e, err := q.Slots().Get(ctx, "acme.0"); err != nil || e.Revision() != s.rev {
		t.Fatalf("a reserved slot was written by release or handBack: %v, %v", e, err)
	}

	// The request finished: its message is gone from the queue.
	st, err := w.js.Stream(ctx, v1.QueueStream)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteMsg(ctx, seq); err != nil {
		t.Fatal(err)
	}
	s, ok = q.acquireSlot(ctx, "acme", 1)
	if !ok || s.reserved {
		t.Fatalf("the slot of a finished request: %+v, %v; want it taken", s, ok)
	}
}

// A request handed back with an extra slot, whose extra was handed back
// before its own key: a dispatcher that finds only the extra kept takes it
// as the request's own slot. The own key, handed back after, then stands in
// for the extra: it stays reserved for the request, and another request of
// the tenant does not get it while the first runs on (found by
// TestAttack_IndexExtraSlotIsKeptWhileItsPlatformJobRunsAfterShutdown).
func TestAKeptOwnKeyStandsInForTheExtraItsRequestTook(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	w.putSlot(q, "acme.0", slotValue{Holder: "gone/1", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq, Extra: true})
	w.putSlot(q, "acme.1", slotValue{Holder: "gone/2", LeaseMs: 4000, Subject: subj, QueueSeq: seq})

	s, ok := q.acquireSlot(ctx, "acme", 2)
	if !ok || !s.reserved || s.key != "acme.0" || s.reservedFor.QueueSeq != seq {
		t.Fatalf("premise: the kept extra offered reserved for its request: %+v, %v", s, ok)
	}
	if err := s.take(ctx); err != nil {
		t.Fatal(err)
	}
	defer s.release()
	w.putSlot(q, "acme.1", slotValue{Holder: "gone/2", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq})

	other, ok := q.acquireSlot(ctx, "acme", 2)
	if !ok || !other.reserved || other.key != "acme.1" || other.reservedFor.QueueSeq != seq {
		t.Fatalf("another request's look at acme's slots: %+v, %v; want acme.1 reserved for the request that runs on acme.0", other, ok)
	}
}

// KeepSlots frees the kept keys that are free, and only those.
func TestKeepSlotsFreesOnlyKeptKeysThatAreFree(t *testing.T) {
	w := newSlotsWorld(t)
	clk := &clock{now: time.Unix(1000, 0)}
	q := w.queue("reader", 10*time.Second, clk)
	ctx := t.Context()
	subj, seq := w.enqueue("acme")
	w.putSlot(q, "acme.0", slotValue{Holder: "h/0", LeaseMs: 4000})                                                     // live (not watched long)
	w.putSlot(q, "acme.1", slotValue{Holder: "h/1", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq})     // kept for a queued request
	w.putSlot(q, "acme.2", slotValue{Holder: "h/2", LeaseMs: 4000, HandedBack: true, Subject: subj, QueueSeq: seq + 9}) // its request finished
	w.putSlot(q, "acme.3", slotValue{Holder: "h/3", LeaseMs: 4000, HandedBack: true})                                   // names no request

	q.KeepSlots(ctx)
	for key, want := range map[string]bool{"acme.0": true, "acme.1": true, "acme.2": false, "acme.3": false} {
		_, err := q.Slots().Get(ctx, key)
		if got := err == nil; got != want {
			t.Errorf("%s kept = %v (%v), want %v", key, got, err, want)
		}
	}
}

func TestSlotWatchMeasuresAnUnbrokenWatchOfOneRevision(t *testing.T) {
	var sw slotWatch
	t0 := time.Unix(1000, 0)
	const gap = 5 * time.Second
	if d := sw.watch("k", 1, gap, t0); d != 0 {
		t.Fatalf("first read = %v, want 0", d)
	}
	if d := sw.watch("k", 1, gap, t0.Add(4*time.Second)); d != 4*time.Second {
		t.Fatalf("second read = %v, want 4s", d)
	}
	if d := sw.watch("k", 1, gap, t0.Add(8*time.Second)); d != 8*time.Second {
		t.Fatalf("third read = %v, want 8s", d)
	}
	if d := sw.watch("k", 2, gap, t0.Add(9*time.Second)); d != 0 {
		t.Fatalf("a new revision = %v, want 0", d)
	}
	if d := sw.watch("k", 2, gap, t0.Add(15*time.Second)); d != 0 {
		t.Fatalf("after a gap of 6s = %v, want 0", d)
	}
	if d := sw.watch("k", 2, gap, t0.Add(14*time.Second)); d != 0 {
		t.Fatalf("the clock going back = %v, want 0", d)
	}
	sw.forget("k")
	if d := sw.watch("k", 2, gap, t0.Add(15*time.Second)); d != 0 {
		t.Fatalf("after forget = %v, want 0", d)
	}
}

func TestSlotValueLeaseDefaultsToTheReadersOwn(t *testing.T) {
	if got := (slotValue{LeaseMs: 1500}).lease(time.Minute); got != 1500*time.Millisecond {
		t.Fatalf("lease = %v, want 1.5s", got)
	}
	if got := (slotValue{}).lease(time.Minute); got != time.Minute {
		t.Fatalf("lease of a value without one = %v, want the default", got)
	}
}
