//go:build integration

package integration

import (
	"context"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// jobsCreated counts the distinct Jobs that ever existed in the namespace.
func (s *suite) jobsCreated() func() int {
	s.t.Helper()
	return s.countAdded(func(ctx context.Context) (watch.Interface, error) {
		return shared.kube.BatchV1().Jobs(s.ns).Watch(ctx, metav1.ListOptions{})
	})
}

// countAdded counts the distinct objects (by UID) a watch reports added.
func (s *suite) countAdded(start func(context.Context) (watch.Interface, error)) func() int {
	s.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.t.Cleanup(cancel)
	w, err := start(ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[types.UID]bool{}
	go func() {
		for ev := range w.ResultChan() {
			if o, err := meta.Accessor(ev.Object); err == nil && ev.Type == watch.Added {
				mu.Lock()
				seen[o.GetUID()] = true
				mu.Unlock()
			}
		}
	}()
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(seen)
	}
}

var siteFiles = map[string]string{
	"Dockerfile": "FROM scratch\nARG V=1\nLABEL org.example.v=$V\nENV APP=site\nCOPY public/ /srv/\nENTRYPOINT [\"/srv/run\"]\n",
	"public/run": "#!/bin/sh\n",
	"public/a":   "a",
}

func TestBuildThroughRealComponents(t *testing.T) {
	s := newSuite(t, options{workerArgs: []string{"--keep-jobs"}})
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()

	req := s.submit(contextDir(t, siteFiles), "site", 1)[0]
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(r))
	}
	// The registry serves exactly the digest the result names.
	d, err := s.regClient.Head(context.Background(), r.Data.Image)
	if err != nil || d != r.Data.Digest {
		t.Fatalf("registry has %s (%v), result says %s", d, err, r.Data.Digest)
	}
	ref, _ := name.ParseReference(r.Data.ImageRef, name.Insecure)
	if ref.Context().RegistryStr() != shared.registryHost {
		t.Errorf("image ref %s", r.Data.ImageRef)
	}
	// The Job the worker created, run through a Pod the real Job
	// controller created.
	job, err := shared.kube.BatchV1().Jobs(s.ns).Get(context.Background(), r.Data.Job, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if job.Annotations[kaniko.AnnotationRequestID] != req.RequestID || job.Labels[kaniko.LabelManagedBy] != "buildq" {
		t.Errorf("job metadata %v %v", job.Labels, job.Annotations)
	}
	pods, err := shared.kube.CoreV1().Pods(s.ns).List(context.Background(), metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=" + job.Name})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("pods %v %v", pods, err)
	}
	if own := metav1.GetControllerOf(&pods.Items[0]); own == nil || own.UID != job.UID {
		t.Errorf("pod not owned by the job: %v", pods.Items[0].OwnerReferences)
	}
	if jobs() != 1 {
		t.Errorf("%d jobs, want 1", jobs())
	}
}

func TestDockerfileErrorFailsTheJobAtOnce(t *testing.T) {
	s := newSuite(t, options{workerArgs: []string{"--keep-jobs"}})
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY missing-file /x\n"}), "broken", 1)
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonBuildFailed || !strings.Contains(r.Data.LogTail, "missing-file") {
		t.Fatalf("result %s", mustJSON(r))
	}
	// The real Job controller failed it through the pod failure policy:
	// one pod, no retries.
	// (The worker acts on the interim FailureTarget condition; the
	// controller adds Failed once the pod's finalizer is gone.)
	var job *batchv1.Job
	failedBy := ""
	eventually(t, time.Minute, "the Failed condition", func() bool {
		j, err := shared.kube.BatchV1().Jobs(s.ns).Get(context.Background(), r.Data.Job, metav1.GetOptions{})
		if err != nil {
			return false
		}
		job = j
		for _, c := range j.Status.Conditions {
			if c.Type == batchv1.JobFailed && c.Status == corev1.ConditionTrue {
				failedBy = c.Reason
				return true
			}
		}
		return false
	})
	if failedBy != batchv1.JobReasonPodFailurePolicy || job.Status.Failed != 1 || s.kubelet.podsRun() != 1 {
		t.Errorf("job failed by %q after %d pod(s), kubelet ran %d", failedBy, job.Status.Failed, s.kubelet.podsRun())
	}
}

func TestWrongRegistryPasswordIsPushFailed(t *testing.T) {
	s := newSuite(t, options{registryPassword: "not-the-password"})
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "push me"}), "denied", 1)
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonPushFailed {
		t.Fatalf("result %s", mustJSON(r))
	}
}

func TestIdenticalRequestsAcrossTwoWorkersMakeOneJob(t *testing.T) {
	hold := make(chan struct{})
	s := newSuite(t, options{faults: func(*corev1.Pod) fault { return fault{hold: hold} }})
	jobs := s.jobsCreated()
	s.startWorker("w1")
	s.startWorker("w2")
	res := s.collect()
	reqs := s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "twenty"}), "same", 20)
	// Let both workers take their share while the build runs.
	eventually(t, time.Minute, "the job", func() bool { return jobs() >= 1 })
	time.Sleep(2 * time.Second)
	close(hold)
	got := res.wait(t, 20, 2*time.Minute)
	ids := map[string]bool{}
	builds := 0
	for _, r := range got {
		ids[r.ID] = true
		if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != got[0].Data.Digest {
			t.Errorf("result %s", mustJSON(r))
		}
		if r.Data.Origin == v1.OriginBuild {
			builds++
		}
	}
	for _, q := range reqs {
		if !ids[q.RequestID] {
			t.Errorf("no result for %s", q.RequestID)
		}
	}
	if jobs() != 1 || builds != 1 {
		t.Errorf("%d jobs, %d results with origin build; want 1 and 1", jobs(), builds)
	}
	if n := s.storedResults(); n != 20 {
		t.Errorf("%d results stored, want 20", n)
	}
}

func TestWorkerKilledMidBuildLosesNothing(t *testing.T) {
	hold := make(chan struct{})
	s := newSuite(t, options{faults: func(*corev1.Pod) fault { return fault{hold: hold} }})
	jobs := s.jobsCreated()
	w1 := s.startWorker("w1")
	res := s.collect()
	req := s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "killed"}), "killed", 1)[0]
	eventually(t, time.Minute, "the job", func() bool { return jobs() >= 1 })

	// SIGKILL: no hand-back, no claim release.
	if err := w1.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-w1.done
	close(hold) // the build finishes while no worker runs
	time.Sleep(time.Second)
	s.startWorker("w2")
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	time.Sleep(2 * time.Second)
	if n := s.storedResults(); n != 1 {
		t.Errorf("%d results stored, want exactly 1", n)
	}
	if jobs() != 1 {
		t.Errorf("%d jobs, want 1 (the dead worker's Job adopted)", jobs())
	}
}

func TestBrokenWatchMissesNoCompletion(t *testing.T) {
	hold := make(chan struct{})
	s := newSuite(t, options{faults: func(*corev1.Pod) fault { return fault{hold: hold} }})
	proxy, kubeconfig := startAPIProxy(t)
	s.kubeconfig = kubeconfig
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "watch"}), "watch", 1)
	eventually(t, time.Minute, "the job", func() bool { return jobs() >= 1 })

	// Break the worker's watches and keep the API server out of its reach
	// while the build completes: the Job controller and the kubelet carry
	// on, the worker sees nothing. When it reconnects, its informers must
	// catch up (re-watch or relist) and it must publish the result.
	proxy.cut()
	close(hold)
	eventually(t, time.Minute, "the job to complete", func() bool {
		list, err := shared.kube.BatchV1().Jobs(s.ns).List(context.Background(), metav1.ListOptions{})
		if err != nil || len(list.Items) == 0 {
			return false
		}
		for _, c := range list.Items[0].Status.Conditions {
			if c.Type == batchv1.JobComplete && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	time.Sleep(2 * time.Second)
	if n := len(res.wait(t, 0, time.Second)); n != 0 {
		t.Fatalf("a result arrived while the worker could not see the API server")
	}
	proxy.restore()
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
}

// firstPodFault applies f to the first pod only; later pods run normally.
func firstPodFault(f fault) func(*corev1.Pod) fault {
	var mu sync.Mutex
	first := true
	return func(*corev1.Pod) fault {
		mu.Lock()
		defer mu.Unlock()
		if first {
			first = false
			return f
		}
		return fault{}
	}
}

func TestRetryableExitIsRetriedByTheJob(t *testing.T) {
	// Exit code 128 is the runtime failing to start the container, not a
	// build error (the pod failure policy fails the Job at once on the
	// codes of build errors, kaniko.RetriedExitCodes): it counts against
	// the backoff limit and the Job controller starts another pod.
	s := newSuite(t, options{faults: firstPodFault(fault{exitCode: 128, message: "failed to create containerd task"})})
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "retry"}), "retry", 1)
	r := res.wait(t, 1, 3*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded || s.kubelet.podsRun() != 2 {
		t.Fatalf("result %s after %d pods", mustJSON(r), s.kubelet.podsRun())
	}
}

func TestDeletedPodIsReplaced(t *testing.T) {
	s := newSuite(t, options{faults: firstPodFault(fault{deletePod: true})})
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "deleted pod"}), "podgone", 1)
	r := res.wait(t, 1, 3*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded || s.kubelet.podsRun() != 2 {
		t.Fatalf("result %s after %d pods", mustJSON(r), s.kubelet.podsRun())
	}
}
