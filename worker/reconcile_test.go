package worker

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

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
	ctx, cancel := context.WithCancel(context.Background())
	client := fake.NewClientset()
	for i := range jobs {
		job, pod := finishedJob(fmt.Sprintf("buildq-%04d", i), fmt.Sprintf("key-%04d", i), "run-1")
		if _, err := client.BatchV1().Jobs(testNamespace).Create(ctx, job, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().Pods(testNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
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
