package worker

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker/internal/fairq"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// Cache hits at intake (docs/design.md §2d). A request whose image is
// built already needs no build slot, so it does not wait in its tenant's
// queue: intake answers it where it arrives. It is answered there only
// when the answer is a plain one — the key's record succeeded, the image
// is still in the registry, every destination holds it already, nothing
// is left to attest or scan, and the tenant was shown to hold the content
// — and only when nothing was written for the request yet. Anything else
// (a build, a join, a copy, a refusal, a redelivery, an id another entry
// holds) goes to the fair queue as before, untouched, and is handled
// there by the same rules as every request.
//
// Decided before anything is written, the request's ledger entry is
// created with its decision in it (one write), its result is published
// with one progress event (finished), and the message is acked. The
// published mark is written only when the ack failed: an acked message is
// never delivered again, and nothing else delivers a request that never
// waited on a build.

// intakeLookupTimeout bounds the record's read and the registry's check
// of an answer at intake (both shared and remembered: a few milliseconds
// when things are well).
const intakeLookupTimeout = 250 * time.Millisecond

// Answer answers in from the cache when it can; false leaves the message
// to intake's admission, with nothing written for it. The returned settle
// acks the message (intake runs it after giving its slot back).
func (h queueHandler) Answer(ctx context.Context, in fairq.Incoming) (bool, func()) {
	return h.w.answerAtIntake(ctx, in.Msg, in.TakenAtOnce, "intake")
}

// answerAtIntake answers msg from the cache when it can; atOnce (the
// request, not a hit, is most likely taken straight from intake by this
// worker) has its preflight sent ahead (intakelook.go). at names where,
// for buildq_cache_hits_answered_total: "intake", or "held" (intakehold.go).
func (w *Worker) answerAtIntake(ctx context.Context, msg jetstream.Msg, atOnce bool, at string) (answered bool, settle func()) {
	defer func() {
		if r := recover(); r != nil {
			// The queue's handler takes the request: it opens the entry
			// as it is, and a panic of its own becomes one failed result.
			w.log.Error("panic while answering a request at intake; it goes to the queue", zap.Any("panic", r), zap.Stack("stack"))
			answered, settle = false, nil
		}
	}()
	meta, err := msg.Metadata()
	if err != nil || meta.NumDelivered > 1 || !w.ledger.Ready() {
		// A redelivery follows trouble (a lost ack, a stopped worker):
		// it gets the queue's handler, which reads what was written.
		return false, nil
	}
	v, le, ok := w.cacheVerdict(ctx, msg, meta, atOnce)
	if !ok {
		return false, nil
	}
	// The request's sequence goes on each line as a field of its own: a
	// child logger (With) would copy the encoder for every hit.
	seq := zap.Uint64("seq", meta.Sequence.Stream)
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	res, err := w.ledger.Deliver(actx, le, v.Decision, ledger.Delivery{Publish: w.publish, Unmarked: true})
	if err != nil || res.Status != ledger.Published {
		cancel()
		// Recorded, not published: the queue's handler finds the
		// decision in the entry and publishes it.
		w.log.Warn("publishing a cache hit's result failed; the request goes to the queue, whose handler publishes its recorded decision",
			seq, zap.String("requestId", v.Data.RequestID), zap.Error(err))
		return false, nil
	}
	w.cfg.Metrics.hitAnswered(at)
	return true, func() {
		defer cancel()
		if err := w.ack(actx, msg, fairq.Action{Kind: fairq.Settle, RequestID: v.Data.RequestID}); err != nil {
			// The message comes again: its handler must find the result
			// marked published, not publish it a second time.
			w.log.Warn("ack of a cache hit answered at intake failed; marking its result published for the redelivery",
				seq, zap.String("requestId", v.Data.RequestID), zap.Error(err))
			if !mutant.On("intake-never-marks") {
				res.Mark(actx)
			}
		}
		d := res.Decision.Data
		w.log.Info("request done", seq, zap.String("requestId", d.RequestID), zap.String("status", string(d.Status)),
			zap.String("origin", string(d.Origin)), zap.String("digest", d.Digest), zap.Bool("atIntake", true))
	}
}

// answerQueuedHit answers a plain cache hit the queue's handler took —
// one that intake could not answer, most often because its key was still
// building then — the way intake answers one: its entry created with its
// decision (one write), one progress event for the take and one for the
// result, and no published mark unless its ack fails (decide). ok false
// leaves the request to processRequest with nothing written, as intake
// leaves it to the queue: a refusal at the queue limit, a redelivery, a
// requeue, and anything that is not a plain hit.
func (w *Worker) answerQueuedHit(ctx context.Context, h *handling) (v verdict, le *ledger.Entry, ok bool) {
	msg, meta := h.in.Msg, h.meta
	if h.in.Refused != nil || meta.NumDelivered > 1 || !w.ledger.Ready() ||
		msg.Headers().Get(ledger.RequeueTokenHeader) != "" || mutant.On("queued-hits-full-path") {
		return verdict{}, nil, false
	}
	defer func() {
		if r := recover(); r != nil {
			// processRequest opens the entry as it is (a decision
			// written before the panic is published from there).
			w.log.Error("panic while answering a queued cache hit; handling it in full", zap.Any("panic", r), zap.Stack("stack"))
			v, le, ok = verdict{}, nil, false
		}
	}()
	v, le, ok = w.cacheVerdict(ctx, msg, meta, false)
	if ok {
		wait := time.Duration(v.Data.Timings.QueueWaitMs) * time.Millisecond
		w.event(v.Tenant, v.Name, v1.Event{RequestID: v.Data.RequestID, Key: v.Data.Key, Phase: v1.PhaseQueued,
			Message: fmt.Sprintf("taken by %s after %s in the queue", w.cfg.ID, wait)})
	}
	return v, le, ok
}

// cacheVerdict decides msg from the cache when the answer is a plain one
// (see above) and records it as the entry's creation; ok false means
// nothing was written and the queue's handler is to take the request.
// sendAhead: a request whose key has no record has its preflight sent
// now (intakelook.go).
func (w *Worker) cacheVerdict(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, sendAhead bool) (verdict, *ledger.Entry, bool) {
	req, repo, key, dests, ok := w.plainCandidate(msg)
	if !ok {
		return verdict{}, nil, false
	}
	if !sendAhead && w.builds.openSent(req.Tenant, req.RequestID, meta.Sequence.Stream) && w.builds.checksTagBeside(ctx, req, repo) {
		// Intake left this request to its handler's claim, unread
		// (below): reading the record here would put back the read
		// intake left out.
		return verdict{}, nil, false
	}
	// A hit is quick or not a hit for intake: a slow registry or store
	// must not hold intake's slots (every tenant's way in) for one
	// tenant's hits; past intakeLookupTimeout the queue takes it.
	wait := intakeLookupTimeout
	if w.cfg.lookupWait > 0 {
		wait = w.cfg.lookupWait
	}
	if mutant.On("intake-waits-on-lookups") {
		wait = time.Hour
	}
	if sendAhead && w.builds.headBesideRead(req, key) {
		// The HEAD and the entry's create do not depend on the record:
		// sent now, they run beside the read instead of after it
		// (intakelook.go, intakeopen.go).
		claimFirst := w.builds.checksTagBeside(ctx, req, repo)
		if !claimFirst {
			w.builds.sendPreflight(ctx, req, key, repo, dests)
		}
		w.builds.sendOpen(ctx, req, key, meta.Sequence.Stream, meta.Timestamp)
		if claimFirst {
			// And its claim, beside the create (intakeclaim.go).
			w.builds.sendClaim(ctx, req, key, repo, dests, meta.Sequence.Stream)
			// The two creates go out now, not once intake's goroutine
			// is done with the request: yielding runs their goroutines,
			// just made, on this thread until each waits for its reply
			// (tens of microseconds), where they would otherwise wait
			// for intake's hand-off to the handler, or for another
			// thread to be woken (0.2-0.3 ms at p50 on 2 shared cores,
			// on the way from publish to Job: P1 in docs/benchmarks.md).
			runtime.Gosched()
			// Most likely a new build whose Pod checks its tag: its
			// handler claims before it reads (build.go, claimFirst), so
			// intake's read would only stand in the way. A hit among
			// these is answered by the handler's walk.
			return verdict{}, nil, false
		}
	}
	lctx, cancel := context.WithTimeout(ctx, wait)
	rec := w.builds.cached(lctx, req, key, dests)
	cancel()
	if rec == nil {
		// Only for a tenant shown to hold the content: whether a look of
		// another tenant's found the key unbuilt is not this one's to
		// time.
		if _, absent := w.builds.looks.absentSince(key); absent && (sendAhead || mutant.On("preflight-ahead-busy")) && w.builds.shownHeld(req) && !mutant.On("no-preflight-ahead") {
			w.builds.sendPreflight(ctx, req, key, repo, dests)
		}
		return verdict{}, nil, false
	}
	started := w.cfg.Now().UTC()
	at := meta.Timestamp
	v := verdict{Decision: ledger.Decision{Tenant: req.Tenant, Name: req.Name, Data: v1.ResultData{
		RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key, Attempts: int(meta.NumDelivered),
		Timings: v1.Timings{QueuedAt: at.UTC(), StartedAt: started, QueueWaitMs: started.Sub(at).Milliseconds()},
	}}}
	v, err := w.resultVerdict(ctx, v, req, rec, v1.OriginCache, false, repo, dests)
	if err != nil || v.Data.Status != v1.StatusSucceeded {
		return verdict{}, nil, false
	}
	if le, opened, ok := w.openedHit(ctx, req, meta.Sequence.Stream); opened {
		// Intake opened the entry beside its read: the decision is
		// recorded on it as it is delivered.
		return v, le, ok
	}
	le, d, ok, err := w.ledger.CreateDecided(ctx, key, meta.Sequence.Stream, at, v.Decision)
	if err != nil {
		// Written or not, the queue's handler opens the entry as it is.
		w.log.Info("creating a cache hit's ledger entry failed; the request goes to the queue",
			zap.String("requestId", req.RequestID), zap.Error(err))
	}
	if !ok {
		return verdict{}, nil, false
	}
	v.Decision = d
	return v, le, true
}

// plainCandidate decodes msg when it may be answered from the cache as it
// is, at intake or held there: it decodes and validates, its source is no
// git source, it asks no SBOM, no queue TTL applies, and its destination
// and registry are the tenant's. ok false: the queue's handler takes it.
func (w *Worker) plainCandidate(msg jetstream.Msg) (req *v1.Request, repo, key string, dests []string, ok bool) {
	req, err := w.decode(msg)
	if err != nil || req.Source.Git != nil || req.SBOM {
		return nil, "", "", nil, false
	}
	if w.cfg.QueueTTL > 0 && !mutant.On("intake-ignores-queue-ttl") {
		// Whether the request expired is told by the server's clock, from
		// its ledger entry's first write (ttl.go); an entry created
		// decided has no write before its decision. With a queue TTL,
		// every request is the queue's.
		return nil, "", "", nil, false
	}
	repo, err = w.cfg.Naming.Repository(req)
	if err == nil {
		err = w.cfg.Naming.CheckDestination(req.Tenant, repo)
	}
	if err == nil && w.cfg.RegistryFor != nil {
		_, err = w.cfg.RegistryFor(req.Tenant)
	}
	if err != nil {
		return nil, "", "", nil, false
	}
	key = w.builds.keyOf(req)
	return req, repo, key, naming.Destinations(repo, key, req.Tags), true
}

// cached is key's succeeded record when it answers req as it is: the
// image still in the registry, every destination of req holding it, its
// provenance made (when this deployment attests), and req's tenant shown
// to hold the content before. nil otherwise (not built, building, failed,
// gone, or work left to do): the queue's handler takes the request.
func (w *builder) cached(ctx context.Context, req *v1.Request, key string, dests []string) *v1.BuildRecord {
	if !w.shownHeld(req) {
		return nil
	}
	rec := w.verifiedHit(ctx, key)
	if rec == nil {
		return nil
	}
	for _, d := range dests {
		if d != rec.Image && !slices.Contains(rec.Pushed, d) && !mutant.On("intake-ignores-destinations") {
			return nil // a copy to make: the handler's work
		}
	}
	if w.cfg.Attestor != nil && rec.Run != "" && (rec.Attestation == "" || (rec.Tenant != "" && rec.Tenant != req.Tenant)) {
		return nil // provenance to make for this tenant
	}
	return rec
}

// shownHeld reports whether intake may look at req's key: its tenant was
// shown to hold the content (possession.go), or the request has no
// context in the store to show.
func (w *builder) shownHeld(req *v1.Request) bool {
	if req.Source.S3 != nil && w.cfg.Contexts != nil && !mutant.On("intake-skips-possession") {
		return req.ContextDigest != "" && w.possessed.has(possessionKey(req.Tenant, req.ContextDigest))
	}
	return true
}

// verifiedHit is key's succeeded record whose image the registry showed,
// or nil. A verified hit answers the hits on its key for indexCheckFresh
// from the earlier of the record's read and the registry's word, like the
// registry's word alone (checkIndexed): a popular key costs one read and
// one HEAD a second, not one each per hit. A record that changed since
// (a copy's destination added, an attestation made) leaves the hits it no
// longer answers as they are to the queue; a record replaced because its
// image was gone is noticed with the image, within indexCheckFresh.
func (w *builder) verifiedHit(ctx context.Context, key string) *v1.BuildRecord {
	if rec, ok := w.hits.fresh(key, time.Now()); ok {
		return rec
	}
	if _, absent := w.looks.absentSince(key); absent {
		return nil // no record a moment ago (intakelook.go)
	}
	// Not a hit is not remembered (an absence only for a moment): a key
	// whose build ends answers its next request from the cache at once.
	at := time.Now()
	rec, rev, watched := w.room.watchedRecord(key)
	var err error
	if !watched || mutant.On("intake-reads-every-record") {
		rec, at, rev, err = w.sharedRecord(ctx, key)
	}
	if err == nil && rec == nil {
		w.looks.sawAbsent(key, at)
	}
	if err == nil && rec != nil && rec.State == v1.StateBuilding {
		w.looks.sawBuilding(key, rec, rev, at)
	}
	if err != nil || rec == nil || rec.State != v1.StateSucceeded || rec.Digest == "" {
		return nil
	}
	if w.registry != nil && !mutant.On("intake-skips-registry-check") {
		seen, err := w.checkIndexedAt(ctx, rec.Repository+"@"+rec.Digest)
		if err != nil {
			if !errors.Is(err, registry.ErrNotFound) {
				w.log.Debug("registry check of a cache hit failed; the request goes to the queue", zap.Error(err))
			}
			return nil
		}
		if seen.Before(at) {
			at = seen
		}
	}
	w.hits.saw(key, rec, at)
	return rec
}

// sharedRecord reads key's record, and when that read started, with the
// record's revision (0: none). Concurrent reads of one key share a single
// read in flight (cache hits on a popular key arrive together); the start
// is that read's.
func (w *builder) sharedRecord(ctx context.Context, key string) (*v1.BuildRecord, time.Time, uint64, error) {
	type read struct {
		rec *v1.BuildRecord
		at  time.Time
		rev uint64
	}
	ch := w.records.DoChan(key, func() (any, error) {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer cancel()
		if w.faults != nil && w.faults.beforeRecordRead != nil {
			w.faults.beforeRecordRead(key)
		}
		at := time.Now()
		rec, rev, err := w.runs.Get(rctx, key)
		return read{rec, at, rev}, err
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, time.Time{}, 0, r.Err
		}
		got, _ := r.Val.(read)
		return got.rec, got.at, got.rev, nil
	case <-ctx.Done():
		return nil, time.Time{}, 0, context.Cause(ctx)
	}
}

// recentHits remembers verified hits (verifiedHit) by key.
type recentHits struct {
	mu sync.Mutex
	m  map[string]recentHit
}

type recentHit struct {
	rec *v1.BuildRecord
	at  time.Time
}

// fresh is key's hit verified within indexCheckFresh of now, a copy.
func (h *recentHits) fresh(key string, now time.Time) (*v1.BuildRecord, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	hit, ok := h.m[key]
	if !ok || (now.Sub(hit.at) >= indexCheckFresh && !mutant.On("registry-check-remembered")) {
		return nil, false
	}
	c := *hit.rec // each caller its own copy (its slices and maps are only read)
	return &c, true
}

// saw records key's hit as verified at at.
func (h *recentHits) saw(key string, rec *v1.BuildRecord, at time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.m == nil || len(h.m) >= 4096 {
		h.m = map[string]recentHit{} // stale entries answer nothing
	}
	if cur, ok := h.m[key]; !ok || at.After(cur.at) {
		c := *rec
		h.m[key] = recentHit{rec: &c, at: at}
	}
}
