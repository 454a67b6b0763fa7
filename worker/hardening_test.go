package worker

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	k8stesting "k8s.io/client-go/testing"
	"sigs.k8s.io/yaml"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
)

// ---- helpers ----

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
	nc, err := nats.Connect(e.srv.ClientURL())
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

// eventLog records every progress event, raw and decoded.
type eventLog struct {
	mu     sync.Mutex
	raw    [][]byte
	events []v1.Event
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

func (l *eventLog) has(requestID string, phase v1.Phase) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.events, func(ev v1.Event) bool { return ev.RequestID == requestID && ev.Phase == phase })
}

func (l *eventLog) all() [][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.raw)
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

// byID groups results by request id.
func byID(rs []v1.Result) map[string][]v1.Result {
	m := map[string][]v1.Result{}
	for _, r := range rs {
		m[r.ID] = append(m[r.ID], r)
	}
	return m
}

var kanikoID = "kaniko@" + testKaniko.ExecutorImage

// ---- queue TTL ----

func TestQueueTTL(t *testing.T) {
	t.Parallel()

	t.Run("request older than the TTL expires without a job", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		const ttl = time.Second
		// The streams exist before the worker starts, as after an outage.
		if _, _, err := EnsureStreams(context.Background(), e.js, testConfig("setup")); err != nil {
			t.Fatal(err)
		}
		req := request("stale")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		// The request must outlive the TTL in the queue: only time does that.
		time.Sleep(ttl + 200*time.Millisecond)
		e.startWorker("w1", func(c *Config) { c.QueueTTL = ttl })
		results := e.collect()

		r := results.waitFor(t, 1, 10*time.Second)[0]
		key := v1.BuildKey(req, kanikoID)
		if r.ID != req.RequestID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonExpired {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if !strings.Contains(r.Data.Message, "longer than the queue TTL of 1s") || r.Data.Key != key {
			t.Errorf("message %q key %q", r.Data.Message, r.Data.Key)
		}
		if r.Data.Timings.QueueWaitMs < ttl.Milliseconds() {
			t.Errorf("queue wait %dms, want more than the TTL", r.Data.Timings.QueueWaitMs)
		}
		eventually(t, 5*time.Second, "request terminated", func() bool {
			msgs, pending, _ := e.streamState()
			return msgs == 0 && pending == 0
		})
		if c := e.creates.total(); c != 0 {
			t.Errorf("%d jobs created for an expired request", c)
		}
		if rec := e.claim(key); rec != nil {
			t.Errorf("an expired request claimed its key: %+v", rec)
		}
		time.Sleep(200 * time.Millisecond)
		if n := len(results.snapshot()); n != 1 {
			t.Errorf("%d results, want 1", n)
		}
	})

	t.Run("request within the TTL is built", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.startWorker("w1", func(c *Config) { c.QueueTTL = time.Minute })
		results := e.collect()
		req := request("fresh")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID))), 0, digestOf("fresh"))
		r := results.waitFor(t, 1, 10*time.Second)[0]
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	})

	t.Run("redelivery after the TTL is not expired", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		const ttl = time.Second
		// The first delivery is taken in time but fails transiently; the
		// retry comes after retryDelay(1) = 2s, past the TTL.
		e.failJobCreates(func(n int64) bool { return n == 1 })
		e.startWorker("w1", func(c *Config) { c.QueueTTL = ttl })
		results := e.collect()
		req := request("retried")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID))), 0, digestOf("retried"))
		r := results.waitFor(t, 1, 15*time.Second)[0]
		if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if r.Data.Timings.QueueWaitMs <= ttl.Milliseconds() {
			t.Errorf("queue wait %dms: the redelivery came before the TTL, the test proves nothing", r.Data.Timings.QueueWaitMs)
		}
	})

	t.Run("negative TTL is refused", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig("w1")
		cfg.QueueTTL = -time.Second
		err := cfg.WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), "queue TTL") {
			t.Fatalf("Validate() = %v, want a queue TTL error", err)
		}
	})
}

// ---- secrets ----

func TestSecretsNeverLeak(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()

	const (
		accessKey   = "AKIA-SECRET-VALUE-123"
		secretKey   = "wJalrXUtnFEMI-SECRET-KEY-456"
		regPassword = "hunter2-registry"
	)
	regAuth := base64.StdEncoding.EncodeToString([]byte("robot:" + regPassword))
	dockerConfig := fmt.Sprintf(`{"auths":{"registry.test:5000":{"username":"robot","password":%q,"auth":%q}}}`, regPassword, regAuth)
	secretValues := []string{accessKey, secretKey, regPassword, regAuth, dockerConfig}
	for _, s := range slices.Clone(secretValues) {
		secretValues = append(secretValues, base64.StdEncoding.EncodeToString([]byte(s)))
	}

	kc := testKaniko
	kc.S3Secret = "buildq-s3-creds"
	kc.S3AccessKeyField = "access-key"
	kc.S3SecretKeyField = "secret-key"
	kc.RegistrySecret = "buildq-push-creds"
	secrets := []*corev1.Secret{
		{
			ObjectMeta: metav1.ObjectMeta{Name: kc.S3Secret, Namespace: testNamespace},
			Data:       map[string][]byte{kc.S3AccessKeyField: []byte(accessKey), kc.S3SecretKeyField: []byte(secretKey)},
		},
		{
			ObjectMeta: metav1.ObjectMeta{Name: kc.RegistrySecret, Namespace: testNamespace},
			Type:       corev1.SecretTypeDockerConfigJson,
			Data:       map[string][]byte{corev1.DockerConfigJsonKey: []byte(dockerConfig)},
		},
	}
	for _, s := range secrets {
		if _, err := e.kube.CoreV1().Secrets(testNamespace).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Everything below is scanned; the scan itself is checked against the
	// Secrets, which must of course hold the values.
	type item struct{ what, text string }
	var corpus []item
	add := func(what string, v any) {
		var s string
		switch x := v.(type) {
		case string:
			s = x
		case []byte:
			s = string(x)
		default:
			b, err := yaml.Marshal(v)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			s = string(b)
		}
		corpus = append(corpus, item{what, s})
	}
	leaks := func(text string) []string {
		var found []string
		for _, s := range secretValues {
			if strings.Contains(text, s) {
				found = append(found, s)
			}
		}
		return found
	}
	for _, s := range secrets {
		if leaks(mustJSON(t, s)) == nil {
			t.Fatalf("the scan does not find the values of secret %s", s.Name)
		}
	}
	firstAction := len(e.kube.Actions())

	var logs syncBuffer
	logger := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(&logs), zapcore.DebugLevel))
	_, watcher := e.startWorkerWith("w1", kc, func(c *Config) { c.Logger = logger })
	events := e.events()
	results := e.collect()

	// One build that succeeds and one that fails, through every phase.
	var jobs []*batchv1.Job
	for i, exit := range []int32{0, 1} {
		req := request(fmt.Sprintf("secret-scan-%d", i))
		if _, err := e.pub.Publish(ctx, req); err != nil {
			t.Fatal(err)
		}
		job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
		jobs = append(jobs, job)
		eventually(t, 5*time.Second, "the worker sees its job", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
		msg := digestOf("scan")
		if exit != 0 {
			msg = "error building image: RUN ./build.sh: exit status 2"
		}
		e.kubelet(job, exit, msg)
		results.waitFor(t, i+1, 10*time.Second)
		eventually(t, 5*time.Second, "job cleaned up", e.jobGone(job.Name))
	}
	eventually(t, 5*time.Second, "requests acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})

	t.Run("credentials reach the job only by reference", func(t *testing.T) {
		for _, job := range jobs {
			c := job.Spec.Template.Spec.Containers[0]
			refs := map[string]corev1.SecretKeySelector{}
			for _, ev := range c.Env {
				if ev.Name == "AWS_ACCESS_KEY_ID" || ev.Name == "AWS_SECRET_ACCESS_KEY" {
					if ev.Value != "" || ev.ValueFrom == nil || ev.ValueFrom.SecretKeyRef == nil {
						t.Errorf("%s: env %s is not a secretKeyRef: %+v", job.Name, ev.Name, ev)
						continue
					}
					if _, dup := refs[ev.Name]; dup {
						t.Errorf("%s: env %s is set twice", job.Name, ev.Name)
					}
					refs[ev.Name] = *ev.ValueFrom.SecretKeyRef
				}
				if l := leaks(ev.Value); l != nil {
					t.Errorf("%s: env %s holds a secret value", job.Name, ev.Name)
				}
			}
			want := map[string]string{"AWS_ACCESS_KEY_ID": kc.S3AccessKeyField, "AWS_SECRET_ACCESS_KEY": kc.S3SecretKeyField}
			for name, key := range want {
				if r, ok := refs[name]; !ok || r.Name != kc.S3Secret || r.Key != key {
					t.Errorf("%s: env %s refers to %+v, want secret %s key %s", job.Name, name, r, kc.S3Secret, key)
				}
			}
			// Registry credentials: the Secret mounted read-only as
			// kaniko's docker config, never copied into the spec.
			var vol *corev1.Volume
			for i := range job.Spec.Template.Spec.Volumes {
				if s := job.Spec.Template.Spec.Volumes[i].Secret; s != nil && s.SecretName == kc.RegistrySecret {
					vol = &job.Spec.Template.Spec.Volumes[i]
				}
			}
			if vol == nil {
				t.Fatalf("%s: no volume of secret %s", job.Name, kc.RegistrySecret)
			}
			mounted := slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
				return m.Name == vol.Name && m.ReadOnly && m.MountPath == kaniko.DockerConfigDir
			})
			if !mounted {
				t.Errorf("%s: secret volume not mounted read-only at %s: %+v", job.Name, kaniko.DockerConfigDir, c.VolumeMounts)
			}
			if sa := job.Spec.Template.Spec.AutomountServiceAccountToken; sa == nil || *sa {
				t.Errorf("%s: the build pod mounts a service account token", job.Name)
			}
		}
	})

	t.Run("the worker never reads secrets", func(t *testing.T) {
		for _, a := range e.kube.Actions()[firstAction:] {
			if a.GetResource().Resource == "secrets" {
				t.Errorf("the worker touched secrets: %s %s", a.GetVerb(), a.GetResource())
			}
		}
	})

	t.Run("no secret value anywhere", func(t *testing.T) {
		// Every object sent to or read from the API server since the
		// Secrets were created (Jobs, Pods, status updates, deletes).
		for i, a := range e.kube.Actions()[firstAction:] {
			add(fmt.Sprintf("kube action %d %s %s", i, a.GetVerb(), a.GetResource().Resource), a)
		}
		for _, j := range jobs {
			add("job "+j.Name, j)
		}
		pods, err := e.kube.CoreV1().Pods("").List(ctx, listAll)
		if err != nil {
			t.Fatal(err)
		}
		add("pods", pods)
		evs, err := e.kube.CoreV1().Events("").List(ctx, listAll)
		if err != nil {
			t.Fatal(err)
		}
		add("core events", evs)
		evs2, err := e.kube.EventsV1().Events("").List(ctx, listAll)
		if err != nil {
			t.Fatal(err)
		}
		add("events.k8s.io events", evs2)

		// Everything stored in NATS: results, dead letters, both KV
		// buckets (KV_<bucket> streams), with headers.
		names := e.js.StreamNames(ctx)
		var streams []string
		for n := range names.Name() {
			streams = append(streams, n)
		}
		for _, want := range []string{v1.ResultsStream, "KV_" + v1.BuildsBucket, "KV_" + v1.RequestsBucket} {
			if !slices.Contains(streams, want) {
				t.Errorf("stream %s not found among %v", want, streams)
			}
		}
		stored := 0
		for _, s := range streams {
			for _, m := range e.streamMsgs(s) {
				stored++
				add(fmt.Sprintf("stream %s seq %d (%s)", s, m.Sequence, m.Subject), fmt.Sprintf("%s %v %s", m.Subject, m.Header, m.Data))
			}
		}
		if stored == 0 {
			t.Error("nothing stored in NATS: the scan proves nothing")
		}
		evRaw := events.all()
		if len(evRaw) == 0 {
			t.Error("no progress events seen: the scan proves nothing")
		}
		for i, b := range evRaw {
			add(fmt.Sprintf("progress event %d", i), b)
		}
		for _, r := range results.snapshot() {
			add("result "+r.ID, mustJSON(t, r))
		}
		logText := logs.String()
		if !strings.Contains(logText, `"request done"`) || !strings.Contains(logText, `"level":"debug"`) && !strings.Contains(logText, `"level":"info"`) {
			t.Errorf("the log buffer misses the worker's log: %.300s", logText)
		}
		add("worker log", logText)

		for _, it := range corpus {
			if l := leaks(it.text); l != nil {
				t.Errorf("%s holds secret values %q", it.what, l)
			}
		}
		t.Logf("scanned %d items, %d bytes of log", len(corpus), len(logText))
	})
}

// syncBuffer is a bytes.Buffer safe for the logger's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ---- cancel ----

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

// runningWithWaiters publishes one request, waits for its Job and for the
// owner to have renewed its claim once (the claim then names the Job),
// and joins two more requests of the same content to the build.
func (e *env) runningWithWaiters(t *testing.T, seed string, events *eventLog) (key, job string, reqs []*v1.Request) {
	t.Helper()
	ctx := context.Background()
	owner := request(seed)
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key = v1.BuildKey(owner, kanikoID)
	job = e.waitJob(kaniko.JobName(key)).Name
	eventually(t, 5*time.Second, "the claim names the job", func() bool {
		r := e.claim(key)
		return r != nil && r.Job == job && r.State == v1.StateBuilding
	})
	reqs = []*v1.Request{owner}
	for range 2 {
		r := request(seed) // same content, a fresh request id
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	for _, r := range reqs[1:] {
		eventually(t, 5*time.Second, "request "+r.RequestID+" waiting", func() bool { return events.has(r.RequestID, v1.PhaseWaiting) })
	}
	return key, job, reqs
}

func assertAllCanceled(t *testing.T, e *env, results *resultCollector, reqs []*v1.Request) {
	t.Helper()
	results.waitFor(t, len(reqs), 10*time.Second)
	eventually(t, 5*time.Second, "requests acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	time.Sleep(200 * time.Millisecond)
	got := byID(results.snapshot())
	for i, r := range reqs {
		rs := got[r.RequestID]
		if len(rs) != 1 {
			t.Errorf("request %d (%s): %d results, want 1: %s", i, r.RequestID, len(rs), mustJSON(t, rs))
			continue
		}
		d := rs[0].Data
		if d.Status != v1.StatusCanceled || d.Reason != v1.ReasonCanceled || rs[0].Type != "dev.buildq.build.canceled.v1" {
			t.Errorf("request %d (%s): %s", i, r.RequestID, mustJSON(t, rs[0]))
		}
	}
	if len(got) != len(reqs) {
		t.Errorf("results for %d requests, want %d", len(got), len(reqs))
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	shortLease := func(c *Config) { c.Lease = time.Second }

	t.Run("by build key stops the job and cancels every waiting request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.startWorker("w1", shortLease)
		events := e.events()
		results := e.collect()
		key, job, reqs := e.runningWithWaiters(t, "cancel-by-key", events)

		rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key)
		if !rep.Canceled || rep.Key != key || rep.Requests != 3 || !rep.Stopped {
			t.Fatalf("reply %+v", rep)
		}
		eventually(t, 5*time.Second, "job deleted", e.jobGone(job))
		assertAllCanceled(t, e, results, reqs)
		if rec := e.claim(key); rec == nil || rec.State != v1.StateFailed || rec.Reason != v1.ReasonCanceled {
			t.Errorf("record %+v, want failed/Canceled", rec)
		}
		// Once finished, a build cannot be canceled again.
		if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key); rep.Canceled || !strings.Contains(rep.Message, "already finished") {
			t.Errorf("second cancel: %+v", rep)
		}
	})

	// Canceling one request cancels that request only: the build goes on
	// for the others — also when the canceled one owned it.
	for _, tc := range []struct {
		name   string
		cancel int // index into reqs: 0 is the owner
	}{{"by request id of a waiting request", 2}, {"by request id of the owner", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			e.startWorker("w1", shortLease)
			events := e.events()
			results := e.collect()
			key, job, reqs := e.runningWithWaiters(t, "cancel-one-"+strings.ReplaceAll(tc.name, " ", "-"), events)

			rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), reqs[tc.cancel].RequestID)
			if !rep.Canceled || rep.Key != key || rep.Requests != 1 || rep.Stopped {
				t.Fatalf("reply %+v", rep)
			}
			first := results.waitFor(t, 1, 10*time.Second)[0]
			if first.ID != reqs[tc.cancel].RequestID || first.Data.Status != v1.StatusCanceled {
				t.Fatalf("first result %s", mustJSON(t, first))
			}
			if e.jobGone(job)() {
				t.Fatal("the job was deleted although two requests still wait on it")
			}
			eventually(t, 10*time.Second, "the build's claim to be held", func() bool {
				r := e.claim(key)
				return r != nil && r.State == v1.StateBuilding && r.Owner != ""
			})
			e.kubelet(e.waitJob(job), 0, digestOf("goes on"))
			got := byID(results.waitFor(t, 3, 15*time.Second))
			for i, r := range reqs {
				if i == tc.cancel {
					continue
				}
				if d := got[r.RequestID][0].Data; d.Status != v1.StatusSucceeded || d.Digest != digestOf("goes on") {
					t.Errorf("request %d: %s", i, mustJSON(t, d))
				}
			}
			if c := e.creates.total(); c != 1 {
				t.Errorf("%d jobs created, want 1", c)
			}
		})
	}

	t.Run("right after the job is created", func(t *testing.T) {
		t.Parallel()
		// The claim names its Job only at the owner's first lease renewal
		// (Lease/3): a cancel before that must still win over the
		// JobDeleted outcome it causes.
		e := setup(t)
		e.startWorker("w1", func(c *Config) { c.Lease = 30 * time.Second })
		results := e.collect()
		req := request("cancel-early")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		key := v1.BuildKey(req, kanikoID)
		job := e.waitJob(kaniko.JobName(key)).Name
		// The owner has not renewed its claim since it created the Job.
		rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key)
		if !rep.Canceled {
			t.Fatalf("reply %+v", rep)
		}
		eventually(t, 5*time.Second, "job deleted", e.jobGone(job))
		assertAllCanceled(t, e, results, []*v1.Request{req})
	})

	t.Run("of an unknown key or request says so", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.startWorker("w1", shortLease)
		unknown := hex64("never built")
		rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), unknown)
		if rep.Canceled || rep.Key != unknown || !strings.Contains(rep.Message, "no request of tenant acme waits on key "+unknown) {
			t.Errorf("unknown key: %+v", rep)
		}
		rep = cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), "no-such-request")
		if rep.Canceled || !strings.Contains(rep.Message, `no request "no-such-request" of tenant acme is known`) {
			t.Errorf("unknown request id: %+v", rep)
		}
		if c := e.creates.total(); c != 0 {
			t.Errorf("%d jobs created", c)
		}
	})
}

// ---- a Job deleted from outside ----

func TestJobDeletedWhileRunningFails(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, watcher := e.startWorkerWith("w1", testKaniko, nil)
	results := e.collect()

	req := request("deleted-job")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	// The worker is watching it; then someone deletes it.
	eventually(t, 5*time.Second, "the worker's cache has the job", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
	// The build goroutine reads the cache when the informer signals it;
	// nothing shows from outside that it has. A delete before that read is
	// TestJobGoneBeforeTheWorkerSawItFails (a hang, until backend.go looks
	// an unseen Job up on the API server): let the read happen first.
	time.Sleep(300 * time.Millisecond)
	bg := metav1.DeletePropagationBackground
	if err := e.kube.BatchV1().Jobs(testNamespace).Delete(context.Background(), job.Name, metav1.DeleteOptions{PropagationPolicy: &bg}); err != nil {
		t.Fatal(err)
	}

	r := results.waitFor(t, 1, 20*time.Second)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonJobDeleted || r.Data.Job != job.Name {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if !strings.Contains(r.Data.Message, "deleted before it finished") {
		t.Errorf("message %q", r.Data.Message)
	}
	eventually(t, 5*time.Second, "request acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	time.Sleep(200 * time.Millisecond)
	if n := len(results.snapshot()); n != 1 {
		t.Errorf("%d results, want 1", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1 (a deleted Job is not recreated)", c)
	}
}

// ---- transient errors ----

func TestTransientJobCreateErrors(t *testing.T) {
	t.Parallel()

	t.Run("failing every delivery gives up once and dead-letters the request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		calls := e.failJobCreates(func(int64) bool { return true })
		e.startWorker("w1", func(c *Config) { c.MaxDeliver = 2 })
		results := e.collect()

		req := request("always-500")
		req.APIVersion, req.RequestID = v1.APIVersion, "req-always-500"
		payload, err := json.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, req.RequestID)
		m.Data = payload
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}

		r := results.waitFor(t, 1, 15*time.Second)[0]
		d := r.Data
		if r.ID != req.RequestID || d.Status != v1.StatusFailed || d.Reason != v1.ReasonInfrastructureError || d.Attempts != 2 {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if !strings.Contains(d.Message, "gave up after 2 transient failures") || !strings.Contains(d.Message, "create job") {
			t.Errorf("message %q", d.Message)
		}
		eventually(t, 5*time.Second, "request terminated", func() bool {
			msgs, pending, _ := e.streamState()
			return msgs == 0 && pending == 0
		})
		var dl []*jetstream.RawStreamMsg
		eventually(t, 5*time.Second, "a dead letter", func() bool {
			dl = e.streamMsgs(v1.DeadLetterStream)
			return len(dl) > 0
		})
		time.Sleep(200 * time.Millisecond)
		dl = e.streamMsgs(v1.DeadLetterStream)
		if len(dl) != 1 {
			t.Fatalf("%d dead letters, want 1", len(dl))
		}
		if dl[0].Subject != v1.DeadLetterSubject("acme") || !bytes.Equal(dl[0].Data, payload) {
			t.Errorf("dead letter on %s: %s, want the original payload on %s", dl[0].Subject, dl[0].Data, v1.DeadLetterSubject("acme"))
		}
		h := dl[0].Header
		if h.Get("Buildq-Original-Msg-Id") != req.RequestID || !strings.HasPrefix(h.Get(v1.MsgIDHeader), "deadletter/") || h.Get("Buildq-Original-Subject") != v1.RequestSubject("acme") || !strings.Contains(h.Get("Buildq-Error"), "Internal error") {
			t.Errorf("dead letter headers %v", h)
		}
		if n := len(results.snapshot()); n != 1 {
			t.Errorf("%d results, want 1", n)
		}
		if n := calls.Load(); n != 2 {
			t.Errorf("%d job creations tried, want one per delivery (2)", n)
		}
		if c := e.creates.total(); c != 0 {
			t.Errorf("%d jobs created", c)
		}
		// The claim is let go, so the next request for the key builds at once.
		if rec := e.claim(r.Data.Key); rec == nil || rec.Owner != "" || !rec.LeaseUntil.IsZero() {
			t.Errorf("claim still held: %+v", rec)
		}
	})

	t.Run("failing the first delivery only succeeds on the redelivery", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.failJobCreates(func(n int64) bool { return n == 1 })
		e.startWorker("w1", func(c *Config) { c.MaxDeliver = 2 })
		results := e.collect()

		req := request("once-500")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
		e.kubelet(job, 0, digestOf("once"))
		r := results.waitFor(t, 1, 15*time.Second)[0]
		if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 || r.Data.Origin != v1.OriginBuild {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		eventually(t, 5*time.Second, "request acked", func() bool {
			msgs, pending, _ := e.streamState()
			return msgs == 0 && pending == 0
		})
		if dl := e.streamMsgs(v1.DeadLetterStream); len(dl) != 0 {
			t.Errorf("%d dead letters for a request that succeeded", len(dl))
		}
		if c := e.creates.total(); c != 1 {
			t.Errorf("%d jobs created, want 1", c)
		}
	})
}

func TestJobGoneBeforeTheWorkerSawItFails(t *testing.T) {
	t.Parallel()
	// A Job that never reaches the cache must not hang the request (and
	// every later request for its key).
	e := setup(t)
	// The API server accepts the Job, and it is gone before the informer
	// lists or watches it (deleted at once, or during a watch gap).
	e.kube.PrependReactor("create", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, a.(k8stesting.CreateAction).GetObject(), nil
	})
	e.startWorker("w1", nil)
	results := e.collect()
	req := request("vanished")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 30*time.Second)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonJobDeleted {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

func TestCancelFromAnotherTenantIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	req := request("cross-tenant")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	job := e.waitJob(kaniko.JobName(key))
	// The key names the owning tenant; a request id is per tenant, so
	// another tenant's id is simply unknown on the intruder's subject.
	for target, want := range map[string]string{key: "no request of tenant intruder waits on key", req.RequestID: "no request"} {
		rep := cancelRequest(t, e.nc, v1.CancelSubject("intruder", "web"), target)
		if rep.Canceled || !strings.Contains(rep.Message, want) {
			t.Fatalf("cancel of %s from another tenant: %+v", target, rep)
		}
	}
	e.kubelet(job, 0, digestOf("kept"))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

func TestRetryAfterFailureReplacesTheFinishedJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.KeepJobs = true })
	results := e.collect()

	first := request("retry-after-failure")
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(first, "kaniko@"+testKaniko.ExecutorImage))
	e.kubelet(e.waitJob(name), 1, "error building image: flaky base")
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusFailed {
		t.Fatalf("first %s", mustJSON(t, r))
	}
	// The failed Job is still there (kept). A new request for the key is a
	// fresh build: it must not adopt the old failure.
	second := request("retry-after-failure")
	if _, err := e.pub.Publish(context.Background(), second); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a second job", func() bool { return e.creates.total() == 2 })
	e.kubelet(e.waitJob(name), 0, digestOf("retried"))
	r := results.waitFor(t, 2, 10*time.Second)[1]
	if r.ID != second.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Digest != digestOf("retried") {
		t.Fatalf("second %s", mustJSON(t, r))
	}
}

func TestHandBackOnTheLastDeliveryIsNotStranded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", func(c *Config) { c.MaxDeliver = 1 })
	results := e.collect()
	req := request("last-delivery")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	w1.stop(t) // hands the request back on its only allowed delivery
	e.startWorker("w2", func(c *Config) { c.MaxDeliver = 1 })
	time.Sleep(300 * time.Millisecond)
	e.kubelet(job, 0, digestOf("not stranded"))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

func TestFinishedJobOfADeadOwnerIsReconciled(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name             string
		jobRun, claimRun string
		want             string
	}{
		// The claim's own run finished while its owner was dead: the
		// outcome is stored with no request around.
		{"own run", "r1", "r1", v1.StateSucceeded},
		// A Job of an earlier run says nothing about the current one.
		{"stale run", "r0", "r1", v1.StateBuilding},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			req := request("orphan")
			key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
			dest := "registry.test:5000/acme/web:" + v1.DefaultTag(key)
			job, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Destinations: []string{dest}, Run: tc.jobRun}, testKaniko.Defaults())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.kube.BatchV1().Jobs(testNamespace).Create(context.Background(), job, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			e.kubelet(job, 0, digestOf("orphan"))
			r := e.startWorker("w1", nil)
			// A dead worker's claim: it stays unchanged, whatever its
			// (skewed) lease timestamp says — here one in the future.
			rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: tc.claimRun, Owner: "dead", LeaseMs: 1000,
				LeaseUntil: time.Now().Add(time.Hour), RequestID: "gone", Repository: "registry.test:5000/acme/web",
				Destinations: []string{dest}, StartedAt: time.Now().Add(-time.Hour)})
			if _, err := r.w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
				t.Fatal(err)
			}
			// Level-triggered: the next event for the finished Job (here, a
			// label change) makes the worker look at it.
			j, _ := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), job.Name, metav1.GetOptions{})
			j.Labels["touched"] = "yes"
			if _, err := e.kube.BatchV1().Jobs(testNamespace).Update(context.Background(), j, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
			if tc.want == v1.StateSucceeded {
				eventually(t, 10*time.Second, "the record to be final", func() bool {
					cur, _, err := r.w.runs.Get(context.Background(), key)
					return err == nil && cur != nil && cur.State == v1.StateSucceeded && cur.Digest == digestOf("orphan") && cur.Run == "r1"
				})
				return
			}
			// Well past the claim's lapse (1.5 × 1 s) and a re-check.
			time.Sleep(4 * time.Second)
			if cur, _, err := r.w.runs.Get(context.Background(), key); err != nil || cur.State != v1.StateBuilding {
				t.Fatalf("a stale run's Job ended the current run: %+v %v", cur, err)
			}
		})
	}
}
