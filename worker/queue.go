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
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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

// fairQueue is a worker's fair queue: it owns BUILDQ_QUEUE and the
// buildq-slots bucket, admits requests (intake.go), takes them for the
// worker's free build slots fairly between tenants (dispatch.go, with the
// concurrency slots of slots.go), and hands each to the worker's handler,
// bounded by the in-flight semaphore.
type fairQueue struct {
	// The worker whose handler runs the requests, with its configuration,
	// connection, ledger and log.
	*Worker
	// queue is BUILDQ_QUEUE; slots the per-tenant concurrency slots.
	queue jetstream.Stream
	slots jetstream.KeyValue
	// slotSeen: how long this worker has seen each slot key unchanged.
	slotSeen slotWatch
	// admitMu: per tenant, its queue-limit checks in this worker.
	admitMu sync.Map
	// sem: one token per request in flight (MaxInFlight).
	sem chan struct{}
}

// release gives back n in-flight tokens.
func (w *fairQueue) release(n int) {
	for range n {
		<-w.sem
	}
}

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
