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
	"context"
	"errors"
	"fmt"
	"golang.org/x/sync/singleflight"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
	"github.com/buildq/buildq/worker/internal/fairq"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/runs"
	"github.com/buildq/buildq/worker/internal/tenantapi"
)

// Worker consumes build requests. Create it with New and call Run.
type Worker struct {
	cfg      Config
	registry Registry
	nc       *nats.Conn
	js       jetstream.JetStream
	backend  Backend
	log      *zap.Logger
	// ledger owns buildq-requests (internal/ledger).
	ledger *ledger.Ledger
	// serverClock bounds the NATS server's clock (results.go): whether a
	// request is young enough for its result to be published first.
	serverClock serverClock
	// runs owns buildq-builds (internal/runs).
	runs *runs.Store
	// The worker's components, each with its own state: the tenant API
	// (internal/tenantapi), parking (park.go) and the builder (build.go).
	api  *tenantapi.Service
	park *parking
	// room holds requests at intake while their key builds (intakehold.go).
	room   *intakeRoom
	builds *builder
	// jobs: the janitor's view of Jobs left behind (janitor.go).
	jobs janitor
	// life is Run's work context: it ends when the worker stops. Work
	// shared between requests (a possession read) runs in it, apart from
	// any one request's context.
	life atomic.Pointer[context.Context]
	// bg counts background work (answering parked requests).
	bg sync.WaitGroup
	// sboms makes one SBOM per image at a time (sbom.go).
	sboms singleflight.Group
	// ackWait is the consumer's AckWait as the server has it (nanoseconds):
	// another worker may have set it lower than this one's.
	ackWait atomic.Int64
	// ackPendingCapped: the consumer's MaxAckPending is a number (set by
	// an older worker, or by hand), not unlimited: intake holds nothing
	// then (intakehold.go), or it would fill that number for everyone.
	ackPendingCapped atomic.Bool
	cons             jetstream.Consumer
	// fq is the fair queue (internal/fairq): BUILDQ_QUEUE, buildq-slots,
	// intake, the dispatcher and the in-flight semaphore.
	fq     *fairq.Queue
	source string

	setupMu   sync.Mutex
	setupDone bool
	// running: Run set up the streams and takes requests (readiness).
	running atomic.Bool

	// logs opens and ends runs' logs (logs.go).
	logs *buildLogs

	// sourceInfo: the resolved git sources of requests being handled,
	// named in their progress events (source.go).
	sourceInfo sourceInfos

	// faults is nil outside the package's fault simulation.
	faults *faultHooks
}

// New validates cfg and returns a worker that uses nc and runs builds on
// backend. It does not touch the server until Run (or Setup). Unless
// cfg.FirstAge is negative, nc must keep no reconnect buffer
// (nats.ReconnectBufSize(-1)).
func New(nc *nats.Conn, backend Backend, cfg Config) (*Worker, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("worker config: %w", err)
	}
	if cfg.FirstAge > 0 && nc != nil && nc.Opts.ReconnectBufSize >= 0 {
		// A publish written while the connection is down waits in that
		// buffer and goes out when it is back, however long that takes:
		// a result published first could then land after the duplicate
		// window, beside another decision (docs/design.md §2 step 6).
		return nil, fmt.Errorf("worker: the NATS connection keeps a reconnect buffer of %d bytes; "+
			"a worker that publishes results first needs one that keeps none (nats.ReconnectBufSize(-1)), "+
			"or a negative FirstAge to record every decision first", nc.Opts.ReconnectBufSize)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	log := cfg.Logger.With(zap.String("worker", cfg.ID))
	w := &Worker{
		runs:     runs.New(),
		cfg:      cfg,
		registry: cfg.Registry,
		nc:       nc,
		js:       js,
		backend:  backend,
		log:      log,
		source:   "/buildq/worker/" + cfg.ID,
	}
	lcfg := ledger.Config{Worker: cfg.ID, Now: cfg.Now, PublishGrace: publishGrace(cfg.Lease), Results: storedResults{js}, Log: log}
	if cfg.FirstAge > 0 {
		lcfg.Young = func(msgTime time.Time) bool { return w.serverClock.young(msgTime, cfg.FirstAge) }
	}
	w.ledger = ledger.New(lcfg)
	w.fq = fairq.New(js, nc, queueHandler{w}, fairq.Options{Fair: cfg.Fair, ID: cfg.ID, Lease: cfg.Lease, AckWait: cfg.AckWait,
		MaxDeliver: cfg.MaxDeliver, MaxInFlight: cfg.MaxInFlight, Now: cfg.Now, Log: log, Metrics: queueMetrics{cfg.Metrics}, Ledger: w.ledger})
	w.room = newIntakeRoom(w)
	w.park = &parking{cfg: &w.cfg, ledger: w.ledger, runs: w.runs, js: js, log: log, bg: &w.bg,
		publish: w.publish, event: w.event, answer: w.resultVerdict, parked: parkWatch{seen: map[string]observed{}}}
	w.logs = &buildLogs{cfg: &w.cfg, reader: buildlog.NewReader(js), log: log,
		openLog: func(ctx context.Context, key, run string, opts buildlog.Options) (*buildlog.Writer, error) {
			return buildlog.Open(ctx, js, key, run, opts)
		}}
	apiCfg := tenantapi.Config{Ledger: w.ledger, Runs: w.runs, NC: nc, Log: log, Now: cfg.Now, AnyReply: cfg.AnyReply,
		StopBuild: w.stopBuild, AnswerParked: w.park.answerWaiters, ReplyRefused: cfg.Metrics.replyRefused}
	if cfg.FirstAge > 0 {
		apiCfg.Publish, apiCfg.Results = w.publish, storedResults{js}
	}
	if cfg.Logs.Enabled {
		apiCfg.Logs, apiCfg.Archive, apiCfg.EndLog = buildlog.NewReader(js), cfg.Logs.Archive, w.logs.endRun
	}
	w.api = tenantapi.New(apiCfg)
	w.builds = &builder{Worker: w, orphans: orphanWatch{seen: map[string]observed{}}}
	// Every write that ends or lets go a run answers its parked requests.
	w.runs.OnEnded(w.park.answerWaiters)
	return w, nil
}

// Setup creates or updates the streams, the shared consumer and the KV
// bucket. It is idempotent and safe to run from many workers at once.
//
// A JetStream that is not ready yet — a cluster still electing its meta
// leader, a node restarting, workers racing to create the same streams —
// is waited for, retrying until ctx ends; other errors are returned at
// once. ctx's deadline bounds the whole, never one request: a JetStream
// API request sent while a cluster elects its meta leader gets no answer
// at all, and under ctx's deadline it would wait out all of it. Each
// resource gets setupRequestTimeout per request instead, and a request
// left unanswered is sent again at once. Two workers that create the same
// stream of a cluster at the same moment are both left unanswered (the
// second, equal proposal takes the first one's reply), so a fresh
// Deployment's replicas pay that timeout once per resource: it is short
// for that reason. The request sent again finds the resource and updates
// it, which is answered.
func (w *Worker) Setup(ctx context.Context) error {
	w.setupMu.Lock()
	defer w.setupMu.Unlock()
	if w.setupDone {
		return nil
	}
	backoff := 200 * time.Millisecond
	lastStep, patience := -1, 1
	for {
		actx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		stop := context.AfterFunc(ctx, cancel)
		step, err := w.setup(actx, patience)
		stop()
		cancel()
		if err == nil {
			w.setupDone = true
			return nil
		}
		if ctx.Err() != nil || !setupRetryable(err) {
			return err
		}
		if errors.Is(err, context.DeadlineExceeded) {
			// Unanswered: the request itself was the wait. The same step
			// unanswered again is given longer (a slow server), up to 8
			// times; a later step starts short again.
			if step == lastStep {
				patience = min(2*patience, 8)
			} else {
				lastStep, patience = step, 1
			}
			w.log.Info("JetStream left a setup request unanswered; sending it again", zap.Error(err))
			continue
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

// A setup step waits setupStepTimeout plus setupRequestTimeout per
// request it makes, times the patience Setup gives it. A cluster answers
// a create in well under a second; an unanswered request (see Setup)
// costs the step's deadline.
const (
	setupStepTimeout    = 1500 * time.Millisecond
	setupRequestTimeout = 250 * time.Millisecond
)

// setup runs the steps of Setup in order and returns the index of the
// one that failed.
func (w *Worker) setup(ctx context.Context, patience int) (int, error) {
	// One after another: against a cluster that is still forming, many
	// stream creations at once (each worker's, of every resource) were
	// refused as "no suitable peers for placement" for over a minute,
	// where one at a time go through.
	//
	// Each step has its own deadline of setupRequestTimeout per request
	// it makes (CreateOrUpdate is an update, then a create if there is
	// nothing to update).
	cfg := w.cfg
	var builds jetstream.KeyValue
	var cons jetstream.Consumer
	var ledgerKV jetstream.KeyValue
	var ledgerStream jetstream.Stream
	steps := []struct {
		requests int
		do       func(context.Context) error
	}{
		{2, func(ctx context.Context) error { return createRequests(ctx, w.js, cfg) }},
		{2, func(ctx context.Context) error { return createResults(ctx, w.js, cfg) }},
		{2, func(ctx context.Context) error { return createDeadLetter(ctx, w.js, cfg) }},
		{2, func(ctx context.Context) (err error) { cons, err = createWorkersConsumer(ctx, w.js, cfg); return err }},
		{3, func(ctx context.Context) (err error) { builds, err = createBuilds(ctx, w.js, cfg); return err }},
		{7, func(ctx context.Context) error {
			return w.fq.Setup(ctx, cfg.Storage, cfg.Replicas, cfg.DuplicateWindow)
		}},
		{4, func(ctx context.Context) (err error) {
			ledgerKV, err = ledger.EnsureBucket(ctx, w.js, ledger.BucketConfig{TTL: cfg.ResultsMaxAge, Storage: cfg.Storage, Replicas: cfg.Replicas})
			if err != nil {
				return err
			}
			ledgerStream, err = ledger.BucketStream(ctx, w.js)
			return err
		}},
		{2, func(ctx context.Context) error {
			if !cfg.Logs.Enabled {
				return nil
			}
			_, err := buildlog.EnsureStream(ctx, w.js, buildlog.StreamConfig{MaxAge: cfg.Logs.MaxAge, MaxBytes: cfg.Logs.MaxBytes,
				Storage: cfg.Storage, Replicas: cfg.Replicas, Duplicates: cfg.DuplicateWindow})
			return err
		}},
	}
	for i, st := range steps {
		timeout := time.Duration(patience) * (setupStepTimeout + time.Duration(st.requests)*setupRequestTimeout)
		sctx, cancel := context.WithTimeout(ctx, timeout)
		err := st.do(sctx)
		cancel()
		if err != nil {
			return i, err
		}
	}
	w.runs.UseBucket(builds)
	w.cons = cons
	w.ackWait.Store(int64(cons.CachedInfo().Config.AckWait))
	w.ackPendingCapped.Store(cons.CachedInfo().Config.MaxAckPending > 0)
	w.ledger.UseBucket(ledgerKV)
	w.ledger.UseStream(ledgerStream)
	return len(steps), nil
}

// EnsureStreams creates or updates everything of the wire contract
// (DESIGN §3) on the server: BUILDQ_REQUESTS, BUILDQ_RESULTS, the dead-letter
// stream, the buildq-workers consumer and the buildq-builds bucket.
func EnsureStreams(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.KeyValue, jetstream.Consumer, error) {
	cfg = cfg.WithDefaults()
	if err := createRequests(ctx, js, cfg); err != nil {
		return nil, nil, err
	}
	if err := createResults(ctx, js, cfg); err != nil {
		return nil, nil, err
	}
	if err := createDeadLetter(ctx, js, cfg); err != nil {
		return nil, nil, err
	}
	cons, err := createWorkersConsumer(ctx, js, cfg)
	if err != nil {
		return nil, nil, err
	}
	kv, err := createBuilds(ctx, js, cfg)
	if err != nil {
		return nil, nil, err
	}
	return kv, cons, nil
}

func createRequests(ctx context.Context, js jetstream.JetStream, cfg Config) error {
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.RequestsStream,
		Description: "buildq build requests (work queue)",
		Subjects:    []string{v1.RequestsPrefix + ".>"},
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
	}); err != nil {
		return fmt.Errorf("create stream %s: %w", v1.RequestsStream, err)
	}
	return nil
}

func createResults(ctx context.Context, js jetstream.JetStream, cfg Config) error {
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
		return fmt.Errorf("create stream %s: %w", v1.ResultsStream, err)
	}
	return nil
}

func createDeadLetter(ctx context.Context, js jetstream.JetStream, cfg Config) error {
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
		return fmt.Errorf("create stream %s: %w", v1.DeadLetterStream, err)
	}
	return nil
}

func createBuilds(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.KeyValue, error) {
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
		return nil, fmt.Errorf("create key-value bucket %s: %w", v1.BuildsBucket, err)
	}
	return kv, nil
}

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
	stopAPI, err := w.api.Serve(workCtx)
	if err != nil {
		return fmt.Errorf("subscribe the status and cancel services: %w", err)
	}
	defer stopAPI()
	var wg sync.WaitGroup
	if r, ok := w.backend.(Reconciler); ok {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.Reconcile(workCtx, w.builds.finishOrphan)
		}()
	}
	// The server's clock, before any result is published (results.go).
	w.sampleServerClock(workCtx)
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
				w.sampleServerClock(workCtx)
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
				w.park.sweepWaiters(sctx)
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

	if w.cfg.Logs.Enabled && w.cfg.Logs.Retention > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(logRetentionEvery)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					lctx, cancel := context.WithTimeout(workCtx, logRetentionEvery/2)
					w.logs.expireLogs(lctx)
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
					w.fq.KeepSlots(kctx)
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

	// Requests held at intake until their key's build ends: the room
	// closes, handing them back, when intake stops.
	wg.Add(1)
	go func() {
		defer wg.Done()
		w.room.run(ctx, workCtx)
	}()
	// Intake admits new requests to the tenants' queues; the dispatcher
	// runs them on this worker's free slots, fairly between tenants.
	w.fq.Run(ctx, workCtx, &wg, w.cons, func() time.Duration { return time.Duration(w.ackWait.Load()) })

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
