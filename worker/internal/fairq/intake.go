package fairq

// Fair queueing (docs/design.md §2d). Requests arrive on BUILDQ_REQUESTS,
// the contract's work queue, and are admitted from it by intake: a cheap
// step that applies the tenant's queue-length limit and moves each request
// to BUILDQ_QUEUE under buildq.queue.<tenant>.<priority>. Build slots are
// filled from there by each worker's dispatcher, which picks the tenant
// with the fewest running requests per weight among those with work and
// below their concurrency limit, and within the tenant the highest
// priority first.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// ---- intake ----

// intakeLoop admits requests from buildq-workers until ctx ends.
func (q *Queue) intakeLoop(ctx, workCtx context.Context, wg *sync.WaitGroup) {
	// sem: requests fetched and not yet admitted, twice what is admitted
	// at once (work), so the next fetch is under way while admissions
	// run: without it every fetch's round trip stalls intake.
	sem := make(chan struct{}, 2*intakeConcurrency)
	work := make(chan struct{}, intakeConcurrency)
	backoff := 100 * time.Millisecond
	var pullGone time.Time
	defer func() {
		q.pullGone = pullGone
		close(q.intakeEnded)
	}()
	for ctx.Err() == nil {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		n := 1
	more:
		for n < cap(sem) {
			select {
			case sem <- struct{}{}:
				n++
			default:
				break more
			}
		}
		fctx, cancel := context.WithTimeout(ctx, fetchWait)
		sent := time.Now()
		batch, err := q.intake.Fetch(n, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			for range n {
				<-sem
			}
			if ctx.Err() != nil {
				return
			}
			q.log.Warn("fetch of new requests failed; retrying", zap.Error(err), zap.Duration("backoff", backoff))
			select {
			case <-time.After(backoff):
			case <-ctx.Done():
				return
			}
			backoff = min(backoff*2, 5*time.Second)
			continue
		}
		got := 0
		for msg := range batch.Messages() {
			got++
			wg.Add(1)
			go func() {
				defer wg.Done()
				work <- struct{}{}
				settle := q.admit(workCtx, msg)
				<-work
				<-sem
				if settle != nil {
					// An answer's ack: no intake slot is held for it.
					settle()
				}
			}()
		}
		cancel()
		for range n - got {
			<-sem
		}
		if batch.Error() != nil {
			// Cut short (stopping) or broken: the pull may still wait
			// on the server until its expiry, within fetchWait of
			// being sent. A fetch that ended on its own — full, or
			// told by the server it expired — left none.
			pullGone = sent.Add(fetchWait)
		}
		if err := batch.Error(); err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.Is(err, nats.ErrTimeout) {
			backoff = 100 * time.Millisecond
		} else if ctx.Err() == nil {
			q.log.Warn("fetch of new requests ended with an error", zap.Error(err))
		}
	}
}

// IntakeQuiet waits, once intake was told to stop, until no pull of its
// can still be waiting on the server. A request handed back (Nak) while
// one is goes to it: the fetch that sent it has stopped reading (the
// client drops what comes), and the request comes back only after the
// consumer's AckWait instead of at once. The server checks a pull's
// interest before it delivers, but the client unsubscribes a fetch it
// cut short only after it has closed the fetch's messages, so a stopping
// worker cannot order its hand-backs after that unsubscribe; it waits
// for the cut pull's expiry instead (at most fetchWait, and only when a
// fetch was cut short). Call it only after ctx of Run has ended.
func (q *Queue) IntakeQuiet() {
	t := time.NewTimer(fetchWait)
	defer t.Stop()
	select {
	case <-q.intakeEnded:
	case <-t.C:
		return // intake never ran, or is stuck: hand back all the same
	}
	if d := time.Until(q.pullGone); d > 0 {
		t.Reset(d)
		<-t.C
	}
}

// intakeView is what intake reads of a request body: just enough to queue
// it. Everything else is validated when it is taken from the queue.
type intakeView struct {
	RequestID string `json:"requestId"`
	Priority  string `json:"priority"`
}

// admit moves one request from BUILDQ_REQUESTS to its tenant's queue, or
// refuses it over the tenant's queue-length limit, or has the handler
// answer it at once (Answerer): then it returns what settles the message,
// to be run once the intake slot is given back; or the handler holds it
// until its key's build ends (Holder), and then answers or admits it.
func (q *Queue) admit(ctx context.Context, msg jetstream.Msg) (settle func()) {
	meta, err := msg.Metadata()
	if err != nil {
		q.log.Error("message without JetStream metadata; terminating it", zap.Error(err))
		_ = msg.TermWithReason("no metadata")
		return
	}
	if len(msg.Data()) > v1.MaxRequestBytes {
		// Refused as too large where it is: nothing worth queueing.
		q.handle(ctx, Incoming{Msg: msg}, nil)
		return
	}
	tenant := invalidTenant
	if t, ok := strings.CutPrefix(msg.Subject(), v1.RequestsPrefix+"."); ok && v1.DNSLabelProblem(t) == "" {
		tenant = t
	}
	if n := headerBytes(msg.Headers()); n > maxRequestHeaderBytes {
		// The queue's copy adds headers: a block near JetStream's 64 KiB
		// limit would be refused there on every try, holding intake.
		q.handle(ctx, Incoming{Msg: msg, Refused: &Refusal{v1.ReasonInvalidRequest, fmt.Sprintf(
			"the request's headers are %d bytes, more than the %d allowed", n, maxRequestHeaderBytes)}}, nil)
		return
	}
	atOnce := tenant != invalidTenant && q.takenAtOnce(meta, tenant)
	if a, ok := q.h.(Answerer); ok && tenant != invalidTenant {
		// A cache hit needs no build slot: answered here, it neither
		// waits in the queue nor counts against its limits.
		if ok, settle := a.Answer(ctx, Incoming{Msg: msg, TakenAtOnce: atOnce}); ok {
			return settle
		}
	}
	// What the queue orders a request by, read only when intake did not
	// answer it (an answer decodes the body in full itself).
	var view intakeView
	_ = json.Unmarshal(msg.Data(), &view) // a body that does not decode is refused when it is taken
	prio, _ := v1.PriorityOf(view.Priority)
	if hd, ok := q.h.(Holder); ok && tenant != invalidTenant && meta.NumDelivered == 1 {
		// A request whose key's build is queued or running elsewhere may
		// wait for it here, holding no intake slot and no place in the
		// queue, to be answered from the cache when the build ends.
		if hd.Hold(ctx, Incoming{Msg: msg, TakenAtOnce: atOnce}, func(ctx context.Context) { q.enqueue(ctx, msg, meta, tenant, prio, view) }) {
			return nil
		}
	}
	q.enqueue(ctx, msg, meta, tenant, prio, view)
	return nil
}

// enqueue admits msg to its tenant's queue (or hands it straight to this
// worker's idle dispatcher, direct.go), or refuses it over the tenant's
// queue-length limit.
func (q *Queue) enqueue(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, tenant, prio string, view intakeView) {
	log := q.log.With(zap.Uint64("seq", meta.Sequence.Stream))
	actx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if q.dispatchDirect(msg, meta, tenant, prio) {
		return // its handler settles it (direct.go)
	}
	// The limit is checked on the first delivery only: a redelivery may
	// follow an admission whose ack was lost, and the count would then
	// include the request itself (and the request may be running). So a
	// request handed back by a stopping worker in the middle of its
	// admission is admitted unchecked. Within a worker, a tenant's checks
	// and admissions go one at a time, so a burst cannot pass the limit.
	if limit := q.cfg.Fair.QueueLimitOf(tenant); limit > 0 && tenant != invalidTenant && meta.NumDelivered == 1 {
		mu := q.admitLock(tenant)
		mu.Lock()
		locked := true
		defer func() {
			if locked {
				mu.Unlock()
			}
		}()
		n, err := q.queuedOf(actx, tenant)
		if err != nil {
			log.Warn("counting the tenant's queue failed; retrying the request", zap.Error(err))
			_ = msg.NakWithDelay(time.Second)
			return
		}
		if n >= uint64(limit) {
			// A parked request published again was admitted before: it
			// is never refused for the queue its own wait is part of.
			// Whether it is one is unknown while its ledger entry cannot
			// be read: it is retried then, not refused.
			rq, err := q.cfg.Ledger.ByRequeueToken(actx, tenant, view.RequestID, msg.Headers().Get(ledger.RequeueTokenHeader))
			if err != nil {
				log.Warn("reading the ledger for a requeue token failed; retrying the request", zap.Error(err))
				_ = msg.NakWithDelay(time.Second)
				return
			}
			if rq == nil {
				// The refusal changes no count: others of the tenant
				// need not wait for it.
				mu.Unlock()
				locked = false
				q.refuse(ctx, msg, Refusal{v1.ReasonQuotaExceeded, fmt.Sprintf(
					"tenant %s already has %d requests queued, its limit is %d; submit again when some have finished", tenant, n, limit)})
				return
			}
		}
	}
	out := nats.NewMsg(QueueSubject(tenant, prio))
	out.Data = msg.Data()
	for k, vs := range msg.Headers() {
		// Nats-* headers are JetStream's publish controls (expected
		// stream, sequence, TTL, rollup, …): a tenant's must not act on
		// the queue.
		if l := strings.ToLower(k); strings.HasPrefix(l, "nats-") || strings.HasPrefix(l, "buildq-intake-") {
			continue
		}
		out.Header[k] = vs
	}
	out.Header.Set(HdrIntakeSubject, msg.Subject())
	out.Header.Set(HdrIntakeSeq, strconv.FormatUint(meta.Sequence.Stream, 10))
	out.Header.Set(HdrIntakeTime, meta.Timestamp.UTC().Format(time.RFC3339Nano))
	if meta.NumDelivered > 1 {
		out.Header.Set(HdrIntakeDelivered, strconv.FormatUint(meta.NumDelivered-1, 10))
	}
	if id := msg.Headers().Get(v1.MsgIDHeader); id != "" {
		out.Header.Set(HdrIntakeMsgID, id)
	}
	// The intake message's sequence and time name it: a redelivery after a
	// lost ack is dropped by the queue's duplicate window.
	qid := fmt.Sprintf("intake-%d-%d", meta.Sequence.Stream, meta.Timestamp.UnixNano())
	if _, err := q.js.PublishMsg(actx, out, jetstream.WithMsgID(qid)); err != nil {
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && int(meta.NumDelivered) >= q.cfg.MaxDeliver {
			// The server refuses this message every time: answer it
			// rather than hold it (and an intake slot) forever.
			log.Error("the queue refuses the request; failing it", zap.Error(err))
			q.handle(ctx, Incoming{Msg: msg, Refused: &Refusal{v1.ReasonInfrastructureError,
				"the request could not be queued: " + err.Error()}}, nil)
			return
		}
		log.Warn("admitting the request failed; retrying it", zap.Error(err))
		_ = msg.NakWithDelay(ledger.RetryDelay(nil, meta.NumDelivered))
		return
	}
	_ = q.nc.Publish(wakeSubject, []byte(tenant+" "+prio))
	if err := msg.DoubleAck(actx); err != nil {
		log.Warn("ack of an admitted request failed; its redelivery is dropped as a duplicate", zap.Error(err))
	}
}

// refuse answers a request intake refuses at its tenant's queue limit.
// The limit is checked on a first delivery only (a redelivery may follow
// an admission whose ack was lost), so a refusal the handler could not
// settle — its ledger entry or its decision not written, its result not
// published: the handler asks for a retry — must not be handed back, or
// its redelivery would be admitted unchecked. It is retried here, holding
// the message (heartbeaten), with the handler's delays; only a worker that
// stops meanwhile, or --max-deliver tries that all failed, hands it back.
func (q *Queue) refuse(ctx context.Context, msg jetstream.Msg, r Refusal) {
	in := Incoming{Msg: msg, Refused: &r}
	for try := 1; ; try++ {
		act := q.h.Decide(ctx, in)
		if act.Kind != Retry && act.Kind != Later {
			q.h.Apply(msg, act)
			if act.After != nil {
				act.After()
			}
			return
		}
		if try >= q.cfg.MaxDeliver {
			q.h.Apply(msg, act)
			return
		}
		q.log.Warn("the refusal of a request over its tenant's queue limit is not settled; retrying it in place",
			zap.String("subject", msg.Subject()), zap.Duration("delay", act.Delay))
		stop := q.h.Heartbeat(msg, 0)
		select {
		case <-time.After(act.Delay):
		case <-ctx.Done():
		}
		stop()
		if ctx.Err() != nil {
			q.h.Apply(msg, Action{Kind: HandBack})
			return
		}
	}
}

// maxRequestHeaderBytes bounds a request message's headers (the SDK sends
// one, Nats-Msg-Id).
const maxRequestHeaderBytes = 16 << 10

// headerBytes is the size of h as NATS sends it, near enough.
func headerBytes(h nats.Header) int {
	n := 0
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// admitLock is the lock of tenant's queue-limit checks in this worker.
func (q *Queue) admitLock(tenant string) *sync.Mutex {
	mu, _ := q.admitMu.LoadOrStore(tenant, &sync.Mutex{})
	return mu.(*sync.Mutex)
}

// queuedOf counts tenant's admitted, unfinished requests.
func (q *Queue) queuedOf(ctx context.Context, tenant string) (uint64, error) {
	info, err := q.queue.Info(ctx, jetstream.WithSubjectFilter(v1.QueuePrefix+"."+tenant+".>"))
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}
