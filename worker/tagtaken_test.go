package worker

// The build Pod's own tag check (kaniko.Spec.Absent): fetch-context asks
// the registry for the run's first tag after unpacking the context and
// builds nothing if an image is there. The run then answers nobody
// (v1.ReasonTagTaken): its Job goes, and every request of it looks again
// — the claimer's own check finds the image, as it would have before
// claiming, and a request whose tag is free builds.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
)

// fetchKaniko is testKaniko in the production shape: contexts through
// fetch-context, whose URL the worker presigns.
func fetchKaniko() kaniko.Config {
	kc := testKaniko
	kc.FetchImage = "ghcr.io/buildq/buildq@sha256:" + hex64("fetch")
	return kc
}

// withPresigner gives a worker of fetchKaniko a presigner (what the
// S3 store's keys give it in production).
func withPresigner(w *Worker) {
	w.backend.(*KubeBackend).WithPresigner(func(_ context.Context, bucket, key string, _ time.Duration) (string, error) {
		return "http://minio.test:9000/" + bucket + "/" + key + "?X-Amz-Signature=test", nil
	})
}

// fetchWorld is a test world with one worker, w1, of fetchKaniko and a
// registry, and a collector of its results.
func fetchWorld(t *testing.T) (*env, *testRegistry, *resultCollector) {
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, withPresigner)
	results := e.collect()
	return e, tr, results
}

// absentArg is the tag job's fetch-context checks (its --absent), or "".
func absentArg(job *batchv1.Job) string { return fetchArg(job, "--absent") }

// fetchArg is the value of flag in job's fetch-context container's
// arguments, or "".
func fetchArg(job *batchv1.Job, flag string) string {
	for _, c := range job.Spec.Template.Spec.InitContainers {
		if i := slices.Index(c.Args, flag); c.Name == kaniko.FetchContainerName && i >= 0 && i+1 < len(c.Args) {
			return c.Args[i+1]
		}
	}
	return ""
}

// Every Job of a one-image build checks its first tag in its Pod; the tag
// is the run's first destination.
func TestABuildPodChecksItsFirstTagBeforeItBuilds(t *testing.T) {
	t.Parallel()
	e, tr, results := fetchWorld(t)
	req := request("pod-checks-tag")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if got, want := absentArg(job), destination(job); got == "" || got != want {
		t.Fatalf("fetch-context checks %q, want the first destination %q (init containers %+v)", got, want, job.Spec.Template.Spec.InitContainers)
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

// An image pushed to the run's first tag after the worker's own check,
// before the build Pod starts: the Pod refuses to build over it. The
// claimer and a request of the same tenant that joined the run are each
// answered once with that image (origin cache), nothing is reported
// failed, and the run's Job is deleted. A HEAD of the tag that intake
// sent ahead before the image was pushed (for a request of the same
// tenant and tag) is forgotten: its "absent" answers no later look.
func TestATagTakenBeforeTheBuildStartsIsNeverPushedOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w, _ := e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, withPresigner)
	results := e.collect()
	req := request("tag-taken-late")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	joiner := request("tag-taken-late")
	joiner.RequestID = "tag-taken-late-joiner"
	if _, err := e.pub.Publish(context.Background(), joiner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	eventually(t, 10*time.Second, "the second request parked on the run", func() bool { return e.isParked(key, joiner.RequestID) })
	// Intake's HEAD sent ahead for the tag, answered "absent".
	repo, err := w.w.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	dests := naming.Destinations(repo, key, req.Tags)
	w.w.builds.sendPreflight(context.Background(), req, key, repo, dests)
	ahead, ok := w.w.builds.preflightSent(req, dests)
	if !ok {
		t.Fatal("no HEAD sent ahead for the tag")
	}
	if r, ok := ahead.wait(context.Background()); !ok || r.found != nil {
		t.Fatalf("the HEAD sent ahead found %+v (%v), want the tag free", r.found, ok)
	}
	hand := tr.push(t, absentArg(job))
	e.fetchFails(job, kaniko.FetchExitTagTaken, "tag taken: "+absentArg(job)+" holds "+hand+" already; the build would push over it")
	for _, id := range []string{req.RequestID, joiner.RequestID} {
		r := oneResult(t, results, id)
		if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != hand {
			t.Errorf("%s: %s, want the image found at its tag (%s), origin cache", id, mustJSON(t, r.Data), hand)
		}
	}
	eventually(t, 10*time.Second, "the refused run's Job deleted", e.jobGone(job.Name))
	if rec := e.claim(key); rec == nil || rec.State != v1.StateFailed || rec.Reason != v1.ReasonTagTaken {
		t.Errorf("the key's record %+v, want the refused run's end (TagTaken), never a build of the image found", rec)
	}
	time.Sleep(300 * time.Millisecond)
	for _, id := range []string{req.RequestID, joiner.RequestID} {
		if n := len(byID(results.snapshot())[id]); n != 1 {
			t.Errorf("%s answered %d times", id, n)
		}
	}
	if d, err := tr.client.Head(context.Background(), absentArg(job)); err != nil || d != hand {
		t.Errorf("the tag holds %s (%v), want the image pushed there first (%s)", d, err, hand)
	}
	w.w.builds.looks.mu.Lock()
	_, kept := w.w.builds.looks.pre[preflightKey(req.Tenant, dests[0])]
	w.w.builds.looks.mu.Unlock()
	if kept {
		t.Error("the HEAD sent ahead before the tag was taken is still kept: its \"absent\" would answer the next look")
	}
}

// The refused build's Pod is gone before the worker reads it (deleted, or
// never seen): the Job's own failure condition names fetch-context's exit
// code, and the run still ends TagTaken — never a build failure that
// would answer the requests.
func TestATagTakenWhosePodIsGoneIsStillNoBuildFailure(t *testing.T) {
	t.Parallel()
	e, tr, results := fetchWorld(t)
	req := request("tag-taken-pod-gone")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	hand := tr.push(t, absentArg(job))
	now := metav1.Now()
	j := job.DeepCopy()
	j.Status.StartTime, j.Status.Failed = &now, 1
	m := fmt.Sprintf("Container %s for pod %s/%s-x1y2z failed with exit code %d matching FailJob rule at index 0", kaniko.FetchContainerName, job.Namespace, job.Name, kaniko.FetchExitTagTaken)
	j.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: m, LastTransitionTime: now},
		{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: m, LastTransitionTime: now},
	}
	if _, err := e.kube.BatchV1().Jobs(job.Namespace).UpdateStatus(context.Background(), j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r := oneResult(t, results, req.RequestID)
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != hand {
		t.Fatalf("result %s, want the image found at its tag (%s), origin cache", mustJSON(t, r.Data), hand)
	}
}

// Whatever path hands a refused run's end to a request as its answer (a
// take-over, the reconciler, a stalled owner), it is never published:
// the request is tried again, and its next walk looks past the run.
func TestARefusedRunIsNeverAResult(t *testing.T) {
	t.Parallel()
	req := request("refused-never-a-result")
	rec := &v1.BuildRecord{Key: v1.BuildKey(req, kanikoID), State: v1.StateFailed, Reason: v1.ReasonTagTaken, Run: "r1", Job: "buildq-x"}
	v, err := (&Worker{}).resultVerdict(context.Background(), verdict{}, req, rec, v1.OriginBuild, true, "registry.test/acme/web", []string{"registry.test/acme/web:x"})
	if err == nil || !IsTransient(err) || v.Data.Status != "" {
		t.Fatalf("a refused run's end as a result: %+v, %v; want no result and a transient error (tried again)", v.Data, err)
	}
}
