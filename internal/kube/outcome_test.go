package kube

import (
	"fmt"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

func job(conds ...batchv1.JobCondition) *batchv1.Job {
	j := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "buildq-x", Namespace: "b"}}
	j.Status.Conditions = conds
	return j
}

func cond(t batchv1.JobConditionType, reason string) batchv1.JobCondition {
	return batchv1.JobCondition{Type: t, Status: corev1.ConditionTrue, Reason: reason, LastTransitionTime: metav1.Now()}
}

// failJob is the Job controller's condition when its pod failure
// policy's FailJob rule matched container's exit code.
func failJob(container string, exit int32) batchv1.JobCondition {
	c := cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)
	c.Message = fmt.Sprintf("Container %s for pod b/buildq-x-abcde failed with exit code %d matching FailJob rule at index 0", container, exit)
	return c
}

func pod(exit int32, reason, msg string, age time.Duration) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p" + reason, CreationTimestamp: metav1.NewTime(time.Now().Add(-age))}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: kaniko.ContainerName,
		State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: exit, Reason: reason, Message: msg}}}}
	return p
}

func fetchFailed(exit int32, msg string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pfetch", CreationTimestamp: metav1.Now()}}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: kaniko.FetchContainerName,
		State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: exit, Reason: "Error", Message: msg}}}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: kaniko.ContainerName,
		State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "PodInitializing"}}}}
	return p
}

func TestJobOutcome(t *testing.T) {
	t.Parallel()
	digest := "sha256:" + strings.Repeat("d", 64)
	cases := []struct {
		name                          string
		job                           *batchv1.Job
		pods                          []*corev1.Pod
		done, ok, pending, needLogs   bool
		reason, digest, tail, message string
	}{
		{name: "running", job: job(), pods: nil},
		{name: "complete with digest", job: job(cond(batchv1.JobComplete, "")), pods: []*corev1.Pod{pod(0, "Completed", digest+"\n", 0)},
			done: true, ok: true, digest: digest},
		{name: "success criteria met counts as done", job: job(cond(batchv1.JobSuccessCriteriaMet, "")), pods: []*corev1.Pod{pod(0, "Completed", digest, 0)},
			done: true, ok: true, digest: digest},
		{name: "complete before its pod is cached", job: job(cond(batchv1.JobComplete, "")), done: true, ok: true, pending: true},
		{name: "failure target counts as done", job: job(cond(batchv1.JobFailureTarget, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{pod(1, "Error", "error building image: parsing dockerfile", 0)}, done: true, reason: v1.ReasonBuildFailed, tail: "parsing dockerfile"},
		{name: "deadline", job: job(cond(batchv1.JobFailed, batchv1.JobReasonDeadlineExceeded)), pods: []*corev1.Pod{pod(137, "Error", "killed", 0)},
			done: true, reason: v1.ReasonDeadlineExceeded},
		{name: "push denied", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{pod(1, "Error", "error pushing image: failed to push to destination r/x:y: UNAUTHORIZED", 0)}, done: true, reason: v1.ReasonPushFailed},
		{name: "context missing", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{pod(1, "Error", "error: failed to get context: NoSuchKey", 0)}, done: true, reason: v1.ReasonContextMissing},
		{name: "OOMKilled without a message reads pods/log", job: job(cond(batchv1.JobFailed, batchv1.JobReasonBackoffLimitExceeded)),
			pods: []*corev1.Pod{pod(137, "OOMKilled", "", 0)}, done: true, reason: v1.ReasonBuildFailed, needLogs: true, message: "out of memory"},
		{name: "kaniko's usage text is cut off its error", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{pod(1, "Error", "Error: error resolving dockerfile path: please provide a valid path to a Dockerfile within the build context\nUsage:\n  executor [flags]\n  executor [command]\n\nFlags:\n      --build-arg multi-arg type\n\nUse \"executor [command] --help\" for more information about a command.\n", 0)},
			done: true, reason: v1.ReasonBuildFailed, tail: "valid path to a Dockerfile within the build context"},
		{name: "a message of usage text only reads pods/log", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{pod(1, "Error", "      --verbosity string   Log level\n\nUse \"executor [command] --help\" for more information about a command.\n", 0)},
			done: true, reason: v1.ReasonBuildFailed, needLogs: true},
		{name: "fetch-context found other bytes", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{fetchFailed(kaniko.FetchExitMismatch, "context mismatch: contexttar: the context's bytes do not match its digest")},
			done: true, reason: v1.ReasonContextMismatch, tail: "do not match its digest"},
		{name: "fetch-context found no object", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{fetchFailed(kaniko.FetchExitRefused, "context missing: GET http://s3/b/k answered 404 Not Found")},
			done: true, reason: v1.ReasonContextMissing, tail: "404"},
		{name: "fetch-context could not fetch: this request's source, not the content", job: job(cond(batchv1.JobFailed, batchv1.JobReasonBackoffLimitExceeded)),
			pods: []*corev1.Pod{fetchFailed(1, "contexttar: GET http://s3/b/k: connection refused")},
			done: true, reason: v1.ReasonContextMissing, tail: "connection refused"},
		{name: "the named context is itself unusable", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{fetchFailed(kaniko.FetchExitBadContext, "context refused: contexttar: unsafe path")},
			done: true, reason: v1.ReasonBuildFailed, tail: "unsafe path"},
		{name: "fetch-context found the first tag taken: nothing built", job: job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)),
			pods: []*corev1.Pod{fetchFailed(kaniko.FetchExitTagTaken, "tag taken: r/acme/web:0123 holds sha256:aa already; the build would push over it")},
			done: true, reason: v1.ReasonTagTaken, tail: "tag taken"},
		{name: "fetch-context's failure named by the Job alone (its Pod gone): the tag taken", job: job(failJob(kaniko.FetchContainerName, kaniko.FetchExitTagTaken)),
			done: true, reason: v1.ReasonTagTaken},
		{name: "fetch-context's failure named by the Job alone (its Pod gone): other bytes", job: job(failJob(kaniko.FetchContainerName, kaniko.FetchExitMismatch)),
			done: true, reason: v1.ReasonContextMismatch},
		{name: "fetch-context could not ask the registry, attempt after attempt", job: job(cond(batchv1.JobFailed, batchv1.JobReasonBackoffLimitExceeded)),
			pods: []*corev1.Pod{fetchFailed(kaniko.FetchExitRegistryDown, "checking that r/acme/web:0123 holds no image yet: 503 Service Unavailable")},
			done: true, reason: v1.ReasonPushFailed, tail: "503"},
		{name: "the registry refused fetch-context's check", job: job(failJob(kaniko.FetchContainerName, kaniko.FetchExitRegistry)),
			pods: []*corev1.Pod{fetchFailed(kaniko.FetchExitRegistry, "checking that r/acme/web:0123 holds no image yet: UNAUTHORIZED")},
			done: true, reason: v1.ReasonPushFailed, tail: "UNAUTHORIZED"},
		{name: "the Job's fetch-context failure decides over an earlier attempt's kaniko Pod", job: job(failJob(kaniko.FetchContainerName, kaniko.FetchExitTagTaken)),
			pods: []*corev1.Pod{pod(137, "OOMKilled", "error pushing image: killed", time.Hour)},
			done: true, reason: v1.ReasonTagTaken},
		{name: "kaniko's failure named by the Job alone is no fetch-context failure", job: job(failJob(kaniko.ContainerName, kaniko.FetchExitTagTaken)),
			done: true, reason: v1.ReasonBuildFailed},
		{name: "the newest pod decides", job: job(cond(batchv1.JobFailed, batchv1.JobReasonBackoffLimitExceeded)),
			pods: []*corev1.Pod{pod(1, "Old", "error pushing image: old attempt", time.Hour), pod(1, "New", "error building image: new attempt", 0)},
			done: true, reason: v1.ReasonBuildFailed, tail: "new attempt"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			o := JobOutcome(c.job, c.pods)
			if strings.Contains(o.LogTail, "Usage:") || strings.Contains(o.LogTail, "--help") {
				t.Errorf("log tail keeps kaniko's usage text: %q", o.LogTail)
			}
			if o.Done != c.done || o.Succeeded != c.ok || o.Pending != c.pending || o.NeedLogs != c.needLogs ||
				o.Reason != c.reason || o.Digest != c.digest || !strings.Contains(o.LogTail, c.tail) || !strings.Contains(o.Message, c.message) {
				t.Fatalf("outcome %+v", o)
			}
		})
	}
}

func TestTail(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	for i := range 1000 {
		fmt.Fprintf(&b, "line %d\n", i)
	}
	got := Tail(b.String(), 100)
	if len(got) > 100 || !strings.HasPrefix(got, "line ") || !strings.HasSuffix(got, "line 999") {
		t.Fatalf("tail %q: want whole lines ending with the last one", got)
	}
}
