package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// The stall the issue describes: 3 workers × 2 slots, 6 identical
// requests, then one different one, the first Job held. Joiners park, so
// the different request is taken and built while the first build runs,
// and every duplicate gets its answer when that build ends.
func TestDuplicatesOfARunningBuildHoldNoSlot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for i := range 3 {
		e.startWorker(fmt.Sprintf("w%d", i), func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = 2
		})
	}
	results := e.collect()
	ctx := context.Background()
	for range 6 {
		if _, err := e.pub.Publish(ctx, request("held")); err != nil {
			t.Fatal(err)
		}
	}
	held := e.waitJob(kaniko.JobName(v1.BuildKey(request("held"), "kaniko@"+testKaniko.ExecutorImage)))
	// Every duplicate parks: nothing holds a message while the build runs
	// except its owner.
	eventually(t, 10*time.Second, "the duplicates parked, only the owner's message in flight", func() bool {
		_, ackPending, _ := e.streamState()
		return ackPending == 1
	})
	other := request("other")
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	otherJob := e.waitJob(kaniko.JobName(v1.BuildKey(other, "kaniko@"+testKaniko.ExecutorImage)))
	e.kubelet(otherJob, 0, tr.push(t, destination(otherJob)))
	got := results.waitFor(t, 1, 10*time.Second)
	if got[0].Data.Key != v1.BuildKey(other, "kaniko@"+testKaniko.ExecutorImage) || got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("the different request was not answered first: %s", mustJSON(t, got[0]))
	}

	e.kubelet(held, 0, tr.push(t, destination(held)))
	got = results.waitFor(t, 7, 15*time.Second)
	origins := map[v1.Origin]int{}
	for _, r := range got {
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if r.Data.Key == held.Annotations[kaniko.AnnotationKey] || r.Data.Key != got[0].Data.Key {
			origins[r.Data.Origin]++
		}
	}
	if origins[v1.OriginBuild] != 1 || origins[v1.OriginInflight] != 5 {
		t.Fatalf("held key's origins %v, want 1 build and 5 inflight", origins)
	}
	if n := e.creates.total(); n != 2 {
		t.Fatalf("%d Jobs created, want 2", n)
	}
	eventually(t, 10*time.Second, "the queue empty", func() bool {
		msgs, ackPending, _ := e.streamState()
		return msgs == 0 && ackPending == 0
	})
	time.Sleep(500 * time.Millisecond)
	for _, r := range got {
		if n := results.publishes(r.Data.RequestID); n != 1 {
			t.Fatalf("request %s published %d times", r.Data.RequestID, n)
		}
	}
}

// A parked request whose run failed for a reason of its claimer's own
// request (here the claimer's shorter timeout) is requeued and built with
// its own inputs, not answered with the claimer's failure.
func TestParkedRequestIsRequeuedOnTheClaimersOwnFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	short := request("timeouts")
	short.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, short); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(short, "kaniko@"+testKaniko.ExecutorImage)
	first := e.waitJob(kaniko.JobName(key))
	long := request("timeouts")
	long.Timeout = v1.Duration{Duration: time.Hour}
	if _, err := e.pub.Publish(ctx, long); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		_, ackPending, _ := e.streamState()
		return ackPending == 1
	})
	// The first run ends past its deadline.
	deadlineExceeded(t, e, first)
	// No Pod shows the end: the backend waits its grace for one first.
	got := results.waitFor(t, 1, 30*time.Second)
	if got[0].Data.RequestID != short.RequestID || got[0].Data.Reason != v1.ReasonDeadlineExceeded {
		t.Fatalf("first result %s", mustJSON(t, got[0]))
	}
	// The parked request builds anew: a second Job of the key.
	var second = first
	eventually(t, 10*time.Second, "a new Job for the requeued request", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.UID == first.UID {
			return false
		}
		second = j
		return true
	})
	e.kubelet(second, 0, tr.push(t, destination(second)))
	got = results.waitFor(t, 2, 10*time.Second)
	if got[1].Data.RequestID != long.RequestID || got[1].Data.Status != v1.StatusSucceeded || got[1].Data.Origin != v1.OriginBuild {
		t.Fatalf("the parked request's result %s", mustJSON(t, got[1]))
	}
}

// A parked request is canceled at once: no handler holds it, the cancel
// service answers it, and the build goes on for its owner.
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

// The owner's worker is dead while requests are parked on its run (its
// claim is never renewed): the sweep sees the run lapse, lets it go and
// requeues the parked requests; one of them takes the run over, and all
// are answered by that one run.
func TestParkedRequestsOutliveADeadOwner(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()
	req := request("dead-owner")
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	w := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	dest := tr.host + "/acme/web:" + v1.DefaultTag(key)
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		RequestID: "gone", Tenant: "acme", Name: "web", Holder: "gone",
		Repository: tr.host + "/acme/web", Destinations: []string{dest}})
	if _, err := w.w.runs.Bucket().Put(ctx, key, rec); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := e.pub.Publish(ctx, request("dead-owner")); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "three requests parked", func() bool {
		items, err := w.w.ledger.ListWaiters(ctx, key)
		n := 0
		for _, it := range items[key] {
			if it.V.Parked {
				n++
			}
		}
		_, ackPending, _ := e.streamState()
		return err == nil && n == 3 && ackPending == 0
	})
	job := e.waitJob(kaniko.JobName(key)) // after the lapse: the run taken over
	if job.Annotations[kaniko.AnnotationRun] != "dead-run" {
		t.Fatalf("the take-over ran another run: %q", job.Annotations[kaniko.AnnotationRun])
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 3, 15*time.Second)
	for _, r := range got {
		if r.Data.Status != v1.StatusSucceeded || r.Data.Key != key {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d Jobs created, want 1", n)
	}
}
