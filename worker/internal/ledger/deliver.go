package ledger

import (
	"cmp"
	"context"
	"errors"
	"fmt"
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

// Ack is what a result's publish was answered: the results stream's
// PubAck.
type Ack struct {
	// Duplicate: the stream held a result of this request id already
	// (its duplicate window) and dropped this one; Seq is that result's.
	Duplicate bool
	Seq       uint64
}

// Results reads the results the stream stored. The first result stored
// under a request's message id is its decision: a later publish of
// another is dropped as a duplicate, and its publisher adopts the stored
// one (Deliver).
type Results interface {
	// Stored is the result stored at seq.
	Stored(ctx context.Context, seq uint64) (v1.ResultData, error)
	// Find is the result stored for tenant's request id, published
	// under name at or after since; nil when there is none.
	Find(ctx context.Context, tenant, name, id string, since time.Time) (*v1.ResultData, error)
}

// Delivery says how Deliver publishes.
type Delivery struct {
	// Publish publishes the decision's result and returns its PubAck.
	Publish func(ctx context.Context, d Decision) (Ack, error)
	// First, when set, publishes the decision before it is recorded,
	// when the request is young enough (Config.Young) that any result
	// stored for it before is inside the stream's duplicate window; the
	// stored result is then recorded with its published mark in one
	// write. The handler of a finished build delivers so: its result
	// goes out before any write. Publish is used when it is not, or when
	// its publish failed.
	First func(ctx context.Context, d Decision) (Ack, error)
	// Now: a decision another worker recorded and left unmarked is
	// published at once rather than after PublishGrace; the cancel does
	// so to learn which result was stored before it replies.
	Now bool
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

// RecordError is a failed record of a decision whose result is stored.
// The message must not be settled: its redelivery publishes again, is
// answered as a duplicate, and records the stored result.
type RecordError struct{ Err error }

func (e *RecordError) Error() string { return "record the stored result: " + e.Err.Error() }
func (e *RecordError) Unwrap() error { return e.Err }

// PublishError is a failed publish of a recorded decision.
type PublishError struct{ Err error }

func (e *PublishError) Error() string { return "publish result: " + e.Err.Error() }
func (e *PublishError) Unwrap() error { return e.Err }

// Deliver is the one-decision-one-publish rule: it records d as the
// request's decision (or takes the one recorded first), publishes it
// unless it was published before, and marks it published — record, then
// publish, then mark. The first result the stream stores under the
// request's message id is the decision: a publish answered as a
// duplicate adopts the stored result, and the entry is written to match
// it. With how.First a young request's decision is published first and
// recorded after (deliverFirst). One goroutine of this worker delivers a
// request at a time (the handler, a parked request's answer, a cancel
// all come here): another that found the decision recorded and not yet
// marked would publish it again. le nil (input too broken for an entry)
// is published without a record.
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
	if how.First != nil && le != nil && !d.Recorded && !d.RecordedNow && l.young(le) {
		out, done, err := l.deliverFirst(ctx, le, d, how)
		if done {
			release()
			return out, err
		}
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
		switch right, err := l.publishRight(ctx, le, how.Now); right {
		case publishDone:
			release()
			if le.E.Result != nil {
				// Published as the entry says now: the decision read
				// before may since have given way to the result stored
				// first (adopt).
				d = withCleanup(DecisionOf(le.E), d)
			}
			d.PublishedBefore = true
			return Delivered{Decision: d, Status: WasPublished}, nil
		case publishLater:
			release()
			return Delivered{Decision: d, Status: Later}, err
		}
	}
	if le != nil && l.cfg.Results != nil && l.cfg.Young != nil && !l.young(le) && !d.RecordedNow {
		// Old enough that a result published first for it may have left
		// the duplicate window: look for one before publishing another.
		found, err := l.cfg.Results.Find(ctx, le.E.Tenant, le.E.Name, le.E.RequestID, le.E.MsgTime)
		if err != nil {
			release()
			return Delivered{Decision: d}, &PublishError{Err: fmt.Errorf("look for a stored result: %w", err)}
		}
		if found != nil {
			ad, err := l.adopt(ctx, le, d, *found)
			release()
			return Delivered{Decision: ad, Status: WasPublished}, err
		}
	}
	ack, err := how.Publish(ctx, d)
	if err != nil {
		release()
		return Delivered{Decision: d}, &PublishError{Err: err}
	}
	if ack.Duplicate && le != nil && l.cfg.Results != nil {
		stored, err := l.cfg.Results.Stored(ctx, ack.Seq)
		if err != nil {
			release()
			return Delivered{Decision: d}, &PublishError{Err: fmt.Errorf("read the stored result: %w", err)}
		}
		if !SameResult(stored, d.Data) {
			ad, err := l.adopt(ctx, le, d, stored)
			release()
			return Delivered{Decision: ad, Status: WasPublished}, err
		}
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

// young reports whether le's request is young enough to be published
// first (Config.Young): any result stored for it before now was stored
// after its message, inside the stream's duplicate window, so another
// publish is answered as its duplicate.
func (l *Ledger) young(le *Entry) bool {
	return l.cfg.Results != nil && l.cfg.Young != nil && !le.E.MsgTime.IsZero() && l.cfg.Young(le.E.MsgTime)
}

// deliverFirst publishes d before recording it, then records the stored
// result — d, or the one stored before it — with its published mark in
// one write. done is false when the publish failed: whether it was
// stored is unknown, and the caller delivers d as usual (record, then
// publish again: the stream answers a stored copy as a duplicate).
func (l *Ledger) deliverFirst(ctx context.Context, le *Entry, d Decision, how Delivery) (_ Delivered, done bool, _ error) {
	ack, err := how.First(ctx, d)
	if err != nil {
		l.cfg.Log.Debug("publishing a result ahead of its record failed; recording it first", zap.String("requestId", d.Data.RequestID), zap.Error(err))
		return Delivered{}, false, nil
	}
	status := Published
	if ack.Duplicate {
		stored, err := l.cfg.Results.Stored(ctx, ack.Seq)
		if err != nil {
			return Delivered{Decision: d}, true, &RecordError{Err: fmt.Errorf("read the stored result: %w", err)}
		}
		if !SameResult(stored, d.Data) {
			d.Data, status = stored, WasPublished
		}
	}
	if err := l.recordStored(ctx, le, d); err != nil {
		return Delivered{Decision: d}, true, &RecordError{Err: err}
	}
	d.Recorded, d.PublishedBefore = true, status == WasPublished
	return Delivered{Decision: d, Status: status}, true, nil
}

// adopt makes the stored result the request's decision: d's result lost
// to it. The entry is written to match, marked published; d's cleanup of
// the run it ended stands (that run ended all the same).
func (l *Ledger) adopt(ctx context.Context, le *Entry, d Decision, stored v1.ResultData) (Decision, error) {
	l.cfg.Log.Info("another result of the request was stored first; adopting it",
		zap.String("requestId", d.Data.RequestID), zap.String("stored", string(stored.Status)), zap.String("ours", string(d.Data.Status)))
	d.Data = stored
	if err := l.recordStored(ctx, le, d); err != nil {
		return d, &RecordError{Err: err}
	}
	d.Recorded, d.PublishedBefore = true, true
	return d, nil
}

// recordStored records d, whose result the stream stored, as the
// entry's decision with its published mark, whatever the entry held: a
// decision recorded there that the stream did not store (a cancel's, a
// racing handler's) gives way to it.
func (l *Ledger) recordStored(ctx context.Context, le *Entry, d Decision) error {
	_, err := l.change(ctx, le, 10, func(e *v1.RequestEntry) bool {
		if e.Published && e.Result != nil && SameResult(*e.Result, d.Data) {
			return false
		}
		r := d.Data
		e.Key, e.State, e.Origin, e.Digest, e.Reason = cmp.Or(r.Key, e.Key), string(r.Status), r.Origin, r.Digest, r.Reason
		e.Result, e.Published = &r, true
		if e.CleanupKey == "" {
			e.CleanupKey, e.CleanupRun = d.CleanupKey, d.CleanupRun
		}
		if !d.Recorded {
			e.Term = d.Term
		}
		e.Worker, e.UpdatedAt = l.cfg.Worker, l.cfg.Now().UTC()
		return true
	})
	if errors.Is(err, errGone) {
		return nil // aged out, and its result with it
	}
	return err
}

// withCleanup is d with the cleanup of the run own ended, when d names
// none: the run ended all the same.
func withCleanup(d, own Decision) Decision {
	if d.CleanupKey == "" {
		d.CleanupKey, d.CleanupRun = own.CleanupKey, own.CleanupRun
	}
	return d
}

// SameResult reports whether two results tell a client the same: status,
// reason, key, digest and origin.
func SameResult(a, b v1.ResultData) bool {
	return a.Status == b.Status && a.Reason == b.Reason && a.Key == b.Key && a.Digest == b.Digest && a.Origin == b.Origin
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
func (l *Ledger) publishRight(ctx context.Context, le *Entry, now bool) (publishRight, error) {
	cur, err := l.Get(ctx, le.E.Tenant, le.E.RequestID)
	switch {
	case err != nil:
		return publishLater, err
	case cur == nil:
		return publishDone, nil // aged out, and its result with it
	case cur.E.Published:
		*le = *cur // marked meanwhile
		return publishDone, nil
	case cur.E.Result == nil:
		return publishLater, errors.New("request ledger: the decision read before is not there")
	}
	*le = *cur
	if le.E.Worker == l.cfg.Worker || now {
		return publishNow, nil
	}
	at := l.cfg.Now()
	if !l.unmarked.lapsed(le.Key(), le.Rev, at, l.cfg.PublishGrace) && !mutant.On("publish-unmarked-at-once") {
		return publishLater, nil
	}
	decidedBy := le.E.Worker
	ok, err := l.change(ctx, le, 1, func(e *v1.RequestEntry) bool {
		e.Worker, e.UpdatedAt = l.cfg.Worker, at.UTC()
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
