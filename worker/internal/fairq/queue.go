// Package fairq is buildq's fair queue (docs/design.md §2d). Requests
// arrive on BUILDQ_REQUESTS, the contract's work queue, and are admitted
// from it by intake: a cheap step that applies the tenant's queue-length
// limit and moves each request to BUILDQ_QUEUE under
// buildq.queue.<tenant>.<priority>. Build slots are filled from there by
// each worker's dispatcher, which picks the tenant with the fewest running
// requests per weight among those with work and below their concurrency
// limit, and within the tenant the highest priority first. The worker's
// Handler decides each request; the queue acts on its Action.
package fairq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
)

const (
	// fetchWait bounds one pull request of intake: a stopping worker
	// that hands back a request taken from intake waits at most this
	// long for its last pull to expire (IntakeQuiet); an idle worker
	// sends one pull request per fetchWait.
	fetchWait = time.Second
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
	// HdrIntakeSubject is the header intake adds to a queued message
	// with the subject the request arrived on.
	HdrIntakeSubject = "Buildq-Intake-Subject"
	// HdrIntakeSeq holds the request's sequence in BUILDQ_REQUESTS.
	HdrIntakeSeq = "Buildq-Intake-Seq"
	// HdrIntakeTime holds the time BUILDQ_REQUESTS stored the request.
	HdrIntakeTime = "Buildq-Intake-Time"
	// HdrIntakeDelivered holds how many times BUILDQ_REQUESTS delivered
	// the request before this admission, when it did (a handler that
	// took it straight from intake, direct.go, and gave it back, or a
	// failed admission): the queued copy's deliveries count on from
	// there.
	HdrIntakeDelivered = "Buildq-Intake-Delivered"
	// HdrIntakeMsgID holds the request's own Nats-Msg-Id.
	HdrIntakeMsgID = "Buildq-Intake-Msg-Id"
	// intakeConcurrency bounds the requests a worker admits at once;
	// admitting uses no build slot.
	intakeConcurrency = 16
	// viewMaxAge bounds how old the dispatcher's view of the queue may be
	// when it picks; idlePoll is how often an idle dispatcher looks again.
	viewMaxAge = 250 * time.Millisecond
	idlePoll   = 500 * time.Millisecond
)

// Queue is a worker's fair queue: it owns BUILDQ_QUEUE and the
// buildq-slots bucket, admits requests from BUILDQ_REQUESTS (intake.go),
// takes them for the worker's free build slots fairly between tenants
// (dispatch.go, with the concurrency slots of slots.go), and hands each to
// the worker's Handler, bounded by the in-flight semaphore.
type Queue struct {
	cfg Options
	js  jetstream.JetStream
	nc  *nats.Conn
	h   Handler
	// intake is the shared consumer of BUILDQ_REQUESTS; consumerAckWait
	// its AckWait as the server last reported it (0: unknown).
	intake          jetstream.Consumer
	consumerAckWait func() time.Duration
	log             *zap.Logger
	// queue is BUILDQ_QUEUE; slots the per-tenant concurrency slots.
	queue jetstream.Stream
	slots jetstream.KeyValue
	// slotSeen: how long this worker has seen each slot key unchanged;
	// renewing: the holders (slotValue.Holder) of the slots this worker
	// renews now — live, whatever its reads of them show.
	slotSeen slotWatch
	renewing sync.Map
	// admitMu: per tenant, its queue-limit checks in this worker.
	admitMu sync.Map
	// sem: one token per request in flight (MaxInFlight); the dispatcher
	// holds the free ones while it waits for work.
	sem chan struct{}
	// takenDirect counts the requests taken straight from intake; idle
	// is set while the dispatcher waits with a slot free and nothing to
	// take.
	takenDirect atomic.Uint64
	idle        atomic.Bool
	// direct: intake hands a request straight to this worker's
	// dispatcher while it waits with a slot free and nothing to take
	// (dispatchDirect).
	direct chan *taken
	// intakeEnded is closed when the intake loop has ended; pullGone is
	// from then on when its last pull is gone from the server for sure
	// (IntakeQuiet).
	intakeEnded chan struct{}
	pullGone    time.Time
}

// Options are what a Queue is run with.
type Options struct {
	// Fair: the tenants' weights, concurrency and queue limits.
	Fair Config
	// ID names the worker in the slots it holds.
	ID string
	// Lease: how long a slot stays held without its holder's renewal;
	// AckWait: the worker's own AckWait (the dispatch consumers').
	Lease, AckWait time.Duration
	// MaxDeliver: tries of a request that intake cannot queue.
	MaxDeliver int
	// MaxInFlight: requests handled at once.
	MaxInFlight int
	Now         func() time.Time
	Log         *zap.Logger
	// Metrics counts requests in flight (may be nil).
	Metrics Metrics
	// Ledger tells a requeued request (its token) from a new one.
	Ledger *ledger.Ledger
}

// Metrics are the queue's gauges.
type Metrics interface {
	Taken()
	Released()
	// TakenDirect counts a request taken straight from intake.
	TakenDirect()
}

// Handler handles the requests the queue hands it.
type Handler interface {
	// Decide handles a request message up to what happens to it, without
	// acting on the message.
	Decide(ctx context.Context, in Incoming) Action
	// Apply acts on the message as decided.
	Apply(msg jetstream.Msg, act Action)
	// Heartbeat tells JetStream the message is being worked on until the
	// returned stop is called; ackWait is the message consumer's.
	Heartbeat(msg jetstream.Msg, ackWait time.Duration) (stop func())
}

// Answerer is a Handler that answers some requests where they arrive,
// without queueing them: cache hits, which need no build slot.
type Answerer interface {
	// Answer decides and publishes in's result when it can and reports
	// whether it did, with settle (nil: nothing) to run once intake's slot
	// is given back: the message's ack. false leaves the message
	// untouched, with nothing written for it, to be queued.
	Answer(ctx context.Context, in Incoming) (ok bool, settle func())
}

// Holder is a QueueHandler that can hold a request at intake while its
// key's build, queued or running for another request, is under way, and
// answer it from the cache when the build ends (docs/design.md §2d, "Held
// at intake"). It is asked about first deliveries only, after Answer.
type Holder interface {
	// Hold reports whether the holder took in: the message is then the
	// holder's, heartbeaten on its consumer, until it either settles it
	// (an answer's ack, a hand-back) or calls admit, once, to have intake
	// admit it as it would have without the hold. false leaves in
	// untouched, with nothing written for it.
	Hold(ctx context.Context, in Incoming, admit func(ctx context.Context)) bool
}

// Incoming is a request message to handle, and what the queue knows of
// it.
type Incoming struct {
	Msg jetstream.Msg
	// AckWait is the AckWait of the consumer the message came from, as
	// the queue last knew it (0: the shared consumer's): heartbeats go at
	// least every third of it.
	AckWait time.Duration
	// Refused: intake refuses the request; it is answered with this
	// instead of being built.
	Refused *Refusal
	// Extra takes more of the tenant's concurrency slots for the request
	// (nil: none; intake's refusals, and tenants without a limit take
	// none and need none).
	Extra *ExtraSlots
	// TakenAtOnce, given to Answer: a request intake does not answer is
	// most likely taken straight from intake by this worker's idle
	// dispatcher (direct.go), so its look ahead is worth sending.
	TakenAtOnce bool
}

// Refusal is why intake refused a request.
type Refusal struct{ Reason, Message string }

// ActionKind is what happens to a handled message.
type ActionKind int

const (
	// Settle means acked, or terminated (Term): the request is answered.
	Settle ActionKind = iota
	// HandBack means given back at once (Nak): the worker stops.
	HandBack
	// Retry means asked for again after Delay, the request's retry budget
	// spent for it (transient trouble).
	Retry
	// Later means asked for again after Delay without spending the budget
	// (another handler publishes its result for now).
	Later
)

// Action is the handler's one decision about its message.
type Action struct {
	Kind      ActionKind
	Delay     time.Duration
	Term      bool
	Reason    string
	RequestID string
	// After runs once the message is settled: the ledger's mark, the
	// request's log line, its Job's cleanup.
	After func()
	// AckFailed, when set, runs when a Settle could not be confirmed (the
	// ack's reply was lost): the message comes again, and what its next
	// handler must find is written here (a decision delivered unmarked
	// is marked published).
	AckFailed func()
}

// New returns a queue of the worker whose handler is h. It does not touch
// the server until Setup.
func New(js jetstream.JetStream, nc *nats.Conn, h Handler, o Options) *Queue {
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	return &Queue{cfg: o, js: js, nc: nc, h: h, log: o.Log, sem: make(chan struct{}, max(o.MaxInFlight, 1)), direct: make(chan *taken), intakeEnded: make(chan struct{})}
}

// Setup creates or updates BUILDQ_QUEUE, its consumer and the slots
// bucket.
func (q *Queue) Setup(ctx context.Context, storage jetstream.StorageType, replicas int, duplicates time.Duration) error {
	var err error
	q.queue, q.slots, err = ensureQueue(ctx, q.js, storage, replicas, duplicates)
	return err
}

// Run admits and dispatches requests until ctx ends: intake takes new
// requests from the shared consumer intake, whose AckWait consumerAckWait
// reports. Handling runs in workCtx, which outlives ctx (requests in
// flight are handed back explicitly); wg counts the goroutines Run starts.
func (q *Queue) Run(ctx, workCtx context.Context, wg *sync.WaitGroup, intake jetstream.Consumer, consumerAckWait func() time.Duration) {
	q.intake, q.consumerAckWait = intake, consumerAckWait
	wg.Add(1)
	go func() {
		defer wg.Done()
		q.intakeLoop(ctx, workCtx, wg)
	}()
	q.dispatchLoop(ctx, workCtx, wg)
}

// InFlight is the number of requests being handled.
func (q *Queue) InFlight() int { return len(q.sem) }

// Slots is the slots bucket (the tests inject faults through it).
func (q *Queue) Slots() jetstream.KeyValue { return q.slots }

// UseSlots replaces the slots bucket (the tests inject faults).
func (q *Queue) UseSlots(kv jetstream.KeyValue) { q.slots = kv }

// handle hands one message to the handler and acts on it as decided.
// settled (nil: none) runs once the message is settled, before the
// action's After (a finished build's Job cleanup, which may take long):
// from then on the request no longer counts as its tenant's running work.
func (q *Queue) handle(ctx context.Context, in Incoming, settled func()) Action {
	act := q.h.Decide(ctx, in)
	q.h.Apply(in.Msg, act)
	if settled != nil {
		settled()
	}
	if act.After != nil {
		act.After()
	}
	return act
}

// release gives back n in-flight tokens.
func (q *Queue) release(n int) {
	for range n {
		<-q.sem
	}
}

// QueueSubject is where intake puts a tenant's request of priority p.
func QueueSubject(tenant, p string) string { return v1.QueuePrefix + "." + tenant + "." + p }

// DispatchConsumer names the consumer of a tenant's priority p.
func DispatchConsumer(tenant, p string) string { return dispatchConsumerPrefix + p + "-" + tenant }

// Config holds the fair-queueing rules. Maps are keyed by tenant; the
// key "*" sets the value of every tenant not named.
type Config struct {
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
func (f Config) Weight(tenant string) int { return max(lookup(f.Weights, tenant), 1) }

// ConcurrencyOf returns tenant's concurrency limit (0: none).
func (f Config) ConcurrencyOf(tenant string) int {
	if tenant == invalidTenant {
		return 0
	}
	return lookup(f.Concurrency, tenant)
}

// QueueLimitOf returns tenant's queue-length limit (0: none).
func (f Config) QueueLimitOf(tenant string) int { return lookup(f.QueueLimit, tenant) }

// Validate reports every invalid rule.
func (f Config) Validate() error {
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
func ensureQueue(ctx context.Context, js jetstream.JetStream, storage jetstream.StorageType, replicas int, duplicates time.Duration) (jetstream.Stream, jetstream.KeyValue, error) {
	st, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.QueueStream,
		Description: "buildq admitted requests, by tenant and priority, until finished",
		Subjects:    []string{v1.QueuePrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Storage:     storage,
		Replicas:    replicas,
		Duplicates:  duplicates,
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
		Storage:  storage,
		Replicas: replicas,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create key-value bucket %s: %w", v1.SlotsBucket, err)
	}
	return st, kv, nil
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
