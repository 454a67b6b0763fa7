package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
)

// errLostClaim cancels a build whose claim another worker took over.
var errLostClaim = errors.New("build claim taken over by another worker")

// build gets the final record for key: from the index (cache), by joining
// the build in flight, or by claiming the key and running the build.
// owned is true when this request ran (or adopted) the build and so cleans
// up after it.
//
// seq is the request message's stream sequence: with the request id it
// tells a redelivery of the request that made a record (its own build) from
// a new submission that reuses an id.
func (w *Worker) build(ctx context.Context, req *v1.Request, key, repo string, dests []string, seq uint64) (rec *Record, origin v1.Origin, owned bool, err error) {
	for {
		if err := ctx.Err(); err != nil {
			return nil, "", false, err
		}
		cur, rev, err := w.claims.get(ctx, key)
		if err != nil {
			return nil, "", false, Transient(err)
		}
		now := w.cfg.Now()
		switch {
		case cur == nil:
			claim := w.newClaim(req, key, repo, seq)
			rev, ok, err := w.claims.create(ctx, claim)
			if err != nil {
				return nil, "", false, Transient(err)
			}
			if !ok {
				continue // another worker claimed it first: look again
			}
			return w.own(ctx, req, claim, rev, dests, true)

		case cur.State == StateSucceeded:
			mine := cur.RequestID == req.RequestID && cur.Seq == seq
			origin := v1.OriginCache
			if mine {
				origin = v1.OriginBuild // our own build, finished before a crash
			}
			if w.registry != nil && !mine {
				// The index says built; only the registry knows whether
				// the image is still there. Not found means build again;
				// any other error means try later, never "exists".
				_, err := w.registry.Head(ctx, cur.Repository+"@"+cur.Digest)
				switch {
				case errors.Is(err, registry.ErrNotFound):
					w.log.Info("indexed image is gone from the registry; rebuilding", zap.String("key", key), zap.String("image", cur.Repository+"@"+cur.Digest))
					claim := w.newClaim(req, key, repo, seq)
					rev, ok, err := w.claims.update(ctx, claim, rev)
					if err != nil {
						return nil, "", false, Transient(err)
					}
					if !ok {
						continue
					}
					return w.own(ctx, req, claim, rev, dests, true)
				case err != nil:
					return nil, "", false, Transient(fmt.Errorf("check %s in the registry: %w", cur.Repository, err))
				}
			}
			return cur, origin, mine, nil

		case cur.State == StateFailed && cur.RequestID == req.RequestID && cur.Seq == seq:
			return cur, v1.OriginBuild, true, nil

		case cur.State == StateFailed, cur.LeaseUntil.Before(now):
			// A failed build is retried by the next request for its key; a
			// claim whose owner stopped renewing it is taken over.
			claim := w.newClaim(req, key, repo, seq)
			if cur.State == StateBuilding {
				claim.StartedAt = cur.StartedAt
			}
			rev, ok, err := w.claims.update(ctx, claim, rev)
			if err != nil {
				return nil, "", false, Transient(err)
			}
			if !ok {
				continue
			}
			if cur.State == StateBuilding {
				w.log.Info("took over a lapsed build claim", zap.String("key", key), zap.String("previousOwner", cur.Owner))
			}
			return w.own(ctx, req, claim, rev, dests, cur.State != StateBuilding)

		default:
			w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseWaiting, Job: cur.Job,
				Message: "joined the build of request " + cur.RequestID})
			final, err := w.join(ctx, key)
			if err != nil {
				return nil, "", false, err
			}
			if final != nil {
				return final, v1.OriginInflight, false, nil
			}
			// The claim lapsed or was released: try to take it over.
		}
	}
}

func (w *Worker) newClaim(req *v1.Request, key, repo string, seq uint64) *Record {
	now := w.cfg.Now().UTC()
	return &Record{
		Key: key, State: StateBuilding, Owner: w.cfg.ID, LeaseUntil: now.Add(w.cfg.Lease),
		RequestID: req.RequestID, Seq: seq, Tenant: req.Tenant, Name: req.Name, Repository: repo, StartedAt: now,
	}
}

// join waits for the build that holds key's claim. It returns the final
// record, or nil when the claim lapsed or was released (the caller then
// tries to take it over).
func (w *Worker) join(ctx context.Context, key string) (*Record, error) {
	watcher, err := w.claims.kv.Watch(ctx, key)
	if err != nil {
		return nil, Transient(fmt.Errorf("watch claim %s: %w", key, err))
	}
	defer func() { _ = watcher.Stop() }()
	timer := time.NewTimer(w.cfg.Lease)
	defer timer.Stop()
	for {
		select {
		case e, ok := <-watcher.Updates():
			if !ok {
				return nil, Transient(fmt.Errorf("watch claim %s: closed", key))
			}
			if e == nil {
				continue // end of the initial values
			}
			if e.Operation() != jetstream.KeyValuePut {
				return nil, nil
			}
			var r Record
			if err := json.Unmarshal(e.Value(), &r); err != nil {
				return nil, nil
			}
			if r.Final() {
				return &r, nil
			}
			left := r.LeaseUntil.Sub(w.cfg.Now())
			if left <= 0 {
				return nil, nil
			}
			if !timer.Stop() {
				select {
				case <-timer.C:
				default:
				}
			}
			// A little slack so a renewal in flight is not mistaken for a
			// lapse.
			timer.Reset(left + w.cfg.Lease/10)
		case <-timer.C:
			return nil, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// own runs the build while holding the claim, renewing its lease, and
// stores the final record.
func (w *Worker) own(ctx context.Context, req *v1.Request, claim *Record, rev uint64, dests []string, fresh bool) (*Record, v1.Origin, bool, error) {
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: claim.Key, Phase: v1.PhaseClaimed, Message: "claimed build by " + w.cfg.ID})
	if rec, done, err := w.preflight(ctx, req, claim, rev, dests); err != nil || done {
		return rec, v1.OriginCache, false, err
	}
	runCtx, cancelRun := context.WithCancelCause(ctx)
	defer cancelRun(nil)

	var (
		mu     sync.Mutex
		origin = v1.OriginBuild
	)
	renewDone := make(chan struct{})
	renewStopped := make(chan struct{})
	go func() {
		defer close(renewStopped)
		t := time.NewTicker(w.cfg.Lease / 3)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				if w.faults != nil && w.faults.beforeRenew != nil {
					w.faults.beforeRenew(claim.Key)
				}
				mu.Lock()
				c := *claim
				mu.Unlock()
				c.LeaseUntil = w.cfg.Now().UTC().Add(w.cfg.Lease)
				nrev, ok, err := w.claims.update(runCtx, &c, rev)
				switch {
				case err != nil:
					w.log.Warn("lease renewal failed", zap.String("key", c.Key), zap.Error(err))
				case !ok:
					cancelRun(errLostClaim)
					return
				default:
					mu.Lock()
					claim.LeaseUntil, rev = c.LeaseUntil, nrev
					mu.Unlock()
				}
			case <-renewDone:
				return
			}
		}
	}()
	stopRenew := func() { close(renewDone); <-renewStopped }

	out, err := w.backend.Run(runCtx, Build{Request: req, Key: claim.Key, Destinations: dests, Fresh: fresh}, func(job string, created bool, creator string) {
		mu.Lock()
		claim.Job = job
		if creator != req.RequestID {
			origin = v1.OriginInflight
		}
		mu.Unlock()
		msg := "created job " + job
		phase := v1.PhaseJobCreated
		if !created {
			msg = "adopted job " + job + " of request " + creator
			phase = v1.PhaseRunning
		}
		w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: claim.Key, Phase: phase, Job: job, Message: msg})
		// A cancel that came while the Job was being created found nothing
		// to delete: look at the claim once now rather than at the next
		// renewal, so the build stops before it can push.
		if cur, _, err := w.claims.get(runCtx, claim.Key); err == nil && cur != nil && (cur.Final() || cur.Owner != w.cfg.ID) {
			cancelRun(errLostClaim)
		}
	})
	stopRenew()

	if err != nil {
		if ctx.Err() == nil {
			// A cancel or a take-over ends a build from outside: the
			// record then says what happened.
			cur, _, gerr := w.claims.get(ctx, claim.Key)
			if errors.Is(context.Cause(runCtx), errLostClaim) || (gerr == nil && cur != nil && (cur.Final() || cur.Owner != w.cfg.ID)) {
				w.log.Info("the build claim changed hands; following the record", zap.String("key", claim.Key))
				return w.build(ctx, req, claim.Key, claim.Repository, dests, claim.Seq)
			}
		}
		// Shutdown or trouble: let the claim go so another worker takes
		// over now rather than after the lease.
		w.releaseClaim(ctx, claim, rev)
		if ctx.Err() != nil || IsTransient(err) {
			return nil, "", false, err
		}
		return nil, "", false, fmt.Errorf("run build: %w", err)
	}

	final := *claim
	final.Owner, final.LeaseUntil = "", time.Time{}
	final.Job, final.JobUID = out.Job, out.JobUID
	final.FinishedAt = w.cfg.Now().UTC()
	if !out.FinishedAt.IsZero() {
		final.FinishedAt = out.FinishedAt.UTC()
	}
	if !out.StartedAt.IsZero() && out.StartedAt.Before(final.StartedAt) {
		final.StartedAt = out.StartedAt.UTC()
	}
	if out.Succeeded {
		final.State, final.Digest, final.Image, final.Pushed = StateSucceeded, out.Digest, dests[0], dests
	} else {
		final.State, final.Reason, final.Message, final.LogTail = StateFailed, out.Reason, out.Message, out.LogTail
	}
	if w.faults != nil && w.faults.beforeFinalize != nil {
		w.faults.beforeFinalize(claim.Key)
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	stored, err := w.claims.finalize(fctx, &final)
	if err != nil {
		return nil, "", false, Transient(err)
	}
	mu.Lock()
	defer mu.Unlock()
	return stored, origin, true, nil
}

// releaseClaim zeroes the lease of a claim we hold, so the next worker
// takes it over at once.
func (w *Worker) releaseClaim(ctx context.Context, claim *Record, rev uint64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	c := *claim
	c.LeaseUntil = time.Time{}
	c.Owner = ""
	if _, _, err := w.claims.update(ctx, &c, rev); err != nil {
		w.log.Warn("release claim failed; it lapses after the lease", zap.String("key", c.Key), zap.Error(err))
	}
}

// preflight runs between claiming a key and building it. A tag that
// already exists in the registry is the build's answer (the index may have
// been lost); done reports that. Harbor projects are created on demand.
// On error the claim is released and the request retried.
func (w *Worker) preflight(ctx context.Context, req *v1.Request, claim *Record, rev uint64, dests []string) (*Record, bool, error) {
	if w.registry == nil {
		return nil, false, nil
	}
	fail := func(err error) (*Record, bool, error) {
		w.releaseClaim(ctx, claim, rev)
		return nil, false, Transient(err)
	}
	// Harbor answers 401, not 404, for a repository of a missing project:
	// create the project before asking for the tag.
	if project, ok := w.cfg.Naming.HarborProject(claim.Repository); ok {
		if err := w.registry.EnsureHarborProject(ctx, w.cfg.Naming.Registry, project); err != nil {
			return fail(fmt.Errorf("harbor project %s: %w", project, err))
		}
	}
	digest, err := w.registry.Head(ctx, dests[0])
	switch {
	case err == nil:
		final := *claim
		final.Owner, final.LeaseUntil = "", time.Time{}
		final.State, final.Digest, final.Image, final.Pushed = StateSucceeded, digest, dests[0], []string{dests[0]}
		final.FinishedAt = w.cfg.Now().UTC()
		stored, err := w.claims.finalize(ctx, &final)
		if err != nil {
			return fail(err)
		}
		return stored, true, nil
	case !errors.Is(err, registry.ErrNotFound):
		return fail(fmt.Errorf("check %s in the registry: %w", dests[0], err))
	}
	return nil, false, nil
}

// finishOrphan stores the outcome of a finished build whose claim lapsed:
// its owner died before it could. Joiners waiting on the key get their
// results now instead of after a take-over, and the owner's redelivered
// request finds its outcome. A live claim is left to its owner.
func (w *Worker) finishOrphan(ctx context.Context, key string, out Outcome) {
	cur, rev, err := w.claims.get(ctx, key)
	if err != nil || cur == nil || cur.State != StateBuilding || cur.LeaseUntil.After(w.cfg.Now()) {
		return
	}
	final := *cur
	final.Owner, final.LeaseUntil = "", time.Time{}
	final.Job, final.JobUID = out.Job, out.JobUID
	final.FinishedAt = w.cfg.Now().UTC()
	if !out.FinishedAt.IsZero() {
		final.FinishedAt = out.FinishedAt.UTC()
	}
	if out.Succeeded {
		final.State, final.Digest = StateSucceeded, out.Digest
		if final.Image == "" {
			final.Image = final.Repository + ":" + v1.DefaultTag(key)
		}
		final.Pushed = append(final.Pushed, final.Image)
	} else {
		final.State, final.Reason, final.Message, final.LogTail = StateFailed, out.Reason, out.Message, out.LogTail
	}
	if _, ok, err := w.claims.update(ctx, &final, rev); err == nil && ok {
		w.log.Info("stored the outcome of a build whose owner is gone", zap.String("key", key), zap.String("state", final.State))
	}
}
