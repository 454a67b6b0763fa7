package ledger

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// Decision is a request's one result and what follows it, as recorded in
// its entry.
type Decision struct {
	Tenant, Name string
	Data         v1.ResultData
	// Term: terminate the message instead of acking it (bad input).
	Term bool
	// CleanupKey, CleanupRun: this request ended the build's run; remove
	// that run's Job after the result is stored.
	CleanupKey, CleanupRun string
	// Recorded: the decision was in the ledger before this handler (or
	// the request has no entry); PublishedBefore: its result was stored
	// already.
	Recorded        bool
	PublishedBefore bool
	// RecordedNow: this handler recorded the decision as it created the
	// entry (CreateDecided); Deliver publishes it without recording it
	// again or asking who publishes.
	RecordedNow bool
}

// DecisionOf is the recorded decision of an entry.
func DecisionOf(e v1.RequestEntry) Decision {
	return Decision{Tenant: e.Tenant, Name: e.Name, Data: *e.Result, Term: e.Term,
		CleanupKey: e.CleanupKey, CleanupRun: e.CleanupRun, Recorded: true, PublishedBefore: e.Published}
}

// Canceled turns d into the "canceled" result of a request its tenant
// canceled.
func (d Decision) Canceled() Decision {
	d.Data.Status, d.Data.Reason, d.Data.Message = v1.StatusCanceled, v1.ReasonCanceled, "canceled on request"
	d.Data.Digest, d.Data.Image, d.Data.ImageRef, d.Data.LogTail = "", "", "", ""
	d.Term = false
	return d
}

// Delivery says how Deliver publishes.
type Delivery struct {
	// Publish publishes the decision's result.
	Publish func(ctx context.Context, d Decision) error
	// Unrecorded is asked, when recording the decision failed, whether
	// to publish it all the same (the request's last try); without it,
	// or when it says no, Deliver returns the error.
	Unrecorded func(err error) bool
	// Async: return once published and write the mark in the background
	// (Delivered.WaitMarked), so the handler acks its message meanwhile.
	Async bool
	// Unmarked: publish without writing the mark; the caller marks it
	// (Delivered.Mark) only when its message may come again — its ack
	// failed. A message acked for sure is never delivered again, and a
	// request with no waiter entry has no other deliverer.
	Unmarked bool
}

// Status is what Deliver did.
type Status int

const (
	// Failed means nothing was delivered; the error says why.
	Failed Status = iota
	// Published means this call published the decision.
	Published
	// WasPublished means the decision was published before: nothing to do.
	WasPublished
	// Busy means another goroutine of this worker is delivering the request.
	Busy
	// Later means another worker decided the request and may be
	// publishing it right now: look again after PublishGrace/2. The
	// error, if any, is the failed read that left it undecided.
	Later
)

// Delivered is Deliver's outcome.
type Delivered struct {
	Decision Decision
	Status   Status
	marked   chan struct{}
	// le, l: the entry an Unmarked delivery left unmarked (Mark).
	le *Entry
	l  *Ledger
}

// Mark writes the mark an Unmarked delivery left out.
func (d Delivered) Mark(ctx context.Context) {
	if d.le != nil && d.Status == Published {
		d.l.markPublished(ctx, d.le)
	}
}

// WaitMarked waits for the mark an Async delivery writes.
func (d Delivered) WaitMarked() {
	if d.marked != nil {
		<-d.marked
	}
}

// PublishError is a failed publish of a recorded decision.
type PublishError struct{ Err error }

func (e *PublishError) Error() string { return "publish result: " + e.Err.Error() }
func (e *PublishError) Unwrap() error { return e.Err }

// Deliver is the one-decision-one-publish rule: it records d as the
// request's decision (or takes the one recorded first), publishes it
// unless it was published before, and marks it published — record, then
// publish, then mark. One goroutine of this worker delivers a request at
// a time (the handler, a parked request's answer, a cancel all come
// here): another that found the decision recorded and not yet marked
// would publish it again. le nil (input too broken for an entry) is
// published without a record.
func (l *Ledger) Deliver(ctx context.Context, le *Entry, d Decision, how Delivery) (Delivered, error) {
	if d.Data.Timings.FinishedAt.IsZero() {
		d.Data.Timings.FinishedAt = l.cfg.Now().UTC()
	}
	release := func() {}
	if le != nil {
		r, ok := l.publishing.acquire(le.Key())
		if !ok {
			return Delivered{Decision: d, Status: Busy}, nil
		}
		release = r
	}
	if le != nil && !d.Recorded && !d.RecordedNow && !mutant.On("publish-before-record") {
		// The decision is stored before it is published: a redelivery
		// publishes this same result, never a second, different one.
		rd, err := l.Record(ctx, le, d)
		if err != nil && (how.Unrecorded == nil || !how.Unrecorded(err)) {
			release()
			return Delivered{Decision: rd}, err
		}
		if err != nil {
			l.cfg.Log.Error("recording the decision failed on the request's last try; publishing it unrecorded",
				zap.String("requestId", d.Data.RequestID), zap.Error(err))
		}
		d = rd
	}
	if d.PublishedBefore {
		release()
		return Delivered{Decision: d, Status: WasPublished}, nil
	}
	if le != nil && d.Recorded {
		// Decided before this call and not marked published: by this
		// worker (its publish failed), or by another party that may be
		// publishing it right now.
		switch right, err := l.publishRight(ctx, le); right {
		case publishDone:
			release()
			d.PublishedBefore = true
			return Delivered{Decision: d, Status: WasPublished}, nil
		case publishLater:
			release()
			return Delivered{Decision: d, Status: Later}, err
		}
	}
	if err := how.Publish(ctx, d); err != nil {
		release()
		return Delivered{Decision: d}, &PublishError{Err: err}
	}
	out := Delivered{Decision: d, Status: Published}
	if le == nil {
		return out, nil
	}
	if how.Unmarked {
		release()
		out.le = le
		out.l = l
		return out, nil
	}
	// The lock is held until the mark is written: a handler of this
	// worker that read the entry before it would publish again.
	if !how.Async {
		l.markPublished(ctx, le)
		release()
		return out, nil
	}
	out.marked = make(chan struct{})
	go func() {
		defer close(out.marked)
		defer release()
		l.markPublished(ctx, le)
	}()
	return out, nil
}

// markPublished marks the entry's result as stored (best effort: without
// it a redelivery publishes the same result again, which the results
// stream's duplicate window drops). Another write may have come between
// the decision and the mark (a retry's count, a take-over): the decision
// itself never changes once recorded, so the mark is written again on the
// entry as it is now.
func (l *Ledger) markPublished(ctx context.Context, le *Entry) {
	_, err := l.change(ctx, le, 5, func(e *v1.RequestEntry) bool {
		if e.Published || e.Result == nil {
			return false
		}
		e.Published, e.UpdatedAt = true, l.cfg.Now().UTC()
		return true
	})
	if err != nil {
		l.cfg.Log.Debug("request ledger: marking published failed", zap.String("requestId", le.E.RequestID), zap.Error(err))
	}
}

// publishRight is what publishRight allows.
type publishRight int

const (
	publishNow   publishRight = iota // publish it
	publishDone                      // it is marked published: nothing to publish
	publishLater                     // not yet: look again later
)

// publishRight says whether the caller may publish le's decision, which
// was recorded before it and was not marked published when the caller
// read it. The caller holds the request in l.publishing, and the entry is
// read again under it: a read from before may predate the mark of another
// goroutine of this worker that held it. A decision this worker recorded
// is its own to publish again (its publish failed, or its mark was lost).
// Another worker's is published only once it has stayed unchanged for
// PublishGrace on this worker's clock, and then only by the one taker
// whose compare-and-swap names it the decision's worker: a decider that
// is only slow publishes it itself, and is not joined by a second publish.
func (l *Ledger) publishRight(ctx context.Context, le *Entry) (publishRight, error) {
	cur, err := l.Get(ctx, le.E.Tenant, le.E.RequestID)
	switch {
	case err != nil:
		return publishLater, err
	case cur == nil || cur.E.Published:
		// Marked meanwhile; or aged out, and its result with it.
		return publishDone, nil
	case cur.E.Result == nil:
		return publishLater, errors.New("request ledger: the decision read before is not there")
	}
	*le = *cur
	if le.E.Worker == l.cfg.Worker {
		return publishNow, nil
	}
	now := l.cfg.Now()
	if !l.unmarked.lapsed(le.Key(), le.Rev, now, l.cfg.PublishGrace) && !mutant.On("publish-unmarked-at-once") {
		return publishLater, nil
	}
	decidedBy := le.E.Worker
	ok, err := l.change(ctx, le, 1, func(e *v1.RequestEntry) bool {
		e.Worker, e.UpdatedAt = l.cfg.Worker, now.UTC()
		return true
	})
	switch {
	case errors.Is(err, errConflict):
		return publishLater, nil // changed meanwhile: marked, or taken over
	case err != nil || !ok:
		return publishLater, err
	}
	l.cfg.Log.Info("publishing a result another worker recorded and left unpublished",
		zap.String("requestId", le.E.RequestID), zap.String("decidedBy", decidedBy))
	return publishNow, nil
}

// keyLocks lets one goroutine at a time hold a key, without waiting.
type keyLocks struct{ m sync.Map }

// acquire takes k and returns its release, or ok false when k is held.
func (kl *keyLocks) acquire(k string) (release func(), ok bool) {
	if _, held := kl.m.LoadOrStore(k, struct{}{}); held {
		return nil, false
	}
	var once sync.Once
	return func() { once.Do(func() { kl.m.Delete(k) }) }, true
}

// unmarkedWatch remembers, per ledger key, the revision of a decision
// another worker recorded and had not marked published, and when this
// worker first saw that revision.
type unmarkedWatch struct {
	mu sync.Mutex
	m  map[string]unmarkedSeen
}

type unmarkedSeen struct {
	rev   uint64
	since time.Time
}

// lapsed reports whether k has been seen at rev for at least grace, on
// this worker's clock; it starts the watch when k is new or changed.
func (u *unmarkedWatch) lapsed(k string, rev uint64, now time.Time, grace time.Duration) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.m == nil {
		u.m = map[string]unmarkedSeen{}
	}
	s, ok := u.m[k]
	if !ok || s.rev != rev {
		if len(u.m) >= 4096 {
			for k, s := range u.m {
				if now.Sub(s.since) > 4*grace {
					delete(u.m, k)
				}
			}
		}
		u.m[k] = unmarkedSeen{rev: rev, since: now}
		return false
	}
	if now.Sub(s.since) < grace {
		return false
	}
	delete(u.m, k)
	return true
}
