package worker

import (
	"context"
	"fmt"
	"sync"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// The request's ledger entry, opened beside intake's read (docs/design.md
// §2d, item 3). A request about to be taken straight from intake whose key
// this worker knows nothing of (headBesideRead) is most often a new build:
// its handler's first write is the entry's create (ledger.Open), which
// depends on neither the record intake reads nor the HEAD sent beside it.
// Intake sends that create too, and the handler takes its outcome instead
// of writing its own:
//
//   - only the handler of the same message (tenant, request id and stream
//     sequence) takes it, and only within lookAheadFresh of its sending;
//     past that, or when it failed, the handler opens the entry itself
//     (which reads it as it is now: a cancel's mark, a decision);
//   - a hit found by the read decides the entry it opened (a compare-and-
//     swap, then the publish: ledger.Deliver), where an entry created
//     with its decision was one write; a hit of a key the worker had not
//     seen is the rare case this costs;
//   - a request that is held or queued after all keeps its entry, as a
//     redelivered request has one: its handler, here or on another
//     worker, opens it as it is.

// openAhead is a ledger entry's create intake sent; done closes when its
// outcome is in.
type openAhead struct {
	seq   uint64
	sent  time.Time
	done  chan struct{}
	le    *ledger.Entry
	fresh bool
	err   error
	// A cancel of the request between the create and its handler's own
	// registration (processRequest's api.Hold) comes to the placeholder
	// registered before the create: it is remembered (canceled), and
	// passed on to the handler once one took the create (handler).
	mu       sync.Mutex
	canceled bool
	handler  context.CancelCauseFunc
	taken    bool
	release  func()
}

// cancel is the placeholder's: see openAhead.
func (o *openAhead) cancel(cause error) {
	o.mu.Lock()
	o.canceled = true
	h := o.handler
	o.mu.Unlock()
	if h != nil {
		h(cause)
	}
}

// attach hands the placeholder's cancels on to handler, from now on;
// canceled reports whether one came before.
func (o *openAhead) attach(handler context.CancelCauseFunc) (canceled bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.handler = handler
	return o.canceled
}

// intakeOpens are the creates intake sent, by ledger key.
type intakeOpens struct {
	mu sync.Mutex
	m  map[string]*openAhead
}

// openAheadTimeout bounds a create sent ahead, as the handler's own is
// bounded by its request's handling.
const openAheadTimeout = 15 * time.Second

// sendOpen creates req's ledger entry now, in its own goroutine, for the
// message at seq, published at at.
func (w *builder) sendOpen(ctx context.Context, req *v1.Request, key string, seq uint64, at time.Time) {
	if mutant.On("no-open-ahead") {
		return
	}
	o := &openAhead{seq: seq, sent: time.Now(), done: make(chan struct{})}
	lk := ledger.Key(req.Tenant, req.RequestID)
	// Registered before the create: a cancel can mark the entry only once
	// it exists, and its notice then finds the placeholder (or the
	// handler's own registration, which replaces it). Released by the
	// handler that takes the create, or after a while when none does.
	if !mutant.On("open-ahead-misses-cancels") {
		o.release = w.api.Hold(lk, o.cancel)
	} else {
		o.release = func() {}
	}
	time.AfterFunc(2*lookAheadFresh, func() {
		o.mu.Lock()
		taken := o.taken
		o.mu.Unlock()
		if !taken {
			o.release()
		}
	})
	w.opens.mu.Lock()
	if w.opens.m == nil || len(w.opens.m) >= maxIntakeLooks {
		w.opens.m = map[string]*openAhead{}
	}
	w.opens.m[lk] = o
	w.opens.mu.Unlock()
	go func() {
		defer close(o.done)
		defer func() {
			if r := recover(); r != nil {
				o.err = fmt.Errorf("ledger entry opened ahead panicked: %v", r)
			}
		}()
		// The worker's context, not intake's deadline: the create
		// outlives the admission, as the handler's own would.
		ctx, cancel := context.WithTimeout(ctx, openAheadTimeout)
		defer cancel()
		o.le, o.fresh, o.err = w.ledger.Open(ctx, req.Tenant, req.Name, req.RequestID, key, seq, at)
	}()
}

// openSent reports whether intake sent the create of the message of
// tenant's request id at seq within lookAheadFresh, and it is not taken
// yet.
func (w *builder) openSent(tenant, id string, seq uint64) bool {
	w.opens.mu.Lock()
	defer w.opens.mu.Unlock()
	o, ok := w.opens.m[ledger.Key(tenant, id)]
	return ok && o.seq == seq && time.Since(o.sent) < lookAheadFresh
}

// takeOpen removes and returns the create intake sent for the message of
// tenant's request id at seq; nil when there is none, or when fresh asks
// for one sent within lookAheadFresh and it is older.
func (w *builder) takeOpen(tenant, id string, seq uint64, fresh bool) *openAhead {
	lk := ledger.Key(tenant, id)
	w.opens.mu.Lock()
	defer w.opens.mu.Unlock()
	o, ok := w.opens.m[lk]
	if !ok || o.seq != seq {
		return nil
	}
	delete(w.opens.m, lk)
	if fresh && time.Since(o.sent) >= lookAheadFresh {
		return nil
	}
	o.mu.Lock()
	o.taken = true
	o.mu.Unlock()
	return o
}

// wait is o's entry once it is in; ok false when ctx ended first or the
// create failed (the caller then opens the entry itself).
func (o *openAhead) wait(ctx context.Context) (le *ledger.Entry, fresh, ok bool) {
	select {
	case <-o.done:
		return o.le, o.fresh, o.err == nil
	case <-ctx.Done():
		return nil, false, false
	}
}

// openEntry opens the entry of req's message at seq: the create intake
// sent for it, or one of its own. handler is the handling's cancel: a
// cancel of the request from now until the handler registers it itself
// comes to it through intake's placeholder. done releases that
// placeholder (the caller runs it once registered, or as it returns).
//
// sent is when intake sent the create that made or found the entry (zero
// for the handler's own): intake registered the request with the cancel
// service before that create, so from sent on a cancel reaches the
// handler (lookAhead's created).
func (w *Worker) openEntry(ctx context.Context, req *v1.Request, key string, seq uint64, at time.Time, handler context.CancelCauseFunc) (le *ledger.Entry, fresh bool, sent time.Time, done func(), err error) {
	done = func() {}
	if o := w.builds.takeOpen(req.Tenant, req.RequestID, seq, true); o != nil {
		done = o.release
		canceled := o.attach(handler)
		if le, fresh, ok := o.wait(ctx); ok && !canceled {
			return le, fresh, o.sent, done, nil
		}
		// Canceled since the create (or it failed): the entry as it is
		// now, with the cancel's mark.
	}
	// The handler's own create: no sending time, since nothing stood
	// between a cancel and the entry until the handler registered
	// itself (its answered check reads the entry, lookAhead).
	opened := time.Now()
	le, fresh, err = w.ledger.Open(ctx, req.Tenant, req.Name, req.RequestID, key, seq, at)
	if mutant.On("answered-stands-handler-create") {
		return le, fresh, opened, done, err
	}
	return le, fresh, time.Time{}, done, err
}

// openedHit is the entry intake opened for a hit's message, when it opened
// one (this call's create, not one found) and it came in: the hit is decided
// on it (ledger.Deliver records the decision). ok false with opened true:
// an entry may exist and the hit is left to the queue's handler, which
// opens it as it is.
func (w *Worker) openedHit(ctx context.Context, req *v1.Request, seq uint64) (le *ledger.Entry, opened, ok bool) {
	// Of any age: the decision is recorded by a compare-and-swap, which
	// finds whatever changed the entry since (a cancel's mark). A hit
	// whose look took long under load is still answered here.
	o := w.builds.takeOpen(req.Tenant, req.RequestID, seq, mutant.On("opened-hit-fresh-only"))
	if o == nil {
		return nil, false, false
	}
	// A cancel since the create is in the entry: recording the decision
	// on it (a compare-and-swap) finds the mark and decides canceled.
	defer o.release()
	le, fresh, ok := o.wait(ctx)
	if !ok || !fresh {
		return nil, true, false
	}
	return le, true, true
}
