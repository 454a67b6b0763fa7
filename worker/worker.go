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
	// publishAttempt bounds the wait for a result's PubAck (0:
	// apiAttempt; tests shorten it).
	publishAttempt time.Duration
	backend        Backend
	log            *zap.Logger
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
	lcfg := ledger.Config{Worker: cfg.ID, Now: cfg.Now, PublishGrace: publishGrace(cfg.Lease), Results: storedResults{js: js}, Log: log}
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
		openLog: func(ctx context.Context, key, run string, fresh bool, opts buildlog.Options) (*buildlog.Writer, error) {
			if fresh {
				return buildlog.OpenNew(js, key, run, opts), nil
			}
			return buildlog.Open(ctx, js, key, run, opts)
		}}
	apiCfg := tenantapi.Config{Ledger: w.ledger, Runs: w.runs, NC: nc, Log: log, Now: cfg.Now, AnyReply: cfg.AnyReply,
		StopBuild: w.stopBuild, AnswerParked: w.park.answerWaiters, ReplyRefused: cfg.Metrics.replyRefused}
	if cfg.FirstAge > 0 {
		apiCfg.Publish, apiCfg.Results = w.publish, storedResults{js: js}
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
	go func() {
		wg.Wait()
		// Claims intake sent that no handler took (intakeclaim.go).
		wctx, cancel := context.WithTimeout(context.Background(), w.cfg.ShutdownTimeout)
		w.builds.withdrawPending(wctx)
		cancel()
		w.bg.Wait()
		close(done)
	}()
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
