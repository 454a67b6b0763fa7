package worker

// Helpers shared by the worker's component tests: workers started in the
// test world of harness_test.go, what they publish and store, and the Jobs
// of the fake cluster. A helper that one file alone uses lives in that file.

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
)

var kanikoID = "kaniko@" + testKaniko.ExecutorImage

// startWorkerWith is startWorker with another Job configuration; it also
// returns the worker's watcher, so a test can wait until the worker has
// seen a Job.
func (e *env) startWorkerWith(id string, kc kaniko.Config, mutate func(*Config)) (*runningWorker, *kube.Watcher) {
	e.t.Helper()
	return e.startWorkerFull(id, kc, mutate, nil, nil)
}

// startWorkerFull starts a worker with its own informers: client (nil: the
// fake cluster's) is the backend's API client, and before runs on the
// worker after Setup and before Run — the place to wrap its buckets or set
// fault hooks without racing its goroutines.
func (e *env) startWorkerFull(id string, kc kaniko.Config, mutate func(*Config), client kubernetes.Interface, before func(*Worker)) (*runningWorker, *kube.Watcher) {
	t := e.t
	t.Helper()
	cfg := testConfig(id)
	cfg.Logger = zaptest.NewLogger(t).Named(id)
	if mutate != nil {
		mutate(&cfg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	factory := kube.NewInformerFactory(e.kube, kc.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		t.Fatal(err)
	}
	factory.Start(ctx.Done())
	if !watcher.WaitForSync(ctx) {
		t.Fatal("informers did not sync")
	}
	if client == nil {
		client = e.kube
	}
	backend, err := NewKubeBackend(client, watcher, kc)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(e.world.nats.URL(), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(nc, backend, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(w)
	}
	r := &runningWorker{w: w, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.err = w.Run(ctx)
		factory.Shutdown()
		nc.Close()
	}()
	t.Cleanup(func() {
		cancel()
		<-r.done
	})
	return r, watcher
}

// startWorkerHooked is startWorkerWith (kaniko backend, own informers) with
// the backend's API client replaced by client (nil: the fake cluster's)
// and before applied to the worker after Setup and before Run: the place to
// wrap its buckets or set fault hooks without racing its goroutines.
func (e *env) startWorkerHooked(id string, mutate func(*Config), client kubernetes.Interface, before func(*Worker)) *runningWorker {
	e.t.Helper()
	r, _ := e.startWorkerFull(id, testKaniko, mutate, client, before)
	return r
}

// startLocalWorker runs a worker on backend (the local executor) with the
// naming policy and registry of tr.
func (e *env) startLocalWorker(id string, backend Backend, mutate func(*Config)) {
	t := e.t
	t.Helper()
	cfg := testConfig(id)
	cfg.Logger = zaptest.NewLogger(t).Named(id)
	if mutate != nil {
		mutate(&cfg)
	}
	nc, err := nats.Connect(e.world.nats.URL(), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(nc, backend, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = w.Run(ctx)
		nc.Close()
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// ruleWorker is a worker set up (buckets and streams) but not running,
// over backend b, for driving one protocol step directly.
func ruleWorker(t *testing.T, e *env, b Backend) *Worker {
	t.Helper()
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	w, err := New(e.nc, b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(context.Background()); err != nil {
		t.Fatal(err)
	}
	return w
}

// countingBackend counts the builds it is asked to run, and runs none.
type countingBackend struct{ runs chan Build }

func (countingBackend) Identity() string { return "counting" }

func (b countingBackend) Run(ctx context.Context, bd Build, _ Started) (Outcome, error) {
	select {
	case b.runs <- bd:
	default:
	}
	<-ctx.Done()
	return Outcome{}, ctx.Err()
}

func (countingBackend) Cleanup(context.Context, string, string) error { return nil }

// withRegistry points a worker's naming policy and registry checks at tr.
// recordFirst runs a worker that records every decision before it
// publishes it (Config.FirstAge < 0): a finished build's result, too.
func recordFirst(c *Config) { c.FirstAge = -1 }

// both applies each of the mutations in turn.
func both(ms ...func(*Config)) func(*Config) {
	return func(c *Config) {
		for _, m := range ms {
			m(c)
		}
	}
}

// patientLookups lets intake's record reads and registry checks take as
// long as they take: a test of what intake (or the queue's handler)
// answers for a hit must not see the lookup give up on a loaded machine
// and the request taken in full, which passes whatever the rule.
// mutate, when set, is applied first.
func patientLookups(mutate func(*Config)) func(*Config) {
	return func(c *Config) {
		if mutate != nil {
			mutate(c)
		}
		c.lookupWait = time.Minute
	}
}

func withRegistry(tr *testRegistry) func(*Config) {
	return func(c *Config) {
		c.Registry = tr.client
		c.Naming = naming.Policy{Registry: tr.host}
	}
}

// build publishes req, plays a kubelet that pushes to the Job's destination
// and returns the result, once the run's end is stored too: a finished
// build's result is published before its run's end is stored, and a test
// that asks again expects a cache hit, not a join of the ending run.
func (e *env) buildThrough(t *testing.T, tr *testRegistry, results *resultCollector, req *v1.Request, want int) v1.Result {
	t.Helper()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, want, 10*time.Second)
	eventually(t, 10*time.Second, "the run's end stored", func() bool {
		rec := e.claim(key)
		return rec == nil || rec.Final()
	})
	return got[want-1]
}

// eventLog records every progress event, raw and decoded.
type eventLog struct {
	mu     sync.Mutex
	raw    [][]byte
	events []v1.Event
}

func (l *eventLog) has(requestID string, phase v1.Phase) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.events, func(ev v1.Event) bool { return ev.RequestID == requestID && ev.Phase == phase })
}

// count is how many events of requestID are in phase.
func (l *eventLog) count(requestID string, phase v1.Phase) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, ev := range l.events {
		if ev.RequestID == requestID && ev.Phase == phase {
			n++
		}
	}
	return n
}

func (l *eventLog) decoded() []v1.Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.events)
}

func (l *eventLog) all() [][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.raw)
}

func (e *env) events() *eventLog {
	t := e.t
	t.Helper()
	l := &eventLog{}
	sub, err := e.nc.Subscribe(v1.EventsPrefix+".>", func(m *nats.Msg) {
		var ev v1.Event
		_ = json.Unmarshal(m.Data, &ev)
		l.mu.Lock()
		l.raw = append(l.raw, append([]byte(m.Subject+" "), m.Data...))
		l.events = append(l.events, ev)
		l.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return l
}

// streamMsgs returns every message stored in a stream.
func (e *env) streamMsgs(name string) []*jetstream.RawStreamMsg {
	e.t.Helper()
	ctx := context.Background()
	s, err := e.js.Stream(ctx, name)
	if err != nil {
		e.t.Fatalf("stream %s: %v", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			e.t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
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

// byID groups results by request id.
func byID(rs []v1.Result) map[string][]v1.Result {
	m := map[string][]v1.Result{}
	for _, r := range rs {
		m[r.ID] = append(m[r.ID], r)
	}
	return m
}

// resultFor returns the stored results of request id.
func resultFor(results *resultCollector, id string) []v1.Result {
	return byID(results.snapshot())[id]
}

// claim reads the build record of key.
func (e *env) claim(key string) *v1.BuildRecord {
	e.t.Helper()
	kv, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		e.t.Fatal(err)
	}
	ent, err := kv.Get(context.Background(), key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	var r v1.BuildRecord
	if err := json.Unmarshal(ent.Value(), &r); err != nil {
		e.t.Fatal(err)
	}
	return &r
}

func (e *env) jobGone(name string) func() bool {
	return func() bool {
		_, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}
}

// failJobCreates makes Job creation answer 500 while fail(attempt) is
// true; attempts counts the calls, starting at 1.
func (e *env) failJobCreates(fail func(attempt int64) bool) *atomic.Int64 {
	var n atomic.Int64
	e.kube.PrependReactor("create", "jobs", func(k8stesting.Action) (bool, runtime.Object, error) {
		if fail(n.Add(1)) {
			return true, nil, apierrors.NewInternalError(errors.New("etcdserver: leader changed"))
		}
		return false, nil, nil
	})
	return &n
}

// deadlineExceeded plays the Job controller ending job at its
// activeDeadlineSeconds.
func deadlineExceeded(t *testing.T, e *env, job *batchv1.Job) {
	t.Helper()
	now := metav1.Now()
	j, err := e.kube.BatchV1().Jobs(job.Namespace).Get(context.Background(), job.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	j.Status.StartTime = &now
	j.Status.Failed = 1
	msg := "Job was active longer than specified deadline"
	j.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonDeadlineExceeded, Message: msg, LastTransitionTime: now},
		{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonDeadlineExceeded, Message: msg, LastTransitionTime: now},
	}
	if _, err := e.kube.BatchV1().Jobs(job.Namespace).UpdateStatus(context.Background(), j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func cancelRequest(t *testing.T, nc *nats.Conn, subject, payload string) v1.CancelReply {
	t.Helper()
	// The worker subscribes when Run starts, which may be a moment after
	// startWorker returned: wait for a responder.
	var m *nats.Msg
	var err error
	eventually(t, 5*time.Second, "a worker answering cancel requests", func() bool {
		m, err = tenantAPIRequest(nc, subjectTenant(subject), subject, payload, 10*time.Second)
		return !errors.Is(err, nats.ErrNoResponders)
	})
	if err != nil {
		t.Fatalf("cancel %q: %v", payload, err)
	}
	var rep v1.CancelReply
	if err := json.Unmarshal(m.Data, &rep); err != nil {
		t.Fatalf("cancel reply %q: %v", m.Data, err)
	}
	return rep
}

var listAll = metav1.ListOptions{}
