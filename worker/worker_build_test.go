package worker

// The worker end to end: a request is built by its own kaniko Job, its
// result published once, classified, and its message acked; two workers
// handle each request once.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// Origin: the build pipeline spine (0bdb2cd).
func TestBuildSucceeds(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	req := request("hello")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	job := e.waitJob(kaniko.JobName(key))

	// The Job is the one DESIGN §5 describes.
	c := job.Spec.Template.Spec.Containers[0]
	for _, want := range []string{
		"--context=s3://buildq/" + req.Source.S3.Key,
		"--destination=registry.test:5000/acme/web:" + key[:12],
		"--digest-file=/dev/termination-log",
		"--build-arg=VERSION=1.2.3",
		"--label=team=platform",
	} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("args %q lack %q", c.Args, want)
		}
	}
	if job.Labels[kaniko.LabelManagedBy] != "buildq" || job.Annotations[kaniko.AnnotationKey] != key || job.Annotations[kaniko.AnnotationRequestID] != req.RequestID {
		t.Errorf("labels %v annotations %v", job.Labels, job.Annotations)
	}
	if c.TerminationMessagePolicy != corev1.TerminationMessageFallbackToLogsOnError {
		t.Errorf("termination message policy %q", c.TerminationMessagePolicy)
	}

	digest := digestOf("image")
	e.kubelet(job, 0, digest)

	got := results.waitFor(t, 1, 10*time.Second)
	r := got[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digest || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if r.Data.ImageRef != "registry.test:5000/acme/web@"+digest || r.Data.Image != "registry.test:5000/acme/web:"+key[:12] {
		t.Errorf("image %q ref %q", r.Data.Image, r.Data.ImageRef)
	}
	if r.SpecVersion != "1.0" || r.Type != "dev.buildq.build.succeeded.v1" || r.Subject != "acme/web" || r.Data.Job != job.Name {
		t.Errorf("envelope %s", mustJSON(t, r))
	}
	// Acked after the result: nothing left in the work queue.
	eventually(t, 5*time.Second, "request acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	// The worker removes the Job once the result is stored.
	eventually(t, 5*time.Second, "job deleted", func() bool {
		_, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), job.Name, metav1.GetOptions{})
		return err != nil
	})
	time.Sleep(200 * time.Millisecond)
	if n := len(results.snapshot()); n != 1 {
		t.Fatalf("%d results, want exactly 1", n)
	}
}

// Origin: the build pipeline spine (0bdb2cd).
func TestBuildFails(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	req := request("broken")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	logs := "INFO Retrieving image manifest\nerror building image: parsing dockerfile: unknown instruction: RUNN"
	e.kubelet(job, 1, logs)

	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonBuildFailed || !strings.Contains(r.Data.LogTail, "unknown instruction") {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if r.Type != "dev.buildq.build.failed.v1" {
		t.Errorf("type %q", r.Type)
	}
	eventually(t, 5*time.Second, "request acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// Origin: the build pipeline spine (0bdb2cd).
func TestPushFailureIsClassified(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	req := request("push")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	e.kubelet(job, 1, "error pushing image: failed to push to destination registry.test:5000/acme/web: UNAUTHORIZED")
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Reason != v1.ReasonPushFailed {
		t.Fatalf("reason %q, want PushFailed", r.Data.Reason)
	}
}

// Origin: the build pipeline spine (0bdb2cd).
func TestTwoWorkersHandleEachRequestOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	e.startWorker("w2", nil)
	results := e.collect()

	const n = 12
	var reqs []*v1.Request
	for i := range n {
		r := request(fmt.Sprintf("ctx-%d", i))
		r.Name = fmt.Sprintf("app-%d", i)
		reqs = append(reqs, r)
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range reqs {
		key := v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage)
		e.kubelet(e.waitJob(kaniko.JobName(key)), 0, digestOf(key))
	}
	got := results.waitFor(t, n, 20*time.Second)
	seen := map[string]int{}
	for _, r := range got {
		seen[r.ID]++
		if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	for _, r := range reqs {
		if seen[r.RequestID] != 1 {
			t.Errorf("request %s has %d results", r.RequestID, seen[r.RequestID])
		}
	}
	if c := e.creates.total(); c != n {
		t.Errorf("%d jobs created, want %d", c, n)
	}
	time.Sleep(300 * time.Millisecond)
	if len(results.snapshot()) != n {
		t.Errorf("%d results, want %d", len(results.snapshot()), n)
	}
}
