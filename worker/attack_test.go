package worker

// Adversarial tests of the claim protocol after the rewrite for issue 9
// (commit 54e1b33 and later). Each test stages one interleaving — a pause,
// a write that landed although its caller saw an error, a cancel racing a
// take-over, hostile input — and names the invariant it broke. Each failed
// on the code it was written against (fa71058) and passes since the fix.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	batchv1client "k8s.io/client-go/kubernetes/typed/batch/v1"
	k8stesting "k8s.io/client-go/testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
)

// ---- helpers ----

// startWorkerHooked is startWorkerWith (kaniko backend, own informers) with
// the backend's API client replaced by client (nil: the fake cluster's)
// and before applied to the worker after Setup and before Run: the place to
// wrap its buckets or set fault hooks without racing its goroutines.
func (e *env) startWorkerHooked(id string, mutate func(*Config), client kubernetes.Interface, before func(*Worker)) *runningWorker {
	e.t.Helper()
	r, _ := e.startWorkerFull(id, testKaniko, mutate, client, before)
	return r
}

// Fates of one KV write in faultyKV.
const (
	writePasses = ""
	// writeLost: the write never reaches the server; the caller sees a
	// timeout.
	writeLost = "lost"
	// writeLanded: the write is stored, but the caller sees a timeout (the
	// reply was lost: a NATS restart, a slow leader).
	writeLanded = "landed"
)

// faultyKV is a KV bucket whose Update calls can be lost or can land and
// still report a timeout.
type faultyKV struct {
	jetstream.KeyValue
	onUpdate func(key string, value []byte) string
}

func (f *faultyKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	switch f.onUpdate(key, value) {
	case writeLost:
		return 0, nats.ErrTimeout
	case writeLanded:
		if _, err := f.KeyValue.Update(ctx, key, value, rev); err != nil {
			return 0, err
		}
		return 0, nats.ErrTimeout
	}
	return f.KeyValue.Update(ctx, key, value, rev)
}

// gateRegistry is a Registry whose first Head blocks until released (a
// slow registry during the preflight); every Head answers from exists.
type gateRegistry struct {
	gate    bool
	entered chan struct{}
	release chan struct{}
	heads   atomic.Int32
	exists  map[string]string // ref → digest
}

func newGateRegistry(gate bool) *gateRegistry {
	return &gateRegistry{gate: gate, entered: make(chan struct{}), release: make(chan struct{}), exists: map[string]string{}}
}

func (g *gateRegistry) Head(ctx context.Context, ref string) (string, error) {
	if g.heads.Add(1) == 1 && g.gate {
		close(g.entered)
		select {
		case <-g.release:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	if d, ok := g.exists[ref]; ok {
		return d, nil
	}
	return "", fmt.Errorf("head %s: %w", ref, registry.ErrNotFound)
}

func (g *gateRegistry) Copy(context.Context, string, string) (string, error) {
	return "", errors.New("copy: not used in these tests")
}

func (g *gateRegistry) EnsureHarborProject(context.Context, string, string) error { return nil }

// slowCreates is an API client whose Job creates can be held: the request
// reached the API server, whose answer comes late. (A reactor cannot
// block: the fake clientset holds its lock while reactors run.)
type slowCreates struct {
	kubernetes.Interface
	hold       func()            // called before each Job create is passed on; nil: none
	holdDelete func(name string) // called before each Job delete is passed on; nil: none
}

func (s slowCreates) BatchV1() batchv1client.BatchV1Interface {
	return slowBatch{BatchV1Interface: s.Interface.BatchV1(), s: s}
}

type slowBatch struct {
	batchv1client.BatchV1Interface
	s slowCreates
}

func (b slowBatch) Jobs(ns string) batchv1client.JobInterface {
	return slowJobs{JobInterface: b.BatchV1Interface.Jobs(ns), s: b.s}
}

type slowJobs struct {
	batchv1client.JobInterface
	s slowCreates
}

func (j slowJobs) Create(ctx context.Context, job *batchv1.Job, opts metav1.CreateOptions) (*batchv1.Job, error) {
	if j.s.hold != nil {
		j.s.hold()
	}
	return j.JobInterface.Create(ctx, job, opts)
}

func (j slowJobs) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	if j.s.holdDelete != nil {
		j.s.holdDelete(name)
	}
	return j.JobInterface.Delete(ctx, name, opts)
}

// resultFor returns the stored results of request id.
func resultFor(results *resultCollector, id string) []v1.Result {
	return byID(results.snapshot())[id]
}

// ---- 1. a stale owner deletes the current run's Job ----

// An owner whose Job create is slow (the API server answers late) runs on
// for a run that ended meanwhile. When its create finally answers
// AlreadyExists, the backend treats the Job standing there — the newer,
// current run's — as stale, deletes it by UID and creates its own; the
// owner learns its run is over only afterwards (the started callback, or
// its next lease renewal). removeStale never asks the record whether the
// Job it deletes belongs to a run that ended.
//
// Interleaving (one worker, lease 30 s, so no renewal interferes):
//
//	R1: claim key → run r1 → Job create sent … API server stalls
//	cancel: r1 → failed/Canceled (no Job yet: nothing to delete)
//	R2: failed record → new run r2 → creates Job(r2)
//	R1: create answers AlreadyExists → removeStale deletes Job(r2),
//	    creates Job(r1) → only then sees the record moved on
//	R2: its Job is gone → run r2 ends failed/JobDeleted
//
// Breaks invariant 7 (a request's answer is its own run's outcome, never
// another claim's doing): R2 fails with JobDeleted because an ended run
// replaced its Job. The local backend does the same (LocalBackend.Run
// cancels the in-process build of any other run of the key).
func TestAttackStaleOwnerDeletesTheCurrentRunsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var creates atomic.Int32
	slow := slowCreates{Interface: e.kube, hold: func() {
		if creates.Add(1) == 1 {
			close(entered)
			<-release // the API server answers R1's create late
		}
	}}
	e.startWorkerHooked("w1", func(c *Config) { c.Lease = 30 * time.Second }, slow, nil)
	results := e.collect()

	r1 := request("stale-owner")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r1, kanikoID)
	name := kaniko.JobName(key)
	select {
	case <-entered: // R1 holds run r1; its create is in flight
	case <-time.After(10 * time.Second):
		t.Fatal("R1 never created its Job")
	}
	if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	r2 := request("stale-owner")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "R2's job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && j.Annotations[kaniko.AnnotationRequestID] == r2.RequestID
	})
	r2Run := e.claim(key).Run
	close(release) // R1's create answers now: AlreadyExists

	// R1's run was canceled: R1 must end canceled and leave R2's build
	// alone. Wait until either request is answered.
	eventually(t, 15*time.Second, "an answer for R1 or R2", func() bool {
		return len(resultFor(results, r1.RequestID)) > 0 || len(resultFor(results, r2.RequestID)) > 0
	})
	if rs := resultFor(results, r2.RequestID); len(rs) > 0 {
		t.Fatalf("R2's build was ended by R1's stale run before it finished: R2 got %s (R1: %s)",
			mustJSON(t, rs[0].Data), mustJSON(t, resultFor(results, r1.RequestID)))
	}
	j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil || j.Annotations[kaniko.AnnotationRun] != r2Run {
		t.Fatalf("R2's Job (run %s) was replaced: %v %v", r2Run, j.GetAnnotations(), err)
	}
	e.kubelet(j, 0, digestOf("stale-owner r2"))
	eventually(t, 10*time.Second, "R2's result", func() bool { return len(resultFor(results, r2.RequestID)) > 0 })
	if d := resultFor(results, r2.RequestID)[0].Data; d.Status != v1.StatusSucceeded || d.Digest != digestOf("stale-owner r2") {
		t.Fatalf("R2 got %s", mustJSON(t, d))
	}
}

// ---- 2. a panic's result is not recorded ----

// panicOnceBackend panics in its first Run (a bug that depends on timing)
// and builds fine afterwards.
type panicOnceBackend struct{ runs atomic.Int32 }

func (*panicOnceBackend) Identity() string { return "panic-once" }
func (b *panicOnceBackend) Run(_ context.Context, bd Build, started Started) (Outcome, error) {
	if b.runs.Add(1) == 1 {
		panic("executor bug that shows once")
	}
	started("fake-"+bd.Run, true, bd.Request.RequestID)
	return Outcome{Succeeded: true, Digest: digestOf("panic-once"), Job: "fake-" + bd.Run, Run: bd.Run}, nil
}
func (*panicOnceBackend) Cleanup(context.Context, string, string) error { return nil }

// safeProcess turns a panic into a failed/InfrastructureError verdict but
// drops the ledger entry (le = nil), so handle() publishes that decision
// without storing it first. When the Term is lost (or the worker dies
// between the PubAck and the Term), the redelivery finds an entry with no
// decision and decides again — here the build works the second time.
//
// Interleaving:
//
//	delivery 1: ledger entry opened → claim → backend panics → recovered →
//	            failed/InfrastructureError published (not in the ledger) →
//	            Term lost
//	delivery 2: ledger has no decision → build (take-over of the claim the
//	            panicking handler never released) → succeeded published
//
// Breaks invariant 1 and the ledger's promise: one request, two different
// results published (the stream's duplicate window hides the second from
// stream readers for 10 minutes; after that it is stored too; the ledger
// and `buildq status` say succeeded while the stored result says failed).
func TestAttackPanicResultIsNotRecordedSoARedeliveryDecidesAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	w, err := New(e.nc, &panicOnceBackend{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	req := request("panic-once")
	var lost atomic.Bool
	w.faults = &faultHooks{loseAck: func(id string) bool { return id == req.RequestID && lost.CompareAndSwap(false, true) }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	results := e.collect()

	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	first := results.waitFor(t, 1, 10*time.Second)[0]
	if first.Data.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("first result %s", mustJSON(t, first.Data))
	}
	eventually(t, 30*time.Second, "the redelivered request to be settled", func() bool {
		msgs, pending, _ := e.streamState()
		return lost.Load() && msgs == 0 && pending == 0
	})
	_ = e.nc.Flush()
	results.mu.Lock()
	defer results.mu.Unlock()
	n := 0
	for _, ds := range results.published { // keyed by Nats-Msg-Id
		for _, d := range ds {
			if d.RequestID != req.RequestID {
				continue
			}
			n++
			if decision(d) != decision(first.Data) {
				t.Fatalf("request %s got two different results:\n  %s\n  %s", req.RequestID, decision(first.Data), decision(d))
			}
		}
	}
	if n == 0 {
		t.Fatal("no publish of the result was seen")
	}
}

// ---- 3. the local backend wedges a key after a panic ----

// panickyContexts panics on its first Open and finds no object afterwards.
type panickyContexts struct{ opened atomic.Int32 }

func (p *panickyContexts) Open(context.Context, string, string) (io.ReadCloser, error) {
	if p.opened.Add(1) == 1 {
		panic("context reader bug")
	}
	return nil, s3store.ErrNotFound
}

// LocalBackend.Run registers the build in l.running and removes it (and
// closes done) only when l.build returns normally. A panic in the build —
// which the worker recovers (safeProcess) so the process lives on — leaves
// the entry behind with done never closed: every later Run of that key in
// the process waits on it forever, whether it is a take-over of the same
// run (it "adopts" the dead build) or a new run (it cancels the dead build
// and waits for it to stop).
//
// Breaks invariant 1 for `buildq dev`: after one panic, no request for the
// key is ever answered by that worker (its handler heartbeats forever).
func TestAttackLocalBuildPanicWedgesTheKey(t *testing.T) {
	t.Parallel()
	l := NewLocalBackend(&panickyContexts{}, noPusher{}, t.TempDir(), 0)
	req := request("local-panic")
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	func() {
		defer func() { _ = recover() }() // as safeProcess does
		_, _ = l.Run(context.Background(), b, func(string, bool, string) {})
		t.Fatal("the first build did not panic")
	}()
	for _, run := range []string{"r1", "r2"} { // a take-over, then a new run
		b.Run = run
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		out, err := l.Run(ctx, b, func(string, bool, string) {})
		cancel()
		if err != nil || out.Reason != v1.ReasonContextMissing {
			t.Fatalf("run %s after a panicked build: %+v, %v; want its own build's outcome (ContextMissing), not a wait on the dead build", run, out, err)
		}
	}
}

// ---- 4. a cancel does not stop a request that took the run over ----

// A request that took a run over (its record names another request) and
// loses the claim to a cancel follows the record; build() sees a failed
// record that is not "mine" and retries it as a new run — a new Job,
// right after the cancel, for a request that was waiting on the canceled
// run. The owner learns of the cancel from its lease renewal whenever the
// cancel's own Job delete did not take effect first (here: the API server
// answers the cancel's delete with a 500).
//
// Interleaving:
//
//	dead owner "dead" holds run r (request "gone")
//	R1 (w1): joins, lapse, takes run r over, creates Job(r)
//	cancel:  r → failed/Canceled; Job delete → 500 (logged, reply canceled)
//	R1:      renewal CAS fails → follows the record → failed, not mine →
//	         new run r' → deletes Job(r), creates Job(r')
//
// Breaks the cancel contract (design §3: every request waiting on the run
// gets `canceled`): R1 is not canceled and a build starts after the cancel.
func TestAttackCancelIsUndoneByARequestThatTookTheRunOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var deletes atomic.Int32
	e.kube.PrependReactor("delete", "jobs", func(k8stesting.Action) (bool, runtime.Object, error) {
		if deletes.Add(1) == 1 {
			return true, nil, apierrors.NewInternalError(errors.New("etcdserver: request timed out"))
		}
		return false, nil, nil
	})
	req := request("cancel-takeover")
	key := v1.BuildKey(req, kanikoID)
	w := e.startWorker("w1", nil)
	results := e.collect()
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		RequestID: "gone", Seq: 999, Tenant: "acme", Name: "web",
		Repository: "registry.test:5000/acme/web", Destinations: []string{"registry.test:5000/acme/web:" + v1.DefaultTag(key)}})
	if _, err := w.w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key)) // R1 took the run over
	if job.Annotations[kaniko.AnnotationRun] != "dead-run" {
		t.Fatalf("take-over ran run %q", job.Annotations[kaniko.AnnotationRun])
	}
	if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(resultFor(results, req.RequestID)) == 0 {
		if time.Now().After(deadline) {
			cur := e.claim(key)
			t.Fatalf("R1 was not canceled within 10s; the record is now %s run %s (request %s), %d jobs created",
				cur.State, cur.Run, cur.RequestID, e.creates.total())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if d := resultFor(results, req.RequestID)[0].Data; d.Status != v1.StatusCanceled {
		t.Fatalf("R1 got %s, want canceled", mustJSON(t, d))
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d jobs created; a canceled run must not be rebuilt by a request that waited on it", n)
	}
}

// ---- 5. cancel by a finished request's id cancels a newer run ----

// cancel(tenant, requestId) maps the id to its build key through the
// ledger and then cancels whatever run holds the key now. When that
// request is long answered and the key has a new run (another request's),
// the newer run is canceled in its place.
//
// Interleaving:
//
//	R1: run r1 fails, R1 answered failed
//	R2: same content, new run r2 building
//	cancel(R1's id) → key → run r2 → failed/Canceled
//
// Breaks "its id, status and cancel are its own": canceling a finished
// request should say it already finished, and never end another
// request's build.
func TestAttackCancelOfAFinishedRequestCancelsTheNextRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	r1 := request("cancel-old-id")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r1, kanikoID)
	name := kaniko.JobName(key)
	e.kubelet(e.waitJob(name), 1, "error building image: first run")
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusFailed {
		t.Fatalf("R1 %s", mustJSON(t, r.Data))
	}
	r2 := request("cancel-old-id")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "R2's build", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateBuilding && rec.RequestID == r2.RequestID
	})
	rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), r1.RequestID)
	if rep.Canceled {
		t.Fatalf("canceling finished request R1 canceled R2's run: reply %+v, record %+v", rep, e.claim(key))
	}
}

// ---- 6. a mismatched header lets a body take another request's id ----

// decode refuses a message whose Nats-Msg-Id header differs from the
// body's requestId ("a body may not claim another id"), but invalid()
// then addresses the failed result — and the ledger entry — by the body's
// id. The body's id is taken all the same: its ledger entry is held by the
// bad message, so the genuine request with that id (another header, so
// JetStream does not drop it) is terminated as a duplicate with no result,
// and the results stream already holds an InvalidRequest under its id.
//
// Breaks invariant 1 for the genuine request and the point of the header
// check. Same-tenant only (the ledger key has the tenant).
func TestAttackMismatchedHeaderTakesTheBodysRequestID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	victim := request("header-preempt")
	victim.APIVersion, victim.RequestID = v1.APIVersion, "victim-id"
	body, _ := json.Marshal(victim)
	m := nats.NewMsg(v1.RequestSubject("acme"))
	m.Header.Set(v1.MsgIDHeader, "forged-header")
	m.Data = body
	if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Reason != v1.ReasonInvalidRequest {
		t.Fatalf("forged message got %s", mustJSON(t, r))
	}
	// The genuine request, with its id in both places.
	if _, err := e.pub.Publish(context.Background(), victim); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(victim, kanikoID))
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the genuine request %s was never built; its results: %s", victim.RequestID, mustJSON(t, resultFor(results, victim.RequestID)))
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.kubelet(e.waitJob(name), 0, digestOf("header-preempt"))
	eventually(t, 10*time.Second, "the requests to be settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	for _, r := range e.resultsStored() {
		if r.ID == victim.RequestID && r.Data.Status == v1.StatusSucceeded {
			return
		}
	}
	t.Fatalf("no succeeded result stored under %s: %s", victim.RequestID, mustJSON(t, resultFor(results, victim.RequestID)))
}

// ---- 8. a lease renewal that landed but timed out ----

// The renewer treats any error as "try again with the revision I hold".
// When the renewal was stored and only its reply was lost, the next
// renewal's CAS fails on the owner's own write, the owner cancels its
// build as if the claim were taken over, follows the record, finds itself
// named as owner, joins its own run and waits the full lapse (1.5 leases)
// before taking it back. Meanwhile nobody renews the claim: any worker may
// take the live build over; the local backend's build is canceled and
// restarted from scratch.
//
// Breaks the lease contract (a live owner renews every lease/3): one lost
// reply makes a live owner abandon its claim for > 1.5 leases.
func TestAttackRenewalThatLandedMakesTheOwnerAbandonItsClaim(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var armed, fired atomic.Bool
	e.startWorkerHooked("w1", nil, nil, func(w *Worker) {
		w.runs.UseBucket(&faultyKV{KeyValue: w.runs.Bucket(), onUpdate: func(_ string, value []byte) string {
			var r v1.BuildRecord
			if armed.Load() && json.Unmarshal(value, &r) == nil && r.State == v1.StateBuilding && r.Owner == "w1" && fired.CompareAndSwap(false, true) {
				return writeLanded
			}
			return writePasses
		}})
	})
	events := e.events()
	req := request("renew-landed")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	e.waitJob(kaniko.JobName(key))
	kv, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	eventually(t, 5*time.Second, "the renewal to land with a lost reply", fired.Load)
	// A live owner renews every lease/3 (0.67 s); watch for a whole lease
	// and a half without one.
	lease := testConfig("").Lease
	var lastRev uint64
	lastChange := time.Now()
	end := time.Now().Add(2 * lease)
	for time.Now().Before(end) {
		ent, err := kv.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if ent.Revision() != lastRev {
			lastRev, lastChange = ent.Revision(), time.Now()
		}
		if gap := time.Since(lastChange); gap > lease {
			t.Fatalf("the live owner stopped renewing its claim for %s (> lease %s) after one lost renewal reply; joined its own run: %v",
				gap.Round(10*time.Millisecond), lease, events.has(req.RequestID, v1.PhaseWaiting))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ---- 9. a preflight cache hit is re-decided as a build (fixed) ----

// When the preflight found the image already in the registry it ended the
// run as succeeded and answered origin=cache; if the ledger write of that
// decision failed (a KV timeout), the redelivery found a succeeded record
// that was "mine" and answered origin=build, though nothing was built.
// Failed on 54e1b33..1902db9; fa71058 (preflight before the claim, its
// answer never recorded as the key's build) fixed it. Kept unguarded as a
// regression test.
func TestPreflightHitStaysACacheAnswerAfterARetry(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := newGateRegistry(false)
	req := request("preflight-origin")
	key := v1.BuildKey(req, kanikoID)
	reg.exists["registry.test:5000/acme/web:"+v1.DefaultTag(key)] = digestOf("already there")
	var failed atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) { c.Registry = reg }, nil, func(w *Worker) {
		w.ledger.UseBucket(&faultyKV{KeyValue: w.ledger.Bucket(), onUpdate: func(_ string, value []byte) string {
			if strings.Contains(string(value), `"result":`) && failed.CompareAndSwap(false, true) {
				return writeLost
			}
			return writePasses
		}})
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 15*time.Second)[0]
	if !failed.Load() {
		t.Fatal("the ledger write never failed")
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache {
		t.Fatalf("nothing was built, the image was in the registry; got %s", mustJSON(t, r.Data))
	}
}

// ---- 10. a request id that looks like a build key cannot be canceled ----

// Request ids may be any [A-Za-z0-9][A-Za-z0-9_.:-]* up to 128 characters,
// so 64 lowercase hex digits (a sha256 a producer uses as its id) are a
// valid request id. cancel() decides "key or request id" by IsBuildKey
// alone, so such an id is looked up as a build key: "no build is known",
// and the request's build runs on.
//
// Breaks the cancel contract (payload: build key or requestId) for valid
// ids. `buildq status` has the same ambiguity (cmd/buildq).
func TestAttackRequestIDThatLooksLikeAKeyCannotBeCanceled(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	req := request("hex-id")
	req.RequestID = hex64("producer's own id")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), req.RequestID); !rep.Canceled {
		t.Fatalf("cancel by request id %s: %+v", req.RequestID, rep)
	}
}
