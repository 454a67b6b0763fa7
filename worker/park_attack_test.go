package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// Adversarial tests of parking (docs/design.md §2c).

// pubsOf returns every publish of tenant's request id's result.
func (c *resultCollector) pubsOf(tenant, id string) []v1.ResultData {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]v1.ResultData(nil), c.published[v1.MsgID(tenant, id)]...)
}

// storedOf returns the stored results of tenant's request id.
func storedOf(c *resultCollector, tenant, id string) []v1.Result {
	var out []v1.Result
	for _, r := range c.snapshot() {
		if r.ID == id && r.Data.Tenant == tenant {
			out = append(out, r)
		}
	}
	return out
}

// parkedCount counts the parked waiter entries of key.
func parkedCount(_ *testing.T, w *Worker, key string) int {
	items, err := w.ledger.ListWaiters(context.Background(), key)
	if err != nil {
		return -1
	}
	n := 0
	for _, it := range items[key] {
		if it.V.Parked {
			n++
		}
	}
	return n
}

// assertEnd checks invariants 1, 3 and 5 for reqs: one stored result
// each, every publish with one decision, the queue empty, no Job left.
func assertEnd(t *testing.T, e *env, results *resultCollector, reqs []*v1.Request, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		missing := 0
		for _, r := range reqs {
			if len(storedOf(results, r.Tenant, r.RequestID)) == 0 {
				missing++
			}
		}
		if missing == 0 {
			break
		}
		if time.Now().After(deadline) {
			for _, r := range reqs {
				if len(storedOf(results, r.Tenant, r.RequestID)) == 0 {
					t.Errorf("STRANDED: request %s/%s has no result", r.Tenant, r.RequestID)
				}
			}
			t.Fatalf("%d of %d requests have no result after %s", missing, len(reqs), timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	eventually(t, 10*time.Second, "the queue empty", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	time.Sleep(500 * time.Millisecond)
	for _, r := range reqs {
		if n := len(storedOf(results, r.Tenant, r.RequestID)); n != 1 {
			t.Errorf("request %s/%s: %d stored results", r.Tenant, r.RequestID, n)
		}
		ps := results.pubsOf(r.Tenant, r.RequestID)
		for _, p := range ps[1:] {
			if decision(p) != decision(ps[0]) {
				t.Errorf("request %s/%s: two decisions: %s / %s", r.Tenant, r.RequestID, decision(ps[0]), decision(p))
			}
		}
	}
	eventually(t, 10*time.Second, "no Job left", func() bool {
		jobs, _ := e.kube.BatchV1().Jobs(testNamespace).List(context.Background(), metav1.ListOptions{})
		return len(jobs.Items) == 0
	})
}

// ---- invariant 4: forged requeue ids ----

// Mallory knows acme's (caller-chosen, deterministic) request id. The
// requeue's Nats-Msg-Id is "acme/<id>/requeue-<ledger revision>": no
// nonce, and the revision is a small counter. Mallory sprays those
// headers on her own subject (refused as invalid, but JetStream keeps
// each id in BUILDQ_REQUESTS's duplicate window, stream-wide). When
// acme's parked request is requeued, JetStream drops the republish as a
// duplicate, requeue() deletes the waiter entry anyway: acme's request is
// stranded without a result.
func TestAttackParkForgedRequeueIDStrandsAnotherTenant(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	short := request("forged-requeue")
	short.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, short); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(short, kanikoID)
	first := e.waitJob(kaniko.JobName(key))
	victim := request("forged-requeue")
	victim.RequestID = "deploy-1234" // a deterministic id
	victim.Timeout = v1.Duration{Duration: time.Hour}
	if _, err := e.pub.Publish(ctx, victim); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's request parked", func() bool { return parkedCount(t, w.w, key) == 1 })

	// Mallory sprays a blind range of revisions (she cannot read the
	// ledger): 1..400 covers a young bucket; a real attack sprays wider
	// and repeats within the 10 m window.
	m := mallorys("spray")
	m.APIVersion, m.RequestID = v1.APIVersion, "spray"
	body, _ := json.Marshal(m)
	for n := 1; n <= 400; n++ {
		msg := nats.NewMsg(v1.RequestSubject("mallory"))
		msg.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", victim.RequestID)+"/requeue-"+strconv.Itoa(n))
		msg.Data = body
		if _, err := e.js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	// The claimer's own deadline ends the run: the victim is requeued.
	deadlineExceeded(t, e, first)
	eventually(t, 30*time.Second, "the short request's result", func() bool {
		return len(storedOf(results, "acme", short.RequestID)) == 1
	})
	// Let the victim's rebuild finish (its requeue holds a message until
	// then; mallory's spray is refused meanwhile).
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && len(storedOf(results, "acme", victim.RequestID)) == 0 {
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil && j.UID != first.UID && len(j.Status.Conditions) == 0 {
			e.kubelet(j, 0, tr.push(t, destination(j)))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(storedOf(results, "acme", victim.RequestID)) == 0 {
		le, _ := w.w.ledger.Get(ctx, "acme", victim.RequestID)
		t.Fatalf("STRANDED: acme's parked request %s has no result; ledger %+v, parked waiters %d, queue empty",
			victim.RequestID, le.E, parkedCount(t, w.w, key))
	}
}

// ---- invariant 3: a requeue across an executor upgrade ----

// Rolling upgrade of the kaniko executor image: the old worker owns a run,
// a request is parked on it; the old worker stops (release, requeue). The
// new worker computes another build key for the requeued body than its
// ledger entry holds, and process() refuses it as a "duplicate": it is
// terminated without a result. The owner's own request (not a requeue)
// builds on under the new key.
func TestAttackParkRequeueAcrossExecutorUpgradeIsDropped(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	old := e.startWorker("old", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	owner := request("upgrade")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(owner, kanikoID)
	e.waitJob(kaniko.JobName(key))
	parked := request("upgrade")
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a request parked", func() bool { return parkedCount(t, old.w, key) == 1 })

	kc := testKaniko
	kc.ExecutorImage = "gcr.io/kaniko-project/executor@sha256:" + hex64("executor-v2")
	e.startWorkerWith("new", kc, withRegistry(tr))
	old.stop(t)
	newKey := v1.BuildKey(owner, "kaniko@"+kc.ExecutorImage)
	job := e.waitJob(kaniko.JobName(newKey))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	eventually(t, 15*time.Second, "the owner's result", func() bool {
		return len(storedOf(results, "acme", owner.RequestID)) == 1
	})
	time.Sleep(3 * time.Second)
	if len(storedOf(results, "acme", parked.RequestID)) == 0 {
		msgs, pending, _ := e.streamState()
		t.Fatalf("STRANDED: the parked request %s has no result after the upgrade (queue msgs=%d pending=%d)",
			parked.RequestID, msgs, pending)
	}
}

// ---- invariant 3: the owner's worker stops (SIGTERM) ----

func TestAttackParkOwnerWorkerStops(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ws := map[string]*runningWorker{}
	for _, id := range []string{"w1", "w2"} {
		ws[id] = e.startWorker(id, withRegistry(tr))
	}
	results := e.collect()
	ctx := context.Background()
	owner := request("sigterm")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(owner, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	reqs := []*v1.Request{owner}
	for range 4 {
		r := request("sigterm")
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	eventually(t, 10*time.Second, "4 parked", func() bool { return parkedCount(t, ws["w1"].w, key) == 4 })
	rec := e.claim(key)
	other := "w1"
	if rec.Owner == "w1" {
		other = "w2"
	}
	ws[rec.Owner].stop(t)
	eventually(t, 15*time.Second, "the run taken over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Owner == other
	})
	e.kubelet(e.waitJob(job.Name), 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, reqs, 20*time.Second)
	for _, r := range reqs {
		if d := storedOf(results, "acme", r.RequestID)[0].Data; d.Status != v1.StatusSucceeded {
			t.Errorf("request %s: %s", r.RequestID, decision(d))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Errorf("%d Jobs created, want 1", n)
	}
}

// ---- invariant 3: tenant B parks on tenant A's build, A cancels ----

func TestAttackParkOtherTenantParksAndOwnerCancels(t *testing.T) {
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

// ---- invariant 3/1: 50 duplicates, 3 workers × 2 slots ----

func TestAttackParkFiftyDuplicates(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var w *runningWorker
	for i := range 3 {
		r := e.startWorker(fmt.Sprintf("w%d", i), func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = 2
		})
		if w == nil {
			w = r
		}
	}
	results := e.collect()
	ctx := context.Background()
	var reqs []*v1.Request
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := request("fifty")
			if _, err := e.pub.Publish(ctx, r); err != nil {
				t.Error(err)
			}
			mu.Lock()
			reqs = append(reqs, r)
			mu.Unlock()
		}()
	}
	wg.Wait()
	key := v1.BuildKey(reqs[0], kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 20*time.Second, "49 parked", func() bool { return parkedCount(t, w.w, key) == 49 })
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, reqs, 30*time.Second)
	for _, r := range reqs {
		if d := storedOf(results, "acme", r.RequestID)[0].Data; d.Status != v1.StatusSucceeded {
			t.Errorf("request %s: %s", r.RequestID, decision(d))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Errorf("%d Jobs created, want 1", n)
	}
}

// ---- invariant 3: a Job deleted under parked requests ----

func TestAttackParkJobDeleted(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w, watcher := e.startWorkerWith("w1", testKaniko, withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	owner := request("job-deleted")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(owner, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	reqs := []*v1.Request{owner}
	for range 3 {
		r := request("job-deleted")
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	eventually(t, 10*time.Second, "3 parked", func() bool { return parkedCount(t, w.w, key) == 3 })
	eventually(t, 5*time.Second, "cache has the job", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
	time.Sleep(300 * time.Millisecond)
	bg := metav1.DeletePropagationBackground
	if err := e.kube.BatchV1().Jobs(testNamespace).Delete(ctx, job.Name, metav1.DeleteOptions{PropagationPolicy: &bg}); err != nil {
		t.Fatal(err)
	}
	assertEnd(t, e, results, reqs, 30*time.Second)
	for _, r := range reqs {
		t.Logf("%s: %s", r.RequestID, decision(storedOf(results, "acme", r.RequestID)[0].Data))
	}
}

// ---- invariant 3/2: a requeued request's own build fails ----

func TestAttackParkRequeuedRequestsOwnBuildFails(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w := e.startWorker("w1", withRegistry(tr))
	e.startWorker("w2", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	short := request("requeued-fails")
	short.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, short); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(short, kanikoID)
	first := e.waitJob(kaniko.JobName(key))
	var longs []*v1.Request
	for range 3 {
		l := request("requeued-fails")
		l.Timeout = v1.Duration{Duration: time.Hour}
		if _, err := e.pub.Publish(ctx, l); err != nil {
			t.Fatal(err)
		}
		longs = append(longs, l)
	}
	eventually(t, 10*time.Second, "3 parked", func() bool { return parkedCount(t, w.w, key) == 3 })
	deadlineExceeded(t, e, first)
	var second = first
	eventually(t, 30*time.Second, "a new Job for a requeued request", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.UID == first.UID {
			return false
		}
		second = j
		return true
	})
	// The other two requeued requests park on the new run (a request
	// handled after the run failed would build again, as a new run).
	eventually(t, 20*time.Second, "2 parked on the new run", func() bool {
		run := e.claim(key)
		items, err := w.w.ledger.ListWaiters(ctx, key)
		if run == nil || err != nil {
			return false
		}
		n := 0
		for _, it := range items[key] {
			if it.V.Parked && it.V.Run == run.Run {
				n++
			}
		}
		return n == 2
	})
	// Its own build fails (content): every long request shares it.
	e.kubelet(second, 1, "")
	assertEnd(t, e, results, append([]*v1.Request{short}, longs...), 30*time.Second)
	if d := storedOf(results, "acme", short.RequestID)[0].Data; d.Reason != v1.ReasonDeadlineExceeded {
		t.Errorf("short: %s", decision(d))
	}
	for _, l := range longs {
		if d := storedOf(results, "acme", l.RequestID)[0].Data; d.Status != v1.StatusFailed || d.Reason == v1.ReasonDeadlineExceeded {
			t.Errorf("long %s: %s", l.RequestID, decision(d))
		}
	}
	if n := e.creates.total(); n != 2 {
		t.Errorf("%d Jobs created, want 2", n)
	}
}

// ---- invariant 2/4: a forged requeue sequence makes mallory "the claimer" ----

// mine() (build.go) and own()'s origin compare a record's RequestID and
// Seq, not its tenant. The requeue headers let mallory choose the Seq her
// ledger entry holds: with acme's (caller-chosen) request id, acme's
// message sequence (bracketed by her own PubAcks) and the same content
// (the documented capability), her request is taken for the claimer of
// acme's failed run and answered with acme's own-input failure
// (DeadlineExceeded of acme's 1-minute timeout, although she asked for
// 2 h), origin "build", and she "owns" the run's clean-up.
func TestAttackParkForgedRequeueSeqTakesAnotherTenantsFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	probe := mallorys("bracket")
	ack0, err := e.pub.Publish(ctx, probe)
	if err != nil {
		t.Fatal(err)
	}
	a := request("forged-seq")
	a.RequestID = "release-42"
	a.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	guess := ack0.Sequence + 1 // mallory's guess of acme's sequence
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	deadlineExceeded(t, e, job)
	eventually(t, 30*time.Second, "acme's result", func() bool { return len(storedOf(results, "acme", a.RequestID)) == 1 })

	m := mallorys("forged-seq")
	m.APIVersion, m.RequestID = v1.APIVersion, a.RequestID
	m.Timeout = v1.Duration{Duration: 2 * time.Hour}
	body, _ := json.Marshal(m)
	msg := nats.NewMsg(v1.RequestSubject("mallory"))
	msg.Header.Set(v1.MsgIDHeader, v1.MsgID("mallory", m.RequestID)+"/requeue-1")
	// The token is the worker's secret: mallory can only guess one (and
	// the sequence she would have claimed is no header any more).
	msg.Header.Set(ledger.RequeueTokenHeader, fmt.Sprintf("%032d", guess))
	msg.Data = body
	if _, err := e.js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if rs := storedOf(results, "mallory", m.RequestID); len(rs) > 0 {
			if d := rs[0].Data; d.Reason == v1.ReasonDeadlineExceeded {
				t.Fatalf("mallory (timeout 2h) was answered with acme's own-input failure: %s (message %q)", decision(d), d.Message)
			}
			return
		}
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil && j.UID != job.UID && len(j.Status.Conditions) == 0 {
			e.kubelet(j, 0, tr.push(t, destination(j)))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("mallory got no result")
}

// ---- invariant 1: a second, different result for one's own id ----

// invalidEntry records no ledger entry for a message without a
// Nats-Msg-Id header, but invalid() still takes the id from its body: a
// tenant that resubmits a decided id without the header gets a second,
// different result published under the same Nats-Msg-Id.
func TestAttackHeaderlessResubmitGivesASecondResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	m := mallorys("headerless")
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(m, kanikoID)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	eventually(t, 10*time.Second, "the result", func() bool { return len(storedOf(results, "mallory", m.RequestID)) == 1 })
	body, _ := json.Marshal(m)
	if err := e.nc.Publish(v1.RequestSubject("mallory"), body); err != nil { // core publish: no header
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	ps := results.pubsOf("mallory", m.RequestID)
	for _, p := range ps[1:] {
		if decision(p) != decision(ps[0]) {
			t.Fatalf("request %s: two different results published: %s / %s", m.RequestID, decision(ps[0]), decision(p))
		}
	}
}

// ---- invariant 2/4: another tenant's cancel answers a parked request ----

type sliceLister struct{ ch chan string }

func (s sliceLister) Keys() <-chan string { return s.ch }
func (s sliceLister) Stop() error         { return nil }

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
func TestAttackParkOtherTenantsCancelAnswersAParkedRequest(t *testing.T) {
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
