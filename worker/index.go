package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// preflight runs before a request claims its key. It creates the
// tenant's Harbor project when needed, and asks the registry for the
// request's own first destination: an image already there answers this
// request alone (found), and is never recorded as the key's build — a
// tenant could have pushed anything under that tag. Registry trouble is
// transient: the request is retried, no Job is created meanwhile.
func (w *builder) preflight(ctx context.Context, req *v1.Request, key, repo string, dests []string) (*v1.BuildRecord, error) {
	if isPlatformPart(ctx) {
		return nil, nil // never an image buildq did not build (asPlatformPart)
	}
	reg, err := w.tenantRegistry(req.Tenant)
	if err != nil || reg == nil {
		return nil, err
	}
	// Harbor answers 401, not 404, for a repository of a missing project:
	// create the project before asking for the tag (with the worker's
	// credentials: a tenant's own cannot create projects).
	if project, ok := w.cfg.Naming.HarborProject(req.Tenant, repo); ok && w.registry != nil {
		if err := w.registry.EnsureHarborProject(ctx, w.cfg.Naming.Registry, project); err != nil {
			return nil, Transient(fmt.Errorf("harbor project %s: %w", project, err))
		}
	}
	digest, err := reg.Head(ctx, dests[0])
	switch {
	case err == nil && mutant.On("preflight-ignores-found-tag"):
		return nil, nil
	case err == nil:
		now := w.cfg.Now().UTC()
		return &v1.BuildRecord{Key: key, State: v1.StateSucceeded, Repository: repo, Image: dests[0], Pushed: []string{dests[0]},
			Digest: digest, Tenant: req.Tenant, Name: req.Name, StartedAt: now, FinishedAt: now}, nil
	case errors.Is(err, registry.ErrNotFound):
		return nil, nil
	default:
		return nil, Transient(fmt.Errorf("check %s in the registry: %w", dests[0], err))
	}
}

// orphanWatch remembers, per key, the revision of a claim whose run's Job
// has finished and when this worker first saw that revision: the
// reconciler ends the run only once the claim sat unchanged for its lease.
type orphanWatch struct {
	mu   sync.Mutex
	seen map[string]observed
}

type observed struct {
	rev uint64
	at  time.Time
}

// finishOrphan ends a run whose Job finished but whose owner is gone (it
// died before storing the outcome): joiners get their results now instead
// of after a take-over, and the owner's redelivered request finds the
// outcome. Only the record's current run is ended, only with its own
// Job's outcome, and only when the claim was released or sat unchanged
// for its lease on this worker's clock. It returns when to look again
// (0: done).
func (w *builder) finishOrphan(ctx context.Context, key string, out Outcome) time.Duration {
	cur, rev, err := w.runs.Get(ctx, key)
	if err != nil {
		return w.cfg.Lease
	}
	o := &w.orphans
	o.mu.Lock()
	now := w.cfg.Now()
	for k, v := range o.seen {
		if now.Sub(v.at) > 10*time.Minute {
			delete(o.seen, k)
		}
	}
	if cur == nil || cur.State != v1.StateBuilding || out.Run == "" || (cur.Run != out.Run && !mutant.On("reconcile-any-run")) {
		delete(o.seen, key)
		o.mu.Unlock()
		return 0
	}
	if cur.Owner != "" {
		seen, ok := o.seen[key]
		if !ok || seen.rev != rev {
			o.seen[key] = observed{rev: rev, at: now}
			o.mu.Unlock()
			return cur.LapseAfter()
		}
		if wait := cur.LapseAfter() - now.Sub(seen.at); wait > 0 {
			o.mu.Unlock()
			return wait
		}
	}
	delete(o.seen, key)
	o.mu.Unlock()
	if out.Succeeded && w.cfg.Attestor != nil && !mutant.On("orphan-ends-unattested") {
		// The image must be attested before the run ends, from the
		// request's inputs, which the record does not hold: the run is
		// left to a request that takes it over (the released claimer's
		// retry, or a requeued waiter), which adopts the Job's outcome.
		return 0
	}
	// One compare-and-swap: a claim that changed meanwhile has a live
	// owner again, and is left to it.
	final := finalRecord(cur, out, now)
	// The rest of the run's log, up to its Job's end, then its end.
	if lw := w.logs.open(ctx, cur, runRequest(&v1.Request{Tenant: cur.Tenant, Name: cur.Name, RequestID: cur.RequestID}, cur), false); lw != nil && !lw.Ended() {
		if c, ok := w.backend.(logCapturer); ok {
			cctx, cancel := context.WithTimeout(ctx, orphanLogDrain)
			c.CaptureLog(cctx, cur.Key, cur.Run, lw)
			cancel()
		}
		final.Logs = w.logs.finish(ctx, lw, final)
	}
	if ok, err := w.runs.EndAt(ctx, final, rev); err == nil && ok {
		w.log.Info("stored the outcome of a build whose owner is gone", zap.String("key", key), zap.String("run", cur.Run), zap.String("state", final.State))
		// Whoever stores a run's end deletes its Job: its requests may
		// all be answered already (an end written ahead of the decision
		// that failed, its claim let go), and then nobody else comes
		// back to it but the janitor, leases later. The delete, not the
		// wait for the Job to be gone: this is the reconciler's one
		// goroutine.
		if !w.cfg.KeepJobs && !mutant.On("orphan-end-leaves-job") {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			if err := w.backend.Cleanup(dctx, key, cur.Run); err != nil {
				w.log.Info("deleting the Job of a build whose owner is gone failed; the janitor deletes it", zap.String("key", key), zap.Error(err))
			}
			cancel()
		}
	}
	return 0
}

// indexCheckTimeout bounds one shared HEAD of checkIndexed; a HEAD that
// found the image answers the checks of the next indexCheckFresh too.
const (
	indexCheckTimeout = time.Minute
	indexCheckFresh   = time.Second
)

// checkIndexed asks the registry whether ref, an indexed image
// (repo@digest), is still there: nil, or an error matching
// registry.ErrNotFound, or another error. Concurrent checks of one image
// share a single HEAD: cache hits on a popular key arrive together, and
// each would otherwise wait for a round trip of its own. A HEAD that found
// the image answers the checks that start within indexCheckFresh of its
// own start: a registry's word is never older than that (an image deleted
// meanwhile is noticed a second later at most), and a popular image costs
// the registry one HEAD a second, not one per hit. A not-found or a failure
// is never remembered. The shared HEAD runs apart from any one caller's
// context (bounded by indexCheckTimeout), so a caller that gives up does
// not fail the others.
func (w *builder) checkIndexed(ctx context.Context, ref string) error {
	_, err := w.checkIndexedAt(ctx, ref)
	return err
}

// checkIndexedAt is checkIndexed, with when the registry last said the
// image is there (the start of the HEAD whose word it is) when it is.
func (w *builder) checkIndexedAt(ctx context.Context, ref string) (time.Time, error) {
	if at, ok := w.present.fresh(ref, time.Now()); ok {
		return at, nil
	}
	ch := w.heads.DoChan(ref, func() (_ any, err error) {
		// singleflight re-raises a panic of this function where nothing
		// can recover it: carry it to each caller instead, whose handler
		// turns it into one failed result (safeProcess), as before the
		// HEAD was shared.
		defer func() {
			if p := recover(); p != nil {
				err = headPanic{p}
			}
		}()
		hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), indexCheckTimeout)
		defer cancel()
		start := time.Now()
		if _, err = w.registry.Head(hctx, ref); err == nil {
			w.present.saw(ref, start)
		}
		return start, err
	})
	select {
	case r := <-ch:
		if p, ok := errors.AsType[headPanic](r.Err); ok {
			panic(p.v)
		}
		if r.Err != nil {
			return time.Time{}, r.Err
		}
		at, _ := r.Val.(time.Time)
		return at, nil
	case <-ctx.Done():
		return time.Time{}, context.Cause(ctx)
	}
}

// headPanic carries a panic of a shared HEAD to its callers.
type headPanic struct{ v any }

func (p headPanic) Error() string { return fmt.Sprintf("panic in a registry HEAD: %v", p.v) }

// presentImages remembers when each indexed image was last found in the
// registry (the start of the HEAD that found it), for indexCheckFresh.
type presentImages struct {
	mu sync.Mutex
	at map[string]time.Time
}

// fresh reports whether ref was found within indexCheckFresh of now, and
// when.
func (p *presentImages) fresh(ref string, now time.Time) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	at, ok := p.at[ref]
	return at, ok && (now.Sub(at) < indexCheckFresh || mutant.On("registry-check-remembered"))
}

// saw records that a HEAD started at found ref.
func (p *presentImages) saw(ref string, at time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.at == nil || len(p.at) >= 4096 {
		// Stale entries answer nothing: dropping them all loses at most
		// one HEAD per image.
		p.at = map[string]time.Time{}
	}
	if at.After(p.at[ref]) {
		p.at[ref] = at
	}
}
