package worker

// Setup of the streams, the shared consumer and the KV buckets.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
	"github.com/buildq/buildq/worker/internal/ledger"
)

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
	w.runs.UseBucket(bounded(builds))
	w.cons = cons
	w.ackWait.Store(int64(cons.CachedInfo().Config.AckWait))
	w.ackPendingCapped.Store(cons.CachedInfo().Config.MaxAckPending > 0)
	w.ledger.UseBucket(bounded(ledgerKV))
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
