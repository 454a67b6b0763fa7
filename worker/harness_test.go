package worker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/publisher"
)

const testNamespace = "builds"

// env is one embedded NATS server with JetStream and one fake cluster,
// shared by the workers a test starts.
type env struct {
	t       *testing.T
	srv     *server.Server
	nc      *nats.Conn
	js      jetstream.JetStream
	kube    *fake.Clientset
	pub     *publisher.Client
	creates *counter
}

type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) inc(name string) {
	c.mu.Lock()
	c.n[name]++
	c.mu.Unlock()
}

func (c *counter) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := 0
	for _, v := range c.n {
		t += v
	}
	return t
}

func setup(t *testing.T) *env {
	t.Helper()
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, srv: srv, nc: nc, js: js, kube: fake.NewClientset(), pub: pub, creates: &counter{n: map[string]int{}}}
	// Count the Job creations that reach the "API server" (the tracker
	// answers AlreadyExists for the rest).
	e.kube.PrependReactor("create", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		job := a.(k8stesting.CreateAction).GetObject().(*batchv1.Job)
		if _, err := e.kube.Tracker().Get(batchv1.SchemeGroupVersion.WithResource("jobs"), job.Namespace, job.Name); err == nil {
			return true, nil, apierrors.NewAlreadyExists(batchv1.Resource("jobs"), job.Name)
		}
		e.creates.inc(job.Name)
		// The API server gives every object a UID; the fake does not.
		job.UID = types.UID(fmt.Sprintf("uid-%s-%d", job.Name, podSeq.Add(1)))
		return false, nil, nil
	})
	// The garbage collector: deleting a Job deletes its Pods.
	e.kube.PrependReactor("delete", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		name := a.(k8stesting.DeleteAction).GetName()
		pods, _ := e.kube.Tracker().List(corev1.SchemeGroupVersion.WithResource("pods"), corev1.SchemeGroupVersion.WithKind("Pod"), a.GetNamespace())
		if pl, ok := pods.(*corev1.PodList); ok {
			for _, p := range pl.Items {
				if p.Labels[batchv1.JobNameLabel] == name {
					_ = e.kube.Tracker().Delete(corev1.SchemeGroupVersion.WithResource("pods"), p.Namespace, p.Name)
				}
			}
		}
		return false, nil, nil
	})
	return e
}

func testConfig(id string) Config {
	return Config{
		ID:              id,
		MaxInFlight:     8,
		AckWait:         2 * time.Second,
		MaxDeliver:      5,
		Lease:           2 * time.Second,
		ShutdownTimeout: 5 * time.Second,
		Naming:          naming.Policy{Registry: "registry.test:5000"},
		ContextPrefix:   "contexts/{tenant}/",
	}
}

var testKaniko = kaniko.Config{
	Namespace:      testNamespace,
	ExecutorImage:  "gcr.io/kaniko-project/executor@sha256:" + hex64("executor"),
	S3Endpoint:     "http://minio.test:9000",
	S3Secret:       "buildq-s3",
	RegistrySecret: "buildq-registry",
}

// runningWorker is a worker with its own informers, as in production.
type runningWorker struct {
	w      *Worker
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

func (r *runningWorker) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case <-r.done:
		if r.err != nil {
			t.Errorf("worker returned %v", r.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("worker did not stop")
	}
}

func (e *env) startWorker(id string, mutate func(*Config)) *runningWorker {
	e.t.Helper()
	r, _ := e.startWorkerWith(id, testKaniko, mutate)
	return r
}

func hex64(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// request returns a valid request whose context digest derives from seed.
func request(seed string) *v1.Request {
	d := hex64(seed)
	return &v1.Request{
		Tenant: "acme", Name: "web",
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/acme/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
		BuildArgs:     map[string]string{"VERSION": "1.2.3"},
		Labels:        map[string]string{"team": "platform"},
	}
}

// resultCollector subscribes to every stored result.
type resultCollector struct {
	mu  sync.Mutex
	got []v1.Result
	ch  chan struct{}
	// published holds every result publish by message id (core NATS).
	published map[string][]v1.ResultData
}

func (e *env) collect() *resultCollector {
	t := e.t
	c := &resultCollector{ch: make(chan struct{}, 1), published: map[string][]v1.ResultData{}}
	// The stream drops a repeated Nats-Msg-Id, so reading it back cannot
	// show a second result for a request. A core subscription sees every
	// publish: a request may be published again (a lost ack, a
	// redelivery), but only ever with the same decision.
	sub, err := e.nc.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		var ev v1.Result
		_ = json.Unmarshal(m.Data, &ev)
		c.mu.Lock()
		id := m.Header.Get(v1.MsgIDHeader)
		if want := v1.MsgID(ev.Data.Tenant, ev.ID); id != want {
			t.Errorf("result %s published with %s %q, want %q", ev.ID, v1.MsgIDHeader, id, want)
		}
		c.published[id] = append(c.published[id], ev.Data)
		c.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.nc.Flush()
		_ = sub.Unsubscribe()
		c.mu.Lock()
		defer c.mu.Unlock()
		for id, ds := range c.published {
			for _, d := range ds[1:] {
				if decision(d) != decision(ds[0]) {
					t.Errorf("request %s: two different results published:\n  %s\n  %s", id, decision(ds[0]), decision(d))
				}
			}
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	go func() {
		// The results stream exists once a worker has set up.
		for ctx.Err() == nil {
			if _, err := e.js.Stream(ctx, v1.ResultsStream); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		close(ready)
		_ = e.pub.Watch(ctx, publisher.Filter{DeliverAll: true}, func(r v1.Result) error {
			c.mu.Lock()
			c.got = append(c.got, r)
			c.mu.Unlock()
			select {
			case c.ch <- struct{}{}:
			default:
			}
			return nil
		})
	}()
	t.Cleanup(cancel)
	<-ready
	return c
}

// decision is what a result decides: two publishes of one request must
// agree on it.
func decision(d v1.ResultData) string {
	return fmt.Sprintf("status=%s reason=%s origin=%s key=%s digest=%s image=%s", d.Status, d.Reason, d.Origin, d.Key, d.Digest, d.Image)
}

// publishes returns how often tenant acme's request id's result was
// published.
func (c *resultCollector) publishes(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.published[v1.MsgID("acme", id)])
}

func (c *resultCollector) snapshot() []v1.Result {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]v1.Result(nil), c.got...)
}

// waitFor blocks until n results arrived.
func (c *resultCollector) waitFor(t *testing.T, n int, timeout time.Duration) []v1.Result {
	t.Helper()
	deadline := time.After(timeout)
	for {
		if got := c.snapshot(); len(got) >= n {
			return got
		}
		select {
		case <-c.ch:
		case <-deadline:
			t.Fatalf("got %d results, want %d: %+v", len(c.snapshot()), n, c.snapshot())
		}
	}
}

// eventually polls cond (test code only) until it holds.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (e *env) waitJob(name string) *batchv1.Job {
	e.t.Helper()
	var job *batchv1.Job
	eventually(e.t, 10*time.Second, "job "+name, func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		job = j
		return true
	})
	return job
}

// kubelet plays the node and the Job controller for one Job: it creates the
// pod with its terminated kaniko container, then sets the Job's conditions.
func (e *env) kubelet(job *batchv1.Job, exitCode int32, message string) {
	t := e.t
	t.Helper()
	ctx := context.Background()
	now := metav1.Now()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: fmt.Sprintf("%s-%d", job.Name, podSeq.Add(1)), Namespace: job.Namespace,
			Labels:            merge(job.Spec.Template.Labels, map[string]string{batchv1.JobNameLabel: job.Name}),
			CreationTimestamp: now,
		},
		Spec: job.Spec.Template.Spec,
		Status: corev1.PodStatus{
			Phase: map[bool]corev1.PodPhase{true: corev1.PodSucceeded, false: corev1.PodFailed}[exitCode == 0],
			ContainerStatuses: []corev1.ContainerStatus{{
				Name: kaniko.ContainerName,
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: exitCode, Message: message, FinishedAt: now,
				}},
			}},
		},
	}
	if _, err := e.kube.CoreV1().Pods(job.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	j := job.DeepCopy()
	j.Status.StartTime = &now
	if exitCode == 0 {
		j.Status.Succeeded = 1
		j.Status.CompletionTime = &now
		j.Status.Conditions = []batchv1.JobCondition{
			{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now},
		}
	} else {
		j.Status.Failed = 1
		j.Status.Conditions = []batchv1.JobCondition{
			{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: "Container kaniko for pod exited with code 1", LastTransitionTime: now},
			{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: "Container kaniko for pod exited with code 1", LastTransitionTime: now},
		}
	}
	if _, err := e.kube.BatchV1().Jobs(job.Namespace).UpdateStatus(ctx, j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func merge(a, b map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

// streamState returns the request messages left (intake and the tenants'
// queues), the requests held by handlers and the redelivered ones.
func (e *env) streamState() (msgs uint64, ackPending int, redelivered int) {
	e.t.Helper()
	q, err := ReadQueueState(context.Background(), e.js)
	if err != nil {
		e.t.Fatal(err)
	}
	return q.Messages, q.Held, q.Redelivered
}

func digestOf(s string) string { return "sha256:" + hex64(s) }

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

var podSeq atomic.Int64

// testRegistry is go-containerregistry's in-memory registry behind a switch
// that makes manifest requests fail, and the worker's client for it.
type testRegistry struct {
	host   string
	client *registry.Client
	fail   atomic.Bool
}

func newTestRegistry(t *testing.T) *testRegistry {
	t.Helper()
	tr := &testRegistry{}
	inner := ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tr.fail.Load() && strings.Contains(r.URL.Path, "/manifests/") {
			http.Error(w, "registry down", http.StatusInternalServerError)
			return
		}
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	tr.host = strings.TrimPrefix(srv.URL, "http://")
	c, err := registry.New(registry.Options{Insecure: []string{tr.host}})
	if err != nil {
		t.Fatal(err)
	}
	tr.client = c
	return tr
}

// push stores a random image under ref and returns its digest, as kaniko
// would have.
func (tr *testRegistry) push(t *testing.T, ref string) string {
	t.Helper()
	img, err := random.Image(256, 1)
	if err != nil {
		t.Fatal(err)
	}
	d, err := tr.client.Push(context.Background(), img, []string{ref})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// destination returns the first --destination of a Job.
func destination(job *batchv1.Job) string {
	for _, a := range job.Spec.Template.Spec.Containers[0].Args {
		if d, ok := strings.CutPrefix(a, "--destination="); ok {
			return d
		}
	}
	return ""
}

// tenantAPIRequest asks one of tenant's API subjects the way the SDK does
// (publisher.Client.TenantRequest): the reply under the tenant's own inbox
// prefix, the only kind (with a service import's) a worker answers. No
// subscriber: nats.ErrNoResponders.
func tenantAPIRequest(nc *nats.Conn, tenant, subject, payload string, timeout time.Duration) (*nats.Msg, error) {
	inbox := v1.InboxPrefix(tenant) + "." + nats.NewInbox()[len(nats.InboxPrefix):]
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(subject, inbox, []byte(payload)); err != nil {
		return nil, err
	}
	m, err := sub.NextMsg(timeout)
	if err != nil {
		return nil, err
	}
	if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
		return nil, nats.ErrNoResponders
	}
	return m, nil
}

// subjectTenant is the tenant of a tenant API subject:
// buildq.api.<service>.<tenant> or buildq.cancel.<tenant>.<name>.
func subjectTenant(subject string) string {
	parts := strings.Split(subject, ".")
	if strings.HasPrefix(subject, v1.CancelPrefix+".") && len(parts) > 2 {
		return parts[2]
	}
	return parts[len(parts)-1]
}
