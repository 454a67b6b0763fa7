// Package worker is buildq's build worker: it takes requests from the
// shared JetStream consumer, deduplicates them by build key through a KV
// claim, runs each unique build once on a Backend (kaniko Jobs, or the local
// executor), and publishes one result per request before acking it.
//
// Any number of workers share the consumer; none is a leader. A worker that
// dies loses nothing: its requests are redelivered, its claims lapse, and
// the deterministic Job name lets the next worker adopt the running build.
package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"golang.org/x/sync/singleflight"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
)

// Worker consumes build requests. Create it with New and call Run.
type Worker struct {
	cfg      Config
	registry Registry
	nc       *nats.Conn
	js       jetstream.JetStream
	backend  Backend
	log      *zap.Logger
	// settling serializes settleWaiters per build key (park.go), by a
	// hash of the key: bounded, whatever the number of keys.
	settling [64]sync.Mutex
	// heads shares concurrent registry checks of one indexed image.
	heads singleflight.Group
	// publishing: the requests whose decision a goroutine of this worker
	// is recording and publishing; unmarked: decisions of other workers
	// seen recorded and not marked published (index.go).
	publishing keyLocks
	unmarked   unmarkedWatch
	claims     claims
	requests   jetstream.KeyValue
	orphans    orphanWatch
	parked     parkWatch
	held       heldRequests
	// possessed: tenants shown to hold a context (possession.go).
	possessed possessions
	// jobs: the janitor's view of Jobs left behind (janitor.go).
	jobs janitor
	// life is Run's work context: it ends when the worker stops. Work
	// shared between requests (a possession read) runs in it, apart from
	// any one request's context.
	life atomic.Pointer[context.Context]
	// bg counts background work (answering parked requests).
	bg     sync.WaitGroup
	apiSem chan struct{}
	// ackWait is the consumer's AckWait as the server has it (nanoseconds):
	// another worker may have set it lower than this one's.
	ackWait atomic.Int64
	cons    jetstream.Consumer
	// queue is BUILDQ_QUEUE; slots the per-tenant concurrency slots.
	queue jetstream.Stream
	slots jetstream.KeyValue
	// slotSeen: how long this worker has seen each slot key unchanged.
	slotSeen slotWatch
	// admitMu: per tenant, its queue-limit checks in this worker.
	admitMu sync.Map
	sem     chan struct{}
	source  string

	setupMu   sync.Mutex
	setupDone bool
	// running: Run set up the streams and takes requests (readiness).
	running atomic.Bool

	// faults is nil outside the package's fault simulation.
	faults *faultHooks
}

// New validates cfg and returns a worker that uses nc and runs builds on
// backend. It does not touch the server until Run (or Setup).
func New(nc *nats.Conn, backend Backend, cfg Config) (*Worker, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("worker config: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Worker{
		cfg:      cfg,
		registry: cfg.Registry,
		nc:       nc,
		js:       js,
		backend:  backend,
		log:      cfg.Logger.With(zap.String("worker", cfg.ID)),
		sem:      make(chan struct{}, cfg.MaxInFlight),
		source:   "/buildq/worker/" + cfg.ID,
		orphans:  orphanWatch{seen: map[string]observed{}},
		parked:   parkWatch{seen: map[string]observed{}},
		held:     heldRequests{m: map[string]context.CancelCauseFunc{}},
		apiSem:   make(chan struct{}, apiConcurrency),
	}, nil
}

// Setup creates or updates the streams, the shared consumer and the KV
// bucket. It is idempotent and safe to run from many workers at once.
//
// A JetStream that is not ready yet — a cluster still electing its meta
// leader, a node restarting, workers racing to create the same streams —
// is waited for, retrying with backoff until ctx ends; other errors are
// returned at once. ctx's deadline bounds the whole, never one request:
// a JetStream API request sent while a cluster elects its meta leader
// gets no answer at all, and under ctx's deadline it would wait out all
// of it. Each request has JetStream's own timeout instead (5 s), as
// without a deadline, and is retried.
func (w *Worker) Setup(ctx context.Context) error {
	w.setupMu.Lock()
	defer w.setupMu.Unlock()
	if w.setupDone {
		return nil
	}
	backoff := 200 * time.Millisecond
	for {
		actx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		stop := context.AfterFunc(ctx, cancel)
		err := w.setup(actx)
		stop()
		cancel()
		if err == nil {
			w.setupDone = true
			return nil
		}
		if ctx.Err() != nil || !setupRetryable(err) {
			return err
		}
		w.log.Warn("JetStream not ready; retrying the setup", zap.Error(err), zap.Duration("backoff", backoff))
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return err
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// setupRetryable reports whether a setup error means "not ready yet".
func setupRetryable(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case 10008, // JetStream system temporarily unavailable
			10005, // no suitable peers for placement (nodes still joining)
			10023: // insufficient resources
			return true
		}
		return false
	}
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) ||
		errors.Is(err, nats.ErrConnectionReconnecting) || errors.Is(err, nats.ErrDisconnected)
}

func (w *Worker) setup(ctx context.Context) error {
	kv, cons, err := EnsureStreams(ctx, w.js, w.cfg)
	if err != nil {
		return err
	}
	w.claims = claims{kv: kv}
	w.cons = cons
	w.ackWait.Store(int64(cons.CachedInfo().Config.AckWait))
	if w.queue, w.slots, err = ensureQueue(ctx, w.js, w.cfg); err != nil {
		return err
	}
	w.requests, err = ensureRequestsBucket(ctx, w.js, w.cfg)
	return err
}

// EnsureStreams creates or updates everything of the wire contract
// (DESIGN §3) on the server: BUILDQ_REQUESTS, BUILDQ_RESULTS, the dead-letter
// stream, the buildq-workers consumer and the buildq-builds bucket.
func EnsureStreams(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.KeyValue, jetstream.Consumer, error) {
	cfg = cfg.WithDefaults()
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.RequestsStream,
		Description: "buildq build requests (work queue)",
		Subjects:    []string{v1.RequestsPrefix + ".>"},
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
	}); err != nil {
		return nil, nil, fmt.Errorf("create stream %s: %w", v1.RequestsStream, err)
	}
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.ResultsStream,
		Description: "buildq build results (CloudEvents), one per request",
		// Workers publish a result on buildq.internal.results.<tenant>.<name>;
		// the stream stores it as buildq.results.<tenant>.<name> and, once
		// stored, publishes it there for core subscribers. A publish the
		// duplicate window drops is never stored and so never published
		// again: every subscriber sees a decision once, whoever published
		// it how many times (a worker killed between its publish and its
		// mark, a redelivery).
		Subjects:         []string{v1.ResultsIngestPrefix + ".>"},
		SubjectTransform: &jetstream.SubjectTransformConfig{Source: v1.ResultsIngestPrefix + ".>", Destination: v1.ResultsPrefix + ".>"},
		RePublish:        &jetstream.RePublish{Source: v1.ResultsPrefix + ".>", Destination: v1.ResultsPrefix + ".>"},
		Retention:        jetstream.LimitsPolicy,
		MaxAge:           cfg.ResultsMaxAge,
		Storage:          cfg.Storage,
		Replicas:         cfg.Replicas,
		Duplicates:       cfg.DuplicateWindow,
	}); err != nil {
		return nil, nil, fmt.Errorf("create stream %s: %w", v1.ResultsStream, err)
	}
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.DeadLetterStream,
		Description: "buildq requests that exhausted their deliveries",
		Subjects:    []string{v1.DeadLetterPrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      cfg.ResultsMaxAge,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
	}); err != nil {
		return nil, nil, fmt.Errorf("create stream %s: %w", v1.DeadLetterStream, err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, v1.RequestsStream, jetstream.ConsumerConfig{
		Durable:     v1.WorkersConsumer,
		Description: "buildq workers (shared)",
		AckPolicy:   jetstream.AckExplicitPolicy,
		AckWait:     cfg.AckWait,
		// Unlimited on the server: a hand-back at shutdown counts as a
		// delivery, and a message past the server's MaxDeliver is never
		// delivered again, so a request handed back on its last delivery
		// would be stranded without a result. The worker enforces
		// cfg.MaxDeliver itself, on transient failures.
		MaxDeliver:    -1,
		FilterSubject: v1.RequestsPrefix + ".>",
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create consumer %s: %w", v1.WorkersConsumer, err)
	}
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      v1.BuildsBucket,
		Description: "buildq build claims and the build key → digest index",
		History:     1,
		// A record unused for this long is dropped: the bucket holds one
		// record per unique build and would otherwise grow forever. A
		// running build renews its record, so only finished ones age out;
		// their key is simply built again when asked for.
		TTL:      cfg.IndexTTL,
		Storage:  cfg.Storage,
		Replicas: cfg.Replicas,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("create key-value bucket %s: %w", v1.BuildsBucket, err)
	}
	return kv, cons, nil
}

// fetchWait bounds one pull request; shorter means a faster stop.
const fetchWait = 2 * time.Second

// Run consumes requests until ctx ends. Then it stops fetching and hands
// every held request back with Nak (releasing its claims), so another worker
// adopts the builds at once; it waits up to ShutdownTimeout for that.
func (w *Worker) Run(ctx context.Context) error {
	if err := w.Setup(ctx); err != nil {
		return err
	}
	// Work outlives the fetch context by design: requests in flight are
	// handed back explicitly, not abandoned mid-publish.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	w.life.Store(&workCtx)
	stopAPI, err := w.serveAPI(workCtx)
	if err != nil {
		return fmt.Errorf("subscribe the status and cancel services: %w", err)
	}
	defer stopAPI()
	var wg sync.WaitGroup
	if r, ok := w.backend.(Reconciler); ok {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.Reconcile(workCtx, w.finishOrphan)
		}()
	}
	w.log.Info("worker started", zap.Int("maxInFlight", w.cfg.MaxInFlight), zap.String("executor", w.backend.Identity()))
	w.running.Store(true)
	w.cfg.Metrics.setReady(true)

	wg.Add(1)
	go func() {
		defer wg.Done()
		// Another worker may lower the consumer's AckWait at any time;
		// heartbeats follow within one tick.
		t := time.NewTicker(ackWaitRefresh)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				w.refreshAckWait(workCtx)
			case <-workCtx.Done():
				return
			}
		}
	}()

	wg.Add(1)
	go func() {
		defer wg.Done()
		// Parked requests whose run's end was not answered (a crash
		// between the two), whose run was let go or lapsed.
		t := time.NewTicker(max(w.cfg.Lease/2, 100*time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-t.C:
				sctx, cancel := context.WithTimeout(workCtx, w.cfg.Lease)
				w.sweepWaiters(sctx)
				cancel()
			case <-workCtx.Done():
				return
			}
		}
	}()

	if _, ok := w.backend.(jobJanitor); ok {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// No Job left behind (janitor.go).
			t := time.NewTicker(w.cfg.Lease)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					jctx, cancel := context.WithTimeout(workCtx, w.cfg.Lease+5*time.Second)
					w.sweepJobs(jctx)
					cancel()
				case <-workCtx.Done():
					return
				}
			}
		}()
	}

	if len(w.cfg.Fair.Concurrency) > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Handed-back and lapsed slots are freed once free; the
			// reads are this worker's watch of every slot.
			t := time.NewTicker(max(w.cfg.Lease/3, 100*time.Millisecond))
			defer t.Stop()
			for {
				select {
				case <-t.C:
					kctx, cancel := context.WithTimeout(workCtx, w.cfg.Lease/3+time.Second)
					w.keepSlots(kctx)
					cancel()
				case <-workCtx.Done():
					return
				}
			}
		}()
	}

	if w.cfg.Metrics != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(queueMetricsEvery)
			defer t.Stop()
			for {
				w.countQueued(workCtx)
				select {
				case <-t.C:
				case <-workCtx.Done():
					return
				}
			}
		}()
	}

	// Intake admits new requests to the tenants' queues; the dispatcher
	// runs them on this worker's free slots, fairly between tenants.
	wg.Add(1)
	go func() {
		defer wg.Done()
		w.intakeLoop(ctx, workCtx, &wg)
	}()
	w.dispatchLoop(ctx, workCtx, &wg)

	w.running.Store(false)
	w.cfg.Metrics.setReady(false)
	w.log.Info("stopping: handing back requests in flight")
	cancelWork()
	done := make(chan struct{})
	go func() { wg.Wait(); w.bg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(w.cfg.ShutdownTimeout):
		w.log.Warn("shutdown timeout: some requests were not handed back; they are redelivered after AckWait")
	}
	w.log.Info("worker stopped")
	return nil
}

// Ready reports why the worker does not take requests, or nil when it
// does: Run has set up the streams and runs its loops, and the NATS
// connection is up (a readiness probe).
func (w *Worker) Ready() error {
	if !w.running.Load() {
		return errors.New("not taking requests: starting (setting up streams) or stopping")
	}
	if !w.nc.IsConnected() {
		return fmt.Errorf("not taking requests: the NATS connection is %s", w.nc.Status())
	}
	return nil
}

// queueMetricsEvery is how often a worker with metrics counts the queue.
const queueMetricsEvery = 5 * time.Second

// countQueued reads the request messages stored per tenant (not yet
// admitted, queued, or held by a handler) for buildq_requests_queued.
func (w *Worker) countQueued(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, queueMetricsEvery)
	defer cancel()
	by := map[string]uint64{}
	for _, src := range []struct{ stream, prefix string }{{v1.RequestsStream, v1.RequestsPrefix}, {v1.QueueStream, v1.QueuePrefix}} {
		st, err := w.js.Stream(ctx, src.stream)
		if err != nil {
			return
		}
		info, err := st.Info(ctx, jetstream.WithSubjectFilter(src.prefix+".>"))
		if err != nil {
			return
		}
		for subj, n := range info.State.Subjects {
			parts := strings.Split(strings.TrimPrefix(subj, src.prefix+"."), ".")
			tenant := "_invalid"
			if (len(parts) == 1 || src.stream == v1.QueueStream) && v1.DNSLabelProblem(parts[0]) == "" {
				tenant = parts[0]
			}
			by[tenant] += n
		}
	}
	w.cfg.Metrics.setQueued(by)
}

func (w *Worker) release(n int) {
	for range n {
		<-w.sem
	}
}

// verdict is what happens to a request message once it is handled.
type verdict struct {
	tenant, name string
	data         v1.ResultData
	// term: terminate the message instead of acking it (bad input).
	term bool
	// cleanupKey, cleanupRun: this request ended the build's run; remove
	// that run's Job after the result is stored.
	cleanupKey string
	cleanupRun string
	// recorded: the decision is in the request ledger (or the request has
	// no ledger entry); publishedBefore: its result was stored already.
	recorded        bool
	publishedBefore bool
	// duplicate: another message holds this request id; this one gets no
	// result of its own and is terminated.
	duplicate bool
	// waiter: the request was indexed as waiting on its build key.
	waiter bool
	// parked: the request waits on a build without holding its message;
	// the message is acked without a result (the build's end brings it).
	parked bool
}

func (w *Worker) handle(ctx context.Context, msg jetstream.Msg) {
	meta, err := msg.Metadata()
	if err != nil {
		w.log.Error("message without JetStream metadata; terminating it", zap.Error(err))
		_ = msg.TermWithReason("no metadata")
		return
	}
	log := w.log.With(zap.Uint64("seq", meta.Sequence.Stream), zap.Uint64("delivery", meta.NumDelivered))

	stop := w.heartbeat(msg)
	defer stop()

	// The tenant's cancel ends hctx with errRequestCanceled.
	hctx, hcancel := context.WithCancelCause(ctx)
	defer hcancel(nil)
	v, le, err := w.safeProcess(hctx, msg, meta, hcancel)
	// Whatever comes now must not be cut short by shutdown: publishing a
	// result and acking are quick and keep the request from being redone.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	switch {
	case err != nil && ctx.Err() == nil && errors.Is(context.Cause(hctx), errRequestCanceled):
		v, err = canceledVerdict(v), nil
	case err != nil && ctx.Err() != nil:
		log.Info("handing request back", zap.String("reason", "shutdown"))
		_ = msg.Nak()
		return
	case err != nil && IsTransient(err) && w.retryBudgetLeft(actx, le, meta):
		delay := retryDelayOf(le, meta)
		log.Warn("transient failure; retrying later", zap.Error(err), zap.Duration("delay", delay))
		w.cfg.Metrics.retried()
		_ = msg.NakWithDelay(delay)
		return
	case err != nil:
		// Terminal, or out of deliveries: the request still gets its one
		// result, and its payload is kept on the dead-letter subject.
		v.data.Status = v1.StatusFailed
		v.data.Reason = v1.ReasonInfrastructureError
		v.data.Message = err.Error()
		v.data.Digest, v.data.Image, v.data.ImageRef, v.data.LogTail = "", "", "", ""
		v.cleanupKey, v.cleanupRun = "", ""
		if IsTransient(err) {
			v.data.Message = fmt.Sprintf("gave up after %d transient failures: %v", w.cfg.MaxDeliver, err)
			w.deadLetter(actx, v.tenant, msg, err)
		}
		v.term = true
	}
	if v.duplicate {
		log.Warn("request id already held by another message; terminating this one without a result",
			zap.String("requestId", v.data.RequestID), zap.String("tenant", v.tenant))
		w.event(v.tenant, v.name, v1.Event{RequestID: v.data.RequestID, Key: v.data.Key, Phase: v1.PhaseFinished,
			Message: "duplicate: request id " + v.data.RequestID + " belongs to an earlier message; its result is that request's"})
		w.cfg.Metrics.duplicate()
		w.settle(actx, log, msg, v.data.RequestID, true, "duplicate request id")
		return
	}
	if v.parked {
		log.Info("request parked on a build in progress", zap.String("requestId", v.data.RequestID), zap.String("key", v.data.Key))
		w.cfg.Metrics.parkedRequest()
		w.settle(actx, log, msg, v.data.RequestID, false, "parked")
		return
	}
	if v.data.Timings.FinishedAt.IsZero() {
		v.data.Timings.FinishedAt = w.cfg.Now().UTC()
	}
	if le != nil {
		// One handler or settling pass of this worker decides and
		// publishes a request at a time: another that found the decision
		// recorded and not yet marked published would publish it again.
		release, ok := w.publishing.acquire(RequestIndexKey(le.e.Tenant, le.e.RequestID))
		if !ok {
			log.Info("this worker is publishing the request's result already; looking again later", zap.String("requestId", v.data.RequestID))
			_ = msg.NakWithDelay(time.Second)
			return
		}
		defer release()
	}
	if le != nil && !v.recorded && !mutant("publish-before-record") {
		// The decision is stored before it is published: a redelivery
		// publishes this same result, never a second, different one.
		rv, err := w.record(actx, le, v)
		if err != nil && w.retryBudgetLeft(actx, le, meta) {
			log.Warn("recording the decision failed; retrying the request", zap.Error(err))
			_ = msg.NakWithDelay(retryDelayOf(le, meta))
			return
		}
		if err != nil {
			log.Error("recording the decision failed on the last delivery; publishing it unrecorded", zap.Error(err))
		}
		v = rv
	}
	if le != nil && v.recorded && !v.publishedBefore {
		// Decided before this handler, and not marked published: by
		// this worker (its publish failed), or by another party that may
		// be publishing it right now.
		right, err := w.mayPublishDecision(actx, le)
		if err != nil {
			log.Warn("reading who publishes the request's result failed; looking again later", zap.Error(err))
		}
		switch right {
		case publishDone:
			v.publishedBefore = true
		case publishLater:
			log.Info("the request's result was decided by another worker and is not marked published yet; looking again later",
				zap.String("requestId", v.data.RequestID), zap.String("decidedBy", le.e.Worker))
			_ = msg.NakWithDelay(w.publishGrace() / 2)
			return
		}
	}
	if v.waiter && le != nil {
		w.dropWaiter(actx, le.e.Key, le.e.Tenant, le.e.RequestID)
	}
	var marking sync.WaitGroup
	if !v.publishedBefore {
		// Progress first: a client waiting for the result sees the last
		// step before the result ends its wait.
		w.event(v.tenant, v.name, v1.Event{RequestID: v.data.RequestID, Key: v.data.Key, Phase: v1.PhaseFinished,
			Message: finishedMessage(v.data), Job: v.data.Job})
		if err := w.publishResult(actx, v.tenant, v.name, v.data); err != nil {
			// Counted in the ledger, like every transient failure: a
			// request's deliveries also count hand-backs and waits for
			// another worker's publish.
			if w.retryBudgetLeft(actx, le, meta) {
				log.Error("publish result failed; retrying the request", zap.Error(err), zap.String("requestId", v.data.RequestID))
				_ = msg.NakWithDelay(retryDelayOf(le, meta))
				return
			}
			log.Error("publish result failed on the last delivery; the request goes to the dead-letter stream",
				zap.Error(err), zap.String("requestId", v.data.RequestID))
			w.deadLetter(actx, v.tenant, msg, err)
			w.settle(actx, log, msg, v.data.RequestID, true, "result publish failed")
			return
		}
		if le != nil {
			// The mark only spares a redelivery a second publish (which
			// the stream would drop as a duplicate), and a redelivery
			// comes only if the ack below is lost: the two go together.
			marking.Go(func() { w.published(actx, le) })
		}
		w.cfg.Metrics.published(v.data)
	}
	w.settle(actx, log, msg, v.data.RequestID, v.term, v.data.Reason)
	marking.Wait()
	log.Info("request done", zap.String("requestId", v.data.RequestID), zap.String("status", string(v.data.Status)),
		zap.String("origin", string(v.data.Origin)), zap.String("reason", v.data.Reason), zap.String("digest", v.data.Digest))
	if v.cleanupKey != "" && !w.cfg.KeepJobs && !mutant("no-job-cleanup") {
		if err := w.backend.Cleanup(actx, v.cleanupKey, v.cleanupRun); err != nil {
			log.Warn("cleanup failed; ttlSecondsAfterFinished will remove the job", zap.Error(err))
		}
	}
}

// retryBudgetLeft counts one transient failure of a request and reports
// whether it may be retried: --max-deliver bounds transient failures, not
// deliveries, so hand-backs at shutdown and crashes (which also redeliver)
// never use up a request's budget. The count lives in the request's ledger
// entry; without one, deliveries are counted.
func (w *Worker) retryBudgetLeft(ctx context.Context, le *ledgerEntry, meta *jetstream.MsgMetadata) bool {
	if le == nil {
		return int(meta.NumDelivered) < w.cfg.MaxDeliver
	}
	k := RequestIndexKey(le.e.Tenant, le.e.RequestID)
	for range 5 {
		e := le.e
		e.TransientFailures++
		b, _ := json.Marshal(e)
		rev, err := w.requests.Update(ctx, k, b, le.rev)
		if err == nil {
			le.e, le.rev = e, rev
			return e.TransientFailures < w.cfg.MaxDeliver
		}
		if !isWrongRevision(err) {
			break
		}
		cur, gerr := w.ledgerGet(ctx, le.e.Tenant, le.e.RequestID)
		if gerr != nil || cur == nil {
			break
		}
		*le = *cur
	}
	// The ledger is unreachable: fall back to counting deliveries.
	return int(meta.NumDelivered) < w.cfg.MaxDeliver
}

// settle acks (or terminates) a handled message.
func (w *Worker) settle(ctx context.Context, log *zap.Logger, msg jetstream.Msg, id string, term bool, reason string) {
	var err error
	switch {
	case w.faults != nil && w.faults.loseAck != nil && w.faults.loseAck(id):
		err = errors.New("ack lost (fault injection)")
	case term:
		err = msg.TermWithReason(reason)
	default:
		err = msg.DoubleAck(ctx)
	}
	if err != nil {
		log.Warn("ack failed; the decision is recorded and a redelivery publishes the same result", zap.Error(err))
	}
}

// safeProcess is process with a panic turned into a terminal error: a
// request that crashes the handler gets a failed result once instead of
// crashing every worker that takes it, forever.
func (w *Worker) safeProcess(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, cancel context.CancelCauseFunc) (v verdict, le *ledgerEntry, err error) {
	var (
		base   verdict // what process knows of the request when it panics
		baseLE *ledgerEntry
	)
	defer func() {
		if r := recover(); r != nil {
			w.log.Error("panic while handling a request", zap.Any("panic", r), zap.Stack("stack"))
			// The failure is recorded in the ledger like any decision, so
			// a redelivery publishes it again instead of deciding anew.
			v, le, err = base, baseLE, fmt.Errorf("internal error while handling the request: %v", r)
			if v.tenant == "" {
				v = w.invalid(msg, nil, err, v1.Timings{}, meta)
			}
		}
	}()
	return w.process(ctx, msg, meta, &base, &baseLE, cancel)
}

func finishedMessage(d v1.ResultData) string {
	if d.Status == v1.StatusSucceeded {
		return fmt.Sprintf("succeeded (%s): %s", d.Origin, d.ImageRef)
	}
	return fmt.Sprintf("%s: %s", d.Status, d.Reason)
}

// retryDelayOf is the delay before a request's next try: by its count
// of transient failures in the ledger (retryBudgetLeft), or without an
// entry by its deliveries (which also count hand-backs and waits).
func retryDelayOf(le *ledgerEntry, meta *jetstream.MsgMetadata) time.Duration {
	if le != nil {
		return retryDelay(uint64(max(le.e.TransientFailures, 1)))
	}
	return retryDelay(meta.NumDelivered)
}

func retryDelay(delivered uint64) time.Duration {
	d := time.Second << min(delivered, 6)
	return min(d, time.Minute)
}

// heartbeatEvery is a third of the shorter of this worker's AckWait and
// the consumer's as the server last reported it: workers started with
// different --ack-wait values share one consumer, and the last to start
// set its AckWait.
func (w *Worker) heartbeatEvery() time.Duration {
	d := w.cfg.AckWait
	if s := time.Duration(w.ackWait.Load()); s > 0 && s < d {
		d = s
	}
	return max(d/3, 100*time.Millisecond)
}

// ackWaitRefresh is how often a worker re-reads the consumer's AckWait.
const ackWaitRefresh = 2 * time.Second

// refreshAckWait re-reads the consumer's AckWait.
func (w *Worker) refreshAckWait(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if info, err := w.cons.Info(ctx); err == nil {
		w.ackWait.Store(int64(info.Config.AckWait))
	}
}

// heartbeat tells JetStream the request is still being worked on, so a
// build longer than AckWait is not redelivered.
func (w *Worker) heartbeat(msg jetstream.Msg) func() {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		every := w.heartbeatEvery()
		if q, ok := msg.(*queuedMsg); ok && q.ackWait > 0 {
			every = min(every, max(q.ackWait/3, 100*time.Millisecond))
		}
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				if err := msg.InProgress(); err != nil {
					w.log.Debug("heartbeat failed", zap.Error(err))
				}
			case <-done:
				return
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// process decides a request's result. An error means no result yet: the
// caller retries (transient), hands back (shutdown) or fails the request.
// le is the request's ledger entry (nil for input too broken to have one).
func (w *Worker) process(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, base *verdict, baseLE **ledgerEntry, cancel context.CancelCauseFunc) (verdict, *ledgerEntry, error) {
	started := w.cfg.Now().UTC()
	seq, at := meta.Sequence.Stream, meta.Timestamp
	timings := v1.Timings{QueuedAt: at.UTC(), StartedAt: started, QueueWaitMs: started.Sub(at).Milliseconds()}
	req, err := w.decode(msg)
	if err != nil {
		return w.invalidEntry(ctx, msg, req, err, timings, meta)
	}
	v := verdict{tenant: req.Tenant, name: req.Name, data: v1.ResultData{
		RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Attempts: int(meta.NumDelivered), Timings: timings,
	}}
	key := w.keyOf(req)
	v.data.Key = key
	*base = v
	le, fresh, err := w.openEntry(ctx, req.Tenant, req.Name, req.RequestID, key, seq, at)
	if errors.Is(err, errDuplicateID) {
		// A parked request published again carries the token its
		// ledger entry holds: it is that request, not a duplicate. A
		// failed read (KV trouble, or the worker stopping) decides
		// nothing: the message is retried or handed back, never
		// terminated as a duplicate (its waiter entry is gone).
		rq, rerr := w.requeuedEntry(ctx, msg, req.Tenant, req.RequestID)
		if rerr != nil {
			return v, nil, Transient(rerr)
		}
		if rq != nil {
			le, fresh, err = rq, false, nil
			seq, at = rq.e.Seq, rq.e.MsgTime
			v.data.Timings = v1.Timings{QueuedAt: at.UTC(), StartedAt: started, QueueWaitMs: started.Sub(at).Milliseconds()}
		}
	}
	switch {
	case errors.Is(err, errDuplicateID):
		v.duplicate = true
		return v, nil, nil
	case err != nil:
		return v, nil, Transient(err)
	case le.e.Result != nil && !mutant("ignore-recorded-decision"):
		return verdictOf(le.e), le, nil // decided before: publish that again
	case le.e.Canceled:
		return canceledVerdict(v), le, nil // canceled while it was not held
	}
	if r, ok := ctx.Value(refuseKey{}).(refusal); ok {
		v.data.Status, v.data.Reason, v.data.Message = v1.StatusFailed, r.reason, r.message
		return v, le, nil
	}
	*baseLE = le
	defer w.held.hold(RequestIndexKey(req.Tenant, req.RequestID), cancel)()
	if fresh { // only its first handler: a redelivery is never expired
		if message, ok := w.expired(ctx, meta, le); ok {
			return expiredVerdict(v, message), le, nil
		}
	}
	repo, err := w.cfg.Naming.Repository(req)
	if err == nil {
		// Every destination is in one repository: the tenant must be
		// allowed to push there. Checked before anything is created
		// (no claim, no Job, no copy, no Harbor project).
		err = w.cfg.Naming.CheckDestination(req.Tenant, repo)
	}
	if err == nil && w.cfg.RegistryFor != nil {
		_, err = w.cfg.RegistryFor(req.Tenant)
	}
	if err != nil {
		v.data.Status, v.data.Reason, v.data.Message = v1.StatusFailed, v1.ReasonInvalidRequest, err.Error()
		v.term = true
		return v, le, nil
	}
	dests := naming.Destinations(repo, key, req.Tags)
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseQueued,
		Message: fmt.Sprintf("taken by %s after %s in the queue", w.cfg.ID, time.Duration(timings.QueueWaitMs)*time.Millisecond)})

	wr := &waiterReg{le: le, park: &waiterValue{Tenant: req.Tenant, RequestID: req.RequestID, Subject: msg.Subject(),
		MsgID: msg.Headers().Get(v1.MsgIDHeader), Seq: seq, MsgTime: at.UTC(), Body: msg.Data()}}
	rec, origin, owned, err := w.build(ctx, req, key, repo, dests, seq, wr)
	v.waiter = wr.added
	if errors.Is(err, errParked) {
		v.parked, v.waiter = true, false
		return v, le, nil
	}
	if errors.Is(err, errAnswered) {
		if cur, gerr := w.ledgerGet(ctx, req.Tenant, req.RequestID); gerr == nil && cur != nil && cur.e.Result != nil {
			return verdictOf(cur.e), cur, nil // publish that answer again, and ack
		}
		err = Transient(err) // the ledger could not be read back: try again
	}
	if nh := (*notHeldError)(nil); errors.As(err, &nh) {
		// Its tenant does not hold the content another tenant's build
		// was made of: refused, nothing of that build given.
		v.data.Status, v.data.Reason, v.data.Message = v1.StatusFailed, nh.reason, nh.message
		v.term = true
		return v, le, nil
	}
	if err != nil {
		return v, le, err
	}
	v, err = w.resultVerdict(ctx, v, req, rec, origin, owned, repo, dests)
	return v, le, err
}

// resultVerdict completes v with the final record rec that answers req.
func (w *Worker) resultVerdict(ctx context.Context, v verdict, req *v1.Request, rec *v1.BuildRecord, origin v1.Origin, owned bool, repo string, dests []string) (verdict, error) {
	v.data.Origin = origin
	v.data.Job = rec.Job
	if owned {
		v.cleanupKey, v.cleanupRun = rec.Key, rec.Run
	}
	if origin != v1.OriginCache {
		v.data.Timings.BuildMs = max(rec.FinishedAt.Sub(rec.StartedAt).Milliseconds(), 0)
	}
	if rec.State == v1.StateSucceeded {
		if err := w.ensureTags(ctx, req.Tenant, rec, dests); err != nil {
			return v, err
		}
		v.data.Status = v1.StatusSucceeded
		v.data.Image = dests[0]
		v.data.Digest = rec.Digest
		v.data.ImageRef = repo + "@" + rec.Digest
		return v, nil
	}
	v.data.Status = v1.StatusFailed
	if rec.Reason == v1.ReasonCanceled {
		v.data.Status = v1.StatusCanceled
	}
	v.data.Reason, v.data.Message, v.data.LogTail = rec.Reason, rec.Message, rec.LogTail
	return v, nil
}

// decode reads and validates a request message. The body's tenant must be
// the subject's, and its requestId the Nats-Msg-Id header's: the subject is
// what NATS permissions guard, and the header is what JetStream dedupes
// on, so a body may not speak for another tenant or another id.
func (w *Worker) decode(msg jetstream.Msg) (*v1.Request, error) {
	if len(bytes.TrimSpace(msg.Data())) == 0 {
		return nil, &v1.DecodeError{Err: errors.New("the request body is empty")}
	}
	req, err := v1.DecodeRequest(msg.Data())
	if err != nil {
		return req, err
	}
	var fields []v1.FieldError
	if msg.Subject() != v1.RequestSubject(req.Tenant) {
		fields = append(fields, v1.FieldError{Field: "tenant", Detail: fmt.Sprintf(
			"%q does not match the subject %s; a request of tenant %q goes on %s",
			req.Tenant, msg.Subject(), req.Tenant, v1.RequestSubject(req.Tenant))})
	}
	if h := msg.Headers().Get(v1.MsgIDHeader); !v1.MsgIDMatches(h, req.Tenant, req.RequestID) {
		if len(h) > 2*v1.MaxRequestIDLen {
			h = h[:2*v1.MaxRequestIDLen] + "…"
		}
		detail := fmt.Sprintf("the %s header is %q but the body says tenant %q, requestId %q; the header must be %q (JetStream dedupes on it)",
			v1.MsgIDHeader, h, req.Tenant, req.RequestID, v1.MsgID(req.Tenant, req.RequestID))
		if h == "" {
			detail = fmt.Sprintf("the %s header is missing; set it to %q", v1.MsgIDHeader, v1.MsgID(req.Tenant, req.RequestID))
		}
		fields = append(fields, v1.FieldError{Field: "requestId", Detail: detail})
	}
	if s3 := req.Source.S3; s3 != nil && w.cfg.ContextPrefix != "" {
		// A request names only its own tenant's contexts: another
		// tenant's object is neither built nor probed.
		if prefix := strings.ReplaceAll(w.cfg.ContextPrefix, "{tenant}", req.Tenant); !strings.HasPrefix(s3.Key, prefix) || strings.Contains(s3.Key, "..") {
			fields = append(fields, v1.FieldError{Field: "source.s3.key", Detail: fmt.Sprintf(
				"a context of tenant %q must be under %s (the CLI and SDK upload there)", req.Tenant, prefix)})
		}
	}
	if s3 := req.Source.S3; s3 != nil && w.cfg.ContextBucket != "" && s3.Bucket != w.cfg.ContextBucket {
		fields = append(fields, v1.FieldError{Field: "source.s3.bucket", Detail: fmt.Sprintf(
			"contexts must be in bucket %q, not %q", w.cfg.ContextBucket, s3.Bucket)})
	}
	if len(fields) > 0 {
		return req, &v1.ValidationError{Fields: fields}
	}
	return req, nil
}

// invalidEntry is the verdict of a request that cannot be decoded or
// validated, with the ledger entry of its id when it has a usable one.
func (w *Worker) invalidEntry(ctx context.Context, msg jetstream.Msg, req *v1.Request, err error, timings v1.Timings, meta *jetstream.MsgMetadata) (verdict, *ledgerEntry, error) {
	v := w.invalid(msg, req, err, timings, meta)
	if w.requests != nil && msg.Headers().Get(v1.MsgIDHeader) == "" && !strings.HasPrefix(v.tenant, "_") &&
		!strings.HasPrefix(v.data.RequestID, "invalid-") {
		// No header: the id is the body's. An id the ledger already
		// holds belongs to another message; this one gets no result
		// (a second, different one would follow the first).
		if le, err := w.ledgerGet(ctx, v.tenant, v.data.RequestID); err != nil {
			return v, nil, Transient(err)
		} else if le != nil {
			v.duplicate = true
			return v, nil, nil
		}
	}
	if w.requests == nil || strings.HasPrefix(v.tenant, "_") || strings.HasPrefix(v.data.RequestID, "invalid-") ||
		msg.Headers().Get(v1.MsgIDHeader) == "" {
		// No ledger entry for an id the message does not hold by its
		// header: it must not block a real request of that id.
		return v, nil, nil
	}
	le, _, lerr := w.openEntry(ctx, v.tenant, v.name, v.data.RequestID, "", meta.Sequence.Stream, meta.Timestamp)
	switch {
	case errors.Is(lerr, errDuplicateID):
		v.duplicate = true
		return v, nil, nil
	case lerr != nil:
		return v, nil, Transient(lerr)
	case le.e.Result != nil:
		return verdictOf(le.e), le, nil
	}
	return v, le, nil
}

// ensureTags makes every destination of a request point at the built
// image: a request for a known key but another repository or tag gets the
// image copied or tagged there, not rebuilt.
func (w *Worker) ensureTags(ctx context.Context, tenant string, rec *v1.BuildRecord, dests []string) error {
	reg, err := w.tenantRegistry(tenant)
	if err != nil {
		return err
	}
	for _, d := range dests {
		if slices.Contains(rec.Pushed, d) || d == rec.Image {
			continue
		}
		if reg == nil {
			return fmt.Errorf("cannot tag %s: the worker has no registry client", d)
		}
		src := rec.Repository + "@" + rec.Digest
		if _, err := reg.Copy(ctx, src, d); err != nil {
			return Transient(fmt.Errorf("copy %s to %s: %w", src, d, err))
		}
	}
	return nil
}

// invalid builds the failed result of a request that cannot be decoded or
// validated. It is still addressed as well as the input allows: tenant
// from the subject, name "_invalid" when the name itself is bad.
func (w *Worker) invalid(msg jetstream.Msg, req *v1.Request, err error, timings v1.Timings, meta *jetstream.MsgMetadata) verdict {
	tenant, name, id := "", "", ""
	if req != nil {
		tenant, name, id = req.Tenant, req.Name, req.RequestID
	} else {
		// Not decodable strictly: recover what addressing the input has.
		var loose struct{ RequestID, Tenant, Name string }
		if json.Unmarshal(msg.Data(), &loose) == nil {
			tenant, name, id = loose.Tenant, loose.Name, loose.RequestID
		}
	}
	// The subject's tenant is the only one: it is the one NATS let the
	// producer publish as, and so the one whose results it reads. A body
	// never picks whose result subject a refusal lands on.
	tenant = "_invalid"
	if parts := strings.Split(msg.Subject(), "."); len(parts) >= 3 && v1.DNSLabelProblem(parts[2]) == "" {
		tenant = parts[2]
	}
	if v1.DNSLabelProblem(name) != "" {
		name = "_invalid"
	}
	// The id is the body's when the header — what JetStream deduped the
	// message on — names it (in any of its forms: the SDK's
	// <tenant>/<id>/<nonce>, <tenant>/<id>, bare), so the producer that
	// waits on its request id gets the refusal. Otherwise it is the id the
	// header names: a broken or forged body must not take (and so block)
	// an id another message of the tenant holds.
	switch h := msg.Headers().Get(v1.MsgIDHeader); {
	case h != "" && usableID(id) && v1.MsgIDMatches(h, tenant, id):
	case h != "" && usableID(v1.RequestIDOfMsgID(h, tenant)):
		id = v1.RequestIDOfMsgID(h, tenant)
	case h == "" && usableID(id):
	default:
		id = fmt.Sprintf("invalid-%d", meta.Sequence.Stream)
	}
	w.log.Info("invalid request", zap.String("requestId", id), zap.Error(err))
	return verdict{tenant: tenant, name: name, term: true, data: v1.ResultData{
		RequestID: id, Tenant: tenant, Name: name, Status: v1.StatusFailed, Reason: v1.ReasonInvalidRequest,
		Message: err.Error(), Attempts: int(meta.NumDelivered), Timings: timings,
	}}
}

// usableID reports whether an id from bad input can still serve as the
// result's message id and CloudEvents id.
func usableID(id string) bool {
	return id != "" && len(id) <= v1.MaxRequestIDLen && !strings.ContainsAny(id, " \t\r\n\x00")
}

func (w *Worker) publishResult(ctx context.Context, tenant, name string, data v1.ResultData) error {
	ev := v1.NewResult(w.source, data, w.cfg.Now())
	b, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	// Into the results stream, which stores it as
	// v1.ResultSubject(tenant, name) and publishes it there once stored.
	m := nats.NewMsg(v1.ResultsIngestPrefix + "." + tenant + "." + name)
	m.Header.Set(v1.MsgIDHeader, v1.MsgID(tenant, data.RequestID))
	m.Header.Set("Content-Type", v1.CloudEventsContentType)
	m.Data = b
	if _, err := w.js.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("publish result %s: %w", data.RequestID, err)
	}
	return nil
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
	b, err := json.Marshal(e)
	if err != nil {
		return
	}
	_ = w.nc.Publish(v1.EventSubject(tenant, name), b)
}

// tenantRegistry is the registry client for a tenant's own repositories:
// its own credentials (Config.RegistryFor) or the worker's.
func (w *Worker) tenantRegistry(tenant string) (Registry, error) {
	if w.cfg.RegistryFor == nil {
		return w.registry, nil
	}
	reg, err := w.cfg.RegistryFor(tenant)
	if err != nil {
		// Checked before the request claimed anything; gone since (a
		// Secret removed): try again later.
		return nil, Transient(err)
	}
	return reg, nil
}
