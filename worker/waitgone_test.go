package worker

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
)

// A Job its informer has not shown yet — created a moment ago, and being
// deleted because its build was stopped as it started — is not gone:
// WaitGone asks the API server, and returns only once the Job is removed.
// Found by the fault simulation (seed 101): a build stopped 2 ms after
// its Job's create gave its tenant's slot back while the Job still stood,
// and the tenant ran one Job over its limit.
func TestWaitGoneWaitsForAJobTheCacheHasNotShown(t *testing.T) {
	t.Parallel()
	key := hex64("wait-gone")
	now := metav1.Now()
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: kaniko.JobName(key), Namespace: testNamespace,
		Annotations: map[string]string{kaniko.AnnotationKey: key, kaniko.AnnotationRun: "run-1"}, DeletionTimestamp: &now, Finalizers: []string{"foregroundDeletion"}}}
	client := fake.NewClientset(job)
	k := uncachedBackend(t, client)
	removed := make(chan time.Time, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		removed <- time.Now()
		_ = client.BatchV1().Jobs(testNamespace).Delete(context.Background(), job.Name, metav1.DeleteOptions{})
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := k.WaitGone(ctx, key, "run-1"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-removed:
	default:
		t.Fatal("WaitGone returned while the Job still stood (marked for deletion, not shown by the cache)")
	}
}

// Its asks of the API server back off: a Job the cache never shows,
// standing for 3 s, is asked for a handful of times, not every 250 ms.
func TestWaitGoneBacksOffItsAsksOfTheAPIServer(t *testing.T) {
	t.Parallel()
	key := hex64("wait-gone-backoff")
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: kaniko.JobName(key), Namespace: testNamespace,
		Annotations: map[string]string{kaniko.AnnotationKey: key, kaniko.AnnotationRun: "run-1"}}}
	client := fake.NewClientset(job)
	var gets atomic.Int32
	client.PrependReactor("get", "jobs", func(k8stesting.Action) (bool, runtime.Object, error) {
		gets.Add(1)
		return false, nil, nil
	})
	k := uncachedBackend(t, client)
	go func() {
		time.Sleep(3 * time.Second)
		_ = client.BatchV1().Jobs(testNamespace).Delete(context.Background(), job.Name, metav1.DeleteOptions{})
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := k.WaitGone(ctx, key, "run-1"); err != nil {
		t.Fatal(err)
	}
	// 250 ms, 500 ms, 1 s, 2 s, then 4 s: six asks at most in 3 s; every
	// 250 ms would be a dozen.
	if n := gets.Load(); n > 6 {
		t.Fatalf("%d GETs of the Job in 3 s: WaitGone does not back off", n)
	} else if n < 2 {
		t.Fatalf("%d GETs of the Job: WaitGone did not look again while the Job stood", n)
	}
}

// uncachedBackend is a KubeBackend on client whose informer never
// started: its cache shows nothing.
func uncachedBackend(t *testing.T, client *fake.Clientset) *KubeBackend {
	t.Helper()
	watcher, err := kube.NewWatcher(informers.NewSharedInformerFactory(client, 0), nil)
	if err != nil {
		t.Fatal(err)
	}
	k, err := NewKubeBackend(client, watcher, testKaniko)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
