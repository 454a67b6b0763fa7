package worker

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
)

// errAnswered: the request was answered by another handler of its message
// (a redelivery) while this one was still at work.
var errAnswered = errors.New("the request was answered by another handler")

// errLostClaim cancels a build whose claim another party changed.
var errLostClaim = errors.New("build claim taken over by another worker")

// build gets the final record for key, walking the state machine of
// claim.go: from the index (cache), by joining the run in flight, or by
// claiming the key (or taking a lapsed run over) and running the build.
// owned is true when this request ended the run and so cleans up its Job.
//
// seq is the request message's stream sequence: with the request id it
// tells a redelivery of the request that made a record (its own build)
// from another request that reuses the id.
func (w *Worker) build(ctx context.Context, req *v1.Request, key, repo string, dests []string, seq uint64, wr *waiterReg) (rec *v1.BuildRecord, origin v1.Origin, owned bool, err error) {
	mine := func(r *v1.BuildRecord) bool { return r.RequestID == req.RequestID && r.Seq == seq }
	// A request that is not answered from the index waits on a build:
	// index it, so a cancel of the key finds it.
	waits := func() { wr.add(ctx, w, key, req.Tenant, req.RequestID) }
	// Before claiming, taking over or joining — work that outlives a
	// handler — make sure the request is still unanswered: a handler that
	// stalled (a NATS outage, a pause) while its redelivered copy was
	// answered elsewhere must not start a build nobody waits for.
	answered := func() error {
		if mutant("answered-check-off") {
			return nil
		}
		le, err := w.ledgerGet(ctx, req.Tenant, req.RequestID)
		if err == nil && le != nil && le.e.Result != nil && le.e.Seq == seq {
			return errAnswered
		}
		return nil
	}
	if req.Source.S3 != nil && w.cfg.Contexts != nil {
		// Before anything else, whoever built the key or is building it:
		// a request is answered only for content its tenant holds, and
		// whether another tenant's build exists must not change what a
		// tenant without the content is told (possession.go).
		if err := w.checkPossession(ctx, req); err != nil {
			return nil, "", false, err
		}
	}
	for {
		if err := ctx.Err(); err != nil {
			return nil, "", false, err
		}
		if w.faults != nil && w.faults.beforeWalk != nil {
			w.faults.beforeWalk(key)
		}
		cur, rev, err := w.claims.get(ctx, key)
		if err != nil {
			return nil, "", false, Transient(err)
		}
		if foreignRun(cur, req) {
			// Answered from another tenant's build: only for content
			// this request's tenant holds (possession.go; remembered, so
			// shown above for an S3 context; a git source's key is its
			// tenant's own, so a foreign run of it is a record made
			// before keys were).
			if err := w.checkPossession(ctx, req); err != nil {
				return nil, "", false, err
			}
		}
		fresh := cur == nil || (cur.State == v1.StateFailed && !mine(cur))
		if fresh {
			// Before claiming: the requester's own first tag may already
			// hold an image (an index lost, a tag pushed by hand). It
			// answers this request only — it is not buildq's verified
			// build, so it never enters the shared index.
			if found, err := w.preflight(ctx, req, key, repo, dests); err != nil || found != nil {
				return found, v1.OriginCache, false, err
			}
		}
		if cur == nil || cur.State == v1.StateBuilding || (cur.State == v1.StateFailed && !mine(cur)) {
			if err := answered(); err != nil {
				return nil, "", false, err
			}
		}
		switch {
		case cur == nil:
			claim := w.newClaim(req, key, repo, dests, seq)
			rev, ok, err := w.claims.create(ctx, claim)
			if err != nil {
				return nil, "", false, Transient(err)
			}
			if !ok {
				continue // another worker claimed it first: look again
			}
			waits()
			return w.own(ctx, req, claim, rev, repo, dests, seq)

		case cur.State == v1.StateSucceeded:
			if mine(cur) {
				return cur, v1.OriginBuild, true, nil // our own build, finished before a crash
			}
			if w.registry != nil {
				// The index says built; only the registry knows whether
				// the image is still there. Not found means build again;
				// any other error means try later, never "exists".
				err := w.checkIndexed(ctx, cur.Repository+"@"+cur.Digest)
				switch {
				case errors.Is(err, registry.ErrNotFound):
					w.log.Info("indexed image is gone from the registry; rebuilding", zap.String("key", key), zap.String("image", cur.Repository+"@"+cur.Digest))
					if found, err := w.preflight(ctx, req, key, repo, dests); err != nil || found != nil {
						return found, v1.OriginCache, false, err
					}
					claim := w.newClaim(req, key, repo, dests, seq)
					rev, ok, err := w.claims.update(ctx, claim, rev)
					if err != nil {
						return nil, "", false, Transient(err)
					}
					if !ok {
						continue
					}
					waits()
					return w.own(ctx, req, claim, rev, repo, dests, seq)
				case err != nil:
					return nil, "", false, Transient(fmt.Errorf("check %s in the registry: %w", cur.Repository, err))
				}
			}
			return cur, v1.OriginCache, false, nil

		case cur.State == v1.StateFailed && mine(cur):
			return cur, v1.OriginBuild, true, nil

		case cur.State == v1.StateFailed:
			// A failed build is retried by the next request for its key,
			// as a new run: nothing of the failed run is adopted.
			claim := w.newClaim(req, key, repo, dests, seq)
			rev, ok, err := w.claims.update(ctx, claim, rev)
			if err != nil {
				return nil, "", false, Transient(err)
			}
			if !ok {
				continue
			}
			waits()
			return w.own(ctx, req, claim, rev, repo, dests, seq)

		case cur.Owner == "":
			// Released by an owner that stopped: take the run over now.
			waits()
			if out, origin, owned, ok, err := w.takeOver(ctx, req, cur, rev, repo, dests, seq); ok || err != nil {
				return out, origin, owned, err
			}

		default:
			if wr != nil && wr.park != nil && !holds(cur, RequestIndexKey(req.Tenant, req.RequestID), req, seq) {
				// Another request's handler runs the build: wait
				// without a slot, answered when the run ends.
				parked, err := w.park(ctx, wr, key, cur)
				if err != nil {
					return nil, "", false, err
				}
				if parked {
					w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseWaiting, Job: cur.Job,
						Message: "joined a build in progress; answered when it ends"})
					return cur, v1.OriginInflight, false, errParked
				}
				continue
			}
			waits()
			w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseWaiting, Job: cur.Job,
				Message: "joined a build in progress"})
			final, lapsed, lrev, err := w.join(ctx, key)
			if err != nil {
				return nil, "", false, err
			}
			if final != nil {
				if mine(final) {
					return final, v1.OriginBuild, true, nil
				}
				if !sharedFailure(final, req, repo) {
					// The run failed for a reason of its claimer's request —
					// its timeout, its context object, its destination —
					// not of the content. It does not answer this request:
					// build with this request's own inputs.
					continue
				}
				return final, v1.OriginInflight, false, nil
			}
			if lapsed != nil {
				if out, origin, owned, ok, err := w.takeOver(ctx, req, lapsed, lrev, repo, dests, seq); ok || err != nil {
					return out, origin, owned, err
				}
			}
			// Released, removed or changed under us: look again.
		}
	}
}

// takeOver claims the run of cur (at revision rev) for this worker and
// runs it on; ok is false when the record changed first, or when the run
// — built from its claimer's inputs — failed for a reason of those inputs
// that req does not share (the caller then looks again and builds with
// req's own, exactly as a joiner of that run would).
func (w *Worker) takeOver(ctx context.Context, req *v1.Request, cur *v1.BuildRecord, rev uint64, repo string, dests []string, seq uint64) (*v1.BuildRecord, v1.Origin, bool, bool, error) {
	claim := *cur
	now := w.cfg.Now().UTC()
	claim.Owner, claim.LeaseMs, claim.LeaseUntil = w.cfg.ID, w.cfg.Lease.Milliseconds(), now.Add(w.cfg.Lease)
	claim.Holder = RequestIndexKey(req.Tenant, req.RequestID)
	if len(claim.Destinations) == 0 {
		// A record written before runs kept their destinations.
		claim.Repository, claim.Destinations = cur.Repository, dests
		if claim.Repository == "" {
			claim.Repository = req.Image
		}
	}
	nrev, ok, err := w.claims.update(ctx, &claim, rev)
	if err != nil {
		return nil, "", false, false, Transient(err)
	}
	if !ok {
		return nil, "", false, false, nil
	}
	w.log.Info("took over a build run", zap.String("key", claim.Key), zap.String("run", claim.Run), zap.String("previousOwner", cur.Owner))
	out, origin, owned, err := w.own(ctx, req, &claim, nrev, repo, dests, seq)
	if err == nil && origin != v1.OriginBuild && out != nil && !sharedFailure(out, req, repo) {
		w.log.Info("the run taken over failed for its claimer's own inputs; building with this request's",
			zap.String("key", claim.Key), zap.String("reason", out.Reason))
		return nil, "", false, false, nil
	}
	return out, origin, owned, true, err
}

func (w *Worker) newClaim(req *v1.Request, key, repo string, dests []string, seq uint64) *v1.BuildRecord {
	now := w.cfg.Now().UTC()
	src := req.Source
	return &v1.BuildRecord{
		Key: key, State: v1.StateBuilding, Run: newRunID(), Owner: w.cfg.ID,
		LeaseMs: w.cfg.Lease.Milliseconds(), LeaseUntil: now.Add(w.cfg.Lease),
		RequestID: req.RequestID, Seq: seq, Tenant: req.Tenant, Name: req.Name,
		Holder:     RequestIndexKey(req.Tenant, req.RequestID),
		Repository: repo, Destinations: dests, StartedAt: now,
		Source: &src, Timeout: req.Timeout,
	}
}

// sharedFailure reports whether a failed run of another request answers
// req too: a failure of the content does, one of the claimer's own
// request-specific inputs does not unless req has the same.
func sharedFailure(final *v1.BuildRecord, req *v1.Request, repo string) bool {
	if final.State != v1.StateFailed {
		return true
	}
	if final.Tenant != req.Tenant && !mutant("share-foreign-failure") {
		// A run builds with its claimer's tenant's credentials (base
		// images, the push) and quota: its failure may be of those, not
		// of the content, and another tenant's request builds with its
		// own instead of taking it.
		return false
	}
	switch final.Reason {
	case v1.ReasonDeadlineExceeded:
		// Shared only with a request that allows no more time (zero is
		// the worker's default, the longest a request without one gets).
		eff := func(d time.Duration) time.Duration {
			if d <= 0 {
				return time.Duration(math.MaxInt64)
			}
			return d
		}
		return final.Source == nil || eff(req.Timeout.Duration) <= eff(final.Timeout.Duration)
	case v1.ReasonContextMissing, v1.ReasonContextMismatch:
		return final.Source == nil || reflect.DeepEqual(*final.Source, req.Source)
	case v1.ReasonPushFailed:
		// The claimer's repository refused it; another may take it.
		return repo == final.Repository
	case v1.ReasonCanceled:
		// A cancel answers the requests canceled (their own ledger
		// entries say so), never one that joined meanwhile.
		return false
	}
	return true
}

// runRequest is the request a run's build is made from: the taker's, but
// with the run's own source and timeout, so a take-over builds exactly
// what the run's claimer asked for, whoever takes it over.
func runRequest(req *v1.Request, claim *v1.BuildRecord) *v1.Request {
	r := *req
	if claim.Source != nil {
		r.Source, r.Timeout = *claim.Source, claim.Timeout
	}
	// The run pushes to the claimer's repository: its Job is the
	// claimer's tenant's (labels, and the registry Secret it mounts).
	if claim.Tenant != "" {
		r.Tenant, r.Name = claim.Tenant, claim.Name
	}
	return &r
}

// join waits for the run that holds key's claim to end. It returns the
// final record; or the record and revision it watched unchanged for the
// owner's lease (lapsed: the caller may take the run over); or neither
// when the claim was released, removed or is gone (the caller looks
// again). The lapse is measured on this worker's clock from when it saw
// the revision, so clocks that disagree between workers do not matter.
func (w *Worker) join(ctx context.Context, key string) (final, lapsed *v1.BuildRecord, rev uint64, err error) {
	watcher, err := w.claims.kv.Watch(ctx, key)
	if err != nil {
		return nil, nil, 0, Transient(fmt.Errorf("watch claim %s: %w", key, err))
	}
	defer func() { _ = watcher.Stop() }()
	var (
		last    *v1.BuildRecord
		lastRev uint64
		timer   *time.Timer
		expired <-chan time.Time
	)
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		select {
		case e, ok := <-watcher.Updates():
			if !ok {
				return nil, nil, 0, Transient(fmt.Errorf("watch claim %s: closed", key))
			}
			if e == nil {
				if last == nil {
					return nil, nil, 0, nil // gone between the read and the watch
				}
				continue // end of the initial value
			}
			if e.Operation() != jetstream.KeyValuePut {
				return nil, nil, 0, nil
			}
			r := decodeRecord(key, e.Value())
			if r.Final() {
				return r, nil, 0, nil
			}
			if r.Owner == "" {
				return nil, nil, 0, nil
			}
			last, lastRev = r, e.Revision()
			if timer != nil {
				timer.Stop()
			}
			timer = time.NewTimer(r.LapseAfter())
			expired = timer.C
		case <-expired:
			return nil, last, lastRev, nil
		case <-ctx.Done():
			return nil, nil, 0, ctx.Err()
		}
	}
}

// own runs the claimed run while renewing its lease, and ends the run with
// its outcome. repo and dests are the request's own (build's), not the
// run's: a run taken over pushes to its claimer's repository, and when the
// record moves on the request follows it with its own inputs.
func (w *Worker) own(ctx context.Context, req *v1.Request, claim *v1.BuildRecord, rev uint64, repo string, dests []string, seq uint64) (*v1.BuildRecord, v1.Origin, bool, error) {
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: claim.Key, Phase: v1.PhaseClaimed, Message: "claimed build by " + w.cfg.ID})
	origin := v1.OriginInflight
	if claim.RequestID == req.RequestID && claim.Seq == seq {
		origin = v1.OriginBuild
	}
	runCtx, cancelRun := context.WithCancelCause(ctx)
	defer cancelRun(nil)

	var mu sync.Mutex // guards claim and rev against the renewer
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
				c, crev := *claim, rev
				mu.Unlock()
				c.LeaseUntil = w.cfg.Now().UTC().Add(w.cfg.Lease)
				nrev, ok, err := w.claims.update(runCtx, &c, crev)
				if !ok && err == nil {
					// Someone wrote the record — or our own earlier write
					// landed although its reply was lost. Only another run
					// or another owner means the claim is lost.
					cur, rrev, gerr := w.claims.get(runCtx, c.Key)
					if gerr == nil && cur != nil && cur.Run == c.Run && cur.Owner == w.cfg.ID && !cur.Final() {
						nrev, ok = rrev, true
					}
				}
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
			case <-runCtx.Done():
				return
			}
		}
	}()
	var stopOnce sync.Once
	stopRenew := func() { stopOnce.Do(func() { close(renewDone); <-renewStopped }) }
	defer stopRenew() // also when the backend panics

	current := func(ctx context.Context) bool {
		cur, _, err := w.claims.get(ctx, claim.Key)
		return err == nil && cur != nil && cur.Run == claim.Run && !cur.Final()
	}
	defer func() {
		// A backend that panics leaves the run to the next worker at once
		// instead of after a lapse; the panic goes on to the handler.
		if p := recover(); p != nil {
			mu.Lock()
			held, heldRev := *claim, rev
			mu.Unlock()
			w.releaseClaim(ctx, &held, heldRev)
			panic(p)
		}
	}()
	w.cfg.Metrics.buildStarted(claim.Tenant)
	defer w.cfg.Metrics.buildEnded(claim.Tenant)
	out, err := w.backend.Run(runCtx, Build{Request: runRequest(req, claim), Key: claim.Key, Run: claim.Run, Destinations: claim.Destinations, Current: current}, func(job string, created bool, creator string) {
		mu.Lock()
		claim.Job = job
		mu.Unlock()
		msg := "created job " + job
		phase := v1.PhaseJobCreated
		if !created {
			msg = "adopted job " + job + " of a build in progress"
			phase = v1.PhaseRunning
		}
		w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: claim.Key, Phase: phase, Job: job, Message: msg})
		// A cancel that came while the Job was being created found nothing
		// to delete: look at the claim once now rather than at the next
		// renewal, so the build stops before it can push.
		if cur, _, err := w.claims.get(runCtx, claim.Key); err == nil && cur != nil && (cur.Final() || cur.Run != claim.Run || cur.Owner != w.cfg.ID) {
			cancelRun(errLostClaim)
		}
	})
	stopRenew()
	mu.Lock()
	held, heldRev := *claim, rev
	mu.Unlock()

	if err != nil {
		if ctx.Err() == nil {
			// A cancel or a take-over ends a build from outside: the
			// record then says what happened.
			cur, _, gerr := w.claims.get(ctx, held.Key)
			if gerr == nil && cur != nil && cur.Run == held.Run && cur.Final() {
				// The run this request held was ended from outside (a
				// cancel, the reconciler): that end is its answer — never
				// a retry that would undo a cancel.
				return cur, origin, true, nil
			}
			if errors.Is(err, errNotCurrent) || errors.Is(context.Cause(runCtx), errLostClaim) || (gerr == nil && cur != nil && (cur.Final() || cur.Run != held.Run || cur.Owner != w.cfg.ID)) {
				w.log.Info("the build claim changed hands; following the record", zap.String("key", held.Key), zap.String("run", held.Run))
				// With the request's own repository, not the run's: a run
				// taken over is its claimer's, and a new run claimed from
				// here pushes to dests — its record must name their
				// repository, or the index points where the image is not.
				return w.build(ctx, req, held.Key, repo, dests, seq, nil)
			}
		}
		// Shutdown or trouble: let the claim go so another worker takes
		// the run over now rather than after the lease; parked requests
		// are requeued, and one of them takes it over.
		w.releaseClaim(ctx, &held, heldRev)
		w.answerWaiters(ctx, held.Key)
		if ctx.Err() != nil || IsTransient(err) {
			return nil, "", false, err
		}
		return nil, "", false, fmt.Errorf("run build: %w", err)
	}

	final := finalRecord(&held, out, w.cfg.Now())
	if w.faults != nil && w.faults.beforeFinalize != nil {
		w.faults.beforeFinalize(held.Key)
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	stored, err := w.claims.finish(fctx, final, heldRev)
	if errors.Is(err, errSuperseded) {
		// The run ended (a cancel) and a newer run holds the key: this
		// outcome answers nobody. Follow the record.
		w.log.Info("the build run was superseded; following the record", zap.String("key", held.Key), zap.String("run", held.Run))
		if !w.cfg.KeepJobs {
			_ = w.backend.Cleanup(fctx, held.Key, held.Run)
		}
		return w.build(ctx, req, held.Key, repo, dests, seq, nil)
	}
	if err != nil {
		return nil, "", false, Transient(err)
	}
	w.answerWaiters(ctx, held.Key)
	return stored, origin, true, nil
}

// finalRecord is the end of run claim with the backend's outcome.
func finalRecord(claim *v1.BuildRecord, out Outcome, now time.Time) *v1.BuildRecord {
	final := *claim
	final.Owner, final.LeaseUntil = "", time.Time{}
	final.Job, final.JobUID = out.Job, out.JobUID
	final.FinishedAt = now.UTC()
	if !out.FinishedAt.IsZero() {
		final.FinishedAt = out.FinishedAt.UTC()
	}
	if !out.StartedAt.IsZero() && (final.StartedAt.IsZero() || out.StartedAt.Before(final.StartedAt)) {
		final.StartedAt = out.StartedAt.UTC()
	}
	if out.Succeeded {
		final.State, final.Digest = v1.StateSucceeded, out.Digest
		if len(final.Destinations) > 0 {
			final.Image = final.Destinations[0]
		}
		final.Pushed = append([]string(nil), final.Destinations...)
	} else {
		final.State, final.Reason, final.Message, final.LogTail = v1.StateFailed, out.Reason, out.Message, out.LogTail
	}
	return &final
}

// releaseClaim lets go of a run this worker holds, so the next worker
// takes it over at once.
func (w *Worker) releaseClaim(ctx context.Context, claim *v1.BuildRecord, rev uint64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	c := *claim
	c.LeaseUntil = time.Time{}
	c.Owner = ""
	if _, _, err := w.claims.update(ctx, &c, rev); err != nil {
		w.log.Warn("release claim failed; it lapses after the lease", zap.String("key", c.Key), zap.Error(err))
	}
}

// preflight runs before a request claims its key. It creates the
// tenant's Harbor project when needed, and asks the registry for the
// request's own first destination: an image already there answers this
// request alone (found), and is never recorded as the key's build — a
// tenant could have pushed anything under that tag. Registry trouble is
// transient: the request is retried, no Job is created meanwhile.
func (w *Worker) preflight(ctx context.Context, req *v1.Request, key, repo string, dests []string) (*v1.BuildRecord, error) {
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
func (w *Worker) finishOrphan(ctx context.Context, key string, out Outcome) time.Duration {
	cur, rev, err := w.claims.get(ctx, key)
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
	if cur == nil || cur.State != v1.StateBuilding || out.Run == "" || (cur.Run != out.Run && !mutant("reconcile-any-run")) {
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
	// One compare-and-swap: a claim that changed meanwhile has a live
	// owner again, and is left to it.
	final := finalRecord(cur, out, now)
	if _, ok, err := w.claims.update(ctx, final, rev); err == nil && ok {
		w.log.Info("stored the outcome of a build whose owner is gone", zap.String("key", key), zap.String("run", cur.Run), zap.String("state", final.State))
		w.answerWaiters(ctx, key)
	}
	return 0
}

// indexCheckTimeout bounds one shared HEAD of checkIndexed.
const indexCheckTimeout = time.Minute

// checkIndexed asks the registry whether ref, an indexed image
// (repo@digest), is still there: nil, or an error matching
// registry.ErrNotFound, or another error. Concurrent checks of one image
// share a single HEAD: cache hits on a popular key arrive together, and
// each would otherwise wait for a round trip of its own. A check joins
// only a HEAD still in flight, so its answer is never older than the
// start of that HEAD; nothing is remembered after it returns. The shared
// HEAD runs apart from any one caller's context (bounded by
// indexCheckTimeout), so a caller that gives up does not fail the others.
func (w *Worker) checkIndexed(ctx context.Context, ref string) error {
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
		_, err = w.registry.Head(hctx, ref)
		return nil, err
	})
	select {
	case r := <-ch:
		if p, ok := r.Err.(headPanic); ok {
			panic(p.v)
		}
		return r.Err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// headPanic carries a panic of a shared HEAD to its callers.
type headPanic struct{ v any }

func (p headPanic) Error() string { return fmt.Sprintf("panic in a registry HEAD: %v", p.v) }
