package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
	"go.uber.org/zap/zaptest"
)

// Tests for the claim protocol's defects of issue 9, each reproduced as it
// was found: every one of them fails on the protocol before runs and the
// request ledger.

// A retry of a failed key whose first Job create fails must not adopt the
// earlier run's failed Job when it is redelivered.
func TestRetryNeverAdoptsAnEarlierRunsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.KeepJobs = true })
	results := e.collect()
	creates := e.failJobCreates(func(n int64) bool { return n == 2 }) // R2's first create: 500

	r1 := request("retry-adopts")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(r1, kanikoID))
	e.kubelet(e.waitJob(name), 1, "error building image: flaky base")
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusFailed {
		t.Fatalf("first %s", mustJSON(t, r))
	}
	r2 := request("retry-adopts")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	// The redelivered R2 must replace R1's kept Job with its own.
	eventually(t, 20*time.Second, "R2's own job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && j.Annotations[kaniko.AnnotationRequestID] == r2.RequestID
	})
	e.kubelet(e.waitJob(name), 0, digestOf("retried"))
	r := results.waitFor(t, 2, 20*time.Second)[1]
	if r.ID != r2.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digestOf("retried") {
		t.Fatalf("R2 got %s (job creates attempted: %d)", mustJSON(t, r), creates.Load())
	}
}

// A request whose ack is lost after its result was stored must not be
// decided again when it is redelivered — not even when the key has moved
// on to a new build meanwhile.
func TestLostAckNeverGivesASecondResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var lost atomic.Bool
	r1 := request("lost-ack")
	e.startWorkerHooked("w1", nil, nil, func(w *Worker) {
		w.faults = &faultHooks{loseAck: func(id string) bool { return id == r1.RequestID && lost.CompareAndSwap(false, true) }}
	})
	results := e.collect()

	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(r1, kanikoID))
	e.kubelet(e.waitJob(name), 1, "error building image: first run")
	first := results.waitFor(t, 1, 10*time.Second)[0]
	if first.Data.Status != v1.StatusFailed {
		t.Fatalf("first %s", mustJSON(t, first))
	}
	// A new request retries the key and succeeds before R1 is redelivered.
	r2 := request("lost-ack")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "R2's job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && j.Annotations[kaniko.AnnotationRequestID] == r2.RequestID
	})
	e.kubelet(e.waitJob(name), 0, digestOf("second run"))
	results.waitFor(t, 2, 10*time.Second)
	// R1 comes back after AckWait; its result is published again at most,
	// and only as it was (the collector fails the test on a difference).
	eventually(t, 20*time.Second, "R1's redelivery to be settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if !lost.Load() {
		t.Fatal("the ack was never lost")
	}
	stored := byID(e.resultsStored())
	if len(stored[r1.RequestID]) != 1 || stored[r1.RequestID][0].Data.Status != v1.StatusFailed {
		t.Fatalf("R1's stored results: %+v", stored[r1.RequestID])
	}
}

// An owner that finishes after its run was canceled and the key claimed by
// a newer run must not overwrite the newer claim with its outcome.
func TestFinishingRunNeverOverwritesANewerClaim(t *testing.T) {
	t.Parallel()
	e := setup(t)
	release := make(chan struct{})
	var paused atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) { c.KeepJobs = true }, nil, func(w *Worker) {
		w.faults = &faultHooks{beforeFinalize: func(string) {
			if paused.CompareAndSwap(false, true) {
				<-release
			}
		}}
	})
	results := e.collect()

	r1 := request("overwrite")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r1, kanikoID)
	name := kaniko.JobName(key)
	e.kubelet(e.waitJob(name), 0, digestOf("first run"))
	eventually(t, 10*time.Second, "the owner to pause before its final write", paused.Load)
	if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	r3 := request("overwrite")
	if _, err := e.pub.Publish(context.Background(), r3); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "R3's claim", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateBuilding && rec.RequestID == r3.RequestID
	})
	close(release) // the first owner writes its outcome now
	// R3's run is still building: the stale outcome must not have ended it.
	time.Sleep(300 * time.Millisecond)
	if rec := e.claim(key); rec.State != v1.StateBuilding || rec.RequestID != r3.RequestID {
		t.Fatalf("the newer claim was overwritten: %+v", rec)
	}
	eventually(t, 10*time.Second, "R3's job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && j.Annotations[kaniko.AnnotationRequestID] == r3.RequestID
	})
	e.kubelet(e.waitJob(name), 0, digestOf("second run"))
	got := byID(results.waitFor(t, 2, 20*time.Second))
	if d := got[r3.RequestID][0].Data; d.Status != v1.StatusSucceeded || d.Digest != digestOf("second run") || d.Origin != v1.OriginBuild {
		t.Fatalf("R3 got %s", mustJSON(t, d))
	}
}

// Cleanup stops only its own run's Job, never a newer run's of the key.
func TestCleanupTouchesOnlyItsOwnRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, watcher := e.startWorkerWith("w1", testKaniko, nil)
	backend, err := NewKubeBackend(e.kube, watcher, testKaniko)
	if err != nil {
		t.Fatal(err)
	}
	req := request("cleanup-run")
	key := v1.BuildKey(req, kanikoID)
	job, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Destinations: []string{"registry.test:5000/acme/web:x"}, Run: "newer"}, testKaniko.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Create(context.Background(), job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the job in the cache", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
	for _, run := range []string{"older", ""} {
		if err := backend.Cleanup(context.Background(), key, run); err != nil {
			t.Fatal(err)
		}
		if e.jobGone(job.Name)() {
			t.Fatalf("cleanup of run %q deleted the newer run's job", run)
		}
	}
	if err := backend.Cleanup(context.Background(), key, "newer"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the run's own job to be deleted", e.jobGone(job.Name))
}

// The Nats-Msg-Id header JetStream dedupes on must be the body's id.
func TestMsgIDHeaderMustMatchTheBody(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	for _, header := range []string{"someone-elses-id", ""} {
		req := request("header-" + header)
		req.APIVersion, req.RequestID = v1.APIVersion, "body-id-"+header
		body, _ := json.Marshal(req)
		m := nats.NewMsg(v1.RequestSubject("acme"))
		if header != "" {
			m.Header.Set(v1.MsgIDHeader, header)
		}
		m.Data = body
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range results.waitFor(t, 2, 10*time.Second) {
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(r.Data.Message, v1.MsgIDHeader) {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
}

// panicBackend panics in Run.
type panicBackend struct{}

func (panicBackend) Identity() string { return "panics" }
func (panicBackend) Run(context.Context, Build, Started) (Outcome, error) {
	panic("executor blew up")
}
func (panicBackend) Cleanup(context.Context, string, string) error { return nil }

// A request that panics the handler gets one failed result and is
// terminated; the worker goes on.
func TestPanicInTheHandlerFailsTheRequestOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	w, err := New(e.nc, panicBackend{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	results := e.collect()
	for _, seed := range []string{"panic-1", "panic-2"} {
		if _, err := e.pub.Publish(context.Background(), request(seed)); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range results.waitFor(t, 2, 10*time.Second) {
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInfrastructureError || !strings.Contains(r.Data.Message, "executor blew up") {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	eventually(t, 5*time.Second, "the requests to be terminated", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// A result that cannot be published is retried only up to MaxDeliver; then
// the request goes to the dead-letter stream instead of looping forever.
func TestUnpublishableResultIsDeadLetteredAfterMaxDeliver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	metrics := NewMetrics(prometheus.NewRegistry())
	e.startWorker("w1", func(c *Config) { c.MaxDeliver = 2; c.Metrics = metrics })
	if err := e.js.DeleteStream(context.Background(), v1.ResultsStream); err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(v1.RequestSubject("acme"))
	m.Header.Set(v1.MsgIDHeader, "unpublishable")
	m.Data = []byte(`{"requestId":"unpublishable"}`) // invalid: a quick verdict
	if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the request to leave the queue", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	dl := e.streamMsgs(v1.DeadLetterStream)
	if len(dl) != 1 || dl[0].Header.Get("Buildq-Original-Msg-Id") != "unpublishable" {
		t.Fatalf("dead letters: %d", len(dl))
	}
	if n := testutil.ToFloat64(metrics.dead); n != 1 {
		t.Fatalf("buildq_dead_letters_total %v, want 1", n)
	}
}

// blockingContexts makes the first Open wait for its context to end; later
// ones find no object.
type blockingContexts struct{ opened atomic.Int32 }

func (b *blockingContexts) Open(ctx context.Context, _, _ string) (io.ReadCloser, error) {
	if b.opened.Add(1) == 1 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return nil, s3store.ErrNotFound
}

type noPusher struct{}

func (noPusher) Push(context.Context, ggcrv1.Image, []string) (string, error) {
	return "", errors.New("not used")
}
func (noPusher) RemoteOptions(context.Context) []remote.Option { return nil }

// A local build that joins the same run in this process, whose first
// caller gives up (a cancel, a lost claim), runs the build itself instead
// of returning the first caller's "context canceled".
func TestLocalJoinerOfAnUnwindingRunBuildsItself(t *testing.T) {
	t.Parallel()
	l := NewLocalBackend(&blockingContexts{}, noPusher{}, t.TempDir(), 0)
	req := request("local-join")
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	firstCtx, cancelFirst := context.WithCancel(context.Background())
	joined := make(chan struct{})
	var (
		wg       sync.WaitGroup
		firstErr error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, firstErr = l.Run(firstCtx, b, func(string, bool, string) {})
	}()
	eventually(t, 5*time.Second, "the first build to run", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.running[b.Key] != nil
	})
	var out Outcome
	var err error
	wg.Add(1)
	go func() {
		defer wg.Done()
		out, err = l.Run(context.Background(), b, func(_ string, created bool, _ string) {
			if !created {
				close(joined)
			}
		})
	}()
	<-joined
	cancelFirst()
	wg.Wait()
	if !errors.Is(firstErr, context.Canceled) {
		t.Fatalf("first caller: %v", firstErr)
	}
	if err != nil || out.Reason != v1.ReasonContextMissing {
		t.Fatalf("joiner got %+v, %v; want its own build's outcome (ContextMissing)", out, err)
	}
}

// A live owner whose clock runs an hour behind keeps its claim: leases are
// judged on the reader's clock, not by comparing timestamps.
func TestSkewedClockNeverTakesALiveClaim(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// One slot: busy with R1, so R2 goes to the other worker.
	e.startWorker("slow-clock", func(c *Config) {
		c.MaxInFlight = 1
		c.Now = func() time.Time { return time.Now().Add(-time.Hour) }
	})
	results := e.collect()
	r1 := request("skew")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r1, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	e.startWorker("fast-clock", func(c *Config) { c.Now = func() time.Time { return time.Now().Add(time.Hour) } })
	r2 := request("skew")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	// Three leases of 2 s: a lease judged across clocks lapses at once.
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		if rec := e.claim(key); rec.Owner != "slow-clock" {
			t.Fatalf("claim taken from a live owner: %+v", rec)
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.kubelet(job, 0, digestOf("skew"))
	for _, r := range results.waitFor(t, 2, 10*time.Second) {
		if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digestOf("skew") {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d jobs created", n)
	}
}

// A dead owner whose clock ran an hour ahead is taken over after its
// lease, not after its timestamp.
func TestDeadOwnerWithAFastClockIsTakenOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	req := request("fast-dead")
	key := v1.BuildKey(req, kanikoID)
	w := e.startWorker("w1", nil)
	results := e.collect()
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		LeaseUntil: time.Now().Add(time.Hour), RequestID: "gone", Tenant: "acme", Name: "web",
		Repository: "registry.test:5000/acme/web", Destinations: []string{"registry.test:5000/acme/web:" + v1.DefaultTag(key)}})
	if _, err := w.w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key)) // taken over within seconds
	if job.Annotations[kaniko.AnnotationRun] != "dead-run" {
		t.Fatalf("the take-over ran another run: %q", job.Annotations[kaniko.AnnotationRun])
	}
	e.kubelet(job, 0, digestOf("fast-dead"))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginInflight {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

// A worker whose --ack-wait is longer than the consumer's (set lower by
// another worker) heartbeats often enough that its requests are not
// redelivered mid-build.
func TestHeartbeatFollowsTheConsumersAckWait(t *testing.T) {
	t.Parallel()
	e := setup(t)
	long := e.startWorker("long", func(c *Config) { c.AckWait = 6 * time.Second })
	short := e.startWorker("short", func(c *Config) { c.AckWait = time.Second })
	short.stop(t) // the consumer keeps its 1 s AckWait
	eventually(t, 10*time.Second, "the long worker to learn the consumer's AckWait", func() bool {
		return long.w.heartbeatEvery() < time.Second
	})
	results := e.collect()
	req := request("ack-wait")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	time.Sleep(4 * time.Second) // four AckWaits of the consumer
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d redeliveries during the build", redelivered)
	}
	e.kubelet(job, 0, digestOf("ack-wait"))
	results.waitFor(t, 1, 10*time.Second)
}

// Labels change the image, so they are part of the build key.
func TestRequestsDifferingOnlyInLabelsBuildTwice(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	a, b := request("labels"), request("labels")
	b.Labels = map[string]string{"team": "other"}
	for _, r := range []*v1.Request{a, b} {
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "two jobs", func() bool { return e.creates.total() == 2 })
}

// The builds bucket does not grow forever.
func TestBuildsBucketHasATTL(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.IndexTTL = 48 * time.Hour })
	kv, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.TTL() != 48*time.Hour {
		t.Fatalf("TTL %s", st.TTL())
	}
}

// resultsStored reads every result on the results stream.
func (e *env) resultsStored() []v1.Result {
	var out []v1.Result
	for _, m := range e.streamMsgs(v1.ResultsStream) {
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil {
			e.t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

// --max-deliver bounds a request's transient failures, not its deliveries:
// hand-backs at shutdown (rolling restarts) and crashes redeliver too, and
// must not use the budget up.
func TestRetryBudgetCountsTransientFailuresNotDeliveries(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.startWorker("w1", func(c *Config) { c.MaxDeliver = 3 })
	w := r.w
	le, _, err := w.ledger.Open(context.Background(), "acme", "web", "budget", "", 1, time.Unix(1e9, 0))
	if err != nil {
		t.Fatal(err)
	}
	// The tenth delivery, after nine hand-backs: still the first failure.
	for i, want := range []bool{true, true, false} {
		if got := w.ledger.SpendRetry(context.Background(), le, 10, w.cfg.MaxDeliver); got != want {
			t.Fatalf("transient failure %d: retry = %v, want %v", i+1, got, want)
		}
	}
	if le.E.TransientFailures != 3 {
		t.Fatalf("ledger counts %d failures", le.E.TransientFailures)
	}
}

// Setup waits for a JetStream that is not ready yet (a cluster electing its
// leader, workers racing to create the streams) and gives up at once on
// anything else.
func TestSetupRetriesOnlyWhatIsNotReadyYet(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err   error
		retry bool
	}{
		{fmt.Errorf("create stream: %w", context.DeadlineExceeded), true},
		{nats.ErrNoResponders, true},
		{&jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}, true},
		{&jetstream.APIError{Code: 500, ErrorCode: 10005, Description: "no suitable peers for placement"}, true},
		{&jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use with a different configuration"}, false},
		{jetstream.ErrJetStreamNotEnabled, false},
		{errors.New("permissions violation"), false},
	} {
		if got := setupRetryable(c.err); got != c.retry {
			t.Errorf("%v: retry %v, want %v", c.err, got, c.retry)
		}
	}
}

// The local executor honours the request's timeout: a build that runs
// past it fails with DeadlineExceeded instead of holding its slot.
func TestLocalBuildHonoursTheTimeout(t *testing.T) {
	t.Parallel()
	l := NewLocalBackend(&blockingContexts{}, noPusher{}, t.TempDir(), 0) // the context never arrives
	req := request("local-timeout")
	req.Timeout = v1.Duration{Duration: 200 * time.Millisecond}
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	out, err := l.Run(context.Background(), b, func(string, bool, string) {})
	if err != nil || out.Succeeded || out.Reason != v1.ReasonDeadlineExceeded {
		t.Fatalf("got %+v, %v; want DeadlineExceeded", out, err)
	}
}

// A JetStream API request that gets no answer at all (sent while a cluster
// elects its meta leader) costs Setup one request timeout, not the
// caller's whole deadline. The worker's connection reaches JetStream through a relay on a
// server without it: the relay drops the first API request unanswered and
// passes on the rest.
func TestSetupAttemptOutlivesAnUnansweredRequest(t *testing.T) {
	backend := setup(t) // the server with JetStream
	front, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	front.Start()
	if !front.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	t.Cleanup(front.Shutdown)
	relay, err := nats.Connect(front.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(relay.Close)
	var requests atomic.Int32
	if _, err := relay.Subscribe("$JS.API.>", func(m *nats.Msg) {
		if requests.Add(1) == 1 {
			return // lost: no answer
		}
		fwd := nats.NewMsg(m.Subject)
		fwd.Data, fwd.Header = m.Data, m.Header
		reply, err := backend.nc.RequestMsg(fwd, 5*time.Second)
		if err != nil {
			return
		}
		out := nats.NewMsg(m.Reply)
		out.Data, out.Header = reply.Data, reply.Header
		_ = relay.PublishMsg(out)
	}); err != nil {
		t.Fatal(err)
	}
	if err := relay.Flush(); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(front.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)

	w, err := New(nc, nil, testConfig("setup-relay"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := w.Setup(ctx); err != nil {
		t.Fatalf("Setup after one unanswered API request: %v", err)
	}
	if requests.Load() < 2 {
		t.Fatalf("%d API requests reached the relay; the setup did not go through it", requests.Load())
	}
	if _, err := backend.js.Stream(ctx, v1.RequestsStream); err != nil {
		t.Fatalf("the requests stream after Setup: %v", err)
	}
}
