package worker

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

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

func TestStoppedWorkerHandsBackAndAnotherAdopts(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", nil)
	results := e.collect()

	req := request("adopt")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	job := e.waitJob(kaniko.JobName(key))

	// SIGTERM: w1 stops fetching and hands the request back at once.
	w1.stop(t)
	e.startWorker("w2", nil)
	// w2 takes the request back well before AckWait or the lease would
	// have run out, and adopts the Job instead of creating another.
	time.Sleep(300 * time.Millisecond)
	e.kubelet(job, 0, digestOf("adopted"))

	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digestOf("adopted") {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if r.Data.Origin != v1.OriginBuild {
		t.Errorf("origin %q: the request's own Job was adopted, so it is still its build", r.Data.Origin)
	}
	if r.Data.Attempts != 2 {
		t.Errorf("attempts %d, want 2 (handed back once)", r.Data.Attempts)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

func TestLongBuildIsNotRedelivered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.AckWait = time.Second; c.Lease = time.Second })
	results := e.collect()

	req := request("slow")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	// Outlast AckWait (and the lease) several times over.
	time.Sleep(3500 * time.Millisecond)
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d redeliveries during a long build", redelivered)
	}
	e.kubelet(job, 0, digestOf("slow"))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Attempts != 1 || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

func TestInvalidRequestIsTerminatedWithoutJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	cases := []struct {
		name    string
		subject string
		msgID   string
		body    string
		wantID  string
	}{
		{"not json", "buildq.requests.acme", "bad-1", "{nope", "bad-1"},
		{"unknown field", "buildq.requests.acme", "", `{"apiVersion":"buildq.dev/v1","requestId":"bad-2","tenant":"acme","name":"web","sauce":1}`, "bad-2"},
		{"bad name", "buildq.requests.acme", "", `{"apiVersion":"buildq.dev/v1","requestId":"bad-3","tenant":"acme","name":"Web.*","source":{"s3":{"bucket":"buildq","key":"k"}},"contextDigest":"sha256:` + hex64("x") + `"}`, "bad-3"},
	}
	for _, c := range cases {
		m := nats.NewMsg(c.subject)
		if c.msgID != "" {
			m.Header.Set(v1.MsgIDHeader, c.msgID)
		}
		m.Data = []byte(c.body)
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]v1.Result{}
	for _, r := range results.waitFor(t, len(cases), 10*time.Second) {
		got[r.ID] = r
	}
	for _, c := range cases {
		r := got[c.wantID]
		if r.ID != c.wantID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || r.Data.Message == "" {
			t.Errorf("%s: result %s", c.name, mustJSON(t, r))
		}
	}
	eventually(t, 5*time.Second, "requests terminated", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if c := e.creates.total(); c != 0 {
		t.Errorf("%d jobs created for bad input", c)
	}
}

func TestConcurrentIdenticalRequestsBuildOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		e.startWorker(id, withRegistry(tr))
	}
	results := e.collect()

	const n = 50
	var key string
	for i := range n {
		r := request("same-content")
		r.Name = fmt.Sprintf("svc-%d", i%5) // who asks does not change the build
		key = v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage)
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	job := e.waitJob(kaniko.JobName(key))
	// Let every worker take its share before the build ends.
	time.Sleep(500 * time.Millisecond)
	shared := tr.push(t, destination(job))
	e.kubelet(job, 0, shared)

	got := results.waitFor(t, n, 30*time.Second)
	origins := map[v1.Origin]int{}
	ids := map[string]bool{}
	for _, r := range got {
		origins[r.Data.Origin]++
		ids[r.ID] = true
		// Five names, five repositories: the image is copied, not rebuilt.
		if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != shared || r.Data.Key != key ||
			r.Data.ImageRef != tr.host+"/acme/"+r.Data.Name+"@"+shared {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	if len(ids) != n {
		t.Errorf("%d distinct request ids in %d results", len(ids), len(got))
	}
	if origins[v1.OriginBuild] != 1 {
		t.Errorf("origins %v: want exactly one build", origins)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
	time.Sleep(300 * time.Millisecond)
	if len(results.snapshot()) != n {
		t.Errorf("%d results, want %d", len(results.snapshot()), n)
	}
	eventually(t, 5*time.Second, "all acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}
