package worker

// Tenant API (worker/internal/tenantapi): cancel. A cancel by build key
// stops the run and answers every request of the tenant waiting on it; a
// cancel by request id answers that request only; either says what it did
// (docs/design.md §3).

import (
	"context"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

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

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
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

// A parked request is canceled at once: no handler holds it, the cancel
// service answers it, and the build goes on for its owner.
//
// Origin: parking, a request that joins a running build holds no slot (897c81b).
func TestCancelOfAParkedRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	r := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	owner := request("cancel-parked")
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(owner, "kaniko@"+testKaniko.ExecutorImage)))
	parked := request("cancel-parked")
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	// Parked: its waiter entry says so (a look at the stream alone may
	// come before the request was taken at all).
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		_, ackPending, _ := e.streamState()
		return ackPending == 1 && parkedCount(t, r.w, v1.BuildKey(owner, "kaniko@"+testKaniko.ExecutorImage)) == 1
	})
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), parked.RequestID)
	if !rep.Canceled || rep.Stopped {
		t.Fatalf("cancel reply %+v", rep)
	}
	got := results.waitFor(t, 1, 10*time.Second)
	if got[0].Data.RequestID != parked.RequestID || got[0].Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s", mustJSON(t, got[0]))
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got = results.waitFor(t, 2, 10*time.Second)
	if got[1].Data.RequestID != owner.RequestID || got[1].Data.Status != v1.StatusSucceeded {
		t.Fatalf("owner's result %s", mustJSON(t, got[1]))
	}
	time.Sleep(300 * time.Millisecond)
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the canceled request was published %d times", n)
	}
}

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
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
//
// Origin: adversarial review of the issue-9 claim protocol, attack 5; failed on fa71058.
func TestCancelOfAFinishedRequestSparesTheNextRun(t *testing.T) {
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

// Request ids may be any [A-Za-z0-9][A-Za-z0-9_.:-]* up to 128 characters,
// so 64 lowercase hex digits (a sha256 a producer uses as its id) are a
// valid request id. cancel() decides "key or request id" by IsBuildKey
// alone, so such an id is looked up as a build key: "no build is known",
// and the request's build runs on.
//
// Breaks the cancel contract (payload: build key or requestId) for valid
// ids. `buildq status` has the same ambiguity (cmd/buildq).
//
// Origin: adversarial review of the issue-9 claim protocol, attack 10; failed on fa71058.
func TestRequestIDThatLooksLikeAKeyCanBeCanceled(t *testing.T) {
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

// A request canceled while its build runs gives its slot back only once
// its Job is gone: the cancel tells the handler first and deletes the Job
// after, and until then the build would run beside the request the slot
// lets in, over its tenant's concurrency limit (make soak, seed 323).
func TestACanceledBuildsSlotComesBackOnceItsJobIsGone(t *testing.T) {
	t.Parallel()
	e := setup(t)
	slow := slowCreates{Interface: e.kube, holdDelete: func(string) { time.Sleep(500 * time.Millisecond) }}
	// Recording first, the handler publishes "canceled" as it gives its
	// slot back; publishing first, the cancel does (the slot's handler
	// code is the same).
	e.startWorkerHooked("w1", recordFirst, slow, nil)
	results := e.collect()
	r := request("cancel-slot")
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(r, kanikoID)))
	replied := make(chan error, 1)
	go func() {
		_, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), r.RequestID, 30*time.Second)
		replied <- err
	}()
	got := results.waitFor(t, 1, 10*time.Second)[0]
	_, err := e.kube.BatchV1().Jobs(testKaniko.Namespace).Get(context.Background(), job.Name, metav1.GetOptions{})
	if rerr := <-replied; rerr != nil {
		t.Errorf("cancel: %v", rerr)
	}
	if got.Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s, want canceled", mustJSON(t, got))
	}
	if !apierrors.IsNotFound(err) {
		t.Fatalf("the canceled request was answered (its slot given back) while its Job was still there (get: %v)", err)
	}
}
