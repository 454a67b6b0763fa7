package worker

// Base images and retries (issue 28, "the first hour"): a base image that
// is missing or refused fails the build once, at once, with its own
// reason and the registry's words — never retried as an infrastructure
// error, never dead-lettered; a retried build's progress events say why;
// progress labels say what happened.

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

// newGuardedRegistry is a registry over HTTP on loopback that answers 401
// UNAUTHORIZED for every repository under "private/", as a registry does
// for an image the build's credentials may not read.
func newGuardedRegistry(t *testing.T) *testRegistry {
	t.Helper()
	inner := ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v2/private/") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required","detail":[{"Type":"repository","Name":"private/base","Action":"pull"}]}]}`)
			return
		}
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	c, err := registry.New(registry.Options{Insecure: []string{host}})
	if err != nil {
		t.Fatal(err)
	}
	return &testRegistry{host: host, addr: host, client: c, srv: srv}
}

func TestLocalBaseImageThatCannotBePulledFailsOnce(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, from, reason string
		words              []string
	}{
		{"a 404 base is BaseImageNotFound", "{reg}/acme/nope:1", v1.ReasonBaseImageNotFound, []string{"{reg}/acme/nope:1", "NAME_UNKNOWN: Unknown name"}},
		{"a 401 base is BaseImageUnauthorized", "{reg}/private/base:1", v1.ReasonBaseImageUnauthorized, []string{"{reg}/private/base:1", "UNAUTHORIZED: authentication required"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newGuardedRegistry(t)
			from := strings.ReplaceAll(c.from, "{reg}", tr.host)
			digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM " + from + "\nCOPY app /app\n", "app": "hello"})
			r := tenantRequestFor("acme", digest)
			r.RequestID = "missing-base"
			e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), withRegistry(tr))
			results := e.collect()
			events := e.events()
			start := time.Now()
			if _, err := e.pub.Publish(context.Background(), r); err != nil {
				t.Fatal(err)
			}
			res := results.waitFor(t, 1, 20*time.Second)[0]
			took := time.Since(start)
			d := res.Data
			if d.Status != v1.StatusFailed || d.Reason != c.reason || d.Attempts != 1 {
				t.Fatalf("result %s, want failed/%s after 1 attempt", mustJSON(t, res), c.reason)
			}
			for _, w := range c.words {
				if w = strings.ReplaceAll(w, "{reg}", tr.host); !strings.Contains(d.Message, w) {
					t.Errorf("message %q does not say %q", d.Message, w)
				}
			}
			// Fast: the first retry of a transient failure alone waits 2 s.
			if took > 5*time.Second {
				t.Errorf("answered after %s", took)
			}
			eventually(t, 5*time.Second, "request settled", func() bool {
				msgs, pending, _ := e.streamState()
				return msgs == 0 && pending == 0
			})
			time.Sleep(200 * time.Millisecond)
			if dl := e.streamMsgs(v1.DeadLetterStream); len(dl) != 0 {
				t.Errorf("%d dead letters, want none", len(dl))
			}
			if n := results.publishes(r.RequestID); n != 1 {
				t.Errorf("%d results published, want 1", n)
			}
			for _, ev := range events.decoded() {
				if ev.RequestID == r.RequestID && strings.HasPrefix(ev.Message, "retrying") {
					t.Errorf("progress event of a retry: %+v", ev)
				}
			}
		})
	}
}

// Origin: issue 28 ("dev's 'created job local-…' names no Job; a cache hit
// says 'pushed'").
func TestLocalProgressSaysWhatHappened(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "hello"})
	r := tenantRequestFor("acme", digest)
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), withRegistry(tr))
	results := e.collect()
	events := e.events()
	r.RequestID = "first"
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	if res := results.waitFor(t, 1, 20*time.Second)[0]; res.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	r2 := *r
	r2.RequestID = "second"
	if _, err := e.pub.Publish(context.Background(), &r2); err != nil {
		t.Fatal(err)
	}
	if res := byID(results.waitFor(t, 2, 20*time.Second))["second"][0]; res.Data.Origin != v1.OriginCache {
		t.Fatalf("second result %s, want a cache hit", mustJSON(t, res))
	}
	eventually(t, 5*time.Second, "both finished events", func() bool {
		return events.has("first", v1.PhaseFinished) && events.has("second", v1.PhaseFinished)
	})
	var started, cached string
	for _, ev := range events.decoded() {
		switch {
		case ev.RequestID == "first" && ev.Phase == v1.PhaseJobCreated:
			started = ev.Message
		case ev.RequestID == "second" && ev.Phase == v1.PhaseFinished:
			cached = ev.Message
		}
		if strings.Contains(ev.Message, "created job") {
			t.Errorf("a local build's event names a Job: %+v", ev)
		}
	}
	if !strings.Contains(started, "building locally") {
		t.Errorf("the local build's start says %q", started)
	}
	if !strings.HasPrefix(cached, "succeeded (cache)") || !strings.Contains(cached, "nothing built") || strings.Contains(cached, "pushed") {
		t.Errorf("the cache hit's finished event says %q", cached)
	}
}

// The kaniko executor's words for a base image it could not get: the
// build fails once, with the new reason and the registry's words, and
// the request is acked, not dead-lettered.
func TestKanikoBaseImageNotFoundFailsOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	req := request("kaniko-missing-base")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 1, "INFO[0000] Retrieving image manifest registry.test:5000/acme/nope:1\n"+
		"error building image: unable to complete operation after 0 attempts, last error: GET https://registry.test:5000/v2/acme/nope/manifests/1: MANIFEST_UNKNOWN: manifest unknown; map[Tag:1]")
	r := results.waitFor(t, 1, 10*time.Second)[0]
	d := r.Data
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonBaseImageNotFound || d.Attempts != 1 ||
		!strings.Contains(d.Message, "registry.test:5000/acme/nope:1") || !strings.Contains(d.Message, "MANIFEST_UNKNOWN: manifest unknown") {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	eventually(t, 5*time.Second, "request acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if dl := e.streamMsgs(v1.DeadLetterStream); len(dl) != 0 {
		t.Errorf("%d dead letters, want none", len(dl))
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

// A request retried after a transient failure: the progress events say
// why (the retry, and the run retried), and the worker's log says it
// retries its own run rather than "took over" from someone.
//
// Origin: issue 28 ("the progress events repeat 'claimed/building'
// without the reason, and the log says 'took over a build run' on each
// retry of a single worker").
func TestRetriedBuildsProgressSaysWhy(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.failJobCreates(func(n int64) bool { return n == 1 })
	core, logs := observer.New(zapcore.InfoLevel)
	e.startWorker("w1", func(c *Config) { c.Logger = zap.New(core).Named("w1") })
	results := e.collect()
	events := e.events()
	req := request("retried")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 0, digestOf("retried"))
	r := results.waitFor(t, 1, 15*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	eventually(t, 5*time.Second, "the finished event", func() bool { return events.has(req.RequestID, v1.PhaseFinished) })
	var retry, queued, claimed []string
	for _, ev := range events.decoded() {
		if ev.RequestID != req.RequestID {
			continue
		}
		switch {
		case ev.Phase == v1.PhaseWaiting && strings.HasPrefix(ev.Message, "retrying"):
			retry = append(retry, ev.Message)
		case ev.Phase == v1.PhaseQueued:
			queued = append(queued, ev.Message)
		case ev.Phase == v1.PhaseClaimed:
			claimed = append(claimed, ev.Message)
		}
	}
	if len(retry) != 1 || !strings.Contains(retry[0], v1.ReasonInfrastructureError) || !strings.Contains(retry[0], "create job") ||
		!strings.Contains(retry[0], "etcdserver: leader changed") || !strings.Contains(retry[0], "transient failure 1 of at most 5") {
		t.Errorf("retry events %q: want one, with the reason and the API server's words", retry)
	}
	if len(queued) != 2 || !strings.Contains(queued[1], "retry after transient failure 1") {
		t.Errorf("queued events %q: want the second to say it is a retry", queued)
	}
	if len(claimed) != 2 || !strings.Contains(claimed[1], "retrying the run after "+v1.ReasonInfrastructureError) || !strings.Contains(claimed[1], "create job") {
		t.Errorf("claimed events %q: want the second to say the run is retried and why", claimed)
	}
	if n := logs.FilterMessage("took over a build run").Len(); n != 0 {
		t.Errorf("the worker logged %d take-overs of its own run", n)
	}
	if n := logs.FilterMessage("retries its build run").Len(); n != 1 {
		t.Errorf("the worker logged %d retries of its run, want 1", n)
	}
}

// A Job that runs its build again in a new Pod (its executor killed,
// exit 137): the request's progress events say so, and why.
//
// Origin: issue 28 ("progress events carry every retry's reason").
func TestJobPodRetryProgressSaysWhy(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	events := e.events()
	req := request("pod-retry")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	// The Job's first Pod: its executor killed from outside (the Job
	// retries exit 137 within its backoff limit).
	killed := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: job.Name + "-0", Namespace: testNamespace, Labels: merge(job.Spec.Template.Labels, map[string]string{
			batchv1.JobNameLabel: job.Name, batchv1.ControllerUidLabel: string(job.UID), "job-name": job.Name})},
		Spec: job.Spec.Template.Spec,
		Status: corev1.PodStatus{Phase: corev1.PodFailed, ContainerStatuses: []corev1.ContainerStatus{{Name: kaniko.ContainerName,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 137, Reason: "Error"}}}}},
	}
	if _, err := e.kube.CoreV1().Pods(testNamespace).Create(context.Background(), killed, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.kubelet(job, 0, digestOf("pod-retry")) // the second Pod builds it
	if r := results.waitFor(t, 1, 15*time.Second)[0]; r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	eventually(t, 5*time.Second, "the finished event", func() bool { return events.has(req.RequestID, v1.PhaseFinished) })
	var again []string
	for _, ev := range events.decoded() {
		if ev.RequestID == req.RequestID && ev.Phase == v1.PhaseRunning && strings.Contains(ev.Message, "runs the build again") {
			again = append(again, ev.Message)
		}
	}
	if len(again) != 1 || !strings.Contains(again[0], "the executor in pod "+killed.Name+" exited 137") {
		t.Fatalf("progress of the Pod's retry: %q", again)
	}
}
