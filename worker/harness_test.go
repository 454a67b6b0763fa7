package worker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/publisher"
)

const testNamespace = "builds"

// env is a test world (world_test.go) as the harness runs it: NATS, the
// API server with no faults, a node whose builds end when the test says
// (kubelet), no TTL controller, and no registry unless the test makes one
// (newTestRegistry). The workers a test starts share it.
type env struct {
	t     *testing.T
	world *world
	nc    *nats.Conn
	js    jetstream.JetStream
	// kube is the test's and the workers' client of the API server.
	kube *apiClient
	pub  *publisher.Client
	// creates counts the Job creations that reached the API server.
	creates *counter
}

func setup(t *testing.T) *env {
	t.Helper()
	w := newWorld(t, worldConfig{})
	nc, err := nats.Connect(w.nats.URL(), nats.ReconnectBufSize(-1))
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
	return &env{t: t, world: w, nc: nc, js: js, kube: w.api.newClient("kube", nil), pub: pub, creates: w.node.creates}
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
		// Duplicates of a build in progress are queued and parked by
		// their handlers, the paths most tests exercise; a test of the
		// holds at intake (intakehold_test.go) turns them on, and the
		// fault simulation varies them by seed and worker.
		HoldAtIntake: -1,
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

// kubelet plays the node and the Job controller for one Job: it ends the
// build with the kaniko container's exit code and termination message (a
// digest, or the error), pushing nothing.
func (e *env) kubelet(job *batchv1.Job, exitCode int32, message string) {
	e.t.Helper()
	if err := e.world.node.end(job, exitCode, message); err != nil {
		e.t.Fatal(err)
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
