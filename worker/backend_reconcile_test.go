package worker

// Backend (backend.go, janitor.go) and the builder's orphan watch: every
// finished Job is reconciled, at start and whenever it changes, and ends
// only the run it was made for (docs/design.md §2a, §4).

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
)

// finishedJob is a failed kaniko Job of key and run, with its Pod.
func finishedJob(name, key, run string) (*batchv1.Job, *corev1.Pod) {
	now := metav1.Now()
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: testNamespace, UID: types.UID("uid-" + name),
			Labels:      map[string]string{kaniko.LabelManagedBy: kaniko.ManagedByValue},
			Annotations: map[string]string{kaniko.AnnotationKey: key, kaniko.AnnotationRun: run},
		},
		Status: batchv1.JobStatus{Failed: 1, StartTime: &now, Conditions: []batchv1.JobCondition{
			{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, LastTransitionTime: now},
			{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, LastTransitionTime: now},
		}},
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-pod", Namespace: testNamespace, Labels: map[string]string{
			batchv1.JobNameLabel: name, kaniko.LabelManagedBy: kaniko.ManagedByValue}},
		Status: corev1.PodStatus{Phase: corev1.PodFailed, ContainerStatuses: []corev1.ContainerStatus{{
			Name:  kaniko.ContainerName,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 1, Message: "RUN make: exit status 2", FinishedAt: now}},
		}}},
	}
	return job, pod
}

// reconcileWorld is a KubeBackend over a fake cluster holding jobs, its
// informers started after the backend registered for finished Jobs (as a
// worker starts them).
func reconcileWorld(t *testing.T, jobs int) *KubeBackend {
	t.Helper()
	client := fake.NewClientset()
	for i := range jobs {
		job, pod := finishedJob(fmt.Sprintf("buildq-%04d", i), fmt.Sprintf("key-%04d", i), "run-1")
		if _, err := client.BatchV1().Jobs(testNamespace).Create(context.Background(), job, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().Pods(testNamespace).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return reconcileBackend(t, client)
}

// reconcileBackend is a KubeBackend over client, its informers started
// and synced, stopped when the test ends.
func reconcileBackend(t *testing.T, client *fake.Clientset) *KubeBackend {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	factory := kube.NewInformerFactory(client, testNamespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		t.Fatal(err)
	}
	k, err := NewKubeBackend(client, watcher, testKaniko)
	if err != nil {
		t.Fatal(err)
	}
	factory.Start(ctx.Done())
	t.Cleanup(func() { cancel(); factory.Shutdown() })
	if !watcher.WaitForSync(ctx) {
		t.Fatal("informers did not sync")
	}
	return k
}

// Every finished Job the informers list at start reaches reconciliation,
// however many there are before it runs. (The hints went through a
// 256-slot channel that dropped the rest: issue 25.)
//
// Origin: issue 25 (the hints at start went through a 256-slot channel that dropped the rest; 85ff387).
func TestReconcileSeesEveryFinishedJobAtStart(t *testing.T) {
	t.Parallel()
	const n = 600
	k := reconcileWorld(t, n)
	var mu sync.Mutex
	seen := map[string]int{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		k.Reconcile(ctx, func(_ context.Context, key string, out Outcome) time.Duration {
			mu.Lock()
			defer mu.Unlock()
			if out.Run != "run-1" || out.Succeeded {
				t.Errorf("%s: outcome %+v", key, out)
			}
			seen[key]++
			return 0
		})
	}()
	eventually(t, 20*time.Second, "every finished Job reconciled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == n
	})
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Reconcile did not return when its context ended")
	}
	for key, c := range seen {
		if c != 1 {
			t.Errorf("%s handed %d times, want once (nothing re-added it)", key, c)
		}
	}
}

// A finished Job whose claim still looks alive is looked at again when
// finish asks, and no sooner.
//
// Origin: issue 25, with TestReconcileSeesEveryFinishedJobAtStart (85ff387).
func TestReconcileLooksAgainWhenAsked(t *testing.T) {
	t.Parallel()
	k := reconcileWorld(t, 1)
	var mu sync.Mutex
	var calls []time.Time
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	const again = 300 * time.Millisecond
	go k.Reconcile(ctx, func(context.Context, string, Outcome) time.Duration {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, time.Now())
		if len(calls) < 3 {
			return again
		}
		return 0
	})
	eventually(t, 10*time.Second, "three looks", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(calls) >= 3
	})
	time.Sleep(2 * again)
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 3 {
		t.Fatalf("%d looks, want 3: finish said done on the third", len(calls))
	}
	for i := 1; i < 3; i++ {
		if gap := calls[i].Sub(calls[i-1]); gap < again {
			t.Errorf("look %d came %s after the one before, asked for %s", i+1, gap, again)
		}
	}
}

// Origin: level-triggered reconciliation of finished Jobs (4ee3476).
func TestFinishedJobOfADeadOwnerIsReconciled(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name             string
		jobRun, claimRun string
		want             string
	}{
		// The claim's own run finished while its owner was dead: the
		// outcome is stored with no request around.
		{"own run", "r1", "r1", v1.StateSucceeded},
		// A Job of an earlier run says nothing about the current one.
		{"stale run", "r0", "r1", v1.StateBuilding},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			req := request("orphan")
			key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
			dest := "registry.test:5000/acme/web:" + v1.DefaultTag(key)
			job, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Destinations: []string{dest}, Run: tc.jobRun}, testKaniko.Defaults())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.kube.BatchV1().Jobs(testNamespace).Create(context.Background(), job, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			e.kubelet(job, 0, digestOf("orphan"))
			r := e.startWorker("w1", nil)
			// A dead worker's claim: it stays unchanged, whatever its
			// (skewed) lease timestamp says — here one in the future.
			rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: tc.claimRun, Owner: "dead", LeaseMs: 1000,
				LeaseUntil: time.Now().Add(time.Hour), RequestID: "gone", Repository: "registry.test:5000/acme/web",
				Destinations: []string{dest}, StartedAt: time.Now().Add(-time.Hour)})
			if _, err := r.w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
				t.Fatal(err)
			}
			// Level-triggered: the next event for the finished Job (here, a
			// label change) makes the worker look at it.
			e.touchJob(job.Name)
			if tc.want == v1.StateSucceeded {
				eventually(t, 10*time.Second, "the record to be final", func() bool {
					cur, _, err := r.w.runs.Get(context.Background(), key)
					return err == nil && cur != nil && cur.State == v1.StateSucceeded && cur.Digest == digestOf("orphan") && cur.Run == "r1"
				})
				return
			}
			// Well past the claim's lapse (1.5 × 1 s) and a re-check.
			time.Sleep(4 * time.Second)
			if cur, _, err := r.w.runs.Get(context.Background(), key); err != nil || cur.State != v1.StateBuilding {
				t.Fatalf("a stale run's Job ended the current run: %+v %v", cur, err)
			}
		})
	}
}

// The reconciler stores a finished Job's outcome only on the run that Job
// was made for: a Job of an earlier run of the key (left behind, or
// finishing late) never ends the run building now. The mutant
// "reconcile-any-run" broke this rule.
//
// Origin: issue 24, mutation testing: a unit test for the mutant reconcile-any-run (85ff387).
func TestReconcilerEndsOnlyTheJobsOwnRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	ctx := context.Background()

	key := "reconcile-own-run"
	current := v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "current-run", Owner: "", LeaseMs: 2000,
		RequestID: "r1", Seq: 1, Tenant: "acme", Name: "api", StartedAt: time.Now().UTC()}
	raw, _ := json.Marshal(current)
	if _, err := w.runs.Bucket().Put(ctx, key, raw); err != nil {
		t.Fatal(err)
	}
	// A failed Job of an earlier run, its owner gone.
	if again := w.builds.finishOrphan(ctx, key, Outcome{Run: "earlier-run", Reason: v1.ReasonBuildFailed, Message: "RUN make: exit status 2"}); again != 0 {
		t.Fatalf("finishOrphan asked to look again in %s at another run's Job", again)
	}
	got, _, err := w.runs.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != v1.StateBuilding || got.Run != "current-run" {
		t.Fatalf("the run building now was ended with another run's Job outcome: %+v", got)
	}
	// Its own Job's outcome ends it (the claim was released: no wait).
	if again := w.builds.finishOrphan(ctx, key, Outcome{Run: "current-run", Reason: v1.ReasonBuildFailed, Message: "RUN make: exit status 2"}); again != 0 {
		t.Fatalf("finishOrphan of the run's own Job asked to look again in %s", again)
	}
	if got, _, err = w.runs.Get(ctx, key); err != nil || got.State != v1.StateFailed || got.Run != "current-run" {
		t.Fatalf("the run's own Job outcome did not end it: %+v (%v)", got, err)
	}
}

// touchJob changes a label of Job name: an event for it, which makes
// the workers' reconcilers look at it.
func (e *env) touchJob(name string) {
	e.t.Helper()
	j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	j.Labels["touched"] = "yes"
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Update(context.Background(), j, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}
