package tenantapi

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// cancel cancels tenant's requests: the one named, or all of the tenant's
// requests waiting on a build key. Each gets the result "canceled". The
// build itself is stopped — its run ended as Canceled and its Job deleted
// — only when no other request, of any tenant, still waits on it;
// otherwise it goes on for them (a canceled owner hands its run over).
func (w *Service) cancel(ctx context.Context, tenant, target string) v1.CancelReply {
	if target == "" || len(target) > v1.MaxRequestIDLen {
		return v1.CancelReply{Message: "send a build key (64 hex digits) or a request id"}
	}
	var (
		key  string
		mine []*ledger.Entry
		// before: the key's waiters read before anything is canceled. A
		// canceled owner lets its run go, and a waiter requeued to take
		// it over is, for a moment, no waiter at all: read only after the
		// cancel, it would not be counted, and its build would be
		// stopped under it.
		before []*ledger.Entry
	)
	// A request id first: an id may look like a build key.
	byID, err := w.cfg.Ledger.Get(ctx, tenant, target)
	if err != nil {
		return v1.CancelReply{Message: err.Error()}
	}
	if byID == nil && v1.IsBuildKey(target) {
		key = target
		ws, err := w.cfg.Ledger.Waiters(ctx, key)
		if err != nil {
			return v1.CancelReply{Key: key, Message: err.Error()}
		}
		for _, le := range ws {
			// The tenant's requests of this key: an image index that
			// waits on one of its platforms' keys is a request of its
			// own key, canceled by that key or its id.
			if (le.E.Tenant == tenant || mutant.On("cancel-other-tenants")) && le.E.Key == key {
				mine = append(mine, le)
			}
		}
		before = ws
	} else {
		le := byID
		switch {
		case le == nil:
			return v1.CancelReply{Message: fmt.Sprintf("no request %q of tenant %s is known", target, tenant)}
		case le.E.Result != nil:
			return v1.CancelReply{Key: le.E.Key, Message: "the request already has its result: " + w.finalState(ctx, le)}
		}
		if le.E.Key == "" {
			// Not keyed yet (its git source is being packed): no build to
			// stop or share; its handler ends the fetch. Keyed meanwhile,
			// it is canceled as a keyed request, below.
			rep, keyed := w.cancelUnkeyed(ctx, le)
			if !keyed {
				return rep
			}
			var err error
			if le, err = w.cfg.Ledger.Get(ctx, tenant, target); err != nil || le == nil {
				return v1.CancelReply{Message: fmt.Sprint("the request changed while it was canceled; try again: ", err)}
			}
			if le.E.Result != nil {
				return v1.CancelReply{Key: le.E.Key, Message: "the request already has its result: " + w.finalState(ctx, le)}
			}
		}
		key, mine = le.E.Key, []*ledger.Entry{le}
		if before, err = w.cfg.Ledger.Waiters(ctx, key); err != nil {
			return v1.CancelReply{Key: key, Message: err.Error()}
		}
	}
	n, finished := 0, 0
	var (
		unconfirmed []string
		finishedAs  string
	)
	for _, le := range mine {
		ok, err := w.cfg.Ledger.MarkCanceled(ctx, le)
		if err != nil {
			return v1.CancelReply{Key: key, Requests: n, Canceled: n > 0, Message: err.Error() + notes(finished, unconfirmed)}
		}
		if !ok {
			if le.E.Result != nil && !le.E.Canceled {
				// Decided between the cancel's read and its mark (the
				// mark's compare-and-swap read it again): its result
				// stands, and this cancel canceled nothing of it.
				finished, finishedAs = finished+1, w.finalState(ctx, le)
			}
			continue
		}
		switch stored, err := w.deliverCanceled(ctx, le); {
		case err != nil:
			unconfirmed = append(unconfirmed, fmt.Sprintf("%s (%v)", le.E.RequestID, err))
		case stored != v1.StatusCanceled:
			// Its build's result was stored before the cancel's.
			finished, finishedAs = finished+1, string(stored)
			continue
		}
		n++
		_ = w.cfg.NC.Publish(internalCancelSubject, []byte(ledger.Key(le.E.Tenant, le.E.RequestID)))
	}
	if n == 0 && finished == 1 {
		return v1.CancelReply{Key: key, Message: "the request already has its result: " + finishedAs}
	}
	if n == 0 && finished > 0 {
		return v1.CancelReply{Key: key, Message: fmt.Sprintf("the %d request(s) of tenant %s on key %s had finished before the cancel", finished, tenant, key)}
	}
	if n > 0 {
		// Parked requests have no handler to tell: answer them here.
		w.cfg.AnswerParked(ctx, key)
	}
	// Does anyone else still wait on the build?
	ws, run, err := w.waiters(ctx, key)
	if err != nil {
		return v1.CancelReply{Key: key, Requests: n, Canceled: n > 0, Message: err.Error() + notes(finished, unconfirmed)}
	}
	canceled := map[string]bool{}
	for _, le := range mine {
		canceled[ledger.Key(le.E.Tenant, le.E.RequestID)] = true
	}
	waiting := map[string]bool{}
	for _, le := range append(before, ws...) {
		if k := ledger.Key(le.E.Tenant, le.E.RequestID); !le.E.Canceled && !canceled[k] {
			waiting[k] = true
		}
	}
	others := len(waiting)
	if others > 0 {
		if n == 0 {
			return v1.CancelReply{Key: key, Message: fmt.Sprintf("no request of tenant %s waits on key %s", tenant, key)}
		}
		return v1.CancelReply{Key: key, Canceled: true, Requests: n,
			Message: fmt.Sprintf("canceled %d request(s); the build goes on for %d other request(s)", n, others) + notes(finished, unconfirmed)}
	}
	stopped, msg := w.stopBuild(ctx, tenant, key, n > 0, countOf(run, mine, before, ws))
	if n == 0 && !stopped {
		return v1.CancelReply{Key: key, Message: msg}
	}
	if stopped {
		msg = fmt.Sprintf("canceled %d request(s) and stopped the build", n)
	} else {
		msg = fmt.Sprintf("canceled %d request(s)", n)
	}
	return v1.CancelReply{Key: key, Canceled: true, Requests: n, Stopped: stopped, Message: msg + notes(finished, unconfirmed)}
}

// finalState names le's result for a cancel's reply: the entry's own when
// it is marked stored (published or final), else the one the stream
// stored for the request. One the stream has not stored (yet), or could
// not be read, is not named as the request's: a result published first
// may be stored ahead of the entry's.
func (w *Service) finalState(ctx context.Context, le *ledger.Entry) string {
	if le.E.Published || le.E.Final {
		return le.E.State
	}
	found, err := w.storedResult(ctx, &le.E, &keyRecord{})
	switch {
	case err != nil:
		return le.E.State + " as recorded; the stored result could not be read (" + err.Error() + "): " + notConfirmed
	case found == nil:
		return le.E.State + " as recorded, not yet confirmed stored: " + notConfirmed
	}
	return string(found.Status)
}

// notes tells what a cancel's reply leaves out: requests whose build's
// result was stored before the cancel's, and canceled requests whose
// "canceled" could not be confirmed stored.
func notes(finished int, unconfirmed []string) string {
	var s string
	if finished > 0 {
		s += fmt.Sprintf("; %d other request(s) had finished before the cancel", finished)
	}
	if len(unconfirmed) > 0 {
		s += "; the canceled result of " + strings.Join(unconfirmed, ", ") + " is recorded but not confirmed stored: " + notConfirmed
	}
	return s
}

// notConfirmed ends a cancel reply's note on a result not confirmed stored.
const notConfirmed = "its result event says how it ended"

// deliverBusyWait bounds how long a cancel waits for another goroutine
// of this worker that is delivering the same request.
const deliverBusyWait = 2 * time.Second

// deliverCanceled delivers the "canceled" of le's request, whose cancel
// mark was just written, and returns the status of the result the stream
// stored: "canceled" (this one, or a copy of it), or another result's — a
// finished build's, published before its record — which is the
// request's. The entry then holds that result.
func (w *Service) deliverCanceled(ctx context.Context, le *ledger.Entry) (v1.Status, error) {
	if w.cfg.Publish == nil || mutant.On("cancel-trusts-its-mark") {
		return v1.StatusCanceled, nil
	}
	e := le.E
	d := ledger.Decision{Tenant: e.Tenant, Name: e.Name, Data: v1.ResultData{RequestID: e.RequestID, Tenant: e.Tenant, Name: e.Name,
		Key: e.Key, Timings: v1.Timings{QueuedAt: e.MsgTime}}}.Canceled()
	if e.Source != nil {
		d.Data.Source = &e.Source.SourceInfo
	}
	deadline := time.Now().Add(deliverBusyWait)
	for {
		res, err := w.cfg.Ledger.Deliver(ctx, le, d, ledger.Delivery{Publish: w.cfg.Publish, Now: true})
		var re *ledger.RecordError
		switch {
		case errors.As(err, &re) && res.Status == ledger.WasPublished:
			// Another result was stored first: known, though the entry
			// could not be written to match (its handler writes it).
			return res.Decision.Data.Status, nil
		case err != nil:
			return "", err
		case res.Status == ledger.Published || res.Status == ledger.WasPublished:
			return res.Decision.Data.Status, nil
		case time.Now().After(deadline):
			return "", errors.New("another handler of this worker is publishing its result")
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}

// cancelUnkeyed cancels a request that has no build key yet, unless it
// has one by now (keyed: to be canceled as a keyed request).
func (w *Service) cancelUnkeyed(ctx context.Context, le *ledger.Entry) (rep v1.CancelReply, keyed bool) {
	ok, keyed, err := w.cfg.Ledger.MarkCanceledUnkeyed(ctx, le)
	switch {
	case err != nil:
		return v1.CancelReply{Message: err.Error()}, false
	case keyed:
		return v1.CancelReply{}, true
	case !ok && le.E.Result == nil:
		return v1.CancelReply{Message: "the request is canceled already"}, false
	case !ok:
		return v1.CancelReply{Message: "the request already has its result: " + le.E.State}, false
	}
	_ = w.cfg.NC.Publish(internalCancelSubject, []byte(ledger.Key(le.E.Tenant, le.E.RequestID)))
	return v1.CancelReply{Canceled: true, Requests: 1, Message: "canceled 1 request(s) before its build started"}, false
}
