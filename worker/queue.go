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
	"bytes"
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
	// QueueStream holds admitted requests until they are finished, one
	// subject per tenant and priority (Limits retention: a finished
	// request's message is deleted by the worker that finished it).
	QueueStream = "BUILDQ_QUEUE"
	// QueuePrefix is the subject prefix of QueueStream:
	// buildq.queue.<tenant>.<high|normal|low>.
	QueuePrefix = "buildq.queue"
	// QueuedConsumer is never pulled: its pending count is the number of
	// admitted requests not finished yet (waiting or running), the second
	// autoscaling signal next to buildq-workers' pending count.
	QueuedConsumer = "buildq-queued"
	// SlotsBucket holds one entry per running request of a tenant with a
	// concurrency limit: <tenant>.<n>, n below the limit. An entry whose
	// holder stops renewing it ages out after the lease.
	SlotsBucket = "buildq-slots"
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
func queueSubject(tenant, p string) string { return QueuePrefix + "." + tenant + "." + p }

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
		Name:        QueueStream,
		Description: "buildq admitted requests, by tenant and priority, until finished",
		Subjects:    []string{QueuePrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create stream %s: %w", QueueStream, err)
	}
	if _, err := js.CreateOrUpdateConsumer(ctx, QueueStream, jetstream.ConsumerConfig{
		Durable:       QueuedConsumer,
		Description:   "never pulled: its pending count is the requests admitted and not finished (autoscaling)",
		AckPolicy:     jetstream.AckExplicitPolicy,
		FilterSubject: QueuePrefix + ".>",
	}); err != nil {
		return nil, nil, fmt.Errorf("create consumer %s: %w", QueuedConsumer, err)
	}
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      SlotsBucket,
		Description: "buildq per-tenant concurrency slots: <tenant>.<n> per running request",
		History:     1,
		TTL:         cfg.Lease,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create key-value bucket %s: %w", SlotsBucket, err)
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
		defer mu.Unlock()
		n, err := w.queuedOf(actx, tenant)
		switch {
		case err != nil:
			log.Warn("counting the tenant's queue failed; retrying the request", zap.Error(err))
			_ = msg.NakWithDelay(time.Second)
			return
		case n >= uint64(limit) && w.requeuedEntry(actx, msg, tenant, view.RequestID) == nil:
			// A parked request published again was admitted before: it
			// is never refused for the queue its own wait is part of.
			w.handle(context.WithValue(ctx, refuseKey{}, refusal{v1.ReasonQuotaExceeded, fmt.Sprintf(
				"tenant %s already has %d requests queued, its limit is %d; submit again when some have finished", tenant, n, limit)}), msg)
			return
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
	info, err := w.queue.Info(ctx, jetstream.WithSubjectFilter(QueuePrefix+"."+tenant+".>"))
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
	// handedBack: the handler gave the message back at once (Nak).
	handedBack atomic.Bool
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

// slotValue is what a slot's key holds.
type slotValue struct {
	// Holder names the worker and this hold of the slot (unique).
	Holder string `json:"holder"`
	// HandedBack: the holder stopped with the request handed back, its
	// build still running; Subject is that request's queue subject. The
	// next dispatcher to take the slot takes it for that subject's
	// request first (the handed-back one is redelivered before new ones).
	HandedBack bool   `json:"handedBack,omitempty"`
	Subject    string `json:"subject,omitempty"`
	// QueueSeq is the handed-back request's message in BUILDQ_QUEUE: while
	// it is there, workers keep the slot from ageing out (keepHandedBack).
	QueueSeq uint64 `json:"queueSeq,omitempty"`
}

// slot is one of a tenant's concurrency slots, held while its request runs.
type slot struct {
	w      *Worker
	tenant string
	key    string
	val    []byte
	rev    uint64
	// prefer: take this subject's request first (a handed-back slot).
	prefer string
	stop   chan struct{}
	done   chan struct{}
}

// acquireSlot takes a free slot of tenant's limit, or one whose holder
// handed its request back, or reports none free.
func (w *Worker) acquireSlot(ctx context.Context, tenant string, limit int) (*slot, bool) {
	val, _ := json.Marshal(slotValue{Holder: w.cfg.ID + "/" + newRunID()})
	for i := range limit {
		key := tenant + "." + strconv.Itoa(i)
		rev, err := w.slots.Create(ctx, key, val)
		prefer := ""
		if errors.Is(err, jetstream.ErrKeyExists) {
			e, gerr := w.slots.Get(ctx, key)
			var cur slotValue
			if gerr != nil || json.Unmarshal(e.Value(), &cur) != nil || !cur.HandedBack {
				continue
			}
			rev, err = w.slots.Update(ctx, key, val, e.Revision())
			prefer = cur.Subject
		}
		if err == nil {
			s := &slot{w: w, tenant: tenant, key: key, val: val, rev: rev, prefer: prefer, stop: make(chan struct{}), done: make(chan struct{})}
			go s.renew()
			return s, true
		}
		if !isWrongRevision(err) && !errors.Is(err, jetstream.ErrKeyExists) {
			w.log.Warn("taking a concurrency slot failed", zap.String("tenant", tenant), zap.Error(err))
			return nil, false
		}
	}
	return nil, false
}

// renew keeps s from ageing out until it is released. A renewal whose
// reply was lost leaves the key a revision ahead: the key is read back,
// and if it is still this hold's, renewing goes on from its revision; a
// key that aged out meanwhile (NATS down longer than the lease) is taken
// again when free.
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
		rev, err := s.w.slots.Update(ctx, s.key, s.val, s.rev)
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
		return s.w.slots.Create(ctx, s.key, s.val)
	case err != nil:
		return 0, cause
	case !bytes.Equal(e.Value(), s.val):
		return 0, fmt.Errorf("the slot was taken by another holder (this worker's renewals failed for longer than the lease): %w", cause)
	}
	return s.w.slots.Update(ctx, s.key, s.val, e.Revision())
}

// release frees s.
func (s *slot) release() {
	if s == nil {
		return
	}
	close(s.stop)
	<-s.done
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if s.w.slots.Delete(ctx, s.key, jetstream.LastRevision(s.rev)) == nil {
		// Dispatchers that skipped the tenant at its limit look again.
		_ = s.w.nc.Publish(wakeSubject, []byte(s.tenant))
	}
}

// handBack keeps s for the handed-back request of subject: its build goes
// on, and whoever takes the request on takes this slot with it.
func (s *slot) handBack(subject string, qseq uint64) {
	if s == nil {
		return
	}
	close(s.stop)
	<-s.done
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	val, _ := json.Marshal(slotValue{Holder: string(s.val), HandedBack: true, Subject: subject, QueueSeq: qseq})
	if _, err := s.w.slots.Update(ctx, s.key, val, s.rev); err == nil {
		_ = s.w.nc.Publish(wakeSubject, []byte(s.tenant))
	}
	// Otherwise the key ages out after the lease.
}

// keepHandedBack renews the handed-back slots whose request is still in
// the queue: a stopping worker's slot must outlive the lease until a
// dispatcher takes it with its request, however long that takes. A slot
// whose request is gone (answered) is freed.
func (w *Worker) keepHandedBack(ctx context.Context) {
	keys, err := w.slots.ListKeys(ctx)
	if err != nil {
		return
	}
	for k := range keys.Keys() {
		e, err := w.slots.Get(ctx, k)
		if err != nil {
			continue
		}
		var v slotValue
		if json.Unmarshal(e.Value(), &v) != nil || !v.HandedBack {
			continue
		}
		_, err = w.queue.GetMsg(ctx, v.QueueSeq)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			if w.slots.Delete(ctx, k, jetstream.LastRevision(e.Revision())) == nil {
				tenant, _, _ := strings.Cut(k, ".")
				_ = w.nc.Publish(wakeSubject, []byte(tenant))
			}
		case err == nil:
			_, _ = w.slots.Update(ctx, k, e.Value(), e.Revision())
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
	info, err := d.w.queue.Info(ctx, jetstream.WithSubjectFilter(QueuePrefix+".>"))
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
	if cur, err := d.w.js.Consumer(ctx, QueueStream, name); err == nil && cur.CachedInfo().Config.AckWait >= ackWait {
		c = cur
	} else {
		var err error
		c, err = d.w.js.CreateOrUpdateConsumer(ctx, QueueStream, jetstream.ConsumerConfig{
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
// slot); otherwise it marks it full.
func (d *dispatcher) tryTenant(ctx context.Context, tenant string, n int) []*taken {
	var s *slot
	if limit := d.w.cfg.Fair.ConcurrencyOf(tenant); limit > 0 {
		var ok bool
		if s, ok = d.w.acquireSlot(ctx, tenant, limit); !ok {
			// At its limit: it waits, nothing is fetched, and its slots
			// are not scanned again until one is freed (announced) or a
			// crashed holder's could have aged out.
			d.mu.Lock()
			d.full[tenant] = time.Now().Add(d.w.cfg.Lease / 3)
			d.mu.Unlock()
			return nil
		}
		n = 1 // one slot, one request
	}
	order := v1.Priorities
	if s != nil && s.prefer != "" {
		// A handed-back slot: its request first, whatever its priority.
		if _, p, ok := strings.Cut(strings.TrimPrefix(s.prefer, QueuePrefix+"."+tenant), "."); ok {
			order = append([]string{p}, slices.DeleteFunc(slices.Clone(order), func(x string) bool { return x == p })...)
		}
	}
	var out []*taken
	for i, p := range order {
		if len(out) >= n {
			break
		}
		d.mu.Lock()
		queued := d.view[tenant][p]
		d.mu.Unlock()
		if queued == 0 && !(i == 0 && s != nil && s.prefer != "") {
			continue
		}
		c, err := d.consumer(ctx, tenant, p)
		if err != nil {
			d.w.log.Warn("creating a dispatch consumer failed", zap.String("tenant", tenant), zap.String("priority", p), zap.Error(err))
			continue
		}
		want := n - len(out)
		if queued > 0 && uint64(want) > queued {
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
	if len(out) > 0 {
		return out
	}
	s.release()
	d.markDry(tenant)
	return nil
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
	if !m.handedBack.Load() {
		tk.slot.release()
		return
	}
	if ctx.Err() != nil {
		// Stopping: the request's build goes on and another worker
		// takes the request on; the slot goes with it.
		tk.slot.handBack(queueSubject(tk.tenant, tk.prio), m.qseq)
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
	qs, err := js.Stream(ctx, QueueStream)
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
