package worker

// A build whose Job succeeded but whose Pod was gone before the worker
// read the digest kaniko reported (podGone, kubebackend.go): the image
// now at the run's first tag cannot be shown to be the build's — anyone
// who may push there may have pushed since — so the run is recorded as
// having built nothing (v1.ReasonTagTaken) and every request of it looks
// again: the claimer's own check answers it with the image at its tag
// (origin cache, never indexed), and a request of another repository
// builds. The run's own watch gives the Pod digestGrace to reach the
// cache, and so does the reconciler for a run whose owner is gone.

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
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
)

// withDigestGrace shortens how long a worker's backend waits for a
// succeeded Job's Pod.
func withDigestGrace(d time.Duration) func(*Worker) {
	return func(w *Worker) { w.backend.(*KubeBackend).digestGrace = d }
}

// podlessWorker is the hook of a worker of fetchKaniko (withPresigner)
// whose backend waits grace for a succeeded Job's Pod, then more.
func podlessWorker(grace time.Duration, more ...func(*Worker)) func(*Worker) {
	return func(w *Worker) {
		withPresigner(w)
		withDigestGrace(grace)(w)
		for _, f := range more {
			f(w)
		}
	}
}

// losePod plays a build of job that pushed its image to the run's first
// tag, an image pushed over it by hand, and the build's Pod deleted
// unseen (the Job succeeded): the digests of the build's image and of
// the hand-pushed one.
func (e *env) losePod(tr *testRegistry, job *batchv1.Job) (built, hand string) {
	e.t.Helper()
	built = tr.push(e.t, destination(job))
	hand = tr.push(e.t, destination(job))
	if err := e.world.node.endWithoutPod(job); err != nil {
		e.t.Fatal(err)
	}
	return built, hand
}

// jobInPlaceOf waits for the Job that stands in old's place: its name (the
// key's), another UID.
func (e *env) jobInPlaceOf(old *batchv1.Job, what string) *batchv1.Job {
	e.t.Helper()
	var next *batchv1.Job
	eventually(e.t, 20*time.Second, what, func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), old.Name, metav1.GetOptions{})
		if err != nil || j.UID == old.UID {
			return false
		}
		next = j
		return true
	})
	return next
}

// The image at a run's tag, pushed over by hand after the build pushed
// it, while the build's Pod was deleted unseen: a request of the same
// content for another repository, parked on the run, is not answered
// with that image but builds; the claimer is answered with the image its
// tag holds (origin cache), as its own check would answer it, or with the
// new build's; and the key's record never names the image at the first
// run's tag. (Taking the digest from the tag answered both with the
// hand-pushed image and indexed it; with the mutant
// "pod-gone-push-failed" the claimer is answered PushFailed.)
func TestARunWhosePodIsGoneAnswersNobodyWithTheImageAtItsTag(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, podlessWorker(500*time.Millisecond))
	results := e.collect()
	ctx := context.Background()
	req := request("pod-gone")
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	other := request("pod-gone")
	other.Name, other.RequestID = "api", "pod-gone-other-repository"
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	eventually(t, 10*time.Second, "the other repository's request parked on the run", func() bool { return e.isParked(key, other.RequestID) })

	built, hand := e.losePod(tr, job)
	// The other repository's request builds the key again.
	again := e.jobInPlaceOf(job, "a Job of the other repository's request")
	if !strings.Contains(destination(again), "/api:") {
		t.Fatalf("the Job built after the Pod was gone pushes to %s, want the other repository's tag", destination(again))
	}
	rebuilt := tr.push(t, destination(again))
	e.kubelet(again, 0, rebuilt)
	if r := oneResult(t, results, other.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Digest != rebuilt {
		t.Fatalf("the other repository's request: %s, want its own build's %s", mustJSON(t, r.Data), rebuilt)
	}
	// The claimer, looking again, either checked its own tag first and
	// is answered with the image there, or joined the new run.
	r := oneResult(t, results, req.RequestID)
	switch {
	case r.Data.Status == v1.StatusSucceeded && r.Data.Origin == v1.OriginCache && r.Data.Digest == hand:
	case r.Data.Status == v1.StatusSucceeded && r.Data.Digest == rebuilt:
	default:
		t.Fatalf("the claimer: %s, want the image its tag holds (%s, origin cache) or the new run's (%s); the first run pushed %s", mustJSON(t, r.Data), hand, rebuilt, built)
	}
	if rec := e.claim(key); rec == nil || rec.State != v1.StateSucceeded || rec.Digest != rebuilt {
		t.Fatalf("the key's record %+v, want the new run's build (%s), never the image found at the first run's tag", rec, rebuilt)
	}
}

// succeededJob is a succeeded kaniko Job of key and run; pod, when made,
// is its Pod, whose kaniko container reported digest.
func succeededJob(name, key, run, digest string) (*batchv1.Job, *corev1.Pod) {
	now := metav1.Now()
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: testNamespace, UID: types.UID("uid-" + name),
			Labels: map[string]string{kaniko.LabelManagedBy: kaniko.ManagedByValue},
			Annotations: map[string]string{kaniko.AnnotationKey: key, kaniko.AnnotationRun: run,
				kaniko.AnnotationImage: "registry.test/acme/web:" + name},
		},
		Status: batchv1.JobStatus{Succeeded: 1, StartTime: &now, CompletionTime: &now, Conditions: []batchv1.JobCondition{
			{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now},
		}},
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-pod", Namespace: testNamespace, Labels: map[string]string{
			batchv1.JobNameLabel: name, kaniko.LabelManagedBy: kaniko.ManagedByValue}},
		Status: corev1.PodStatus{Phase: corev1.PodSucceeded, ContainerStatuses: []corev1.ContainerStatus{{
			Name:  kaniko.ContainerName,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Message: digest, FinishedAt: now}},
		}}},
	}
	return job, pod
}

// The reconciler gives a succeeded Job's Pod the grace a run's own watch
// gives it: a Pod that comes within it tells the digest; a Job whose Pod
// never comes is handed on as a run that built nothing, naming its tag.
// (Such a Job was dropped until a Pod event came, and stood, its run
// building, until a request of the key took the run over; mutant
// "pod-gone-left-standing".)
func TestTheReconcilerEndsASucceededJobWhosePodNeverCame(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	client := fake.NewClientset()
	late, latePod := succeededJob("buildq-late-pod", "key-late", "run-1", digestOf("late"))
	gone, _ := succeededJob("buildq-pod-gone", "key-gone", "run-1", "")
	for _, j := range []*batchv1.Job{late, gone} {
		if _, err := client.BatchV1().Jobs(testNamespace).Create(ctx, j, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	k := reconcileBackend(t, client)
	k.digestGrace = 3 * time.Second
	var mu sync.Mutex
	handed := map[string][]Outcome{}
	go k.Reconcile(ctx, func(_ context.Context, key string, out Outcome) time.Duration {
		mu.Lock()
		defer mu.Unlock()
		handed[key] = append(handed[key], out)
		return 0
	})
	// The late Job's Pod comes within the grace.
	time.Sleep(200 * time.Millisecond)
	if _, err := client.CoreV1().Pods(testNamespace).Create(ctx, latePod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "both Jobs handed on", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handed["key-late"]) > 0 && len(handed["key-gone"]) > 0
	})
	mu.Lock()
	defer mu.Unlock()
	if o := handed["key-late"]; len(o) != 1 || !o[0].Succeeded || o[0].Digest != digestOf("late") || o[0].Run != "run-1" {
		t.Errorf("the Job whose Pod came late: %+v, want one success with its Pod's digest", o)
	}
	o := handed["key-gone"]
	if len(o) != 1 || o[0].Succeeded || o[0].Reason != v1.ReasonTagTaken || o[0].Run != "run-1" || o[0].Digest != "" {
		t.Fatalf("the Job whose Pod never came: %+v, want one end that built nothing (%s) of run-1", o, v1.ReasonTagTaken)
	}
	if !strings.Contains(o[0].Message, gone.Annotations[kaniko.AnnotationImage]) {
		t.Errorf("its message %q does not name the tag %s", o[0].Message, gone.Annotations[kaniko.AnnotationImage])
	}
}

// A run whose owner died, whose Job then succeeded and whose Pod was
// deleted unseen: the reconciler ends it as having built nothing, so it
// does not stand building until a request of the key comes back (the
// fault simulation's seed 188: job-left-behind), and deletes its Job,
// which nobody else may come back to (seed 188 again: late-job-cleanup).
func TestAnOrphanedRunWhosePodIsGoneIsEnded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	req := request("orphan-pod-gone")
	key := v1.BuildKey(req, kanikoID)
	dest := "registry.test:5000/acme/web:" + v1.DefaultTag(key)
	job, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Destinations: []string{dest}, Run: "r1"}, testKaniko.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	created, err := e.kube.BatchV1().Jobs(testNamespace).Create(context.Background(), job, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.world.node.endWithoutPod(created); err != nil {
		t.Fatal(err)
	}
	// A lease the janitor would take to come back: the Job goes with the
	// reconciler's end (mutant "orphan-end-leaves-job").
	r := e.startWorkerHooked("w1", func(c *Config) { c.Lease = time.Minute }, nil, withDigestGrace(300*time.Millisecond))
	// A dead worker's claim, released: nothing waits on its lease.
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "r1", LeaseMs: 1000,
		RequestID: "gone", Tenant: "acme", Name: "web", Repository: "registry.test:5000/acme/web",
		Destinations: []string{dest}, StartedAt: time.Now().Add(-time.Minute)})
	if _, err := r.w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
	// Level-triggered: the next event of the finished Job makes the
	// worker look at it.
	e.touchJob(job.Name)
	eventually(t, 20*time.Second, "the orphaned run ended", func() bool {
		cur, _, err := r.w.runs.Get(context.Background(), key)
		return err == nil && cur != nil && cur.State != v1.StateBuilding
	})
	cur, _, _ := r.w.runs.Get(context.Background(), key)
	if cur.State != v1.StateFailed || cur.Reason != v1.ReasonTagTaken || cur.Run != "r1" || cur.Digest != "" {
		t.Fatalf("the orphaned run ended %s", fmt.Sprintf("%+v", cur))
	}
	eventually(t, 20*time.Second, "its Job deleted", e.jobGone(job.Name))
}
