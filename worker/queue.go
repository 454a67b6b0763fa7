package worker

// Fair queueing (docs/design.md §2d). Requests arrive on BUILDQ_REQUESTS,
// the contract's work queue, and are admitted from it by intake: a cheap
// step that applies the tenant's queue-length limit and moves each request
// to BUILDQ_QUEUE under buildq.queue.<tenant>.<priority>. Build slots are
// filled from there by each worker's dispatcher, which picks the tenant
// with the fewest running requests per weight among those with work and
// below their concurrency limit, and within the tenant the highest
// priority first.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

const (
	// invalidTenant queues requests whose subject names no valid tenant
	// (they are answered InvalidRequest); no tenant can be called this.
	invalidTenant = "_invalid"
	// dispatchConsumerPrefix names the per-tenant, per-priority consumers:
	// buildq-q-<priority>-<tenant>.
	dispatchConsumerPrefix = "buildq-q-"
	// wakeSubject tells every worker's dispatcher that a request was
	// admitted (payload: "<tenant> <priority>") or that a tenant's
	// concurrency slot was freed ("<tenant>"); core NATS, best effort.
	wakeSubject = "buildq.internal.queued"
	// Headers intake adds to a queued message: where the request arrived.
	hdrIntakeSubject = "Buildq-Intake-Subject"
	hdrIntakeSeq     = "Buildq-Intake-Seq"
	hdrIntakeTime    = "Buildq-Intake-Time"
	hdrIntakeMsgID   = "Buildq-Intake-Msg-Id"
	// intakeConcurrency bounds the requests a worker admits at once;
	// admitting uses no build slot.
	intakeConcurrency = 16
	// viewMaxAge bounds how old the dispatcher's view of the queue may be
	// when it picks; idlePoll is how often an idle dispatcher looks again.
	viewMaxAge = 250 * time.Millisecond
	idlePoll   = 500 * time.Millisecond
)

// queueSubject is where intake puts a tenant's request of priority p.
func queueSubject(tenant, p string) string { return v1.QueuePrefix + "." + tenant + "." + p }

// dispatchConsumer names the consumer of a tenant's priority p.
func dispatchConsumer(tenant, p string) string { return dispatchConsumerPrefix + p + "-" + tenant }

// FairConfig holds the fair-queueing rules. Maps are keyed by tenant; the
// key "*" sets the value of every tenant not named.
type FairConfig struct {
	// Weights: a tenant's share of the build slots against the others'
	// (default 1). A tenant of weight 2 runs twice as many requests as
	// one of weight 1 while both have work waiting.
	Weights map[string]int
	// Concurrency: how many of a tenant's requests run at once, across all
	// workers (0 or absent: no limit). A tenant at its limit waits.
	Concurrency map[string]int
	// QueueLimit: how many of a tenant's requests may wait (admitted, not
	// finished); a request beyond it gets failed/QuotaExceeded (0 or
	// absent: no limit).
	QueueLimit map[string]int
}

func lookup(m map[string]int, tenant string) int {
	if v, ok := m[tenant]; ok {
		return v
	}
	return m["*"]
}

// Weight returns tenant's weight (at least 1).
func (f FairConfig) Weight(tenant string) int { return max(lookup(f.Weights, tenant), 1) }

// ConcurrencyOf returns tenant's concurrency limit (0: none).
func (f FairConfig) ConcurrencyOf(tenant string) int {
	if tenant == invalidTenant {
		return 0
	}
	return lookup(f.Concurrency, tenant)
}

// QueueLimitOf returns tenant's queue-length limit (0: none).
func (f FairConfig) QueueLimitOf(tenant string) int { return lookup(f.QueueLimit, tenant) }

// Validate reports every invalid rule.
func (f FairConfig) Validate() error {
	var errs []error
	check := func(what string, m map[string]int, least int) {
		for t, v := range m {
			if t != "*" && v1.DNSLabelProblem(t) != "" {
				errs = append(errs, fmt.Errorf("%s: %q is not a tenant (a DNS-1123 label, or * for every other tenant)", what, t))
			}
			if v < least {
				errs = append(errs, fmt.Errorf("%s of %s must be at least %d, got %d", what, t, least, v))
			}
		}
	}
	check("tenant weight", f.Weights, 1)
	check("tenant concurrency", f.Concurrency, 0)
	check("tenant queue limit", f.QueueLimit, 0)
	return errors.Join(errs...)
}

// ensureQueue creates or updates BUILDQ_QUEUE, the buildq-queued consumer
// and the slots bucket.
func ensureQueue(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.Stream, jetstream.KeyValue, error) {
	st, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.QueueStream,
		Description: "buildq admitted requests, by tenant and priority, until finished",
		Subjects:    []string{v1.QueuePrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create stream %s: %w", v1.QueueStream, err)
	}
	if _, err := js.CreateOrUpdateConsumer(ctx, v1.QueueStream, jetstream.ConsumerConfig{
		Durable:       v1.QueuedConsumer,
		Description:   "never pulled: its pending count is the requests admitted and not finished (autoscaling)",
		AckPolicy:     jetstream.AckExplicitPolicy,
		FilterSubject: v1.QueuePrefix + ".>",
	}); err != nil {
		return nil, nil, fmt.Errorf("create consumer %s: %w", v1.QueuedConsumer, err)
	}
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      v1.SlotsBucket,
		Description: "buildq per-tenant concurrency slots: <tenant>.<n> per running request",
		History:     1,
		// No TTL: a key's life is its holder's lease as the key records
		// it, judged on each reader's clock, and it is kept for a request
		// whose build may be running (see the concurrency slots below).
		// A bucket TTL would be the last starting worker's lease, and a
		// NATS outage longer than it would drop every key.
		Storage:  cfg.Storage,
		Replicas: cfg.Replicas,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create key-value bucket %s: %w", v1.SlotsBucket, err)
	}
	return st, kv, nil
}

// ---- intake ----

// intakeLoop admits requests from buildq-workers until ctx ends.
func (w *Worker) intakeLoop(ctx, workCtx context.Context, wg *sync.WaitGroup) {
	sem := make(chan struct{}, intakeConcurrency)
	backoff := 100 * time.Millisecond
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
		batch, err := w.cons.Fetch(n, jetstream.FetchContext(fctx))
		if err != nil {
			cancel()
			for range n {
				<-sem
			}
			if ctx.Err() != nil {
				return
			}
			w.log.Warn("fetch of new requests failed; retrying", zap.Error(err), zap.Duration("backoff", backoff))
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
				defer func() { <-sem }()
				w.admit(workCtx, msg)
			}()
		}
		cancel()
		for range n - got {
			<-sem
		}
		if err := batch.Error(); err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.Is(err, nats.ErrTimeout) {
			backoff = 100 * time.Millisecond
		} else if ctx.Err() == nil {
			w.log.Warn("fetch of new requests ended with an error", zap.Error(err))
		}
	}
}

// intakeView is what intake reads of a request body: just enough to queue
// it. Everything else is validated when it is taken from the queue.
type intakeView struct {
	RequestID string `json:"requestId"`
	Priority  string `json:"priority"`
}

// refuseKey marks a context whose request intake refuses: process answers
// it with the refusal instead of building it.
type refuseKey struct{}

// refusal is why intake refused a request.
type refusal struct{ reason, message string }

// admit moves one request from BUILDQ_REQUESTS to its tenant's queue, or
// refuses it over the tenant's queue-length limit.
func (w *Worker) admit(ctx context.Context, msg jetstream.Msg) {
	meta, err := msg.Metadata()
	if err != nil {
		w.log.Error("message without JetStream metadata; terminating it", zap.Error(err))
		_ = msg.TermWithReason("no metadata")
		return
	}
	log := w.log.With(zap.Uint64("seq", meta.Sequence.Stream))
	if len(msg.Data()) > v1.MaxRequestBytes {
		// Refused as too large where it is: nothing worth queueing.
		w.handle(ctx, msg)
		return
	}
	tenant := invalidTenant
	if t, ok := strings.CutPrefix(msg.Subject(), v1.RequestsPrefix+"."); ok && v1.DNSLabelProblem(t) == "" {
		tenant = t
	}
	var view intakeView
	_ = json.Unmarshal(msg.Data(), &view) // a body that does not decode is refused when it is taken
	prio, _ := v1.PriorityOf(view.Priority)

	actx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if n := headerBytes(msg.Headers()); n > maxRequestHeaderBytes {
		// The queue's copy adds headers: a block near JetStream's 64 KiB
		// limit would be refused there on every try, holding intake.
		w.handle(context.WithValue(ctx, refuseKey{}, refusal{v1.ReasonInvalidRequest, fmt.Sprintf(
			"the request's headers are %d bytes, more than the %d allowed", n, maxRequestHeaderBytes)}), msg)
		return
	}
	// The limit is checked on the first delivery only: a redelivery may
	// follow an admission whose ack was lost, and the count would then
	// include the request itself (and the request may be running). So a
	// request handed back by a stopping worker in the middle of its
	// admission is admitted unchecked. Within a worker, a tenant's checks
	// and admissions go one at a time, so a burst cannot pass the limit.
	if limit := w.cfg.Fair.QueueLimitOf(tenant); limit > 0 && tenant != invalidTenant && meta.NumDelivered == 1 {
		mu := w.admitLock(tenant)
		mu.Lock()
		locked := true
		defer func() {
			if locked {
				mu.Unlock()
			}
		}()
		n, err := w.queuedOf(actx, tenant)
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
			rq, err := w.requeuedEntry(actx, msg, tenant, view.RequestID)
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
				w.refuse(ctx, msg, refusal{v1.ReasonQuotaExceeded, fmt.Sprintf(
					"tenant %s already has %d requests queued, its limit is %d; submit again when some have finished", tenant, n, limit)})
				return
			}
		}
	}
	out := nats.NewMsg(queueSubject(tenant, prio))
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
	out.Header.Set(hdrIntakeSubject, msg.Subject())
	out.Header.Set(hdrIntakeSeq, strconv.FormatUint(meta.Sequence.Stream, 10))
	out.Header.Set(hdrIntakeTime, meta.Timestamp.UTC().Format(time.RFC3339Nano))
	if id := msg.Headers().Get(v1.MsgIDHeader); id != "" {
		out.Header.Set(hdrIntakeMsgID, id)
	}
	// The intake message's sequence and time name it: a redelivery after a
	// lost ack is dropped by the queue's duplicate window.
	qid := fmt.Sprintf("intake-%d-%d", meta.Sequence.Stream, meta.Timestamp.UnixNano())
	if _, err := w.js.PublishMsg(actx, out, jetstream.WithMsgID(qid)); err != nil {
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && int(meta.NumDelivered) >= w.cfg.MaxDeliver {
			// The server refuses this message every time: answer it
			// rather than hold it (and an intake slot) forever.
			log.Error("the queue refuses the request; failing it", zap.Error(err))
			w.handle(context.WithValue(ctx, refuseKey{}, refusal{v1.ReasonInfrastructureError,
				"the request could not be queued: " + err.Error()}), msg)
			return
		}
		log.Warn("admitting the request failed; retrying it", zap.Error(err))
		_ = msg.NakWithDelay(retryDelay(meta.NumDelivered))
		return
	}
	_ = w.nc.Publish(wakeSubject, []byte(tenant+" "+prio))
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
func (w *Worker) refuse(ctx context.Context, msg jetstream.Msg, r refusal) {
	rctx := context.WithValue(ctx, refuseKey{}, r)
	for try := 1; ; try++ {
		held := &refusalMsg{Msg: msg}
		w.handle(rctx, held)
		if !held.retry {
			return
		}
		if try >= w.cfg.MaxDeliver {
			_ = msg.NakWithDelay(held.delay)
			return
		}
		w.log.Warn("the refusal of a request over its tenant's queue limit is not settled; retrying it in place",
			zap.String("subject", msg.Subject()), zap.Duration("delay", held.delay))
		stop := w.heartbeat(msg)
		select {
		case <-time.After(held.delay):
		case <-ctx.Done():
		}
		stop()
		if ctx.Err() != nil {
			_ = msg.Nak()
			return
		}
	}
}

// refusalMsg is a refused request's message whose retries (NakWithDelay)
// refuse keeps for itself.
type refusalMsg struct {
	jetstream.Msg
	retry bool
	delay time.Duration
}

func (m *refusalMsg) NakWithDelay(d time.Duration) error {
	m.retry, m.delay = true, d
	return nil
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
func (w *Worker) admitLock(tenant string) *sync.Mutex {
	mu, _ := w.admitMu.LoadOrStore(tenant, &sync.Mutex{})
	return mu.(*sync.Mutex)
}

// queuedOf counts tenant's admitted, unfinished requests.
func (w *Worker) queuedOf(ctx context.Context, tenant string) (uint64, error) {
	info, err := w.queue.Info(ctx, jetstream.WithSubjectFilter(v1.QueuePrefix+"."+tenant+".>"))
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return n, nil
}

// ---- the queued message ----

// queuedMsg is a message of BUILDQ_QUEUE seen as the request message it
// was admitted from: its subject, headers, stream sequence and time are
// the original's, so the request's identity and queue wait are unchanged.
// Settling it (ack or term) deletes it from the queue.
type queuedMsg struct {
	jetstream.Msg
	subject string
	hdr     nats.Header
	meta    *jetstream.MsgMetadata
	qseq    uint64
	queue   jetstream.Stream
	// handedBack: the handler gave the message back at once (Nak);
	// retryIn: it asked for it again after a delay (NakWithDelay).
	handedBack atomic.Bool
	retryIn    atomic.Int64
	// ackWait is the AckWait of the consumer the message came from, as
	// this worker last knew it: heartbeats go at least every third of it.
	ackWait time.Duration
}

// asRequest restores the request message behind a queued message.
func asRequest(m jetstream.Msg, queue jetstream.Stream) (*queuedMsg, error) {
	qm, err := m.Metadata()
	if err != nil {
		return nil, err
	}
	h := m.Headers()
	seq, err := strconv.ParseUint(h.Get(hdrIntakeSeq), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("queued message %d has no intake sequence", qm.Sequence.Stream)
	}
	at, err := time.Parse(time.RFC3339Nano, h.Get(hdrIntakeTime))
	if err != nil {
		return nil, fmt.Errorf("queued message %d has no intake time", qm.Sequence.Stream)
	}
	subj := h.Get(hdrIntakeSubject)
	if subj == "" {
		return nil, fmt.Errorf("queued message %d has no intake subject", qm.Sequence.Stream)
	}
	hdr := nats.Header{}
	for k, vs := range h {
		if !strings.HasPrefix(k, "Buildq-Intake-") && k != v1.MsgIDHeader {
			hdr[k] = vs
		}
	}
	if id := h.Get(hdrIntakeMsgID); id != "" {
		hdr.Set(v1.MsgIDHeader, id)
	}
	meta := *qm
	meta.Sequence.Stream = seq
	meta.Timestamp = at
	meta.Stream = v1.RequestsStream
	return &queuedMsg{Msg: m, subject: subj, hdr: hdr, meta: &meta, qseq: qm.Sequence.Stream, queue: queue}, nil
}

func (q *queuedMsg) Subject() string                           { return q.subject }
func (q *queuedMsg) Headers() nats.Header                      { return q.hdr }
func (q *queuedMsg) Metadata() (*jetstream.MsgMetadata, error) { m := *q.meta; return &m, nil }

// remove deletes the message from the queue; a message already gone is
// fine. Until it is deleted, it counts as queued and would be handled
// again (publishing the same, recorded result).
func (q *queuedMsg) remove(ctx context.Context) error {
	err := q.queue.DeleteMsg(ctx, q.qseq)
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) && !isMsgDeleted(err) {
		return err
	}
	return nil
}

func isMsgDeleted(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeMessageNotFound
}

func (q *queuedMsg) Ack() error { return q.DoubleAck(context.Background()) }

func (q *queuedMsg) Nak() error {
	q.handedBack.Store(true)
	return q.Msg.Nak()
}

func (q *queuedMsg) NakWithDelay(d time.Duration) error {
	q.retryIn.Store(int64(max(d, time.Millisecond)))
	return q.Msg.NakWithDelay(d)
}

func (q *queuedMsg) DoubleAck(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := q.remove(ctx); err != nil {
		return err // not acked: redelivered after AckWait and settled again
	}
	_ = q.Msg.Ack()
	return nil
}

func (q *queuedMsg) Term() error { return q.TermWithReason("") }

func (q *queuedMsg) TermWithReason(reason string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.remove(ctx); err != nil {
		return err
	}
	if reason == "" {
		return q.Msg.Term()
	}
	_ = q.Msg.TermWithReason(reason)
	return nil
}

// ---- concurrency slots ----

// A tenant's concurrency slots are the keys <tenant>.<n>, n below its
// limit, of the slots bucket (docs/design.md §2d): Create is atomic on the
// server, so at most limit of them exist. A key counts for as long as the
// request it was taken for may have a build running. It is
//
//   - live while its holder renews it, every third of the holder's own
//     lease (LeaseMs in the value);
//   - handed back when its holder stopped with the request handed back
//     and its build running on, or retries the request after a delay
//     (the run it let go may have a Job running on);
//   - lapsed when a reader watched it unchanged, without a gap, for 1.5
//     of its holder's leases on the reader's own clock (the holder died,
//     or lost NATS).
//
// The bucket has no TTL, and no clock is compared with another: workers
// with other leases or skewed clocks, and a NATS outage (which breaks
// every reader's watch), leave a live holder its key. A handed-back or
// lapsed key is free when it names no request, or its request is
// finished (its message is gone from BUILDQ_QUEUE) or runs on a live key;
// otherwise it is kept for its request, and a dispatcher takes it only
// with that request (takeReserved). So a request whose build may be
// running always holds a key, whatever the AckWait, the priorities or the
// leases: the limit is exact.

// slotValue is what a slot's key holds.
type slotValue struct {
	// Holder names the worker and this hold of the slot (unique).
	Holder string `json:"holder"`
	// LeaseMs is the holder's lease: it renews the key every third of
	// it, and a reader counts the key lapsed once it watched it unchanged
	// for 1.5 times it.
	LeaseMs int64 `json:"leaseMs,omitempty"`
	// HandedBack: the holder stopped with the request handed back, its
	// build still running; or the request is retried after RetryMs
	// (transient trouble: the run it let go may still have a Job).
	HandedBack bool  `json:"handedBack,omitempty"`
	RetryMs    int64 `json:"retryMs,omitempty"`
	// Subject and QueueSeq name the request the slot was taken for: its
	// queue subject and its message in BUILDQ_QUEUE. They are written
	// before the request is handled; while that message is in the queue,
	// a handed-back or lapsed key is kept for that request.
	Subject  string `json:"subject,omitempty"`
	QueueSeq uint64 `json:"queueSeq,omitempty"`
}

// lease is the holder's lease (def for a value without one).
func (v slotValue) lease(def time.Duration) time.Duration {
	if v.LeaseMs <= 0 {
		return def
	}
	return time.Duration(v.LeaseMs) * time.Millisecond
}

// slotWatch remembers, per slot key, the revision this worker last read
// and since when it has read it unchanged without a gap.
type slotWatch struct {
	mu sync.Mutex
	m  map[string]slotSeen
}

type slotSeen struct {
	rev         uint64
	since, last time.Time
}

// watch records a read of key at rev and returns how long this worker has
// seen the key unchanged. A gap of more than gap since its previous read
// (this worker could not read: a NATS outage, a pause, during which the
// holder could not renew either) starts the watch again.
func (sw *slotWatch) watch(key string, rev uint64, gap time.Duration, now time.Time) time.Duration {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	if sw.m == nil {
		sw.m = map[string]slotSeen{}
	}
	s, ok := sw.m[key]
	if !ok || s.rev != rev || now.Sub(s.last) > gap || now.Before(s.last) {
		sw.m[key] = slotSeen{rev: rev, since: now, last: now}
		return 0
	}
	s.last = now
	sw.m[key] = s
	return now.Sub(s.since)
}

func (sw *slotWatch) forget(key string) {
	sw.mu.Lock()
	delete(sw.m, key)
	sw.mu.Unlock()
}

// slotState is a slot key as this worker reads it now.
type slotState struct {
	key     string
	rev     uint64
	v       slotValue
	watched time.Duration
	// kept: handed back, or lapsed; no live holder renews it.
	kept bool
}

// readSlot judges a slot key read at e.
func (w *Worker) readSlot(key string, e jetstream.KeyValueEntry) slotState {
	var v slotValue
	if json.Unmarshal(e.Value(), &v) != nil {
		v = slotValue{} // unreadable: judged by its lapse, naming no request
	}
	lease := v.lease(w.cfg.Lease)
	// The watch tolerates gaps of this worker's own reading pace too (it
	// reads every third of its lease).
	watched := w.slotSeen.watch(key, e.Revision(), max(lease, w.cfg.Lease), w.cfg.Now())
	return slotState{key: key, rev: e.Revision(), v: v, watched: watched, kept: v.HandedBack || watched >= lease+lease/2}
}

// slotFree reports whether a kept key is free: it names no request, its
// request runs on a live key (held: the queue sequences live keys name),
// or its request is finished (its message gone from the queue).
func (w *Worker) slotFree(ctx context.Context, s slotState, held map[uint64]bool) (bool, error) {
	if s.v.QueueSeq == 0 || held[s.v.QueueSeq] {
		return true, nil
	}
	_, err := w.queue.GetMsg(ctx, s.v.QueueSeq)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return true, nil
	case err != nil:
		return false, err
	}
	return false, nil
}

// slot is one of a tenant's concurrency slots, held while its request runs.
type slot struct {
	w      *Worker
	tenant string
	key    string
	val    slotValue
	rev    uint64
	// reserved: a kept key, not taken yet, for the request reservedFor
	// names; watched is how long this worker saw it unchanged.
	reserved    bool
	reservedFor slotValue
	watched     time.Duration
	renewing    bool
	stop        chan struct{}
	done        chan struct{}
}

func (w *Worker) newSlot(tenant, key string, val slotValue, rev uint64) *slot {
	return &slot{w: w, tenant: tenant, key: key, val: val, rev: rev, stop: make(chan struct{}), done: make(chan struct{})}
}

func (s *slot) bytes() []byte {
	b, _ := json.Marshal(s.val)
	return b
}

// acquireSlot takes a free slot of tenant's limit: a key nobody holds, or
// a handed-back or lapsed one that is free (slotFree). Failing that, it
// returns a kept key reserved for its request (s.reserved: not taken yet;
// see takeReserved), or reports none.
func (w *Worker) acquireSlot(ctx context.Context, tenant string, limit int) (*slot, bool) {
	val := slotValue{Holder: w.cfg.ID + "/" + newRunID(), LeaseMs: w.cfg.Lease.Milliseconds()}
	b, _ := json.Marshal(val)
	var kept []slotState
	held := map[uint64]bool{}
	for i := range limit {
		key := tenant + "." + strconv.Itoa(i)
		rev, err := w.slots.Create(ctx, key, b)
		if err == nil {
			return w.newSlot(tenant, key, val, rev), true
		}
		if !isWrongRevision(err) {
			w.log.Warn("taking a concurrency slot failed", zap.String("tenant", tenant), zap.Error(err))
			return nil, false
		}
		e, err := w.slots.Get(ctx, key)
		if err != nil {
			continue // deleted meanwhile, or unreadable now: looked at again later
		}
		st := w.readSlot(key, e)
		if !st.kept {
			if st.v.QueueSeq > 0 {
				held[st.v.QueueSeq] = true
			}
			continue
		}
		kept = append(kept, st)
	}
	var reserved *slotState
	for i, st := range kept {
		free, err := w.slotFree(ctx, st, held)
		if err != nil {
			continue
		}
		if !free {
			if reserved == nil {
				reserved = &kept[i]
			}
			continue
		}
		if rev, err := w.slots.Update(ctx, st.key, b, st.rev); err == nil {
			w.slotSeen.forget(st.key)
			return w.newSlot(tenant, st.key, val, rev), true
		}
	}
	if reserved != nil {
		s := w.newSlot(tenant, reserved.key, val, reserved.rev)
		s.reserved, s.reservedFor, s.watched = true, reserved.v, reserved.watched
		return s, true
	}
	return nil, false
}

// hold records the request a fresh slot was taken for — before the
// request is handled: a slot that names no request is freed when its
// holder lapses — and starts renewing the slot.
func (s *slot) hold(ctx context.Context, subject string, qseq uint64) error {
	s.val.Subject, s.val.QueueSeq = subject, qseq
	rev, err := s.w.slots.Update(ctx, s.key, s.bytes(), s.rev)
	if err != nil {
		if rev, err = s.recover(ctx, err); err != nil {
			return err
		}
	}
	s.rev = rev
	s.startRenew()
	return nil
}

// take takes a reserved slot for its request, which the caller holds.
func (s *slot) take(ctx context.Context) error {
	s.val.Subject, s.val.QueueSeq = s.reservedFor.Subject, s.reservedFor.QueueSeq
	rev, err := s.w.slots.Update(ctx, s.key, s.bytes(), s.rev)
	if err != nil {
		return err
	}
	s.rev, s.reserved = rev, false
	s.w.slotSeen.forget(s.key)
	s.startRenew()
	return nil
}

func (s *slot) startRenew() {
	s.renewing = true
	go s.renew()
}

func (s *slot) stopRenew() {
	if s.renewing {
		s.renewing = false
		close(s.stop)
		<-s.done
	}
}

// renew keeps s live until it is released. A renewal whose reply was lost
// leaves the key a revision ahead: the key is read back, and if it is
// still this hold's, renewing goes on from its revision.
func (s *slot) renew() {
	defer close(s.done)
	lease := s.w.cfg.Lease
	t := time.NewTicker(max(lease/3, 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), lease/3+time.Second)
		rev, err := s.w.slots.Update(ctx, s.key, s.bytes(), s.rev)
		if err != nil {
			rev, err = s.recover(ctx, err)
		}
		cancel()
		if err != nil {
			s.w.log.Warn("renewing a concurrency slot failed", zap.String("slot", s.key), zap.Error(err))
			continue
		}
		s.rev = rev
	}
}

func (s *slot) recover(ctx context.Context, cause error) (uint64, error) {
	e, err := s.w.slots.Get(ctx, s.key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted):
		// Freed by a reader that saw it lapse: take it again if it is
		// still free.
		return s.w.slots.Create(ctx, s.key, s.bytes())
	case err != nil:
		return 0, cause
	}
	var cur slotValue
	if json.Unmarshal(e.Value(), &cur) != nil || cur.Holder != s.val.Holder || cur.HandedBack {
		return 0, fmt.Errorf("the slot was taken by another holder (this worker's renewals failed for longer than the lease): %w", cause)
	}
	return s.w.slots.Update(ctx, s.key, s.bytes(), e.Revision())
}

// release frees s.
func (s *slot) release() {
	if s == nil || s.reserved {
		return
	}
	s.stopRenew()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if s.w.slots.Delete(ctx, s.key, jetstream.LastRevision(s.rev)) == nil {
		s.w.slotSeen.forget(s.key)
		// Dispatchers that skipped the tenant at its limit look again.
		_ = s.w.nc.Publish(wakeSubject, []byte(s.tenant))
	}
	// Otherwise it lapses, and is freed once its request is finished.
}

// handBack keeps s for the handed-back request of subject: its build goes
// on, and whoever takes the request on takes this slot with it — at once,
// or for a request retried after a delay (retry), once the delay passed.
func (s *slot) handBack(subject string, qseq uint64, retry time.Duration) {
	if s == nil || s.reserved {
		return
	}
	s.stopRenew()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.val.HandedBack, s.val.Subject, s.val.QueueSeq = true, subject, qseq
	s.val.RetryMs = retry.Milliseconds()
	if _, err := s.w.slots.Update(ctx, s.key, s.bytes(), s.rev); err == nil {
		_ = s.w.nc.Publish(wakeSubject, []byte(s.tenant))
	}
	// Otherwise it lapses, and is kept for its request all the same.
}

// keepSlots frees the handed-back and lapsed keys that are free
// (slotFree), announcing each: a key kept for a request whose message is
// gone, or that runs on another key, or a lapsed key naming no request.
// Reading every key every third of the lease is also what keeps this
// worker's watch of them without gaps.
func (w *Worker) keepSlots(ctx context.Context) {
	keys, err := w.slots.ListKeys(ctx)
	if err != nil {
		return
	}
	var kept []slotState
	held := map[uint64]bool{}
	for k := range keys.Keys() {
		e, err := w.slots.Get(ctx, k)
		if err != nil {
			continue
		}
		st := w.readSlot(k, e)
		if !st.kept {
			if st.v.QueueSeq > 0 {
				held[st.v.QueueSeq] = true
			}
			continue
		}
		kept = append(kept, st)
	}
	for _, st := range kept {
		if free, err := w.slotFree(ctx, st, held); err != nil || !free {
			continue
		}
		if w.slots.Delete(ctx, st.key, jetstream.LastRevision(st.rev)) == nil {
			w.slotSeen.forget(st.key)
			tenant, _, _ := strings.Cut(st.key, ".")
			_ = w.nc.Publish(wakeSubject, []byte(tenant))
		}
	}
}

// ---- the dispatcher ----

// dispatcher fills this worker's free build slots from the queue.
type dispatcher struct {
	w *Worker

	mu     sync.Mutex
	view   map[string]map[string]uint64 // tenant → priority → queued
	viewAt time.Time
	dry    map[string]bool // fetched nothing since the last look
	// full: tenants found at their concurrency limit, until when they are
	// skipped without asking the slots bucket again (a freed slot's
	// announcement clears it sooner).
	full    map[string]time.Time
	running map[string]int // this worker's requests per tenant
	vtime   map[string]float64
	vnow    float64
	cons    map[string]jetstream.Consumer
	wake    chan struct{}
}

func newDispatcher(w *Worker) *dispatcher {
	return &dispatcher{w: w, view: map[string]map[string]uint64{}, dry: map[string]bool{}, full: map[string]time.Time{}, running: map[string]int{},
		vtime: map[string]float64{}, cons: map[string]jetstream.Consumer{}, wake: make(chan struct{}, 1)}
}

// woken records an admitted request ("<tenant> <priority>") or a freed
// concurrency slot ("<tenant>") announced on wakeSubject.
func (d *dispatcher) woken(m *nats.Msg) {
	tenant, prio, admitted := strings.Cut(string(m.Data), " ")
	if _, ok := v1.PriorityOf(prio); !ok || tenant == "" {
		return
	}
	d.mu.Lock()
	if admitted {
		if d.view[tenant] == nil {
			d.view[tenant] = map[string]uint64{}
		}
		d.view[tenant][prio]++
	}
	delete(d.dry, tenant)
	delete(d.full, tenant)
	d.mu.Unlock()
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// look reads the queue's per-subject counts.
func (d *dispatcher) look(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	info, err := d.w.queue.Info(ctx, jetstream.WithSubjectFilter(v1.QueuePrefix+".>"))
	if err != nil {
		d.w.log.Debug("reading the queue failed", zap.Error(err))
		return
	}
	view := map[string]map[string]uint64{}
	for subj, n := range info.State.Subjects {
		parts := strings.Split(subj, ".")
		if len(parts) != 4 || n == 0 {
			continue
		}
		if view[parts[2]] == nil {
			view[parts[2]] = map[string]uint64{}
		}
		view[parts[2]][parts[3]] = n
	}
	d.mu.Lock()
	d.view, d.viewAt, d.dry = view, time.Now(), map[string]bool{}
	d.mu.Unlock()
}

// order returns the tenants with queued work, the one most owed a slot
// first: fewest running per weight, then least served lately.
func (d *dispatcher) order() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var ts []string
	for t, ps := range d.view {
		if d.dry[t] || time.Now().Before(d.full[t]) {
			continue
		}
		for _, n := range ps {
			if n > 0 {
				ts = append(ts, t)
				break
			}
		}
	}
	share := func(t string) float64 { return float64(d.running[t]) / float64(d.w.cfg.Fair.Weight(t)) }
	vt := func(t string) float64 {
		if v, ok := d.vtime[t]; ok && v > d.vnow {
			return v
		}
		return d.vnow
	}
	slices.SortFunc(ts, func(a, b string) int {
		if mutant("ignore-shares") {
			return strings.Compare(a, b)
		}
		if c := cmp.Compare(share(a), share(b)); c != 0 {
			return c
		}
		if c := cmp.Compare(vt(a), vt(b)); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	return ts
}

// started counts a request of tenant taken by this worker; finished undoes it.
func (d *dispatcher) started(tenant, prio string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.running[tenant]++
	v := max(d.vtime[tenant], d.vnow)
	d.vnow = v
	d.vtime[tenant] = v + 1/float64(d.w.cfg.Fair.Weight(tenant))
	if n := d.view[tenant][prio]; n > 0 {
		d.view[tenant][prio] = n - 1
	}
}

func (d *dispatcher) finished(tenant string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.running[tenant]--; d.running[tenant] <= 0 {
		delete(d.running, tenant)
	}
}

// consumer returns (creating it if needed) the consumer of tenant's prio.
func (d *dispatcher) consumer(ctx context.Context, tenant, prio string) (jetstream.Consumer, error) {
	name := dispatchConsumer(tenant, prio)
	// At least the AckWait every worker's heartbeats follow now:
	// buildq-workers' as the server has it (workers with different
	// --ack-wait share both). A dispatch consumer's AckWait is only ever
	// raised, never lowered: a request taken under AckWait X is
	// heartbeaten every X/3 for as long as it runs, which a lower AckWait
	// set under it would outrun.
	ackWait := d.w.cfg.AckWait
	if a := time.Duration(d.w.ackWait.Load()); a > 0 {
		ackWait = a
	}
	d.mu.Lock()
	c := d.cons[name]
	d.mu.Unlock()
	if c != nil && c.CachedInfo().Config.AckWait >= ackWait {
		return c, nil
	}
	// Another worker may have raised it further than this one knows.
	if cur, err := d.w.js.Consumer(ctx, v1.QueueStream, name); err == nil && cur.CachedInfo().Config.AckWait >= ackWait {
		c = cur
	} else {
		var err error
		c, err = d.w.js.CreateOrUpdateConsumer(ctx, v1.QueueStream, jetstream.ConsumerConfig{
			Durable:       name,
			Description:   "buildq dispatch: tenant " + tenant + ", priority " + prio,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       ackWait,
			MaxDeliver:    -1,
			FilterSubject: queueSubject(tenant, prio),
		})
		if err != nil {
			return nil, err
		}
	}
	d.mu.Lock()
	d.cons[name] = c
	d.mu.Unlock()
	return c, nil
}

func (d *dispatcher) forget(tenant, prio string) {
	d.mu.Lock()
	delete(d.cons, dispatchConsumer(tenant, prio))
	d.mu.Unlock()
}

// taken is a request the dispatcher took from the queue.
type taken struct {
	msg     jetstream.Msg
	tenant  string
	prio    string
	slot    *slot
	ackWait time.Duration
}

// next waits for requests to run on n free slots of this worker. It
// returns at least one and at most n, all of one tenant: the first in
// fair order, up to its weight's share of the n slots (one when the
// tenant has a concurrency limit). Taking several in one fetch keeps the
// dispatcher from being the bottleneck when requests are short (cache
// hits) — one fetch per request would cap a worker at one request per
// round trip to the server — while the share keeps a burst of free slots
// from going to one tenant.
func (d *dispatcher) next(ctx context.Context, n int) ([]*taken, bool) {
	for ctx.Err() == nil {
		d.mu.Lock()
		stale := time.Since(d.viewAt) > viewMaxAge
		d.mu.Unlock()
		if stale {
			d.look(ctx)
		}
		order := d.order()
		total := 0
		for _, t := range order {
			total += d.w.cfg.Fair.Weight(t)
		}
		for _, t := range order {
			share := max(1, n*d.w.cfg.Fair.Weight(t)/max(total, 1))
			if tks := d.tryTenant(ctx, t, share); len(tks) > 0 {
				return tks, true
			}
		}
		select {
		case <-d.wake:
		case <-time.After(idlePoll):
			d.mu.Lock()
			d.viewAt = time.Time{}
			d.mu.Unlock()
		case <-ctx.Done():
		}
	}
	return nil, false
}

// tryTenant takes up to n of tenant's next requests, highest priority
// first, if the tenant is below its concurrency limit (then one, with its
// slot, recorded in the slot before it is handled); otherwise it marks it
// full.
func (d *dispatcher) tryTenant(ctx context.Context, tenant string, n int) []*taken {
	var s *slot
	if limit := d.w.cfg.Fair.ConcurrencyOf(tenant); limit > 0 && !mutant("ignore-concurrency") {
		var ok bool
		if s, ok = d.w.acquireSlot(ctx, tenant, limit); !ok {
			// At its limit: it waits, nothing is fetched, and its slots
			// are not scanned again until one is freed (announced) or a
			// holder could have lapsed.
			d.markFull(tenant)
			return nil
		}
		if s.reserved {
			return d.takeReserved(ctx, tenant, s)
		}
		n = 1 // one slot, one request
	}
	var out []*taken
	prios := v1.Priorities
	if mutant("ignore-priority") {
		prios = slices.Clone(prios)
		slices.Reverse(prios)
	}
	for _, p := range prios {
		if len(out) >= n {
			break
		}
		d.mu.Lock()
		queued := d.view[tenant][p]
		d.mu.Unlock()
		if queued == 0 {
			continue
		}
		c, err := d.consumer(ctx, tenant, p)
		if err != nil {
			d.w.log.Warn("creating a dispatch consumer failed", zap.String("tenant", tenant), zap.String("priority", p), zap.Error(err))
			continue
		}
		want := n - len(out)
		if uint64(want) > queued {
			want = int(queued)
		}
		batch, err := c.FetchNoWait(want)
		if err != nil {
			d.forget(tenant, p)
			continue
		}
		got := 0
		for m := range batch.Messages() {
			got++
			out = append(out, &taken{msg: m, tenant: tenant, prio: p, slot: s, ackWait: c.CachedInfo().Config.AckWait})
		}
		if err := batch.Error(); err != nil && errors.Is(err, jetstream.ErrConsumerNotFound) {
			d.forget(tenant, p)
		}
		if got < want {
			d.mu.Lock()
			if d.view[tenant] != nil {
				d.view[tenant][p] = 0 // nothing more deliverable now (held, or waiting to be retried)
			}
			d.mu.Unlock()
		}
	}
	if len(out) > 0 && s != nil {
		tk := out[0]
		meta, err := tk.msg.Metadata()
		if err == nil {
			err = s.hold(ctx, tk.msg.Subject(), meta.Sequence.Stream)
		}
		if err != nil {
			// Unrecorded, the slot would not be kept for the request
			// were this worker to die while its build runs: it is not
			// run now, and goes back at once.
			d.w.log.Warn("recording a request in its concurrency slot failed; handing it back", zap.String("tenant", tenant), zap.Error(err))
			_ = tk.msg.Nak()
			s.release()
			d.markFull(tenant)
			return nil
		}
	}
	if len(out) > 0 {
		return out
	}
	s.release()
	d.markDry(tenant)
	return nil
}

// takeReserved takes a kept slot with the request it is kept for, and
// with no other: it fetches the next message of that request's subject
// and takes the slot if it is that request (redelivered: handed back, its
// retry delay over, or its holder's AckWait passed). Any other message
// goes back at once (Nak) and the tenant waits. A lapsed holder's request
// is redelivered only once its consumer's AckWait has passed since the
// holder's last heartbeat, a retried one after its delay: nothing is
// fetched before this worker watched the slot unchanged that long (and,
// for a lapse, half a lease more).
func (d *dispatcher) takeReserved(ctx context.Context, tenant string, s *slot) []*taken {
	want := s.reservedFor
	p, ok := v1.PriorityOf(strings.TrimPrefix(want.Subject, v1.QueuePrefix+"."+tenant+"."))
	if !ok || queueSubject(tenant, p) != want.Subject {
		d.markFull(tenant) // not its queue: only keepSlots frees it, when its request is finished
		return nil
	}
	c, err := d.consumer(ctx, tenant, p)
	if err != nil {
		d.markFull(tenant)
		return nil
	}
	ackWait := c.CachedInfo().Config.AckWait
	if (!want.HandedBack && s.watched < ackWait+want.lease(d.w.cfg.Lease)/2) ||
		(want.HandedBack && s.watched < time.Duration(want.RetryMs)*time.Millisecond) {
		d.markFull(tenant)
		return nil
	}
	batch, err := c.FetchNoWait(1)
	if err != nil {
		d.forget(tenant, p)
		d.markFull(tenant)
		return nil
	}
	var m jetstream.Msg
	for x := range batch.Messages() {
		m = x
	}
	if m == nil {
		d.markFull(tenant)
		return nil
	}
	meta, err := m.Metadata()
	if err != nil || meta.Sequence.Stream != want.QueueSeq {
		// Not redelivered yet, or still held by a holder whose renewals
		// fail: another request must not run on its slot.
		_ = m.Nak()
		d.markFull(tenant)
		return nil
	}
	if err := s.take(ctx); err != nil {
		_ = m.Nak()
		d.markFull(tenant)
		return nil
	}
	return []*taken{{msg: m, tenant: tenant, prio: p, slot: s, ackWait: ackWait}}
}

// markFull skips tenant, at its limit, for a third of the lease (or until
// a freed slot is announced).
func (d *dispatcher) markFull(tenant string) {
	d.mu.Lock()
	d.full[tenant] = time.Now().Add(d.w.cfg.Lease / 3)
	d.mu.Unlock()
}

func (d *dispatcher) markDry(tenant string) {
	d.mu.Lock()
	d.dry[tenant] = true
	d.mu.Unlock()
}

// dispatchLoop runs requests from the queue on this worker's free slots
// until ctx ends.
func (w *Worker) dispatchLoop(ctx, workCtx context.Context, wg *sync.WaitGroup) {
	d := newDispatcher(w)
	sub, err := w.nc.Subscribe(wakeSubject, d.woken)
	if err != nil {
		w.log.Warn("subscribing to queue announcements failed; the queue is polled", zap.Error(err))
	} else {
		defer func() { _ = sub.Unsubscribe() }()
	}
	for {
		select {
		case w.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		n := 1
	more:
		for n < cap(w.sem) {
			select {
			case w.sem <- struct{}{}:
				n++
			default:
				break more
			}
		}
		tks, ok := d.next(ctx, n)
		if !ok {
			w.release(n)
			return
		}
		w.release(n - len(tks))
		for _, tk := range tks {
			d.started(tk.tenant, tk.prio)
			wg.Add(1)
			go w.dispatched(ctx, workCtx, wg, d, tk)
		}
	}
}

// dispatched runs one request taken from the queue on its slot.
func (w *Worker) dispatched(ctx, workCtx context.Context, wg *sync.WaitGroup, d *dispatcher, tk *taken) {
	defer wg.Done()
	defer w.release(1)
	defer d.finished(tk.tenant)
	w.cfg.Metrics.taken()
	defer w.cfg.Metrics.released()
	m, err := asRequest(tk.msg, w.queue)
	if err != nil {
		// Not put there by intake (only possible without NATS
		// permissions): nothing to answer it with.
		w.log.Error("dropping a queued message that did not come through intake", zap.Error(err))
		if meta, merr := tk.msg.Metadata(); merr == nil {
			_ = w.queue.DeleteMsg(context.WithoutCancel(ctx), meta.Sequence.Stream)
		}
		_ = tk.msg.Term()
		tk.slot.release()
		return
	}
	m.ackWait = tk.ackWait
	w.handle(workCtx, m)
	if retry := time.Duration(m.retryIn.Load()); retry > 0 && !m.handedBack.Load() {
		// Retried after transient trouble (or a wait for another
		// worker's publish): the run it let go may have a Job running
		// on, which its retry takes over. The slot is kept for it.
		tk.slot.handBack(queueSubject(tk.tenant, tk.prio), m.qseq, retry)
		return
	}
	if !m.handedBack.Load() {
		tk.slot.release()
		return
	}
	if ctx.Err() != nil {
		// Stopping: the request's build goes on and another worker
		// takes the request on; the slot goes with it.
		tk.slot.handBack(queueSubject(tk.tenant, tk.prio), m.qseq, 0)
	} else {
		tk.slot.release()
	}
	// Other workers' dispatchers take the handed-back request now, not
	// at their next look at the queue.
	_ = w.nc.Publish(wakeSubject, []byte(tk.tenant+" "+tk.prio))
}

// QueueState is where the requests are, summed over intake
// (BUILDQ_REQUESTS) and the tenants' queues (BUILDQ_QUEUE).
type QueueState struct {
	// Messages stored in both streams: requests not finished.
	Messages uint64
	// Waiting: requests no worker holds now (not admitted yet, or queued).
	Waiting uint64
	// Held: requests delivered to a worker and not settled.
	Held int
	// Redelivered: messages delivered more than once and not settled.
	Redelivered int
}

// ReadQueueState reads the queue's state from the server (for tests,
// benchmarks and operators' tools).
func ReadQueueState(ctx context.Context, js jetstream.JetStream) (QueueState, error) {
	var q QueueState
	in, err := js.Stream(ctx, v1.RequestsStream)
	if err != nil {
		return q, err
	}
	ii, err := in.Info(ctx)
	if err != nil {
		return q, err
	}
	c, err := in.Consumer(ctx, v1.WorkersConsumer)
	if err != nil {
		return q, err
	}
	ci, err := c.Info(ctx)
	if err != nil {
		return q, err
	}
	q.Messages = ii.State.Msgs
	q.Waiting = ci.NumPending
	q.Held = ci.NumAckPending
	q.Redelivered = ci.NumRedelivered
	qs, err := js.Stream(ctx, v1.QueueStream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return q, nil
	}
	if err != nil {
		return q, err
	}
	qi, err := qs.Info(ctx)
	if err != nil {
		return q, err
	}
	held := 0
	lister := qs.ListConsumers(ctx)
	for info := range lister.Info() {
		if !strings.HasPrefix(info.Name, dispatchConsumerPrefix) {
			continue
		}
		held += info.NumAckPending
		q.Redelivered += info.NumRedelivered
	}
	if err := lister.Err(); err != nil {
		return q, err
	}
	q.Messages += qi.State.Msgs
	q.Held += held
	if qi.State.Msgs > uint64(held) {
		q.Waiting += qi.State.Msgs - uint64(held)
	}
	return q, nil
}
