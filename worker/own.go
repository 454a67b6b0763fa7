package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
	"github.com/buildq/buildq/worker/internal/tenantapi"
)

// own runs the claimed run while renewing its lease, and ends the run with
// its outcome. repo and dests are the request's own (build's), not the
// run's: a run taken over pushes to its claimer's repository, and when the
// record moves on the request follows it with its own inputs.
//
// fresh: claim is a new run this handler has just claimed (newClaim), not
// one taken over, so nothing is stored under its log yet and it is not
// read before the build starts.
//
// note, when not empty, says why the build runs again (a new run after a
// failed one, a run taken over or retried); the "claimed" progress event
// carries it.
//
// tagCheck, when not nil, is the request's preflight HEAD of its first
// tag (build.go, checksTagBeside), sent by calling it: the build starts
// without waiting for it, and it is sent once the build's Job is created
// (or adopted), not before — the Pod's own check guards the tag, and a
// HEAD sent beside the create would take its share of a small machine's
// cores (the registry's check of the tenant's credentials among it) from
// the create itself, on the way to the Job every request waits for. It is
// not sent at all once its answer could no longer stop the build (past
// TagCheckBeside from the build's start, or once it has ended). If it
// finds an image there before the build has ended, the build is stopped,
// the run ends refused (v1.ReasonTagTaken, as its Pod's own check would
// have ended it), its Job goes, and the image found answers the request.
// An error is not waited out: the Pod's check guards the tag.
func (w *builder) own(ctx context.Context, req *v1.Request, claim *v1.BuildRecord, rev uint64, repo string, dests []string, seq uint64, fresh bool, note string, tagCheck func() preflightRead) (*v1.BuildRecord, v1.Origin, bool, error) {
	claimed := "claimed build by " + w.cfg.ID
	if note != "" {
		claimed += ": " + note
	}
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Platform: platformOf(req), Key: claim.Key, Phase: v1.PhaseClaimed, Message: claimed})
	origin := v1.OriginInflight
	if claim.RequestID == req.RequestID && claim.Seq == seq {
		origin = v1.OriginBuild
	}
	beforeRenew := func(key string) {
		if w.faults != nil && w.faults.beforeRenew != nil {
			w.faults.beforeRenew(key)
		}
	}
	// The renewer, the re-check once the Job is started and Current are
	// the run's looks at its record (runs.Hold).
	hold, runCtx := w.runs.Hold(ctx, claim, rev, runs.HoldOptions{Owner: w.cfg.ID, Lease: w.cfg.Lease, Now: w.cfg.Now, Log: w.log, BeforeRenew: beforeRenew})
	defer hold.Close() // also when the backend panics
	defer func() {
		// A backend that panics leaves the run to the next worker at once
		// instead of after a lapse; the panic goes on to the handler.
		if p := recover(); p != nil {
			held, heldRev := hold.Held()
			w.releaseClaim(ctx, &held, heldRev, fmt.Sprintf("%s: the build panicked: %v", v1.ReasonInfrastructureError, p))
			panic(p)
		}
	}()
	w.cfg.Metrics.buildStarted(claim.Tenant)
	defer w.cfg.Metrics.buildEnded(claim.Tenant)
	rreq := runRequest(req, claim)
	// The run's log: its own lines say who runs it, the backend writes
	// the build's output (logs.go).
	lw := w.logs.open(ctx, claim, rreq, fresh)
	secrets := secretValues(rreq, claim)
	// live is the log the backend writes into: none once the log has
	// ended (a take-over of a run whose end was stored; it is archived
	// again below, which changes nothing).
	live := lw
	if lw != nil && lw.Ended() {
		live = nil
	}
	if live != nil {
		// The flusher first: the first line is stored beside the Job's
		// create, not before it.
		flushCtx, stopFlush := context.WithCancel(runCtx)
		defer stopFlush()
		lw.Start(flushCtx)
		if lw.Lines() == 0 {
			// No tenant or request id: a build's log is read by every
			// tenant it answers, and who asked first is not theirs to know.
			_ = lw.Own(ctx, fmt.Sprintf("build %s claimed by worker %s", claim.Key, w.cfg.ID))
		} else {
			_ = lw.Own(ctx, fmt.Sprintf("worker %s runs the build from here", w.cfg.ID))
		}
	}
	// A new attempt inside the build (the Job runs its Pod again): the
	// progress events and the run's log say so, and why.
	progress := func(msg string) {
		if live != nil {
			_ = live.Own(runCtx, msg)
		}
		w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Platform: platformOf(req), Key: claim.Key, Phase: v1.PhaseRunning, Message: msg})
	}
	b := Build{Request: rreq, Key: claim.Key, Run: claim.Run, Repository: claim.Repository, Destinations: claim.Destinations, Current: hold.Current, Log: live, Progress: progress,
		KeepFirstTag: !isPlatformPart(ctx)}
	// buildCtx is the build's: stopped as well when the tag check finds
	// an image at the tag (foundAhead).
	buildCtx := runCtx
	var foundAhead atomic.Pointer[v1.BuildRecord]
	sendTagCheck := func() {}
	// starting is when the backend was asked to start the build: before
	// its Job's create was sent, so before any Pod of it could push.
	var starting time.Time
	if tagCheck != nil {
		var stopBuild context.CancelCauseFunc
		buildCtx, stopBuild = context.WithCancelCause(runCtx)
		defer stopBuild(nil)
		var once sync.Once
		sendTagCheck = func() {
			once.Do(func() {
				if (time.Since(starting) >= w.cfg.TagCheckBeside || buildCtx.Err() != nil) && !mutant.On("tag-check-past-window") {
					// Its answer could no longer stop the build (a slow
					// create, a stale Job waited out, a build already
					// ended): the Pod's own check guards the tag.
					return
				}
				go func() {
					// Only an answer within TagCheckBeside of the build's
					// start, before its Job's create: a later one may
					// have found the build's own push.
					if r := tagCheck(); r.err == nil && r.found != nil && (time.Since(starting) < w.cfg.TagCheckBeside || mutant.On("tag-check-beside-any-age")) {
						foundAhead.Store(r.found)
						stopBuild(errTagFoundBeside)
					}
				}()
			})
		}
	}
	run := w.backend.Run
	if multiPlatform(rreq) {
		// An image index: each platform is a build of its own
		// (platforms.go); no Job of this key.
		run = func(ctx context.Context, b Build, _ Started) (Outcome, error) {
			return w.buildIndex(ctx, req, repo, seq, b)
		}
	}
	starting = time.Now()
	if mutant.On("tag-check-before-create") {
		sendTagCheck()
	}
	out, err := run(buildCtx, b, func(job string, created bool, _ string) {
		sendTagCheck()
		msg := "created job " + job
		phase := v1.PhaseJobCreated
		if !created {
			msg = "adopted job " + job + " of a build in progress"
			phase = v1.PhaseRunning
		}
		if d, ok := w.backend.(StartDescriber); ok {
			msg = d.DescribeStart(job, created)
		}
		if live != nil {
			_ = live.Own(runCtx, msg)
		}
		w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Platform: platformOf(req), Key: claim.Key, Phase: phase, Job: job, Message: msg})
		hold.Started(runCtx, job)
	})
	// Every image built is attested before its run ends, while the
	// lease is still renewed: the record's end is what answers, with the
	// attestation's digest.
	var (
		att      string
		facts    *v1.BuildProvenance
		attErr   error
		attested bool
	)
	if err == nil && out.Succeeded {
		h, _ := hold.Held()
		att, facts, attErr = w.attestRun(runCtx, rreq, finalRecord(&h, out, w.cfg.Now()), out, live)
		attested = true
	}
	held, heldRev := hold.Stop()

	if found := foundAhead.Load(); err != nil && found != nil && errors.Is(context.Cause(buildCtx), errTagFoundBeside) && ctx.Err() == nil && runCtx.Err() == nil {
		return w.endFoundBeside(ctx, req, &held, heldRev, found, lw, origin, repo, dests, seq)
	}
	if err != nil {
		if ctx.Err() == nil {
			// A cancel or a take-over ends a build from outside: the
			// record then says what happened.
			cur, _, gerr := w.runs.Get(ctx, held.Key)
			if gerr == nil && cur != nil && cur.Run == held.Run && cur.Final() {
				if refusedRun(cur) {
					// Ended from outside (the reconciler, a take-over)
					// as refused by its Pod: nothing was built.
					return w.lookAgainAfterRefusal(ctx, req, cur, repo, dests, seq)
				}
				// The run this request held was ended from outside (a
				// cancel, the reconciler): that end is its answer — never
				// a retry that would undo a cancel. Its log ends here.
				if cur.Logs == nil {
					w.logs.finish(ctx, lw, cur)
				}
				return cur, origin, true, nil
			}
			if errors.Is(err, errNotCurrent) || errors.Is(context.Cause(runCtx), runs.ErrLostClaim) || (gerr == nil && cur != nil && (cur.Final() || cur.Run != held.Run || cur.Owner != w.cfg.ID)) {
				w.log.Info("the build claim changed hands; following the record", zap.String("key", held.Key), zap.String("run", held.Run))
				// With the request's own repository, not the run's: a run
				// taken over is its claimer's, and a new run claimed from
				// here pushes to dests — its record must name their
				// repository, or the index points where the image is not.
				return w.build(ctx, req, held.Key, repo, dests, seq, nil)
			}
		}
		if ctx.Err() != nil {
			// Stopped from outside: a run a cancel ended has its log
			// ended here (a shutdown leaves it to the worker that takes
			// the run over), and its Job gone before this handler gives
			// its slot back. The cancel tells the handler first and
			// deletes the Job after (maybe on another worker); until the
			// Job is gone its build may run beside the request the freed
			// slot lets in, over the tenant's concurrency limit.
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			if cur := w.stoppedRun(fctx, &held, errors.Is(context.Cause(ctx), tenantapi.ErrCanceled)); cur != nil {
				if lw != nil {
					w.logs.finish(fctx, lw, cur)
				}
				if !mutant.On("canceled-holder-leaves-job") {
					w.jobGone(fctx, held.Key, held.Run)
				}
			}
			cancel()
		}
		// Shutdown or trouble: let the claim go so another worker takes
		// the run over now rather than after the lease; parked requests
		// are requeued, and one of them takes it over.
		why := v1.ReasonInfrastructureError + ": " + err.Error()
		if ctx.Err() != nil {
			why = "the worker stopped handling the request (" + context.Cause(ctx).Error() + ")"
		}
		w.releaseClaim(ctx, &held, heldRev, maskSecrets(why, secrets))
		if ctx.Err() != nil || IsTransient(err) {
			return nil, "", false, err
		}
		return nil, "", false, fmt.Errorf("run build: %w", err)
	}

	// Secret build arguments are masked in what the result says too.
	out.Message, out.LogTail = maskSecrets(out.Message, secrets), maskSecrets(out.LogTail, secrets)
	final := finalRecord(&held, out, w.cfg.Now())
	if attested {
		if attErr != nil {
			if errors.Is(context.Cause(runCtx), runs.ErrLostClaim) {
				// The claim changed hands while attesting: follow the
				// record, as for a build ended from outside.
				return w.build(ctx, req, held.Key, repo, dests, seq, nil)
			}
			w.releaseClaim(ctx, &held, heldRev, maskSecrets(v1.ReasonInfrastructureError+": "+attErr.Error(), secrets))
			return nil, "", false, Transient(attErr)
		}
		final.Attestation, final.Provenance = att, facts
		if live != nil && att != "" {
			_ = live.Own(ctx, "attached the signed provenance "+att+" to "+final.Repository+"@"+final.Digest)
		}
	}
	final.Logs = w.logs.finish(ctx, lw, final)
	if w.faults != nil && w.faults.beforeFinalize != nil {
		w.faults.beforeFinalize(held.Key)
	}
	if ea := endAheadOf(ctx); ea != nil && ea.req == req && !multiPlatform(rreq) && !refusedRun(final) &&
		hold.SinceWrite() < w.cfg.Lease/2 && context.Cause(runCtx) == nil {
		// A run this handler claimed (not taken over: endAheadOf is nil
		// there), for its own request, whose claim was written recently
		// enough that nobody can have taken it over: its end can only be
		// this outcome, or a cancel's that marked the request first. The
		// decision follows from final alone, so the run's end is stored
		// while the decision is recorded (endAhead).
		ea.start(func() endResult { return w.endAhead(ctx, &held, final, heldRev) })
		return final, origin, true, nil
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
		// The end's write failed or its reply was lost (a NATS hiccup):
		// let the claim go — a compare-and-swap at the revision held,
		// which fails if the end landed after all — so that the
		// request's retry, or any request of the key, takes the run over
		// at once and adopts its Job (deleted only once an end is
		// stored), rather than after the lease lapses.
		if !mutant.On("failed-end-keeps-claim") {
			w.releaseClaim(ctx, &held, heldRev, maskSecrets(v1.ReasonInfrastructureError+": storing the run's end failed: "+err.Error(), secrets))
		}
		return nil, "", false, Transient(err)
	}
	if refusedRun(stored) {
		// This outcome's end, or the same run's end stored from outside
		// first (a take-over that adopted the Job, the reconciler).
		return w.lookAgainAfterRefusal(ctx, req, stored, repo, dests, seq)
	}
	return stored, origin, true, nil
}

// refusedRun reports whether rec is the end of a run whose build Pod found
// its first tag taken and built nothing (v1.ReasonTagTaken): an end that
// answers nobody.
func refusedRun(rec *v1.BuildRecord) bool {
	return rec != nil && rec.State == v1.StateFailed && rec.Reason == v1.ReasonTagTaken && !mutant.On("tag-taken-answers")
}

// lookAgainAfterRefusal follows the end of a run its build Pod refused
// (refusedRun): the run answers nobody. Its Job goes, the HEADs sent
// ahead for its tag are forgotten, and req looks again — its own check
// then finds the image there (the claimer's tag) or it builds with its
// own inputs.
func (w *builder) lookAgainAfterRefusal(ctx context.Context, req *v1.Request, ended *v1.BuildRecord, repo string, dests []string, seq uint64) (*v1.BuildRecord, v1.Origin, bool, error) {
	tag := firstOf(ended.Destinations)
	w.log.Info("nothing is recorded as built (the build's first tag held an image when its Pod started, or its Pod was gone before its digest was read); looking again",
		zap.String("key", ended.Key), zap.String("run", ended.Run), zap.String("tag", tag), zap.String("why", ended.Message))
	if !mutant.On("tag-taken-keeps-preflight") {
		w.looks.forgetPreflight(tag)
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	w.jobGone(fctx, ended.Key, ended.Run)
	cancel()
	return w.build(ctx, req, ended.Key, repo, dests, seq, nil)
}

// firstOf is the first of refs, or "".
func firstOf(refs []string) string {
	if len(refs) == 0 {
		return ""
	}
	return refs[0]
}

// endAhead stores the end of a run whose request's decision goes out
// meanwhile (endAhead below). Nobody else comes back to the run for that
// request, so a failed write is tried again for about a lease (10 s at
// most); if it
// still fails the claim is let go, so that the next request of the key
// takes the run over at once and adopts its Job.
func (w *builder) endAhead(ctx context.Context, held, final *v1.BuildRecord, rev uint64) endResult {
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.Lease+15*time.Second)
	defer cancel()
	wait := w.cfg.Lease / 8
	// Within the 10 s the handler's publish and ack get (decide: actx
	// is 15 s), so a result is never held past its own deadline.
	deadline := time.Now().Add(min(w.cfg.Lease, 10*time.Second))
	for {
		stored, err := w.runs.End(ectx, final, rev)
		if err == nil || errors.Is(err, runs.ErrSuperseded) || time.Now().Add(wait).After(deadline) {
			if err != nil && !errors.Is(err, runs.ErrSuperseded) {
				w.log.Warn("storing the end of a run whose request was answered failed; letting the claim go, so the run is taken over and its Job adopted",
					zap.String("key", final.Key), zap.String("run", final.Run), zap.Error(err))
				w.releaseClaim(ctx, held, rev, v1.ReasonInfrastructureError+": storing the run's end failed: "+err.Error())
			}
			return endResult{stored, err}
		}
		select {
		case <-time.After(wait):
		case <-ectx.Done():
			return endResult{nil, ectx.Err()}
		}
		wait = min(2*wait, w.cfg.Lease/2)
	}
}

// stoppedRunWait is how long a handler whose request its tenant canceled
// waits for the cancel to end its run: the cancel tells the handler first,
// then ends the run unless others wait on it (then the run goes on, taken
// over once the handler lets its claim go).
const stoppedRunWait = 250 * time.Millisecond

// stoppedRun is held's run as someone else ended it (a cancel, the
// reconciler), or nil when the record is on another run or still
// building. canceled: the handler's own request was canceled, so the
// run's end may be on its way.
func (w *builder) stoppedRun(ctx context.Context, held *v1.BuildRecord, canceled bool) *v1.BuildRecord {
	deadline := time.Now().Add(stoppedRunWait)
	for {
		cur, _, err := w.runs.Get(ctx, held.Key)
		switch {
		case err != nil || cur == nil || cur.Run != held.Run:
			return nil
		case cur.Final():
			return cur
		case !canceled || time.Now().After(deadline):
			return nil
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			return nil
		}
	}
}

// jobGone deletes the Job of an ended run and waits until it is gone
// (bounded by ctx), unless the deployment keeps Jobs.
func (w *builder) jobGone(ctx context.Context, key, run string) {
	if w.cfg.KeepJobs {
		return
	}
	if err := w.backend.Cleanup(ctx, key, run); err != nil {
		w.log.Info("deleting an ended run's Job failed; whoever ended the run deletes it", zap.String("key", key), zap.Error(err))
		return
	}
	if g, ok := w.backend.(interface {
		WaitGone(ctx context.Context, key, run string) error
	}); ok {
		if err := g.WaitGone(ctx, key, run); err != nil {
			w.log.Info("the ended run's Job is not gone yet; giving the slot back all the same", zap.String("key", key), zap.Error(err))
		}
	}
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
	final.Platforms = out.Platforms
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
// takes it over). why is remembered for when this worker runs it again.
func (w *builder) releaseClaim(ctx context.Context, claim *v1.BuildRecord, rev uint64, why string) {
	w.letGo.put(claim.Run, why)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := w.runs.Release(ctx, claim, rev); err != nil {
		w.log.Warn("release claim failed; it lapses after the lease", zap.String("key", claim.Key), zap.Error(err))
	}
}

// endAhead lets a handler store its own run's end while it records its
// request's decision, instead of before (P2 in docs/benchmarks.md: one
// durable write fewer in sequence between the Job's end and the result).
// The decision does not wait for the end: it follows from the run's
// outcome alone, and it is recorded in the request's ledger entry by
// compare-and-swap — the cancel's mark is read there, as ever. The result
// is published once both are stored (decide), so whoever sees it and asks
// again finds the build ended.
//
// Only a run this handler claimed itself, for its own request, and whose
// claim it wrote within half a lease: nobody can have taken such a run
// over (a take-over waits for the record to sit unchanged for a lease and
// a half), so its end can only be this outcome, or a cancel's that marked
// the request first (then the decision is "canceled" too). A run taken
// over is ended first, as before: its former holder may come back and end
// it with the same Job, then delete that Job under the taker. Should the
// write fail, it is tried again for about a lease, then the claim is let
// go; the Job is deleted only once the end is stored (or superseded), so
// the next request of the key takes the run over and adopts it.
type endAhead struct {
	req  *v1.Request
	wait func() endResult // nil until started
	// stored closes once the end's write has returned (started only).
	stored chan struct{}
}

type endResult struct {
	stored *v1.BuildRecord
	err    error
}

type endAheadKey struct{}

// withEndAhead lets the run of req that build ends for its handler store
// its end ahead (own).
func withEndAhead(ctx context.Context, ea *endAhead) context.Context {
	return context.WithValue(ctx, endAheadKey{}, ea)
}

func endAheadOf(ctx context.Context) *endAhead {
	ea, _ := ctx.Value(endAheadKey{}).(*endAhead)
	return ea
}

func (e *endAhead) start(end func() endResult) {
	e.stored = make(chan struct{})
	e.wait = sendAhead(func() endResult {
		defer close(e.stored)
		return end()
	})
}

// started reports whether the end is being stored ahead.
func (e *endAhead) started() bool { return e != nil && e.wait != nil }

// settled waits for the end when it was stored ahead: ok says whether the
// run's Job may be cleaned up (the end stored, or superseded by a newer
// run); true when nothing was stored ahead.
func (e *endAhead) settled() (ok bool) {
	if e == nil || e.wait == nil {
		return true
	}
	r := e.wait()
	return r.err == nil || errors.Is(r.err, runs.ErrSuperseded)
}

// settledWithin is settled, waiting at most d for an end stored ahead
// that is still being written (false if it still is).
func (e *endAhead) settledWithin(d time.Duration) bool {
	if e == nil || e.wait == nil {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-e.stored:
		return e.settled()
	case <-t.C:
		return false
	}
}

// letGo remembers why this worker let go of build runs (by run id), so
// that when it runs one again — the same request retried, or a parked one
// requeued — its log and progress events say it retries its own run and
// why. Bounded: it forgets everything past maxLetGo runs.
type letGo struct {
	mu  sync.Mutex
	why map[string]string
}

const maxLetGo = 1024

func (l *letGo) put(run, why string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.why == nil || len(l.why) >= maxLetGo {
		l.why = map[string]string{}
	}
	l.why[run] = why
}

func (l *letGo) get(run string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	why, ok := l.why[run]
	return why, ok
}
