package worker

// Issue 24: the defects a review found that the fault simulation had not
// reported, and the three suspicions it raised. Each test fails on the
// code before its fix (the comment says how) and passes with it.

import (
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// i24KV is a KV bucket whose calls a test can fail or hold: each hook,
// when set, sees the call first and returns a non-nil error to fail it.
type i24KV struct {
	jetstream.KeyValue
	onGet    func(ctx context.Context, key string) error
	onCreate func(key string, value []byte) error
	onUpdate func(key string, value []byte) error
}

func (k *i24KV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.onGet != nil {
		if err := k.onGet(ctx, key); err != nil {
			return nil, err
		}
	}
	return k.KeyValue.Get(ctx, key)
}

func (k *i24KV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	if k.onCreate != nil {
		if err := k.onCreate(key, value); err != nil {
			return 0, err
		}
	}
	return k.KeyValue.Create(ctx, key, value, opts...)
}

func (k *i24KV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if k.onUpdate != nil {
		if err := k.onUpdate(key, value); err != nil {
			return 0, err
		}
	}
	return k.KeyValue.Update(ctx, key, value, rev)
}

// i24DeadRun stores a build record of key whose owner is dead: a request
// of the key parks on it, and the waiter sweep lets the run go after 1.5
// leases and requeues the parked request, which then takes the run over.
func i24DeadRun(t *testing.T, w *Worker, tr *testRegistry, key string) {
	t.Helper()
	dest := tr.host + "/acme/web:" + v1.DefaultTag(key)
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		RequestID: "gone", Tenant: "acme", Name: "web", Holder: "gone",
		Repository: tr.host + "/acme/web", Destinations: []string{dest}})
	if _, err := w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
}

// i24Parked waits until tenant acme's request id is parked on key.
func i24Parked(t *testing.T, w *Worker, key, id string) {
	t.Helper()
	eventually(t, 10*time.Second, "request "+id+" parked", func() bool {
		items, err := w.ledger.ListWaiters(context.Background(), key)
		if err != nil {
			return false
		}
		for _, it := range items[key] {
			if it.V.Parked && it.V.RequestID == id {
				return true
			}
		}
		return false
	})
}

// i24Answer plays the node for every Job of key until tenant acme's
// request id has a stored result, and returns it.
func i24Answer(t *testing.T, e *env, tr *testRegistry, results *resultCollector, key, id string, timeout time.Duration) v1.Result {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(timeout)
	finished := map[string]bool{}
	for time.Now().Before(deadline) {
		if rs := storedOf(results, "acme", id); len(rs) > 0 {
			return rs[0]
		}
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil &&
			len(j.Status.Conditions) == 0 && j.DeletionTimestamp == nil && !finished[string(j.UID)] {
			finished[string(j.UID)] = true
			e.kubelet(j, 0, tr.push(t, destination(j)))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("request %s got no result in %s", id, timeout)
	return v1.Result{}
}

// ---- defect 1: a requeued parked request loses its result ----

// i24Requeue is a world for a requeued parked request: the env, its
// registry, acme's request id (also its content), its build key and its
// ledger key.
func i24Requeue(t *testing.T, id string) (*env, *testRegistry, *v1.Request, string, string) {
	t.Helper()
	e := setup(t)
	req := request(id)
	req.RequestID = id
	return e, newTestRegistry(t), req, v1.BuildKey(req, kanikoID), RequestIndexKey("acme", req.RequestID)
}

// A parked request is requeued (its run's owner is dead); the handler of
// the requeued message reads the ledger to match its requeue token, and
// that read fails once (a KV timeout). requeuedEntry() returned nil on
// the error, process() took the requeued message for a duplicate and
// terminated it — and requeue() had already deleted the waiter entry:
// nobody ever answered the request.
func TestIssue24RequeuedRequestSurvivesALedgerReadError(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := i24Requeue(t, "i24-requeue-read-error")
	var armed, fired atomic.Bool
	r := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.ledger.UseBucket(&i24KV{KeyValue: w.ledger.Bucket(), onGet: func(_ context.Context, k string) error {
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && fired.CompareAndSwap(false, true) {
				return nats.ErrTimeout
			}
			return nil
		}})
	})
	results := e.collect()
	i24DeadRun(t, r.w, tr, key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	i24Parked(t, r.w, key, req.RequestID)
	armed.Store(true)
	res := i24Answer(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if !fired.Load() {
		t.Fatal("premise: the requeued message's ledger read never failed")
	}
	if d := res.Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("requeued request answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
}

// The same requeued message, with the worker stopped (SIGTERM) while its
// handler reads the ledger between openEntry and requeuedEntry: the read
// ends with the work context's cancellation, and the message was
// terminated as a duplicate instead of handed back. Another worker must
// answer the request.
func TestIssue24RequeuedRequestHandedBackAtShutdown(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := i24Requeue(t, "i24-requeue-sigterm")
	var armed atomic.Bool
	entered := make(chan struct{})
	var once atomic.Bool
	r := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.ledger.UseBucket(&i24KV{KeyValue: w.ledger.Bucket(), onGet: func(ctx context.Context, k string) error {
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && once.CompareAndSwap(false, true) {
				close(entered)
				<-ctx.Done() // held until the worker stops
				return ctx.Err()
			}
			return nil
		}})
	})
	results := e.collect()
	i24DeadRun(t, r.w, tr, key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	i24Parked(t, r.w, key, req.RequestID)
	armed.Store(true)
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the requeued message was never handled")
	}
	r.stop(t)
	e.startWorker("w2", withRegistry(tr))
	res := i24Answer(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if d := res.Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("requeued request answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
}

// ---- defect 2: a requeued request refused at the queue limit ----

// acme (queue limit 1) has one request running when its parked request
// is requeued; intake, at the limit, reads the ledger to recognize the
// requeue, and the read fails once. requeuedEntry() returned nil, and the
// parked request — admitted long before — was answered QuotaExceeded.
func TestIssue24RequeueAtTheQueueLimitSurvivesALedgerReadError(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := i24Requeue(t, "i24-requeue-at-limit")
	var armed, fired atomic.Bool
	r := e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.QueueLimit = map[string]int{"acme": 1}
	}, nil, func(w *Worker) {
		w.ledger.UseBucket(&i24KV{KeyValue: w.ledger.Bucket(), onGet: func(_ context.Context, k string) error {
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && calledFrom(".admit") && fired.CompareAndSwap(false, true) {
				return nats.ErrTimeout
			}
			return nil
		}})
	})
	results := e.collect()
	i24DeadRun(t, r.w, tr, key)
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	i24Parked(t, r.w, key, req.RequestID)
	// acme's queue is at its limit when the parked request comes back.
	other := request("i24-fills-the-queue")
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	otherJob := e.waitJob(kaniko.JobName(v1.BuildKey(other, kanikoID)))
	armed.Store(true)
	res := i24Answer(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if !fired.Load() {
		t.Fatal("premise: intake's ledger read of the requeue never failed")
	}
	if d := res.Data; d.Status != v1.StatusSucceeded {
		t.Fatalf("the parked request, requeued, was answered %s/%s: %q", d.Status, d.Reason, d.Message)
	}
	e.kubelet(otherJob, 0, tr.push(t, destination(otherJob)))
}

// ---- defect 3: a killed worker's running Job escapes the limit ----

// i24Kill is SIGKILL: the worker's connection drops before anything is
// handed back or released, then it stops.
func i24Kill(r *runningWorker) {
	r.w.nc.Close()
	r.cancel()
	<-r.done
}

// i24NeverTwo fails the test if acme ever runs more than one of jobs at
// once during d.
func i24NeverTwo(t *testing.T, e *env, names map[string]string, d time.Duration, why string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if n := e.running(names)["acme"]; n > 1 {
			t.Fatalf("acme runs %d builds at once, its concurrency limit is 1: %s", n, why)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// w1 runs acme's r1 (limit 1) and is killed. The dispatch consumer's
// AckWait (6 s) is longer than the lease (2 s): the slot key aged out
// after the lease (the bucket's TTL) while r1's Job ran on and r1 was not
// redelivered yet, and w2 took the slot for r2 — two Jobs at once.
func TestIssue24KilledHoldersSlotOutlivesTheLeaseWhileItsJobRuns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	cfg := func(c *Config) {
		withRegistry(tr)(c)
		c.AckWait = 6 * time.Second
		c.Lease = 2 * time.Second
		c.Fair.Concurrency = map[string]int{"acme": 1}
	}
	w1 := e.startWorker("w1", cfg)
	results := e.collect()
	r1, r2, names := i24HolderAndNext(t, e, "i24-killed-holder", "i24-next", func() { e.startWorker("w2", cfg) })
	i24Kill(w1)
	// Past the lease, past r1's redelivery and w2's take-over of its run.
	i24NeverTwo(t, e, names, 12*time.Second, "the killed holder's slot was given to another request while its Job ran")
	j1 := e.jobs()[jobOf(r1)]
	if j1 == nil {
		t.Fatal("premise: r1's Job is gone")
	}
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	j2 := e.waitJob(jobOf(r2))
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	got := results.waitFor(t, 2, 20*time.Second)
	for _, r := range got {
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	}
}

// The same escape without a crash: w1 creates r1's Job, but the API
// server's answer is lost (a timeout: the Job was created all the same).
// The handler lets its run go and retries r1 after a delay, and released
// acme's slot (limit 1): w1 took it for r2 while r1's Job ran on.
func TestIssue24RetriedRequestKeepsItsSlotWhileItsJobRuns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	r1 := tenantRequest("acme", "i24-create-timeout")
	var once atomic.Bool
	e.kube.PrependReactor("create", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		job := a.(k8stesting.CreateAction).GetObject().(*batchv1.Job)
		if job.Name != jobOf(r1) || !once.CompareAndSwap(false, true) {
			return false, nil, nil
		}
		// Created, and the answer lost.
		job = job.DeepCopy()
		job.UID = "uid-i24-lost-answer"
		if err := e.kube.Tracker().Create(batchv1.SchemeGroupVersion.WithResource("jobs"), job, job.Namespace); err != nil {
			t.Error(err)
		}
		return true, nil, apierrors.NewTimeoutError("the create answer was lost", 1)
	})
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 1}
	})
	results := e.collect()
	ctx := context.Background()
	names := map[string]string{jobOf(r1): "acme"}
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	r2 := tenantRequest("acme", "i24-after-timeout")
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	i24NeverTwo(t, e, names, 6*time.Second, "a request retried after transient trouble released its slot while its Job ran")
	if !once.Load() {
		t.Fatal("premise: r1's Job create never lost its answer")
	}
	j1 := e.jobs()[jobOf(r1)]
	if j1 == nil {
		t.Fatal("premise: r1's Job is gone")
	}
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	j2 := e.waitJob(jobOf(r2))
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	for _, r := range results.waitFor(t, 2, 20*time.Second) {
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	}
}

// ---- defect 4: the slots bucket's TTL is the last starting worker's lease ----

// w1 (lease 6 s, renewing its slot every 2 s) runs acme's r1; w2 starts
// with a lease of 1 s and set the slots bucket's TTL to it: w1's key aged
// out between its renewals and w2 took the slot for r2, nobody paused or
// killed.
func TestIssue24SlotExpiryIsTheHoldersLeaseNotTheBuckets(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(lease time.Duration) func(*Config) {
		return func(c *Config) {
			withRegistry(tr)(c)
			c.Lease = lease
			c.Fair.Concurrency = map[string]int{"acme": 1}
		}
	}
	e.startWorker("w1", limit(6*time.Second))
	ctx := context.Background()
	names := map[string]string{}
	r1 := tenantRequest("acme", "i24-long-lease")
	names[jobOf(r1)] = "acme"
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	e.startWorker("w2", limit(time.Second))
	r2 := tenantRequest("acme", "i24-short-lease")
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	i24NeverTwo(t, e, names, 8*time.Second, "w1's live slot expired by w2's lease")
	j1 := e.jobs()[jobOf(r1)]
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	e.waitJob(jobOf(r2))
}

// ---- defect 5: --queue-ttl compares the worker's clock with the server's ----

// A worker whose clock is 5 minutes ahead refused a fresh request Expired
// (queue TTL 1 minute); one 5 minutes behind built a request that had
// waited past its queue TTL of 1 s.
func TestIssue24QueueTTLIsJudgedOnTheServersClock(t *testing.T) {
	t.Parallel()
	t.Run("a worker ahead does not expire a fresh request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.startWorker("w1", func(c *Config) {
			c.QueueTTL = time.Minute
			c.Now = func() time.Time { return time.Now().Add(5 * time.Minute) }
		})
		results := e.collect()
		req := request("i24-fresh-ahead")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			if got := results.snapshot(); len(got) > 0 {
				t.Fatalf("a fresh request was answered %s/%s: %q", got[0].Data.Status, got[0].Data.Reason, got[0].Data.Message)
			}
			if _, ok := e.jobs()[kaniko.JobName(v1.BuildKey(req, kanikoID))]; ok {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatal("the fresh request was not built")
	})
	t.Run("a worker behind expires a stale request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		const ttl = time.Second
		if _, _, err := EnsureStreams(context.Background(), e.js, testConfig("setup")); err != nil {
			t.Fatal(err)
		}
		req := request("i24-stale-behind")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		time.Sleep(ttl + 500*time.Millisecond)
		e.startWorker("w1", func(c *Config) {
			c.QueueTTL = ttl
			c.Now = func() time.Time { return time.Now().Add(-5 * time.Minute) }
		})
		results := e.collect()
		r := results.waitFor(t, 1, 10*time.Second)[0]
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonExpired {
			t.Fatalf("a request past its queue TTL was answered %s", mustJSON(t, r))
		}
		if n := e.creates.total(); n != 0 {
			t.Fatalf("%d Jobs created for an expired request", n)
		}
	})
}

// ---- suspicion: slots lost while NATS is down longer than the lease ----

// i24RestartNATS stops e's server and starts it again on the same port
// and store after down.
func i24RestartNATS(t *testing.T, e *env, down time.Duration) {
	t.Helper()
	portN := e.srv.Addr().(*net.TCPAddr).Port
	store := filepath.Dir(e.srv.StoreDir())
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
	time.Sleep(down)
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: portN, JetStream: true, StoreDir: store, NoLog: true, NoSigs: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start again")
	}
	t.Cleanup(srv.Shutdown)
	e.srv = srv
}

// w1 runs acme's r1 (limit 1). NATS is down for 3 s, longer than the
// 2 s lease, and w1's first slot renewals after it fail (its KV answers
// late). The slot key expired at the restart (the bucket's TTL): w2's
// dispatcher created it again and ran r2 while r1's build went on.
func TestIssue24SlotSurvivesANATSOutageLongerThanTheLease(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var blocked atomic.Bool
	fail := func() error {
		if blocked.Load() {
			return nats.ErrTimeout
		}
		return nil
	}
	limit := func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 1}
	}
	e.startWorkerHooked("w1", limit, nil, func(w *Worker) {
		w.fq.UseSlots(&i24KV{KeyValue: w.fq.Slots(),
			onGet:    func(context.Context, string) error { return fail() },
			onCreate: func(string, []byte) error { return fail() },
			onUpdate: func(string, []byte) error { return fail() }})
	})
	r1, _, names := i24HolderAndNext(t, e, "i24-outage-holder", "i24-outage-next", func() { e.startWorker("w2", limit) })
	time.Sleep(500 * time.Millisecond)
	blocked.Store(true)
	i24RestartNATS(t, e, 3*time.Second)
	go func() {
		time.Sleep(4 * time.Second) // w1 recovers after the others reconnected
		blocked.Store(false)
	}()
	i24NeverTwo(t, e, names, 10*time.Second, "the slot was taken by another dispatcher after a NATS outage longer than the lease")
	if _, ok := e.jobs()[jobOf(r1)]; !ok {
		t.Fatal("premise: r1's Job is gone")
	}
}

// ---- suspicion: a refusal whose record fails is admitted on redelivery ----

// acme (queue limit 1) has one request running; its next one is refused
// QuotaExceeded, and writing the refusal to the ledger fails (first the
// entry's creation, then the decision). The handler Nak'd the message,
// and intake checks the limit on a first delivery only: the redelivery
// was admitted and built over the limit.
func TestIssue24RefusalWhoseRecordFailsIsNotAdmitted(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	refused := request("i24-refused")
	refused.RequestID = "i24-refused"
	lk := RequestIndexKey("acme", refused.RequestID)
	var createFailed, updateFailed atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.QueueLimit = map[string]int{"acme": 1}
	}, nil, func(w *Worker) {
		w.ledger.UseBucket(&i24KV{KeyValue: w.ledger.Bucket(),
			onCreate: func(k string, _ []byte) error {
				if k == lk && createFailed.CompareAndSwap(false, true) {
					return nats.ErrTimeout
				}
				return nil
			},
			onUpdate: func(k string, value []byte) error {
				if k == lk && strings.Contains(string(value), v1.ReasonQuotaExceeded) && updateFailed.CompareAndSwap(false, true) {
					return nats.ErrTimeout
				}
				return nil
			}})
	})
	results := e.collect()
	ctx := context.Background()
	running := request("i24-running")
	if _, err := e.pub.Publish(ctx, running); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(running, kanikoID)))
	if _, err := e.pub.Publish(ctx, refused); err != nil {
		t.Fatal(err)
	}
	refusedJob := kaniko.JobName(v1.BuildKey(refused, kanikoID))
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, ok := e.jobs()[refusedJob]; ok {
			t.Fatal("the request refused at acme's queue limit was admitted and built after its refusal could not be recorded")
		}
		if rs := storedOf(results, "acme", refused.RequestID); len(rs) > 0 {
			if d := rs[0].Data; d.Status != v1.StatusFailed || d.Reason != v1.ReasonQuotaExceeded {
				t.Fatalf("the request over acme's queue limit was answered %s/%s", d.Status, d.Reason)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the request over the limit got no result")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !createFailed.Load() {
		t.Fatal("premise: the refusal's ledger entry was never written")
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
}

// ---- suspicion: --index-ttl not checked against --lease ----

// A build record is renewed every third of the lease and a dead owner's
// is taken over after 1.5 leases watched: an index TTL shorter than that
// drops a running build's record (its key is claimed again, its Job
// replaced) or a dead owner's before anyone takes it over. The worker
// accepted --lease 30m with --index-ttl 1h.
func TestIssue24IndexTTLMustOutliveTheLease(t *testing.T) {
	t.Parallel()
	cfg := testConfig("w1")
	cfg.Lease = 30 * time.Minute
	cfg.IndexTTL = time.Hour
	err := cfg.WithDefaults().Validate()
	if err == nil || !strings.Contains(err.Error(), "index TTL") {
		t.Fatalf("Validate() with --lease 30m --index-ttl 1h = %v, want an index TTL error", err)
	}
	cfg.IndexTTL = 3 * time.Hour
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatalf("Validate() with --lease 30m --index-ttl 3h = %v", err)
	}
	if err := testConfig("w1").WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}
	cfg.IndexTTL = time.Hour
	if _, err := New(nil, nil, cfg); err == nil || !strings.Contains(err.Error(), "index TTL") {
		t.Fatalf("New with --lease 30m --index-ttl 1h = %v, want refused", err)
	}
}

// i24HolderAndNext publishes acme's request id1, waits for its Job, runs
// then (a second worker's start), and publishes acme's high-priority id2,
// which waits on the tenant's one slot. names maps both Jobs to acme.
func i24HolderAndNext(t *testing.T, e *env, id1, id2 string, then func()) (r1, r2 *v1.Request, names map[string]string) {
	t.Helper()
	ctx := context.Background()
	names = map[string]string{}
	r1 = tenantRequest("acme", id1)
	names[jobOf(r1)] = "acme"
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	then()
	r2 = tenantRequest("acme", id2)
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	return r1, r2, names
}
