package tenantapi

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// Stopping a build on a cancel: who waits on it, and which run may be
// ended (cancel, StopUnwaited).

// waiters are the undecided requests waiting on key: those the waiter
// index lists, and the one whose handler runs key's build (the run's
// holder), listed or not — a requeued request's old entry is dropped
// after its new message is out, and that drop can remove the entry its
// new handler registered on taking the run. A cancel must never take
// the holder for nobody.
//
// It returns the run it read too (nil: none): the waiters counted are
// that run's, and only that run may be stopped on their count (stopBuild).
func (w *Service) waiters(ctx context.Context, key string) ([]*ledger.Entry, *v1.BuildRecord, error) {
	ws, err := w.cfg.Ledger.Waiters(ctx, key)
	if err != nil {
		return nil, nil, err
	}
	cur, _, err := w.cfg.Runs.Get(ctx, key)
	if err != nil {
		return nil, nil, err
	}
	if mutant.On("cancel-ignores-holder") {
		return ws, cur, nil
	}
	if cur == nil || cur.Final() || cur.Holder == "" {
		return ws, cur, nil
	}
	for _, le := range ws {
		if le.Key() == cur.Holder {
			return ws, cur, nil
		}
	}
	h, err := w.cfg.Ledger.GetKey(ctx, cur.Holder)
	if err != nil {
		return nil, nil, err
	}
	// A holder decided "succeeded" whose run is not final yet is storing
	// the run's end beside its decision (worker/own.go, endAhead): the
	// build has ended well, and stopping it now would end the run
	// canceled under a published success.
	if h != nil && (h.E.Result == nil || (h.E.Result.Status == v1.StatusSucceeded && !mutant.On("cancel-stops-decided-holder"))) {
		ws = append(ws, h)
	}
	return ws, cur, nil
}

// StopUnwaited stops key's run, as a cancel does, when no request but
// tenant's request id (canceled) waits on it: a canceled image index's
// platform builds that nobody else wants. It reports whether it stopped
// the run.
func (w *Service) StopUnwaited(ctx context.Context, tenant, id, key string) (bool, error) {
	ok, judged, err := w.unwaited(ctx, tenant, id, key)
	if !ok || err != nil {
		return false, err
	}
	judged.reqs[ledger.Key(tenant, id)] = true
	stopped, _ := w.stopBuild(ctx, tenant, key, true, judged)
	return stopped, nil
}

// Unwaited reports whether no request but tenant's request id, and none
// not canceled, waits on key.
func (w *Service) Unwaited(ctx context.Context, tenant, id, key string) (bool, error) {
	ok, _, err := w.unwaited(ctx, tenant, id, key)
	return ok, err
}

// unwaited is Unwaited, with the run whose waiters it counted and them.
func (w *Service) unwaited(ctx context.Context, tenant, id, key string) (bool, counted, error) {
	ws, run, err := w.waiters(ctx, key)
	if err != nil {
		return false, counted{}, err
	}
	judged := countOf(run, ws)
	for _, le := range ws {
		if !le.E.Canceled && (le.E.Tenant != tenant || le.E.RequestID != id) && !mutant.On("index-cancel-stops-shared") {
			return false, judged, nil
		}
	}
	return true, judged, nil
}

// waitingSince reports whether a request the caller did not count, and
// not canceled, waits on key now.
func (w *Service) waitingSince(ctx context.Context, key string, judged counted) (bool, error) {
	ws, _, err := w.waiters(ctx, key)
	if err != nil {
		return false, err
	}
	for _, le := range ws {
		if !le.E.Canceled && !judged.reqs[le.Key()] {
			return true, nil
		}
	}
	return false, nil
}

// counted is what a stop's caller judged: the run whose waiters it
// counted, and the requests it counted (ledger keys), canceled or not.
type counted struct {
	run  *v1.BuildRecord
	reqs map[string]bool
}

// countOf is the judgement of run with the requests of lists.
func countOf(run *v1.BuildRecord, lists ...[]*ledger.Entry) counted {
	c := counted{run: run, reqs: map[string]bool{}}
	for _, l := range lists {
		for _, le := range l {
			c.reqs[le.Key()] = true
		}
	}
	return c
}

// stopBuild ends key's current run as Canceled and deletes its Job, when
// the run is still building, is the run judged (the one whose waiters the
// caller counted: a run begun since has waiters nobody counted — a request
// that looked again after the judged run ended, and claimed the key), held
// by its holder then or by a request the caller counted (a take-over keeps
// the run and names its taker the holder: a taker nobody counted may be a
// waiter that came since; a counted one was canceled, or there would be
// no stop), and tenant may stop it (it canceled requests waiting on it, or its own
// request claimed it).
func (w *Service) stopBuild(ctx context.Context, tenant, key string, hadRequests bool, judged counted) (bool, string) {
	for {
		cur, rev, err := w.cfg.Runs.Get(ctx, key)
		switch {
		case err != nil:
			return false, err.Error()
		case !hadRequests && (cur == nil || cur.Tenant != tenant):
			// One answer whether the key is unknown, built or building
			// for others: a cancel tells nothing of other tenants' builds.
			return false, fmt.Sprintf("no request of tenant %s waits on key %s", tenant, key)
		case cur == nil:
			return false, "no build is known for key " + key
		case cur.Final():
			return false, "the build already finished: " + cur.State
		case judged.run == nil || cur.Run != judged.run.Run:
			return false, "the build ended, and a new build of the key began meanwhile: it goes on"
		case cur.Holder != judged.run.Holder && !judged.reqs[cur.Holder]:
			// A take-over keeps the run and names its taker the holder:
			// a request that looked after the waiters were counted.
			return false, "another request took the build over meanwhile: it goes on"
		}
		// A request that began waiting since the count (its handler
		// parked or joined, or took the run over) is one nobody counted:
		// the build goes on for it. Read last, just before the end.
		if waiting, err := w.waitingSince(ctx, key, judged); err != nil {
			return false, err.Error()
		} else if waiting {
			return false, "another request began waiting on the build meanwhile: it goes on"
		}
		final := runs.Canceled(cur, w.cfg.Now())
		ok, err := w.cfg.Runs.EndAt(ctx, final, rev)
		if err != nil {
			return false, err.Error()
		}
		if !ok {
			continue
		}
		if w.cfg.EndLog != nil {
			// The owner's capture stops with its Job; the log ends here,
			// so its followers stop too. Apart from the reply: it reads
			// the log back to archive it.
			go func() {
				lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
				defer cancel()
				w.cfg.EndLog(lctx, final)
			}()
		}
		// An image index's platforms: each one nobody else waits on is
		// stopped too — its handler may be gone (a worker killed), and
		// the platforms' Jobs would run on for nobody.
		for _, pk := range cur.PlatformKeys {
			if alone, pjudged, err := w.unwaited(ctx, "", "", pk); err == nil && alone {
				if stopped, _ := w.stopBuild(ctx, tenant, pk, true, pjudged); stopped {
					w.cfg.Log.Info("build canceled with its image index", zap.String("key", pk), zap.String("index", key))
				}
			}
		}
		// The owner notices at its next renewal; stop the build now so
		// nothing is pushed after the cancel.
		if err := w.cfg.StopBuild(ctx, key, cur.Run); err != nil && !errors.Is(err, context.Canceled) {
			w.cfg.Log.Warn("cancel: stopping the build failed", zap.String("key", key), zap.Error(err))
		}
		w.cfg.Log.Info("build canceled", zap.String("key", key), zap.String("run", cur.Run))
		return true, "stopped"
	}
}
