package worker

// Fair queue (worker/internal/fairq), concurrency slots: a slot is kept for
// its request while the request's build may run — handed back at
// shutdown, after its holder was killed, while the request waits for a
// retry — and is given to no other request meanwhile (docs/design.md §2d).
// A review's test tells the attack as it worked before its fix; it asserts
// the fixed outcome.

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
)

// Worker stopped at the worst moment (a rolling update). At shutdown the
// handler of acme's running build hands its request back (Nak) and lets
// the run go, but the run's Job keeps running in the cluster, waiting to
// be taken over; the deferred tk.slot.release() frees acme's only slot
// (limit 1) at once all the same. Another worker's dispatcher takes the
// slot for acme's next request — a high-priority one is fetched before the
// handed-back normal one — and creates a second Job: acme runs two builds
// with a limit of 1, for as long as the new build takes, with no worker
// paused. (The commit's purpose: "nothing bounded a tenant's running
// builds".)
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestHandBackAtShutdownKeepsTheSlotWhileItsJobRuns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 1}
	}
	w1 := e.startWorker("w1", limit)
	ctx := context.Background()
	names := map[string]string{}
	r1 := tenantRequest("acme", "handback-normal")
	names[jobOf(r1)] = "acme"
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	e.startWorker("w2", limit)
	r2 := tenantRequest("acme", "handback-high")
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	time.Sleep(300 * time.Millisecond)
	if n := e.running(names)["acme"]; n != 1 {
		t.Fatalf("acme runs %d builds before the shutdown", n)
	}
	w1.stop(t)
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		js := e.jobs()
		_, j1 := js[jobOf(r1)]
		_, j2 := js[jobOf(r2)]
		if j1 && j2 {
			t.Fatalf("acme runs two builds at once (%s, handed back but still running, and %s), its concurrency limit is 1",
				jobOf(r1), jobOf(r2))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Worker stopped while the cluster is busy (a rolling update under load,
// exactly when fair queueing matters). w1 runs acme's r1 (acme's limit: 1)
// and stops: the handler hands r1 back, its Job runs on, and slot.handBack
// marks acme.0 "handed back" — but nothing renews that key, and the bucket's
// TTL is the lease. w2, the other worker, has no free build slot, so its
// dispatcher does not look at acme for longer than a lease: the handed-back
// key aged out. When w2 freed a slot it found acme.0 free, created it
// (prefer ""), and takes acme's highest-priority request first — r2 (high),
// not the handed-back r1 (normal) — and creates r2's Job while r1's, handed
// back, still runs: acme runs two builds with a limit of 1, no worker
// paused. (Same with one worker whose replacement takes longer than the
// lease to start.)
//
// Origin: second adversarial review of fair queueing; failed on db0cecb, fixed by 3fd2295.
func TestHandedBackSlotOutlivesTheLeaseWhileItsBuildRuns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(inFlight int) func(*Config) {
		return func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = inFlight
			c.Fair.Concurrency = map[string]int{"acme": 1}
		}
	}
	ctx := context.Background()
	// w2 (one build slot) is busy with globex's build.
	e.startWorker("w2", limit(1))
	g := tenantRequest("globex", "keeps-w2-busy")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	gj := e.waitJob(jobOf(g))
	w1 := e.startWorker("w1", limit(4))
	r1 := tenantRequest("acme", "handed-back-normal")
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	r2 := tenantRequest("acme", "next-high")
	r2.Priority = v1.PriorityHigh
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(3)
	w1.stop(t)
	kv, err := e.js.KeyValue(ctx, v1.SlotsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if en, err := kv.Get(ctx, "acme.0"); err != nil || !strings.Contains(string(en.Value()), `"handedBack":true`) {
		t.Fatalf("acme.0 after w1's stop: %v %v, want handed back", en, err)
	}
	// Longer than the lease (2 s) while w2 is busy: nobody takes the slot.
	time.Sleep(3 * time.Second)
	if _, ok := e.jobs()[jobOf(r1)]; !ok {
		t.Fatal("r1's Job is gone: the premise (its build runs on after the hand-back) does not hold")
	}
	// The workers keep a handed-back slot while its request is queued.
	if en, err := kv.Get(ctx, "acme.0"); err != nil || !strings.Contains(string(en.Value()), `"handedBack":true`) {
		t.Fatalf("acme.0 after a lease: %v %v, want still handed back", en, err)
	}
	e.kubelet(gj, 0, tr.push(t, destination(gj)))
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		js := e.jobs()
		_, j1 := js[jobOf(r1)]
		_, j2 := js[jobOf(r2)]
		if j1 && j2 {
			t.Fatalf("acme runs two builds at once (%s, handed back and still running, and %s), its concurrency limit is 1: "+
				"the handed-back slot aged out after one lease while no worker had a free build slot", jobOf(r1), jobOf(r2))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// killWorker is SIGKILL: the worker's connection drops before anything is
// handed back or released, then it stops.
func killWorker(r *runningWorker) {
	r.w.nc.Close()
	r.cancel()
	<-r.done
}

// w1 runs acme's r1 (limit 1) and is killed. The dispatch consumer's
// AckWait (6 s) is longer than the lease (2 s): the slot key aged out
// after the lease (the bucket's TTL) while r1's Job ran on and r1 was not
// redelivered yet, and w2 took the slot for r2 — two Jobs at once.
//
// Origin: issue 24, defect 3 (a killed worker's running Job escaped the limit).
func TestKilledHoldersSlotOutlivesTheLeaseWhileItsJobRuns(t *testing.T) {
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
	r1, r2, names := holderAndNext(t, e, "i24-killed-holder", "i24-next", func() { e.startWorker("w2", cfg) })
	killWorker(w1)
	// Past the lease, past r1's redelivery and w2's take-over of its run.
	neverTwoAtOnce(t, e, names, 12*time.Second, "the killed holder's slot was given to another request while its Job ran")
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
//
// Origin: issue 24, defect 3 (a killed worker's running Job escaped the limit).
func TestRetriedRequestKeepsItsSlotWhileItsJobRuns(t *testing.T) {
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
	neverTwoAtOnce(t, e, names, 6*time.Second, "a request retried after transient trouble released its slot while its Job ran")
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
