package worker

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"golang.org/x/sync/singleflight"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// builder answers a request with a build record: from the index, by
// joining the run in flight, or by claiming the key (or taking a run
// over) and running the build on the backend while it holds the run.
type builder struct {
	// The worker, for its configuration, ledger, runs, backend and
	// registry.
	*Worker
	// heads shares concurrent registry checks of one indexed image;
	// records, concurrent reads of one key's record at intake (answer.go).
	heads, records singleflight.Group
	// present: indexed images the registry showed within indexCheckFresh;
	// hits: keys whose hits were verified so (answer.go).
	present presentImages
	hits    recentHits
	// looks: what intake saw of records and tags (intakelook.go);
	// opens: the ledger entries it opened ahead (intakeopen.go);
	// claims: the keys it claimed ahead (intakeclaim.go).
	looks  intakeLooks
	opens  intakeOpens
	claims intakeClaims
	// orphans: the reconciler's watch of runs whose Job finished.
	orphans orphanWatch
	// possessed: tenants shown to hold a context (possession.go).
	possessed possessions
	// letGo: why this worker let go of runs it held.
	letGo letGo
}

// errAnswered: the request was answered by another handler of its message
// (a redelivery) while this one was still at work.
var errAnswered = errors.New("the request was answered by another handler")

// build gets the final record for key, walking the state machine of
// claim.go: from the index (cache), by joining the run in flight, or by
// claiming the key (or taking a lapsed run over) and running the build.
// owned is true when this request ended the run and so cleans up its Job.
//
// seq is the request message's stream sequence: with the request id it
// tells a redelivery of the request that made a record (its own build)
// from another request that reuses the id.
func (w *builder) build(ctx context.Context, req *v1.Request, key, repo string, dests []string, seq uint64, wr *waiterReg) (rec *v1.BuildRecord, origin v1.Origin, owned bool, err error) {
	mine := func(r *v1.BuildRecord) bool { return r.RequestID == req.RequestID && r.Seq == seq }
	// ownEnd: r, a run this request claimed, ended for this request. A
	// run canceled for other requests did not: a cancel stops a run only
	// when it finds no other request waiting on it, and the waiter index
	// is best effort (a claimer killed between its claim and its index
	// entry has none, and its redelivery has not written it yet). A
	// claimer whose own ledger entry is not canceled builds again; one
	// whose entry cannot be read now tries again later (transient), and
	// is not answered "canceled" on a guess.
	ownEnd := func(r *v1.BuildRecord) (bool, error) {
		if !mine(r) {
			return false, nil
		}
		if r.State == v1.StateFailed && r.Reason == v1.ReasonTagTaken && !mutant.On("tag-taken-answers") {
			// Nothing was built: the claimer looks again too, its run's
			// Job gone first.
			w.refusedJobGone(ctx, r)
			return false, nil
		}
		if r.State != v1.StateFailed || r.Reason != v1.ReasonCanceled || mutant.On("claimer-takes-others-cancel") {
			return true, nil
		}
		le, err := w.ledger.Get(ctx, req.Tenant, req.RequestID)
		if err != nil {
			return false, Transient(fmt.Errorf("reading the ledger entry of a claimer whose run was canceled: %w", err))
		}
		return le == nil || le.E.Canceled, nil
	}
	// A request that is not answered from the index waits on a build:
	// index it, so a cancel of the key finds it.
	waits := func() { wr.add(ctx, w.ledger, key, req.Tenant, req.RequestID) }
	// waitsBeside indexes the request beside the run it just claimed
	// (its Job's create goes on meanwhile), and returns the wait for it.
	// Only once the claim is made: a claim that fails leaves no entry
	// (TestAttack_AFailedClaimLeavesNoWaiterEntry).
	waitsBeside := func() func() struct{} {
		return sendAhead(func() struct{} { waits(); return struct{}{} })
	}
	// Before claiming, taking over or joining — work that outlives a
	// handler — make sure the request is still unanswered: a handler that
	// stalled (a NATS outage, a pause) while its redelivered copy was
	// answered elsewhere must not start a build nobody waits for.
	answered := func() error {
		if mutant.On("answered-check-off") {
			return nil
		}
		le, err := w.ledger.Get(ctx, req.Tenant, req.RequestID)
		if err != nil && !mutant.On("answered-check-fails-open") {
			// Unread, the request may have been answered: the check
			// fails closed, and the request is tried again. Right after
			// a NATS outage — the stall this check is for — a read can
			// fail where the answer was recorded long before.
			return Transient(fmt.Errorf("reading the request's ledger entry before building: %w", err))
		}
		if le != nil && le.E.Result != nil && le.E.Seq == seq {
			return errAnswered
		}
		return nil
	}
	if w.faults != nil && w.faults.beforeWalk != nil {
		w.faults.beforeWalk(key)
	}
	// The first look's reads — the key's record and the request's own
	// entry (answered) — depend on neither each other nor the possession
	// check: they are sent at once, and each is waited for only where the
	// walk needs it. What they find is told to nobody before possession
	// is shown. The preflight HEAD is sent only when the walk needs it.
	var created time.Time
	if wr != nil {
		created = wr.created
	}
	// claimFirst: the request's first look is its claim (below).
	claimFirst := !created.IsZero() && (time.Since(created) < lookAheadFresh || mutant.On("claim-first-stale")) && w.checksTagBeside(ctx, req, repo)
	// first: the walk's first pass, which takes the reads sent ahead; a
	// claim made first leaves none, and its walk reads afresh.
	first := !claimFirst
	ahead := w.lookAhead(ctx, req, key, repo, dests, answered, created, claimFirst)
	defer ahead.stop()
	if req.Source.S3 != nil && w.cfg.Contexts != nil {
		// Before anything else, whoever built the key or is building it:
		// a request is answered only for content its tenant holds, and
		// whether another tenant's build exists must not change what a
		// tenant without the content is told (possession.go).
		if err := w.checkPossession(ctx, req); err != nil {
			return nil, "", false, err
		}
	}
	if claimFirst && time.Since(created) >= lookAheadFresh && !mutant.On("claim-first-stale") {
		// The possession check took long (a large context read, a
		// pause): the entry as created no longer stands, and the walk
		// reads everything afresh.
		claimFirst = false
		first = false
	}
	// The claim intake sent beside the entry's create (intakeclaim.go)
	// is this walk's first look when it claims first; otherwise it is
	// withdrawn before the walk reads the key, which would find it.
	sentClaim, withdrew, err := w.settleSentClaim(ctx, req, seq, claimFirst)
	if err != nil {
		return nil, "", false, err
	}
	if withdrew {
		// The reads sent ahead may have found that claim: the walk
		// reads afresh.
		first = false
	}
	if claimFirst {
		// A fresh key's build whose Pod checks its tag, for a request
		// whose entry was just created undecided: nothing of the first
		// look needs waiting for. The claim is a create, which fails
		// if the key has any record — then the walk reads it — so it
		// goes first, its waiter entry beside it, and the tag's HEAD
		// once the Job is created (own).
		claim, rev, ok, err := w.claimAtOnce(ctx, sentClaim, req, key, repo, dests, seq)
		if err != nil {
			return nil, "", false, Transient(err)
		}
		if ok {
			w.looks.forget(key)
			tagCheck := ahead.preflightBeside(true)
			indexed := waitsBeside()
			rec, origin, owned, err := w.own(ctx, req, claim, rev, repo, dests, seq, true, "", tagCheck)
			indexed()
			return rec, origin, owned, err
		}
	}
	for ; ; first = false {
		if err := ctx.Err(); err != nil {
			return nil, "", false, err
		}
		if !first && w.faults != nil && w.faults.beforeWalk != nil {
			w.faults.beforeWalk(key)
		}
		var (
			cur *v1.BuildRecord
			rev uint64
			err error
		)
		readAt := time.Now()
		if first && ahead.fresh() {
			readAt = ahead.sent
			cur, rev, err = ahead.record()
		} else {
			cur, rev, err = w.runs.Get(ctx, key)
		}
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
		ended := false
		if cur != nil && cur.State == v1.StateFailed {
			if ended, err = ownEnd(cur); err != nil {
				return nil, "", false, err
			}
		}
		fresh := cur == nil || (cur.State == v1.StateFailed && !ended)
		// tagCheck: the preflight of a build whose Pod checks the tag
		// itself (checksTagBeside), sent by own once the build's Job is
		// created; the build does not wait for it.
		var tagCheck func() preflightRead
		switch {
		case fresh && first && cur == nil && w.checksTagBeside(ctx, req, repo):
			tagCheck = ahead.preflightBeside(first)
		case fresh:
			// Before claiming: the requester's own first tag may already
			// hold an image (an index lost, a tag pushed by hand). It
			// answers this request only — it is not buildq's verified
			// build, so it never enters the shared index.
			found, err := ahead.preflight(first)
			if err != nil || found != nil {
				return found, v1.OriginCache, false, err
			}
		}
		if cur == nil || cur.State == v1.StateBuilding || (cur.State == v1.StateFailed && !ended) {
			if err := ahead.answered(first); err != nil {
				return nil, "", false, err
			}
		}
		switch {
		case cur == nil:
			claim := w.newClaim(req, key, repo, dests, seq)
			rev, ok, err := w.runs.Claim(ctx, claim)
			if err != nil {
				return nil, "", false, Transient(err)
			}
			if !ok {
				continue // another worker claimed it first: look again
			}
			w.looks.forget(key)
			indexed := waitsBeside()
			rec, origin, owned, err := w.own(ctx, req, claim, rev, repo, dests, seq, true, "", tagCheck)
			indexed()
			return rec, origin, owned, err

		case cur.State == v1.StateSucceeded:
			if mine(cur) {
				return cur, v1.OriginBuild, true, nil // our own build, finished before a crash
			}
			if w.registry != nil {
				// The index says built; only the registry knows whether
				// the image is still there. Not found means build again;
				// any other error means try later, never "exists".
				seen, err := w.checkIndexedAt(ctx, cur.Repository+"@"+cur.Digest)
				switch {
				case errors.Is(err, registry.ErrNotFound):
					w.log.Info("indexed image is gone from the registry; rebuilding", zap.String("key", key), zap.String("image", cur.Repository+"@"+cur.Digest))
					if found, err := w.preflight(ctx, req, key, repo, dests); err != nil || found != nil {
						return found, v1.OriginCache, false, err
					}
					claim := w.newClaim(req, key, repo, dests, seq)
					rev, ok, err := w.runs.Reclaim(ctx, claim, rev)
					if err != nil {
						return nil, "", false, Transient(err)
					}
					if !ok {
						continue
					}
					waits()
					return w.own(ctx, req, claim, rev, repo, dests, seq, true,
						fmt.Sprintf("building again: the image built before (%s@%s) is gone from the registry", cur.Repository, cur.Digest), nil)
				case err != nil:
					return nil, "", false, Transient(fmt.Errorf("check %s in the registry: %w", cur.Repository, err))
				}
				// A verified hit, as intake's: the key's next hits within
				// indexCheckFresh are answered at intake (claimFirst sends
				// a hit of a key the worker has not seen to this walk).
				if seen.Before(readAt) {
					readAt = seen
				}
				w.hits.saw(key, cur, readAt)
			}
			return cur, v1.OriginCache, false, nil

		case cur.State == v1.StateFailed && ended:
			return cur, v1.OriginBuild, true, nil

		case cur.State == v1.StateFailed:
			// A failed build is retried by the next request for its key,
			// as a new run: nothing of the failed run is adopted.
			claim := w.newClaim(req, key, repo, dests, seq)
			rev, ok, err := w.runs.Reclaim(ctx, claim, rev)
			if err != nil {
				return nil, "", false, Transient(err)
			}
			if !ok {
				continue
			}
			waits()
			return w.own(ctx, req, claim, rev, repo, dests, seq, true, "a new run: the last run of this build failed ("+failedWhy(cur)+")", nil)

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
				parked, err := w.Worker.park.park(ctx, wr, key, cur)
				if err != nil {
					return nil, "", false, err
				}
				if parked {
					w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Platform: platformOf(req), Key: key, Phase: v1.PhaseWaiting, Job: cur.Job,
						Message: "joined a build in progress; answered when it ends"})
					return cur, v1.OriginInflight, false, errParked
				}
				continue
			}
			waits()
			w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Platform: platformOf(req), Key: key, Phase: v1.PhaseWaiting, Job: cur.Job,
				Message: "joined a build in progress"})
			final, lapsed, lrev, err := w.join(ctx, key)
			if err != nil {
				return nil, "", false, err
			}
			if final != nil {
				own, err := ownEnd(final)
				if err != nil {
					return nil, "", false, err
				}
				if own {
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
func (w *builder) takeOver(ctx context.Context, req *v1.Request, cur *v1.BuildRecord, rev uint64, repo string, dests []string, seq uint64) (*v1.BuildRecord, v1.Origin, bool, bool, error) {
	claim := *cur
	now := w.cfg.Now().UTC()
	claim.Owner, claim.LeaseMs, claim.LeaseUntil = w.cfg.ID, w.cfg.Lease.Milliseconds(), now.Add(w.cfg.Lease)
	claim.Holder = ledger.Key(req.Tenant, req.RequestID)
	if len(claim.Destinations) == 0 {
		// A record written before runs kept their destinations.
		claim.Repository, claim.Destinations = cur.Repository, dests
		if claim.Repository == "" {
			claim.Repository = req.Image
		}
	}
	nrev, ok, err := w.runs.TakeOver(ctx, &claim, rev)
	if err != nil {
		return nil, "", false, false, Transient(err)
	}
	if !ok {
		return nil, "", false, false, nil
	}
	note := w.takeOverNote(cur)
	// A run taken over may be ended by its former holder, come back with
	// the same Job's outcome, while this handler runs it: its end is
	// stored before its decision (own.go, endAhead).
	out, origin, owned, err := w.own(withEndAhead(ctx, nil), req, &claim, nrev, repo, dests, seq, false, note, nil)
	if err == nil && origin != v1.OriginBuild && out != nil && !sharedFailure(out, req, repo) {
		w.log.Info("the run taken over failed for its claimer's own inputs; building with this request's",
			zap.String("key", claim.Key), zap.String("reason", out.Reason))
		return nil, "", false, false, nil
	}
	return out, origin, owned, true, err
}

// takeOverNote logs a take-over of run cur and says, for the progress
// event, why the run is run again: this worker let it go itself (a
// transient failure, the backend's trouble) and now retries it, or
// another worker let it go or stopped renewing its claim.
func (w *builder) takeOverNote(cur *v1.BuildRecord) string {
	fields := []zap.Field{zap.String("key", cur.Key), zap.String("run", cur.Run)}
	why, mine := w.letGo.get(cur.Run)
	switch {
	case mine:
		w.log.Info("retries its build run", append(fields, zap.String("previousOwner", w.cfg.ID), zap.String("why", why))...)
		return "retrying the run after " + why
	case cur.Owner == w.cfg.ID:
		// This worker's own claim, lapsed: it stopped renewing (a stall,
		// or a restart under the same id).
		w.log.Info("retries its build run, whose claim lapsed", append(fields, zap.String("previousOwner", cur.Owner))...)
		return "retrying the run: this worker's claim on it lapsed"
	case cur.Owner == "":
		w.log.Info("took over a build run its worker let go", fields...)
		return "took over the run: the worker running it let it go (a failure or a shutdown)"
	}
	w.log.Info("took over a build run", append(fields, zap.String("previousOwner", cur.Owner))...)
	return fmt.Sprintf("took over the run of worker %s, which stopped renewing its claim", cur.Owner)
}

// failedWhy is what a failed record says of its failure, short.
func failedWhy(r *v1.BuildRecord) string {
	if r.Message == "" {
		return r.Reason
	}
	m := r.Message
	if i := strings.IndexByte(m, '\n'); i >= 0 {
		m = m[:i]
	}
	if len(m) > 200 {
		m = m[:200] + "…"
	}
	return r.Reason + ": " + m
}

func (w *builder) newClaim(req *v1.Request, key, repo string, dests []string, seq uint64) *v1.BuildRecord {
	now := w.cfg.Now().UTC()
	src := req.Source
	var platformKeys map[string]string
	if multiPlatform(req) {
		platformKeys = map[string]string{}
		for _, p := range req.PlatformsOrDefault() {
			platformKeys[p] = w.keyOf(platformRequest(req, p))
		}
	}
	return &v1.BuildRecord{
		PlatformKeys: platformKeys,
		Key:          key, State: v1.StateBuilding, Run: runs.NewRunID(), Owner: w.cfg.ID,
		LeaseMs: w.cfg.Lease.Milliseconds(), LeaseUntil: now.Add(w.cfg.Lease),
		RequestID: req.RequestID, Seq: seq, Tenant: req.Tenant, Name: req.Name,
		Holder:     ledger.Key(req.Tenant, req.RequestID),
		Repository: repo, Destinations: dests, StartedAt: now,
		Source: &src, Timeout: req.Timeout, SecretBuildArgs: req.SecretBuildArgs,
		SourceInfo: w.sourceInfo.get(req.Tenant, req.RequestID),
	}
}

// sharedFailure reports whether a failed run of another request answers
// req too: a failure of the content does, one of the claimer's own
// request-specific inputs does not unless req has the same.
func sharedFailure(final *v1.BuildRecord, req *v1.Request, repo string) bool {
	if final.State != v1.StateFailed {
		return true
	}
	if final.Tenant != req.Tenant && !mutant.On("share-foreign-failure") {
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
	case v1.ReasonTagTaken:
		// Nothing was built: each request looks again with its own
		// tag.
		return mutant.On("tag-taken-answers")
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
func (w *builder) join(ctx context.Context, key string) (final, lapsed *v1.BuildRecord, rev uint64, err error) {
	watcher, err := w.runs.Watch(ctx, key)
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
			r := runs.Decode(key, e.Value())
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
