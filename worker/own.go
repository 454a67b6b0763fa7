package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/runs"
)

// own runs the claimed run while renewing its lease, and ends the run with
// its outcome. repo and dests are the request's own (build's), not the
// run's: a run taken over pushes to its claimer's repository, and when the
// record moves on the request follows it with its own inputs.
func (w *builder) own(ctx context.Context, req *v1.Request, claim *v1.BuildRecord, rev uint64, repo string, dests []string, seq uint64) (*v1.BuildRecord, v1.Origin, bool, error) {
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
				c, crev := runs.Renewed(claim, w.cfg.Now(), w.cfg.Lease), rev
				mu.Unlock()
				nrev, ok, err := w.runs.Renew(runCtx, c, crev)
				if !ok && err == nil {
					// Someone wrote the record — or our own earlier write
					// landed although its reply was lost. Only another run
					// or another owner means the claim is lost.
					cur, rrev, gerr := w.runs.Get(runCtx, c.Key)
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
		cur, _, err := w.runs.Get(ctx, claim.Key)
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
	out, err := w.backend.Run(runCtx, Build{Request: runRequest(req, claim), Key: claim.Key, Run: claim.Run, Destinations: claim.Destinations, Current: current}, func(job string, created bool, _ string) {
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
		if cur, _, err := w.runs.Get(runCtx, claim.Key); err == nil && cur != nil && (cur.Final() || cur.Run != claim.Run || cur.Owner != w.cfg.ID) {
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
			cur, _, gerr := w.runs.Get(ctx, held.Key)
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
	stored, err := w.runs.End(fctx, final, heldRev)
	if errors.Is(err, runs.ErrSuperseded) {
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
// takes it over at once (parked requests are requeued, and one of them
// takes it over).
func (w *builder) releaseClaim(ctx context.Context, claim *v1.BuildRecord, rev uint64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := w.runs.Release(ctx, claim, rev); err != nil {
		w.log.Warn("release claim failed; it lapses after the lease", zap.String("key", claim.Key), zap.Error(err))
	}
}
