package worker

// Helpers for tests of parked requests and their answers: what was stored
// and published per request, who is parked, and the world of a parked
// request requeued from a dead owner's run.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

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

// pubsOf returns every publish of tenant's request id's result.
func (c *resultCollector) pubsOf(tenant, id string) []v1.ResultData {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]v1.ResultData(nil), c.published[v1.MsgID(tenant, id)]...)
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

// parkBehind publishes owner, waits until w1 holds the claim on key and
// its Job exists, then publishes parked and waits until it parked on that
// run with its ack lost (lost set by the worker's loseAck fault). It
// returns the owner's Job.
func (e *env) parkBehind(owner, parked *v1.Request, key string, lost *atomic.Bool) *batchv1.Job {
	e.t.Helper()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		e.t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(e.t, 5*time.Second, "the claim held", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		e.t.Fatal(err)
	}
	eventually(e.t, 5*time.Second, "the request parked, its ack lost", func() bool {
		return e.isParked(key, parked.RequestID) && lost.Load()
	})
	return job
}

// isParked reports whether acme's request id has a parked waiter entry on
// key.
func (e *env) isParked(key, id string) bool {
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return false
	}
	ent, err := kv.Get(ctx, ledger.WaiterKey(key, "acme", id))
	if err != nil {
		return false
	}
	v, ok := ledger.ParseWaiter(ent.Value())
	return ok && v.Parked
}

// parkedAs reports whether tenant's request id is parked on key.
func (e *env) parkedAs(key, tenant, id string) bool {
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return false
	}
	ent, err := kv.Get(ctx, ledger.WaiterKey(key, tenant, id))
	if err != nil {
		return false
	}
	v, ok := ledger.ParseWaiter(ent.Value())
	return ok && v.Parked
}

// ownerAndParked is two requests for one build key: the first claims it,
// the second parks on its run.
func ownerAndParked(seed, ownerID, parkedID string) (owner, parked *v1.Request, key string) {
	owner, parked = request(seed), request(seed)
	owner.RequestID, parked.RequestID = ownerID, parkedID
	return owner, parked, v1.BuildKey(owner, kanikoID)
}

// requeueWorld is a world for a requeued parked request: the env, its
// registry, acme's request id (also its content), its build key and its
// ledger key.
func requeueWorld(t *testing.T, id string) (*env, *testRegistry, *v1.Request, string, string) {
	t.Helper()
	e := setup(t)
	req := request(id)
	req.RequestID = id
	return e, newTestRegistry(t), req, v1.BuildKey(req, kanikoID), RequestIndexKey("acme", req.RequestID)
}

// putDeadRun stores a build record of key whose owner is dead: a request
// of the key parks on it, and the waiter sweep lets the run go after 1.5
// leases and requeues the parked request, which then takes the run over.
func putDeadRun(t *testing.T, w *Worker, tr *testRegistry, key string) {
	t.Helper()
	dest := tr.host + "/acme/web:" + v1.DefaultTag(key)
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		RequestID: "gone", Tenant: "acme", Name: "web", Holder: "gone",
		Repository: tr.host + "/acme/web", Destinations: []string{dest}})
	if _, err := w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
}

// waitParked waits until tenant acme's request id is parked on key.
func waitParked(t *testing.T, w *Worker, key, id string) {
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

// playUntilAnswered plays the node for every Job of key until tenant acme's
// request id has a stored result, and returns it.
func playUntilAnswered(t *testing.T, e *env, tr *testRegistry, results *resultCollector, key, id string, timeout time.Duration) v1.Result {
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
