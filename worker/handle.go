package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/fairq"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/tenantapi"
)

// The handler: one request message in, one action on it out. process
// decides the request's result; decide turns that outcome (or the error
// that left it undecided) into what happens to the message, delivering
// the result through the ledger (record, then publish, then mark); apply
// is the one place that acts on the message.

// verdict is a request's decision and how it was reached.
type verdict struct {
	ledger.Decision
	// duplicate: another message holds this request id; this one gets no
	// result of its own and is terminated.
	duplicate bool
	// waiter: the request was indexed as waiting on its build key.
	waiter bool
	// parked: the request waits on a build without holding its message;
	// the message is acked without a result (the build's end brings it).
	parked bool
	// end: its own run's end, when it was stored alongside the decision
	// (own.go, endAhead); the Job is cleaned up once it is.
	end *endAhead
}

// queueHandler is the worker's handler as the fair queue sees it.
type queueHandler struct{ w *Worker }

func (h queueHandler) Decide(ctx context.Context, in fairq.Incoming) fairq.Action {
	return h.w.decide(ctx, in)
}
func (h queueHandler) Apply(msg jetstream.Msg, act fairq.Action) { h.w.apply(msg, act) }
func (h queueHandler) Heartbeat(msg jetstream.Msg, ackWait time.Duration) func() {
	return h.w.heartbeat(msg, ackWait)
}

// queueMetrics counts the fair queue's requests in flight.
type queueMetrics struct{ m *Metrics }

func (q queueMetrics) Taken()       { q.m.taken() }
func (q queueMetrics) Released()    { q.m.released() }
func (q queueMetrics) TakenDirect() { q.m.takenDirect() }

// apply acts on the message as decided: the only place the handler
// settles, retries or hands back a message.
func (w *Worker) apply(msg jetstream.Msg, act fairq.Action) {
	var err error
	switch act.Kind {
	case fairq.HandBack:
		if md, merr := msg.Metadata(); merr == nil && md.Stream == v1.RequestsStream {
			w.fq.IntakeQuiet() // taken from intake's pull: none of its may still wait (IntakeQuiet)
		}
		err = msg.Nak()
	case fairq.Retry, fairq.Later:
		err = msg.NakWithDelay(act.Delay)
	case fairq.Settle:
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := w.ack(ctx, msg, act); err != nil {
			w.log.Warn("ack failed; the decision is recorded and a redelivery publishes the same result",
				zap.String("requestId", act.RequestID), zap.Error(err))
			if act.AckFailed != nil {
				act.AckFailed()
			}
		}
		return
	}
	if err != nil {
		w.log.Debug("handing the request back failed; it is redelivered after AckWait", zap.Error(err))
	}
}

// ack settles msg as act says: acked (and the ack confirmed), or
// terminated.
func (w *Worker) ack(ctx context.Context, msg jetstream.Msg, act fairq.Action) error {
	switch {
	case w.faults != nil && w.faults.loseAck != nil && w.faults.loseAck(act.RequestID):
		return errors.New("ack lost (fault injection)")
	case act.Term:
		return msg.TermWithReason(act.Reason)
	default:
		return msg.DoubleAck(ctx)
	}
}

// decide handles the message up to its action: the result decided,
// recorded and published when there is one.
func (w *Worker) decide(ctx context.Context, in fairq.Incoming) (action fairq.Action) {
	msg := in.Msg
	meta, err := msg.Metadata()
	if err != nil {
		w.log.Error("message without JetStream metadata; terminating it", zap.Error(err))
		return fairq.Action{Kind: fairq.Settle, Term: true, Reason: "no metadata"}
	}
	log := w.log.With(zap.Uint64("seq", meta.Sequence.Stream), zap.Uint64("delivery", meta.NumDelivered))

	stop := w.heartbeat(msg, in.AckWait)
	defer stop()

	// The tenant's cancel ends hctx with tenantapi.ErrCanceled.
	hctx, hcancel := context.WithCancelCause(ctx)
	defer hcancel(nil)
	h := &handling{in: in, meta: meta, cancel: hcancel}
	err = w.safeProcess(hctx, h)
	v, le := h.v, h.le
	// The run this handler's own walk ended, if it ended one (v.end is
	// set by the walk; a decision read back from the ledger names the
	// run of whoever decided it, whose end may not be stored): its Job
	// goes once the message is settled, whatever the action
	// (endedJobGone). cleansOwn: the action's own After deletes the
	// Job of the run its decision names.
	var ended endedRun
	if v.end != nil || mutant.On("ended-job-of-any-decision") {
		ended = endedRun{key: v.CleanupKey, run: v.CleanupRun, end: v.end}
	}
	cleansOwn := false
	defer func() { action = w.endedJobGone(action, ended, cleansOwn, v.Decision, log) }()
	// Whatever comes now must not be cut short by shutdown: publishing a
	// result and acking are quick and keep the request from being redone.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	// spend counts a transient failure; retryIn is the retry it buys.
	spend := func() bool { return w.ledger.SpendRetry(actx, le, meta.NumDelivered, w.cfg.MaxDeliver) }
	retryIn := func() fairq.Action {
		cancel()
		return fairq.Action{Kind: fairq.Retry, Delay: ledger.RetryDelay(le, meta.NumDelivered), RequestID: v.Data.RequestID}
	}
	done := func(term bool, reason string) fairq.Action {
		cancel()
		return fairq.Action{Kind: fairq.Settle, Term: term, Reason: reason, RequestID: v.Data.RequestID}
	}
	switch {
	case err != nil && ctx.Err() == nil && errors.Is(context.Cause(hctx), tenantapi.ErrCanceled):
		v.Decision = v.Canceled()
	case err != nil && ctx.Err() != nil:
		log.Info("handing request back", zap.String("reason", "shutdown"))
		cancel()
		return fairq.Action{Kind: fairq.HandBack, RequestID: v.Data.RequestID}
	case err != nil && IsTransient(err) && spend():
		a := retryIn()
		w.retrying(v, le, meta, a.Delay, v1.ReasonInfrastructureError+": "+err.Error())
		log.Warn("transient failure; retrying later", zap.Error(err), zap.Duration("delay", a.Delay))
		w.cfg.Metrics.retried()
		return a
	case err != nil:
		// Terminal, or out of deliveries: the request still gets its one
		// result, and its payload is kept on the dead-letter subject.
		v.Data.Status = v1.StatusFailed
		v.Data.Reason = v1.ReasonInfrastructureError
		v.Data.Message = err.Error()
		v.Data.Digest, v.Data.Image, v.Data.ImageRef, v.Data.LogTail = "", "", "", ""
		v.CleanupKey, v.CleanupRun = "", ""
		if IsTransient(err) {
			v.Data.Message = fmt.Sprintf("gave up after %d transient failures: %v", w.cfg.MaxDeliver, err)
		}
		v.Term = true
		if le == nil && !v.duplicate && ownsEntry(v) {
			// Given up before the request had its entry (the ledger
			// failing on every try): its result goes into a new entry
			// first, as every result of a tenant's id does, or the
			// request is tried again later — published without one, a
			// later message of the id would be built and answered again.
			nle, d, ok, cerr := w.ledger.CreateDecided(actx, v.Data.Key, meta.Sequence.Stream, meta.Timestamp, v.Decision)
			if ok {
				le, v.Decision = nle, d
			} else if cerr == nil {
				// An entry of the id exists: this message's own (from a
				// write whose reply was lost, or the entry a requeued
				// message carries the token of), or another message's.
				tok := msg.Headers().Get(ledger.RequeueTokenHeader)
				switch got, gerr := w.ledger.Get(actx, v.Tenant, v.Data.RequestID); {
				case gerr != nil:
					cerr = fmt.Errorf("read the entry of %s: %w", v.Data.RequestID, gerr)
				case got == nil:
					cerr = fmt.Errorf("the entry of %s went as it was read", v.Data.RequestID)
				case got.E.Seq == meta.Sequence.Stream || (tok != "" && got.E.RequeueToken == tok):
					le = got
				default:
					v.duplicate = true
				}
			}
			if cerr != nil {
				log.Warn("the request's result cannot be written into the ledger; trying it again later", zap.Error(cerr))
				w.cfg.Metrics.retried()
				return retryIn()
			}
		}
		if IsTransient(err) {
			// Once, as the result goes out (not on each try at its entry).
			w.deadLetter(actx, v.Tenant, msg, err)
		}
	}
	if v.duplicate {
		log.Warn("request id already held by another message; terminating this one without a result",
			zap.String("requestId", v.Data.RequestID), zap.String("tenant", v.Tenant))
		w.event(v.Tenant, v.Name, v1.Event{RequestID: v.Data.RequestID, Key: v.Data.Key, Phase: v1.PhaseFinished,
			Message: "duplicate: request id " + v.Data.RequestID + " belongs to an earlier message; its result is that request's"})
		w.cfg.Metrics.duplicate()
		return done(true, "duplicate request id")
	}
	if v.parked {
		log.Info("request parked on a build in progress", zap.String("requestId", v.Data.RequestID), zap.String("key", v.Data.Key))
		w.cfg.Metrics.parkedRequest()
		return done(false, "parked")
	}
	// The entry's identity, read now: once delivered, the entry is the
	// ledger's to mark while the message is settled.
	var waiterKey, tenant, id string
	if le != nil {
		waiterKey, tenant, id = le.E.Key, le.E.Tenant, le.E.RequestID
	}
	publish := w.publish
	var first func(context.Context, ledger.Decision) (ledger.Ack, error)
	if v.end.started() {
		if !w.cfg.RecordFirst && v.Data.Status != v1.StatusCanceled && w.nc.IsConnected() && !mutant.On("never-publish-first") {
			// The handler of a finished build: a young request's result
			// goes out first, and its decision and the run's end are
			// stored after it, beside each other (ledger.Delivery.First).
			// Whoever sees the result and asks again before the run's end
			// is stored joins the ended run and is answered from it.
			first = w.publish
		}
		if !mutant.On("publish-before-end") {
			// Recorded first (an old request, or a failed first publish):
			// the run's end, stored alongside the decision, is stored
			// before the result goes out, so whoever sees the result and
			// asks again finds a cache hit.
			publish = func(ctx context.Context, d ledger.Decision) (ledger.Ack, error) {
				v.end.wait()
				return w.publish(ctx, d)
			}
		}
	}
	res, err := w.ledger.Deliver(actx, le, v.Decision, ledger.Delivery{
		First:   first,
		Publish: publish,
		Unrecorded: func(err error) bool {
			if spend() {
				log.Warn("recording the decision failed; retrying the request", zap.Error(err))
				return false
			}
			return true
		},
		// A decision recorded as its entry was created (a plain cache hit
		// taken from the queue, answer.go) is marked only when its ack
		// fails (AckFailed below): nothing else delivers it.
		Async:    !v.RecordedNow,
		Unmarked: v.RecordedNow,
	})
	var (
		pe *ledger.PublishError
		re *ledger.RecordError
	)
	switch {
	case errors.As(err, &re) && spend():
		// The result is stored; its entry is not written yet. The
		// redelivery publishes it again, is answered as a duplicate and
		// records the stored result.
		log.Warn("recording a stored result failed; retrying the request", zap.Error(re.Err), zap.String("requestId", v.Data.RequestID))
		a := retryIn()
		w.retrying(v, le, meta, a.Delay, "recording the stored result failed: "+re.Err.Error())
		return a
	case errors.As(err, &re):
		log.Error("recording a stored result failed on the request's last delivery; its entry stays undecided until it ages out",
			zap.Error(re.Err), zap.String("requestId", v.Data.RequestID))
	case errors.As(err, &pe):
		// Counted in the ledger, like every transient failure: a
		// request's deliveries also count hand-backs and waits for
		// another worker's publish.
		if spend() {
			log.Error("publish result failed; retrying the request", zap.Error(pe.Err), zap.String("requestId", v.Data.RequestID))
			a := retryIn()
			w.retrying(v, le, meta, a.Delay, "publishing the result failed: "+pe.Err.Error())
			return a
		}
		log.Error("publish result failed on the last delivery; the request goes to the dead-letter stream",
			zap.Error(pe.Err), zap.String("requestId", v.Data.RequestID))
		w.deadLetter(actx, v.Tenant, msg, pe.Err)
		return done(true, "result publish failed")
	case res.Status == ledger.Busy:
		// One handler or settling pass of this worker decides and
		// publishes a request at a time.
		log.Info("this worker is publishing the request's result already; looking again later", zap.String("requestId", v.Data.RequestID))
		cancel()
		return fairq.Action{Kind: fairq.Later, Delay: time.Second, RequestID: v.Data.RequestID}
	case res.Status == ledger.Later:
		if err != nil {
			log.Warn("reading who publishes the request's result failed; looking again later", zap.Error(err))
		}
		log.Info("the request's result was decided by another worker and is not marked published yet; looking again later",
			zap.String("requestId", v.Data.RequestID), zap.String("decidedBy", le.E.Worker))
		cancel()
		return fairq.Action{Kind: fairq.Later, Delay: publishGrace(w.cfg.Lease) / 2, RequestID: v.Data.RequestID}
	case err != nil:
		// Recording the decision failed, and the retry budget allows
		// another try (Unrecorded said so).
		a := retryIn()
		w.retrying(v, le, meta, a.Delay, "recording the decision failed: "+err.Error())
		return a
	}
	v.Decision = res.Decision
	if v.RecordedNow && res.Status == ledger.Published {
		w.cfg.Metrics.hitAnswered("queue")
	}
	if v.waiter && le != nil {
		w.ledger.DropWaiter(actx, waiterKey, tenant, id)
	}
	act := fairq.Action{Kind: fairq.Settle, Term: v.Term, Reason: v.Data.Reason, RequestID: v.Data.RequestID}
	if v.RecordedNow && !mutant.On("queued-hit-never-marks") {
		// Its message comes again: the redelivery must find the result
		// marked published, not publish it a second time.
		act.AckFailed = func() { res.Mark(actx) }
	}
	cleansOwn = true
	act.After = func() {
		defer cancel()
		res.WaitMarked()
		log.Info("request done", zap.String("requestId", v.Data.RequestID), zap.String("status", string(v.Data.Status)),
			zap.String("origin", string(v.Data.Origin)), zap.String("reason", v.Data.Reason), zap.String("digest", v.Data.Digest))
		if !v.end.settled() && !mutant.On("ahead-end-cleans-unstored") {
			// The run's end is not stored: whoever takes the run over
			// adopts its Job, which must still be there.
			return
		}
		if v.CleanupKey != "" && !w.cfg.KeepJobs && !mutant.On("no-job-cleanup") {
			// A context of its own: actx was made as the decision began,
			// and an end stored ahead slowly (its write retried) or a
			// slow mark may have used it up.
			cctx, ccancel := context.WithTimeout(context.WithoutCancel(actx), 15*time.Second)
			defer ccancel()
			if mutant.On("own-cleanup-on-decision-context") {
				cctx = actx
			}
			if own := v.CleanupKey == ended.key && v.CleanupRun == ended.run; !own && !w.runEnded(cctx, v.CleanupKey, v.CleanupRun) {
				// A decision read back from the ledger (or adopted from
				// it) names the run of whoever decided it, whose end may
				// not be stored (its decider killed while storing it
				// ahead): that run's Job stays for the take-over.
				return
			}
			if err := w.backend.Cleanup(cctx, v.CleanupKey, v.CleanupRun); err != nil {
				log.Warn("cleanup failed; ttlSecondsAfterFinished will remove the job", zap.Error(err))
			}
		}
	}
	return act
}

// publishGrace is how long a decision another worker recorded may stay
// unmarked before this worker takes its publish over (the ledger's
// PublishGrace): the decider publishes right after recording and marks
// right after the PubAck, so a decision left unmarked this long is taken
// to be a dead decider's.
func publishGrace(lease time.Duration) time.Duration { return 2 * lease }

// handling is one handling of a request message: what process knows of
// the request so far, and what a panic's failure is recorded with.
type handling struct {
	in     fairq.Incoming
	meta   *jetstream.MsgMetadata
	cancel context.CancelCauseFunc
	// v and le are the outcome: the decision and the request's ledger
	// entry (nil for input too broken to have one).
	v  verdict
	le *ledger.Entry
	// known, knownLE: the request as far as it was read before a panic
	// (its key, its entry once opened).
	known   verdict
	knownLE *ledger.Entry
}

// safeProcess is processRequest with a panic turned into a terminal error: a
// request that crashes the handler gets a failed result once instead of
// crashing every worker that takes it, forever.
func (w *Worker) safeProcess(ctx context.Context, h *handling) (err error) {
	defer func() {
		if r := recover(); r != nil {
			w.log.Error("panic while handling a request", zap.Any("panic", r), zap.Stack("stack"))
			// The failure is recorded in the ledger like any decision, so
			// a redelivery publishes it again instead of deciding anew.
			h.v, h.le, err = h.known, h.knownLE, fmt.Errorf("internal error while handling the request: %v", r)
			if h.v.Tenant == "" {
				h.v = w.invalid(h.in.Msg, nil, err, v1.Timings{}, h.meta)
			}
		}
	}()
	h.v, h.le, err = w.processRequest(ctx, h)
	return err
}

// retrying tells the request's watchers that it goes back to the queue
// for another try, and why: every retry's reason is in a progress event
// ("waiting": the request waits for its next delivery).
func (w *Worker) retrying(v verdict, le *ledger.Entry, meta *jetstream.MsgMetadata, delay time.Duration, why string) {
	n := int(meta.NumDelivered)
	if le != nil {
		n = le.E.TransientFailures
	}
	w.event(v.Tenant, v.Name, v1.Event{RequestID: v.Data.RequestID, Key: v.Data.Key, Phase: v1.PhaseWaiting,
		Message: fmt.Sprintf("retrying in %s (transient failure %d of at most %d): %s", delay, n, w.cfg.MaxDeliver, why)})
}

func finishedMessage(d v1.ResultData) string {
	if d.Status == v1.StatusSucceeded {
		if d.Origin == v1.OriginCache {
			// Nothing was built or pushed: the image was there already
			// (tagged into this request's destinations where missing).
			return fmt.Sprintf("succeeded (%s): answered from the cache, nothing built: %s", d.Origin, d.ImageRef)
		}
		return fmt.Sprintf("succeeded (%s): %s", d.Origin, d.ImageRef)
	}
	return fmt.Sprintf("%s: %s", d.Status, d.Reason)
}

// publish publishes a decision's result, after its last progress event:
// a client waiting for the result sees the last step before the result
// ends its wait.
func (w *Worker) publish(ctx context.Context, d ledger.Decision) (ledger.Ack, error) {
	w.event(d.Tenant, d.Name, v1.Event{RequestID: d.Data.RequestID, Key: d.Data.Key, Phase: v1.PhaseFinished,
		Message: finishedMessage(d.Data), Job: d.Data.Job})
	ev := v1.NewResult(w.source, d.Data, w.cfg.Now())
	b, err := json.Marshal(ev)
	if err != nil {
		return ledger.Ack{}, err
	}
	// Into the results stream, which stores it as
	// v1.ResultSubject(tenant, name) and publishes it there once stored.
	m := nats.NewMsg(v1.ResultsIngestPrefix + "." + d.Tenant + "." + d.Name)
	m.Header.Set(v1.MsgIDHeader, v1.MsgID(d.Tenant, d.Data.RequestID))
	m.Header.Set("Content-Type", v1.CloudEventsContentType)
	m.Data = b
	// A PubAck lost with a dropped connection never comes, and the wait
	// for it is bounded: a publish whose attempt runs out fails as any
	// failed publish does — whether it was stored is unknown — and the
	// ledger's rules for that take over (a result published first is
	// recorded and published again, whose copy the stream answers as a
	// duplicate; otherwise the request is retried). Waiting out the
	// caller's 15 s instead held the request's decision that long after
	// a NATS restart.
	attempt := w.publishAttempt
	if attempt <= 0 {
		attempt = apiAttempt
	}
	pctx, cancel := context.WithTimeout(ctx, attempt)
	defer cancel()
	ack, err := w.js.PublishMsg(pctx, m)
	if err != nil {
		return ledger.Ack{}, fmt.Errorf("publish result %s: %w", d.Data.RequestID, err)
	}
	w.cfg.Metrics.published(d.Data)
	return ledger.Ack{Duplicate: ack.Duplicate, Seq: ack.Sequence}, nil
}

func (w *Worker) deadLetter(ctx context.Context, tenant string, msg jetstream.Msg, cause error) {
	m := nats.NewMsg(v1.DeadLetterSubject(tenant))
	for k, vs := range msg.Headers() {
		m.Header[k] = vs
	}
	// The copy is stored under its own id: a producer's header must not
	// shadow another message in the dead-letter stream's dedupe window.
	m.Header.Set("Buildq-Original-Msg-Id", msg.Headers().Get(v1.MsgIDHeader))
	if meta, err := msg.Metadata(); err == nil {
		m.Header.Set(v1.MsgIDHeader, fmt.Sprintf("deadletter/%d", meta.Sequence.Stream))
	} else {
		m.Header.Del(v1.MsgIDHeader)
	}
	m.Header.Set("Buildq-Error", cause.Error())
	m.Header.Set("Buildq-Original-Subject", msg.Subject())
	m.Data = msg.Data()
	w.cfg.Metrics.deadLettered()
	if _, err := w.js.PublishMsg(ctx, m); err != nil {
		w.log.Error("dead-letter publish failed", zap.Error(err))
	}
}

// event publishes a progress event; progress is best effort.
func (w *Worker) event(tenant, name string, e v1.Event) {
	if tenant == "" || name == "" || strings.HasPrefix(tenant, "_") || strings.HasPrefix(name, "_") {
		return
	}
	e.Tenant, e.Name, e.Worker, e.Time = tenant, name, w.cfg.ID, w.cfg.Now().UTC()
	if e.Source == nil {
		e.Source = w.sourceInfo.get(tenant, e.RequestID)
	}
	b, err := json.Marshal(e)
	if err != nil {
		return
	}
	_ = w.nc.Publish(v1.EventSubject(tenant, name), b)
}

// ownsEntry reports whether v's request id is one a ledger entry is kept
// for: a tenant's own id, not one generated for unreadable input.
func ownsEntry(v verdict) bool {
	return v.Data.RequestID != "" && !strings.HasPrefix(v.Tenant, "_") && !strings.HasPrefix(v.Data.RequestID, v1.GeneratedIDPrefix)
}

// verdictOf is the recorded decision of an entry.
func verdictOf(e v1.RequestEntry) verdict { return verdict{Decision: ledger.DecisionOf(e)} }

// canceled is v as the "canceled" result of a request its tenant
// canceled.
func (v verdict) canceled() verdict {
	v.Decision = v.Decision.Canceled()
	return v
}
