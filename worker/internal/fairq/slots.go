package fairq

// Fair queueing (docs/design.md §2d). Requests arrive on BUILDQ_REQUESTS,
// the contract's work queue, and are admitted from it by intake: a cheap
// step that applies the tenant's queue-length limit and moves each request
// to BUILDQ_QUEUE under buildq.queue.<tenant>.<priority>. Build slots are
// filled from there by each worker's dispatcher, which picks the tenant
// with the fewest running requests per weight among those with work and
// below their concurrency limit, and within the tenant the highest
// priority first.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// ---- concurrency slots ----

// A tenant's concurrency slots are the keys <tenant>.<n>, n below its
// limit, of the slots bucket (docs/design.md §2d): Create is atomic on the
// server, so at most limit of them exist. A key counts for as long as the
// request it was taken for may have a build running. It is
//
//   - live while its holder renews it, every third of the holder's own
//     lease (LeaseMs in the value);
//   - handed back when its holder stopped with the request handed back
//     and its build running on, or retries the request after a delay
//     (the run it let go may have a Job running on);
//   - lapsed when a reader watched it unchanged, without a gap, for 1.5
//     of its holder's leases on the reader's own clock (the holder died,
//     or lost NATS).
//
// The bucket has no TTL, and no clock is compared with another: workers
// with other leases or skewed clocks, and a NATS outage (which breaks
// every reader's watch), leave a live holder its key. A handed-back or
// lapsed key is free when it names no request, or its request is
// finished (its message is gone from BUILDQ_QUEUE) or runs on a live key;
// otherwise it is kept for its request, and a dispatcher takes it only
// with that request (takeReserved). So a request whose build may be
// running always holds a key, whatever the AckWait, the priorities or the
// leases: the limit is exact.

// slotValue is what a slot's key holds.
type slotValue struct {
	// Holder names the worker and this hold of the slot (unique).
	Holder string `json:"holder"`
	// LeaseMs is the holder's lease: it renews the key every third of
	// it, and a reader counts the key lapsed once it watched it unchanged
	// for 1.5 times it.
	LeaseMs int64 `json:"leaseMs,omitempty"`
	// HandedBack: the holder stopped with the request handed back, its
	// build still running; or the request is retried after RetryMs
	// (transient trouble: the run it let go may still have a Job).
	HandedBack bool  `json:"handedBack,omitempty"`
	RetryMs    int64 `json:"retryMs,omitempty"`
	// Subject and QueueSeq name the request the slot was taken for: its
	// queue subject and its message in BUILDQ_QUEUE. They are written
	// before the request is handled; while that message is in the queue,
	// a handed-back or lapsed key is kept for that request.
	Subject  string `json:"subject,omitempty"`
	QueueSeq uint64 `json:"queueSeq,omitempty"`
	// Extra: one more slot of the request QueueSeq names, for a build it
	// runs besides its first (an image index's platforms; ExtraSlots). A
	// kept extra is free only once its request is finished — not when the
	// request runs on a live key again, since the builds its earlier
	// handler let go may still have Jobs running.
	Extra bool `json:"extra,omitempty"`
	// TookExtra: a live key its request took from one of its kept
	// extras, or from a kept TookExtra key (the first kept key a
	// dispatcher found for it). The request's other kept keys then stand
	// in for that extra: they are not freed because the request runs on
	// this live key. Kept in its turn, it is free only once its request
	// is finished, like an extra.
	TookExtra bool `json:"tookExtra,omitempty"`
}

// lease is the holder's lease (def for a value without one).
func (v slotValue) lease(def time.Duration) time.Duration {
	if v.LeaseMs <= 0 {
		return def
	}
	return time.Duration(v.LeaseMs) * time.Millisecond
}

// slotWatch remembers, per slot key, the revision this worker last read
// and since when it has read it unchanged without a gap.
type slotWatch struct {
	mu sync.Mutex
	m  map[string]slotSeen
}

type slotSeen struct {
	rev         uint64
	since, last time.Time
}

// watch records a read of key at rev and returns how long this worker has
// seen the key unchanged. A gap of more than gap since its previous read
// (this worker could not read: a NATS outage, a pause, during which the
// holder could not renew either) starts the watch again.
func (sw *slotWatch) watch(key string, rev uint64, gap time.Duration, now time.Time) time.Duration {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	if sw.m == nil {
		sw.m = map[string]slotSeen{}
	}
	s, ok := sw.m[key]
	if !ok || s.rev != rev || now.Sub(s.last) > gap || now.Before(s.last) {
		sw.m[key] = slotSeen{rev: rev, since: now, last: now}
		return 0
	}
	s.last = now
	sw.m[key] = s
	return now.Sub(s.since)
}

func (sw *slotWatch) forget(key string) {
	sw.mu.Lock()
	delete(sw.m, key)
	sw.mu.Unlock()
}

// slotState is a slot key as this worker reads it now.
type slotState struct {
	key     string
	rev     uint64
	v       slotValue
	watched time.Duration
	// kept: handed back, or lapsed; no live holder renews it.
	kept bool
}

// readSlot judges a slot key read at e.
func (q *Queue) readSlot(key string, e jetstream.KeyValueEntry) slotState {
	var v slotValue
	if json.Unmarshal(e.Value(), &v) != nil {
		v = slotValue{} // unreadable: judged by its lapse, naming no request
	}
	lease := v.lease(q.cfg.Lease)
	// The watch tolerates gaps of this worker's own reading pace too (it
	// reads every third of its lease).
	watched := q.slotSeen.watch(key, e.Revision(), max(lease, q.cfg.Lease), q.cfg.Now())
	kept := v.HandedBack || watched >= lease+lease/2
	if _, mine := q.renewing.Load(v.Holder); mine && !v.HandedBack {
		// This worker holds it and renews it: live, even while its
		// renewals fail (other workers may judge it lapsed then, as the
		// design allows; this one must not take its own live key).
		kept = false
	}
	return slotState{key: key, rev: e.Revision(), v: v, watched: watched, kept: kept}
}

// liveOwn is, per request (queue sequence), the newest revision read of
// a live key its request runs on (runsOn).
type liveOwn map[uint64]uint64

// saw notes a live key read.
func (l liveOwn) saw(st slotState) {
	if runsOn(st.v) && st.rev > l[st.v.QueueSeq] {
		l[st.v.QueueSeq] = st.rev
	}
}

// slotFree reports whether a kept key is free: it names no request, its
// request runs on a live own key written after the kept key (held) and it
// is not an extra or a stand-in for one, or its request is finished (its
// message gone from the queue). "Written after" makes the rule one-way:
// two kept-or-live own keys of one request, judged by two readers that
// see them differently (one watched a dead holder's key lapse, the other
// started watching it later), are never freed each on the strength of
// the other — the older of the two never frees the newer, and a live
// holder's renewals soon make its key the newer.
func (q *Queue) slotFree(ctx context.Context, s slotState, held liveOwn) (bool, error) {
	if s.v.QueueSeq == 0 || (held[s.v.QueueSeq] > s.rev && ((!s.v.Extra && !s.v.TookExtra) || mutant.On("extra-slot-free-on-live-key"))) {
		return true, nil
	}
	_, err := q.queue.GetMsg(ctx, s.v.QueueSeq)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return true, nil
	case err != nil:
		return false, err
	}
	return false, nil
}

// runsOn reports whether a live key's request runs on it as on its own
// key: the key its handler took first, standing in for no kept extra. A
// live extra does not (its handler builds a platform on it; the request's
// kept own key may still have a build running), nor does a key taken from
// a kept extra (it stands in for that extra).
func runsOn(v slotValue) bool {
	return v.QueueSeq > 0 && !v.Extra && !v.TookExtra
}

// slot is one of a tenant's concurrency slots, held while its request runs.
type slot struct {
	q      *Queue
	tenant string
	key    string
	val    slotValue
	rev    uint64
	// reserved: a kept key, not taken yet, for the request reservedFor
	// names; watched is how long this worker saw it unchanged.
	reserved    bool
	reservedFor slotValue
	watched     time.Duration
	renewing    bool
	stop        chan struct{}
	done        chan struct{}
}

func (q *Queue) newSlot(tenant, key string, val slotValue, rev uint64) *slot {
	return &slot{q: q, tenant: tenant, key: key, val: val, rev: rev, stop: make(chan struct{}), done: make(chan struct{})}
}

func (s *slot) bytes() []byte {
	b, _ := json.Marshal(s.val)
	return b
}

// acquireSlot takes a free slot of tenant's limit: a key nobody holds, or
// a handed-back or lapsed one that is free (slotFree). Failing that, it
// returns a kept key reserved for its request (s.reserved: not taken yet;
// see takeReserved), or reports none.
func (q *Queue) acquireSlot(ctx context.Context, tenant string, limit int) (*slot, bool) {
	return q.acquireSlotFor(ctx, tenant, limit, 0)
}

// acquireSlotFor is acquireSlot for the request of queue sequence mine
// (0: none): a key kept for that request comes first, before a missing
// key is created — a kept key left aside would sit idle, reserved for the
// request, until the request is finished.
func (q *Queue) acquireSlotFor(ctx context.Context, tenant string, limit int, mine uint64) (*slot, bool) {
	val := slotValue{Holder: q.cfg.ID + "/" + runs.NewRunID(), LeaseMs: q.cfg.Lease.Milliseconds()}
	b, _ := json.Marshal(val)
	var kept []slotState
	var missing []string
	held := liveOwn{}
	// create takes key if nobody holds it; done: the caller returns s
	// and ok (taken, or the bucket failed).
	create := func(key string) (s *slot, ok, done bool) {
		rev, err := q.slots.Create(ctx, key, b)
		if err == nil {
			return q.newSlot(tenant, key, val, rev), true, true
		}
		if !ledger.IsWrongRevision(err) {
			q.log.Warn("taking a concurrency slot failed", zap.String("tenant", tenant), zap.Error(err))
			return nil, false, true
		}
		return nil, false, false
	}
	for i := range limit {
		key := tenant + "." + strconv.Itoa(i)
		if mine == 0 {
			if s, ok, done := create(key); done {
				return s, ok
			}
		}
		e, err := q.slots.Get(ctx, key)
		if mine != 0 && (errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted)) {
			missing = append(missing, key)
			continue
		}
		if err != nil {
			continue // deleted meanwhile, or unreadable now: looked at again later
		}
		st := q.readSlot(key, e)
		if !st.kept {
			held.saw(st)
			continue
		}
		kept = append(kept, st)
	}
	if mine != 0 {
		for _, st := range kept {
			if st.v.QueueSeq == mine {
				return q.reservedSlot(tenant, val, st), true
			}
		}
		for _, key := range missing {
			if s, ok, done := create(key); done {
				return s, ok
			}
		}
	}
	var reserved *slotState
	for i, st := range kept {
		free, err := q.slotFree(ctx, st, held)
		if err != nil {
			continue
		}
		if !free {
			if reserved == nil {
				reserved = &kept[i]
			}
			continue
		}
		if rev, err := q.slots.Update(ctx, st.key, b, st.rev); err == nil {
			q.slotSeen.forget(st.key)
			return q.newSlot(tenant, st.key, val, rev), true
		}
	}
	if reserved != nil {
		return q.reservedSlot(tenant, val, *reserved), true
	}
	return nil, false
}

// reservedSlot is st, a key kept for its request, offered to a dispatcher
// or a handler of that request to take (take) as val.
func (q *Queue) reservedSlot(tenant string, val slotValue, st slotState) *slot {
	s := q.newSlot(tenant, st.key, val, st.rev)
	s.reserved, s.reservedFor, s.watched = true, st.v, st.watched
	return s
}

// ExtraSlots lets the handler of one dispatched request take more of its
// tenant's concurrency slots, for builds the request runs besides its
// first (an image index's platforms, side by side): a tenant's Jobs never
// outnumber its slots. Each extra names the request like its first and is
// kept, handed back or released with it when the handler is done (finish),
// unless the handler released it before (a platform's build ended). Kept
// (its worker stopped or died, or the request is retried), it stays the
// request's until the request is finished: the builds let go may still
// have Jobs running. A nil *ExtraSlots takes nothing.
type ExtraSlots struct {
	q        *Queue
	tenant   string
	subject  string
	qseq     uint64
	limit    int
	mu       sync.Mutex
	held     []*slot
	finished bool
}

func (q *Queue) extraSlots(tenant, subject string, qseq uint64) *ExtraSlots {
	return &ExtraSlots{q: q, tenant: tenant, subject: subject, qseq: qseq, limit: q.cfg.Fair.ConcurrencyOf(tenant)}
}

// Take takes one more slot: one kept for this request first (its earlier
// handler's), else a free one. ok is false when the tenant has none free
// (the caller then builds on the slots it holds, one build at a time);
// with no limit ok is true and release does nothing.
func (e *ExtraSlots) Take(ctx context.Context) (release func(), ok bool) {
	if e == nil {
		return nil, false
	}
	if e.limit <= 0 || mutant.On("index-ignores-slots") {
		return func() {}, true
	}
	s, ok := e.q.acquireSlotFor(ctx, e.tenant, e.limit, e.qseq)
	if !ok {
		return nil, false
	}
	s.val.Extra = true
	if s.reserved {
		if s.reservedFor.QueueSeq != e.qseq || s.reservedFor.Subject != e.subject {
			return nil, false // kept for another request
		}
		if err := s.take(ctx); err != nil {
			return nil, false
		}
	} else if err := s.hold(ctx, e.subject, e.qseq); err != nil {
		e.q.log.Warn("holding an extra concurrency slot failed", zap.String("slot", s.key), zap.Error(err))
		s.release() // or it lapses: it names no request
		return nil, false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.finished {
		s.release()
		return nil, false
	}
	e.held = append(e.held, s)
	return func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if i := slices.Index(e.held, s); i >= 0 {
			e.held = slices.Delete(e.held, i, i+1)
			s.release()
		}
	}, true
}

// finish ends the handler's hold of the extras still held: released, or
// handed back (keep) for the request with retry as its delay.
func (e *ExtraSlots) finish(keep bool, retry time.Duration) {
	if e == nil {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.finished = true
	for _, s := range e.held {
		if keep {
			s.handBack(e.subject, e.qseq, retry)
		} else {
			s.release()
		}
	}
	e.held = nil
}

// hold records the request a fresh slot was taken for — before the
// request is handled: a slot that names no request is freed when its
// holder lapses — and starts renewing the slot.
func (s *slot) hold(ctx context.Context, subject string, qseq uint64) error {
	s.val.Subject, s.val.QueueSeq = subject, qseq
	rev, err := s.q.slots.Update(ctx, s.key, s.bytes(), s.rev)
	if err != nil {
		if rev, err = s.recover(ctx, err); err != nil {
			return err
		}
	}
	s.rev = rev
	s.startRenew()
	return nil
}

// take takes a reserved slot for its request, which the caller holds.
func (s *slot) take(ctx context.Context) error {
	s.val.Subject, s.val.QueueSeq = s.reservedFor.Subject, s.reservedFor.QueueSeq
	s.val.TookExtra = (s.reservedFor.Extra || s.reservedFor.TookExtra) && !s.val.Extra
	rev, err := s.q.slots.Update(ctx, s.key, s.bytes(), s.rev)
	if err != nil {
		return err
	}
	s.rev, s.reserved = rev, false
	s.q.slotSeen.forget(s.key)
	s.startRenew()
	return nil
}

func (s *slot) startRenew() {
	s.renewing = true
	s.q.renewing.Store(s.val.Holder, true)
	go s.renew()
}

func (s *slot) stopRenew() {
	if s.renewing {
		s.renewing = false
		close(s.stop)
		<-s.done
		s.q.renewing.Delete(s.val.Holder)
	}
}

// renew keeps s live until it is released. A renewal whose reply was lost
// leaves the key a revision ahead: the key is read back, and if it is
// still this hold's, renewing goes on from its revision.
func (s *slot) renew() {
	defer close(s.done)
	lease := s.q.cfg.Lease
	t := time.NewTicker(max(lease/3, 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), lease/3+time.Second)
		rev, err := s.q.slots.Update(ctx, s.key, s.bytes(), s.rev)
		if err != nil {
			rev, err = s.recover(ctx, err)
		}
		cancel()
		if err != nil {
			s.q.log.Warn("renewing a concurrency slot failed", zap.String("slot", s.key), zap.Error(err))
			continue
		}
		s.rev = rev
	}
}

func (s *slot) recover(ctx context.Context, cause error) (uint64, error) {
	e, err := s.q.slots.Get(ctx, s.key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted):
		// Freed by a reader that saw it lapse: take it again if it is
		// still free.
		return s.q.slots.Create(ctx, s.key, s.bytes())
	case err != nil:
		return 0, cause
	}
	var cur slotValue
	if json.Unmarshal(e.Value(), &cur) != nil || cur.Holder != s.val.Holder || cur.HandedBack {
		return 0, fmt.Errorf("the slot was taken by another holder (this worker's renewals failed for longer than the lease): %w", cause)
	}
	return s.q.slots.Update(ctx, s.key, s.bytes(), e.Revision())
}

// release frees s.
func (s *slot) release() {
	if s == nil || s.reserved {
		return
	}
	s.stopRenew()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if s.q.slots.Delete(ctx, s.key, jetstream.LastRevision(s.rev)) == nil {
		s.q.slotSeen.forget(s.key)
		// Dispatchers that skipped the tenant at its limit look again.
		_ = s.q.nc.Publish(wakeSubject, []byte(s.tenant))
	}
	// Otherwise it lapses, and is freed once its request is finished.
}

// handBack keeps s for the handed-back request of subject: its build goes
// on, and whoever takes the request on takes this slot with it — at once,
// or for a request retried after a delay (retry), once the delay passed.
func (s *slot) handBack(subject string, qseq uint64, retry time.Duration) {
	if s == nil || s.reserved {
		return
	}
	s.stopRenew()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.val.HandedBack, s.val.Subject, s.val.QueueSeq = true, subject, qseq
	s.val.RetryMs = retry.Milliseconds()
	if _, err := s.q.slots.Update(ctx, s.key, s.bytes(), s.rev); err == nil {
		_ = s.q.nc.Publish(wakeSubject, []byte(s.tenant))
	}
	// Otherwise it lapses, and is kept for its request all the same.
}

// KeepSlots frees the handed-back and lapsed keys that are free
// (slotFree), announcing each: a key kept for a request whose message is
// gone, or that runs on another key, or a lapsed key naming no request.
// Reading every key every third of the lease is also what keeps this
// worker's watch of them without gaps.
func (q *Queue) KeepSlots(ctx context.Context) {
	keys, err := q.slots.ListKeys(ctx)
	if err != nil {
		return
	}
	var kept []slotState
	held := liveOwn{}
	for k := range keys.Keys() {
		e, err := q.slots.Get(ctx, k)
		if err != nil {
			continue
		}
		st := q.readSlot(k, e)
		if !st.kept {
			held.saw(st)
			continue
		}
		kept = append(kept, st)
	}
	for _, st := range kept {
		if free, err := q.slotFree(ctx, st, held); err != nil || !free {
			continue
		}
		if q.slots.Delete(ctx, st.key, jetstream.LastRevision(st.rev)) == nil {
			q.slotSeen.forget(st.key)
			tenant, _, _ := strings.Cut(st.key, ".")
			_ = q.nc.Publish(wakeSubject, []byte(tenant))
		}
	}
}
