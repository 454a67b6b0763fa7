package worker

// Tenant API (worker/internal/tenantapi): a cancel ends its own run only.
// Its Job delete carries the run's Job UID; a request that took the run
// over does not undo it; another tenant's request waiting on the key is
// neither canceled nor answered by it (docs/design.md §3).

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

var errPreconditionUID = preconditionError("the UID in the precondition does not match the Job's")

type preconditionError string

func (e preconditionError) Error() string { return string(e) }

// TestCancelDeletesOnlyItsRunsJob: a cancel ends its run and then deletes
// that run's Job. Its delete can reach the API server late — after a new
// request of the key claimed a new run and replaced the old Job with its
// own under the same name. The cancel's delete carries the old Job's UID,
// so it removes nothing of the new run. (Issue 24: a mutant that deleted
// the key's Job by name survived 200 schedules of the simulation; the race
// needs a delete held up at the wrong moment, which this test stages.)
//
// Origin: issue 24, mutation testing: a unit test for the mutant cancel-by-name (85ff387).
func TestCancelDeletesOnlyItsRunsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// The API server honours a delete's UID precondition (the fake
	// tracker does not), and the first delete of a Job — the cancel's —
	// is held, on its way to the API server, until released. (A reactor
	// cannot hold it: the fake clientset holds its lock while reactors
	// run.)
	e.kube.PrependReactor("delete", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		d := a.(k8stesting.DeleteAction)
		obj, err := e.kube.Tracker().Get(batchv1.SchemeGroupVersion.WithResource("jobs"), a.GetNamespace(), d.GetName())
		if err != nil {
			return true, nil, err
		}
		if pre := d.GetDeleteOptions().Preconditions; pre != nil && pre.UID != nil && *pre.UID != obj.(*batchv1.Job).UID {
			return true, nil, apierrors.NewConflict(batchv1.Resource("jobs"), d.GetName(), errPreconditionUID)
		}
		return false, nil, nil
	})
	var (
		once    sync.Once
		release = make(chan struct{})
		reached = make(chan struct{})
	)
	slow := slowCreates{Interface: e.kube, holdDelete: func(string) {
		first := false
		once.Do(func() { first = true })
		if first {
			close(reached)
			<-release
		}
	}}
	e.startWorkerHooked("w1", nil, slow, nil)
	results := e.collect()
	ctx := context.Background()

	a := request("cancel-race")
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	old := e.waitJob(kaniko.JobName(key))

	// The cancel ends a's run; its delete of the Job is held.
	canceled := make(chan *nats.Msg, 1)
	go func() {
		m, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), a.RequestID, 30*time.Second)
		if err != nil {
			t.Errorf("cancel: %v", err)
		}
		canceled <- m
	}()
	select {
	case <-reached:
	case <-time.After(10 * time.Second):
		t.Fatal("the cancel never deleted the Job")
	}
	// A new request of the key: a new run, whose Job replaces the old one
	// (its own delete, by the old Job's UID, goes through).
	b := request("cancel-race")
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	var fresh *batchv1.Job
	eventually(t, 10*time.Second, "the new run's Job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.UID == old.UID {
			return false
		}
		fresh = j
		return true
	})
	close(release)
	m := <-canceled
	if m == nil {
		t.FailNow()
	}
	var rep v1.CancelReply
	if err := json.Unmarshal(m.Data, &rep); err != nil || !rep.Canceled {
		t.Fatalf("cancel: %s (%v)", m.Data, err)
	}
	// The cancel answered after its delete returned.
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, fresh.Name, metav1.GetOptions{}); err != nil {
		t.Fatalf("the new run's Job is gone after the cancel's late delete: %v", err)
	}
	e.kubelet(fresh, 0, digestOf("cancel-race"))
	got := byID(results.waitFor(t, 2, 10*time.Second))
	if r := got[b.RequestID]; len(r) != 1 || r[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("the new request: %s", mustJSON(t, r))
	}
	if r := got[a.RequestID]; len(r) != 1 || r[0].Data.Status != v1.StatusCanceled {
		t.Fatalf("the canceled request: %s", mustJSON(t, r))
	}
}

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
//
// Origin: adversarial review of the issue-9 claim protocol, attack 4; failed on fa71058.
func TestCancelIsNotUndoneByARequestThatTookTheRunOver(t *testing.T) {
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

// Mallory's request claims a key acme's request then joins. Mallory
// cancels the key: her request is canceled, acme's build goes on and
// succeeds.
//
// Origin: issue 10, tenancy tests (fbfd804).
func TestCancelOfASharedBuildSparesOtherTenants(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Lease = time.Second })
	events := e.events()
	results := e.collect()
	m := mallorys("shared-cancel")
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(m, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	a := request("shared-cancel")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "acme's request to join", func() bool { return events.has(a.RequestID, v1.PhaseWaiting) })

	rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), key)
	if !rep.Canceled || rep.Requests != 1 || rep.Stopped {
		t.Fatalf("mallory's cancel: %+v", rep)
	}
	if mr := results.waitFor(t, 1, 10*time.Second)[0]; mr.ID != m.RequestID || mr.Data.Status != v1.StatusCanceled {
		t.Fatalf("first result %s", mustJSON(t, mr))
	}
	if e.jobGone(job.Name)() {
		t.Fatal("mallory's cancel deleted the job acme waits on")
	}
	// Acme's request takes the run over and adopts the Job.
	eventually(t, 10*time.Second, "the run to be taken over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Owner != ""
	})
	// The run pushes where its Job says (mallory's repository); acme's
	// request gets the image copied into its own.
	digest := tr.push(t, destination(job))
	e.kubelet(job, 0, digest)
	ar := byID(results.waitFor(t, 2, 15*time.Second))[a.RequestID]
	if len(ar) != 1 || ar[0].Data.Status != v1.StatusSucceeded || ar[0].Data.Digest != digest ||
		!strings.HasPrefix(ar[0].Data.Image, tr.host+"/acme/") {
		t.Fatalf("acme got %s", mustJSON(t, ar))
	}
}

// Origin: adversarial review of parking (docs/design.md §2c), invariant 3; fixed by 9f3c611.
func TestOtherTenantsParkedRequestOutlivesTheOwnersCancel(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w := e.startWorker("w1", withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	a := request("b-on-a")
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	b := mallorys("b-on-a")
	if v1.BuildKey(b, kanikoID) != key {
		t.Fatal("keys differ")
	}
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "B parked", func() bool { return parkedCount(t, w.w, key) == 1 })
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), a.RequestID)
	if !rep.Canceled || rep.Stopped {
		t.Fatalf("reply %+v", rep)
	}
	eventually(t, 15*time.Second, "B took the run over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Owner != "" && r.Holder == RequestIndexKey("mallory", b.RequestID)
	})
	e.kubelet(e.waitJob(job.Name), 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, []*v1.Request{a, b}, 20*time.Second)
	if d := storedOf(results, "acme", a.RequestID)[0].Data; d.Status != v1.StatusCanceled {
		t.Errorf("A: %s", decision(d))
	}
	if d := storedOf(results, "mallory", b.RequestID)[0].Data; d.Status != v1.StatusSucceeded {
		t.Errorf("B: %s", decision(d))
	}
}

type sliceLister struct{ ch chan string }

func (s sliceLister) Keys() <-chan string { return s.ch }

func (s sliceLister) Stop() error { return nil }

// slowList drains a waiter listing of filter, then waits (a slow KV
// answer, a GC pause) before the caller sees it.
type slowList struct {
	jetstream.KeyValue
	filter string
	armed  atomic.Bool
	delay  time.Duration
}

func (s *slowList) ListKeysFiltered(ctx context.Context, filters ...string) (jetstream.KeyLister, error) {
	l, err := s.KeyValue.ListKeysFiltered(ctx, filters...)
	if err != nil || !s.armed.Load() || len(filters) != 1 || !strings.HasSuffix(filters[0], s.filter) {
		return l, err
	}
	var keys []string
	for k := range l.Keys() {
		keys = append(keys, k)
	}
	_ = l.Stop()
	time.Sleep(s.delay)
	ch := make(chan string, len(keys))
	for _, k := range keys {
		ch <- k
	}
	close(ch)
	return sliceLister{ch}, nil
}

// slowRelease delays an owner's release of its run (a slow KV write).
type slowRelease struct {
	jetstream.KeyValue
	armed atomic.Bool
}

func (s *slowRelease) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	var r v1.BuildRecord
	if s.armed.Load() && json.Unmarshal(value, &r) == nil && r.State == v1.StateBuilding && r.Owner == "" {
		time.Sleep(3 * time.Second)
	}
	return s.KeyValue.Update(ctx, key, value, rev)
}

// Acme cancels its own request, which owns the run; mallory's request
// (same content) parks while the cancel service is between its waiter
// listing and stopBuild's compare-and-swap. The run ends failed/Canceled
// and answerWaiters answers mallory "canceled": sharedFailure() treats
// Canceled as a failure every waiter shares. Mallory never canceled.
//
// Origin: adversarial review of parking (docs/design.md §2c), invariants 2 and 4; fixed by 9f3c611.
func TestAnotherTenantsCancelNeverAnswersAParkedRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	a := request("cancel-race")
	key := v1.BuildKey(a, kanikoID)
	sl := &slowList{filter: "w." + key + ".*", delay: 1500 * time.Millisecond}
	sr := &slowRelease{}
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		sl.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(sl)
		sr.KeyValue = w.runs.Bucket()
		w.runs.UseBucket(sr)
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	sl.armed.Store(true)
	sr.armed.Store(true)
	done := make(chan v1.CancelReply, 1)
	go func() { done <- cancelRequest(t, e.nc, v1.APICancelSubject("acme"), a.RequestID) }()
	time.Sleep(200 * time.Millisecond) // the cancel service is listing waiters
	b := mallorys("cancel-race")
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	rep := <-done
	t.Logf("acme's cancel reply: %+v", rep)
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if rs := storedOf(results, "mallory", b.RequestID); len(rs) > 0 {
			if d := rs[0].Data; d.Status == v1.StatusCanceled {
				t.Fatalf("mallory's request, never canceled, was answered by acme's cancel: %s", decision(d))
			}
			return
		}
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil && len(j.Status.Conditions) == 0 && j.DeletionTimestamp == nil {
			e.kubelet(j, 0, tr.push(t, destination(j)))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("mallory got no result")
}

// A run's holder waits on it whether or not the waiter index lists it:
// the drop of a requeued request's old entry can race the new handler's
// registration, leaving the handler that runs the build unlisted. Another
// tenant's cancel by key then saw nobody else waiting and stopped the
// build under it (the simulation's "unexplained-cancel", seed 204).
func TestAnotherTenantsCancelSparesARunItsHolderIsNotListedFor(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	a := request("holder-unlisted")
	a.RequestID = "holder"
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	// The holder's waiter entry is gone (a requeue's late drop).
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, ledger.WaiterKey(key, a.Tenant, a.RequestID)); err != nil {
		t.Fatal(err)
	}
	m := mallorys("holder-unlisted")
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "mallory's request parked", func() bool { return e.parkedAs(key, m.Tenant, m.RequestID) })
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), key)
	if !rep.Canceled || rep.Requests != 1 || rep.Stopped {
		t.Fatalf("mallory's cancel: %+v; want her request canceled and acme's build going on", rep)
	}
	if e.jobGone(job.Name)() {
		t.Fatal("mallory's cancel deleted the job acme's request runs")
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := byID(results.waitFor(t, 2, 15*time.Second))
	if ar := got[a.RequestID]; len(ar) != 1 || ar[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme got %s", mustJSON(t, ar))
	}
}
