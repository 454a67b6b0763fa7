package worker

// Backend (backend.go): a run's Job is its own. A new run never adopts an
// earlier run's Job, a stale owner never deletes the current run's, a
// clean-up touches only its own run's, and a Job deleted or gone before
// the worker saw it fails its run once (docs/design.md §2 step 5).

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// A retry of a failed key whose first Job create fails must not adopt the
// earlier run's failed Job when it is redelivered.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestRetryNeverAdoptsAnEarlierRunsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.KeepJobs = true })
	results := e.collect()
	creates := e.failJobCreates(func(n int64) bool { return n == 2 }) // R2's first create: 500

	r1 := request("retry-adopts")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(r1, kanikoID))
	e.kubelet(e.waitJob(name), 1, "error building image: flaky base")
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusFailed {
		t.Fatalf("first %s", mustJSON(t, r))
	}
	r2 := request("retry-adopts")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	// The redelivered R2 must replace R1's kept Job with its own.
	eventually(t, 20*time.Second, "R2's own job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && j.Annotations[kaniko.AnnotationRequestID] == r2.RequestID
	})
	e.kubelet(e.waitJob(name), 0, digestOf("retried"))
	r := results.waitFor(t, 2, 20*time.Second)[1]
	if r.ID != r2.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digestOf("retried") {
		t.Fatalf("R2 got %s (job creates attempted: %d)", mustJSON(t, r), creates.Load())
	}
}

// Origin: stranded hand-backs and stale Job adoption (ebcc535).
func TestRetryAfterFailureReplacesTheFinishedJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.KeepJobs = true })
	results := e.collect()

	first := request("retry-after-failure")
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(first, "kaniko@"+testKaniko.ExecutorImage))
	e.kubelet(e.waitJob(name), 1, "error building image: flaky base")
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusFailed {
		t.Fatalf("first %s", mustJSON(t, r))
	}
	// The failed Job is still there (kept). A new request for the key is a
	// fresh build: it must not adopt the old failure.
	second := request("retry-after-failure")
	if _, err := e.pub.Publish(context.Background(), second); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a second job", func() bool { return e.creates.total() == 2 })
	e.kubelet(e.waitJob(name), 0, digestOf("retried"))
	r := results.waitFor(t, 2, 10*time.Second)[1]
	if r.ID != second.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Digest != digestOf("retried") {
		t.Fatalf("second %s", mustJSON(t, r))
	}
}

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
//
// Origin: adversarial review of the issue-9 claim protocol, attack 1; failed on fa71058.
func TestStaleOwnerNeverDeletesTheCurrentRunsJob(t *testing.T) {
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

// Cleanup stops only its own run's Job, never a newer run's of the key.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestCleanupTouchesOnlyItsOwnRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, watcher := e.startWorkerWith("w1", testKaniko, nil)
	backend, err := NewKubeBackend(e.kube, watcher, testKaniko)
	if err != nil {
		t.Fatal(err)
	}
	req := request("cleanup-run")
	key := v1.BuildKey(req, kanikoID)
	job, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Destinations: []string{"registry.test:5000/acme/web:x"}, Run: "newer"}, testKaniko.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Create(context.Background(), job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the job in the cache", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
	for _, run := range []string{"older", ""} {
		if err := backend.Cleanup(context.Background(), key, run); err != nil {
			t.Fatal(err)
		}
		if e.jobGone(job.Name)() {
			t.Fatalf("cleanup of run %q deleted the newer run's job", run)
		}
	}
	if err := backend.Cleanup(context.Background(), key, "newer"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the run's own job to be deleted", e.jobGone(job.Name))
}

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
func TestJobDeletedWhileRunningFails(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, watcher := e.startWorkerWith("w1", testKaniko, nil)
	results := e.collect()

	req := request("deleted-job")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	// The worker is watching it; then someone deletes it.
	eventually(t, 5*time.Second, "the worker's cache has the job", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
	// The build goroutine reads the cache when the informer signals it;
	// nothing shows from outside that it has. A delete before that read is
	// TestJobGoneBeforeTheWorkerSawItFails (a hang, until backend.go looks
	// an unseen Job up on the API server): let the read happen first.
	time.Sleep(300 * time.Millisecond)
	bg := metav1.DeletePropagationBackground
	if err := e.kube.BatchV1().Jobs(testNamespace).Delete(context.Background(), job.Name, metav1.DeleteOptions{PropagationPolicy: &bg}); err != nil {
		t.Fatal(err)
	}

	r := results.waitFor(t, 1, 20*time.Second)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonJobDeleted || r.Data.Job != job.Name {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if !strings.Contains(r.Data.Message, "deleted before it finished") {
		t.Errorf("message %q", r.Data.Message)
	}
	eventually(t, 5*time.Second, "request acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	time.Sleep(200 * time.Millisecond)
	if n := len(results.snapshot()); n != 1 {
		t.Errorf("%d results, want 1", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1 (a deleted Job is not recreated)", c)
	}
}

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
func TestJobGoneBeforeTheWorkerSawItFails(t *testing.T) {
	t.Parallel()
	// A Job that never reaches the cache must not hang the request (and
	// every later request for its key).
	e := setup(t)
	// The API server accepts the Job, and it is gone before the informer
	// lists or watches it (deleted at once, or during a watch gap).
	e.kube.PrependReactor("create", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, a.(k8stesting.CreateAction).GetObject(), nil
	})
	e.startWorker("w1", nil)
	results := e.collect()
	req := request("vanished")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 30*time.Second)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonJobDeleted {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}
