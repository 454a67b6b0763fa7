package kube

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// MaxLogTail bounds the log tail carried in a result.
const MaxLogTail = 4096

var digestRe = regexp.MustCompile(`sha256:[a-f0-9]{64}`)

// Outcome is what a finished Job says about its build.
type Outcome struct {
	Done       bool
	Succeeded  bool
	Digest     string
	Reason     string
	Message    string
	LogTail    string
	StartedAt  time.Time
	FinishedAt time.Time
	// NeedLogs is set for a failure whose pod left no termination message:
	// the caller may read the tail from pods/log (LogPod names the pod).
	NeedLogs bool
	LogPod   string
	// Pending is set for a success whose digest is not in the pod cache
	// (yet): wait for the next pod event.
	Pending bool
}

// JobOutcome reads the outcome of a Job from the Job and its Pods. It is a
// pure function of cached objects, so it is safe to call on every event.
func JobOutcome(job *batchv1.Job, pods []*corev1.Pod) Outcome {
	done, ok := Finished(job)
	if !done {
		return Outcome{}
	}
	out := Outcome{Done: true, Succeeded: ok}
	if job.Status.StartTime != nil {
		out.StartedAt = job.Status.StartTime.Time
	}
	if job.Status.CompletionTime != nil {
		out.FinishedAt = job.Status.CompletionTime.Time
	}
	for _, c := range job.Status.Conditions {
		if c.Status == corev1.ConditionTrue && out.FinishedAt.IsZero() &&
			(c.Type == batchv1.JobComplete || c.Type == batchv1.JobFailed || c.Type == batchv1.JobSuccessCriteriaMet || c.Type == batchv1.JobFailureTarget) {
			out.FinishedAt = c.LastTransitionTime.Time
		}
	}
	// Newest pods first: the last attempt decides.
	sorted := append([]*corev1.Pod(nil), pods...)
	sort.SliceStable(sorted, func(i, j int) bool {
		return sorted[j].CreationTimestamp.Before(&sorted[i].CreationTimestamp)
	})

	if ok {
		for _, p := range sorted {
			if t := kanikoTerminated(p); t != nil && t.ExitCode == 0 {
				if d := digestRe.FindString(t.Message); d != "" {
					out.Digest = d
					return out
				}
			}
		}
		// The Job and Pod informers are separate streams: the Job's
		// completion can arrive before its Pod's final status. Wait for it;
		// the caller bounds the wait for Pods that are gone for good.
		out.Pending = true
		return out
	}

	var cond *batchv1.JobCondition
	for i := range job.Status.Conditions {
		c := &job.Status.Conditions[i]
		if c.Status == corev1.ConditionTrue && (c.Type == batchv1.JobFailed || c.Type == batchv1.JobFailureTarget) {
			cond = c
			break
		}
	}
	out.Reason = v1.ReasonBuildFailed
	if cond != nil {
		out.Message = strings.TrimSpace(cond.Reason + ": " + cond.Message)
		if cond.Reason == batchv1.JobReasonDeadlineExceeded {
			out.Reason = v1.ReasonDeadlineExceeded
		}
	}
	if code, ok := fetchFailedJob(cond); ok {
		// The Job controller failed the Job on fetch-context's exit code
		// (its pod failure policy): that decides, whatever an earlier
		// attempt's Pod says, and also when the failing Pod is gone
		// (deleted, or not in the cache yet). Its message is the log
		// tail when that Pod is at hand.
		for _, p := range sorted {
			if t := fetchTerminated(p); t != nil && t.ExitCode == code {
				out.LogPod, out.LogTail = p.Name, Tail(t.Message, MaxLogTail)
				break
			}
		}
		classifyFetchFailure(&out, code)
		return out
	}
	for _, p := range sorted {
		// The context never reached kaniko: fetch-context says why.
		if t := fetchTerminated(p); t != nil && t.ExitCode != 0 {
			out.LogPod = p.Name
			out.LogTail = Tail(t.Message, MaxLogTail)
			classifyFetchFailure(&out, t.ExitCode)
			return out
		}
		t := kanikoTerminated(p)
		if t == nil || t.ExitCode == 0 {
			continue
		}
		out.LogPod = p.Name
		out.LogTail = Tail(StripUsage(t.Message), MaxLogTail)
		if t.Reason == "OOMKilled" {
			out.Message = "the build ran out of memory (OOMKilled); raise the executor's memory limit"
		}
		break
	}
	if out.LogTail == "" {
		// No termination message, or one that held only kaniko's usage
		// text: the log itself says what failed.
		out.NeedLogs = out.LogPod != "" || len(sorted) > 0
		if out.LogPod == "" && len(sorted) > 0 {
			out.LogPod = sorted[0].Name
		}
	}
	if out.Reason == v1.ReasonBuildFailed {
		reason, message := ClassifyFailure(out.LogTail)
		out.Reason = reason
		if message != "" {
			out.Message = message
		}
	}
	return out
}

// classifyFetchFailure sets out's reason for fetch-context's exit code.
func classifyFetchFailure(out *Outcome, code int32) {
	switch code {
	case kaniko.FetchExitMismatch:
		out.Reason = v1.ReasonContextMismatch
	case kaniko.FetchExitTagTaken:
		// Refused before the build began: nothing was pushed.
		out.Reason = v1.ReasonTagTaken
		out.Message = "the build's first tag held an image when its Pod started; nothing was built"
	case kaniko.FetchExitRegistry, kaniko.FetchExitRegistryDown:
		// The registry refused the Pod's check of its tag, or could not
		// answer it attempt after attempt: the destination's registry,
		// as for a push.
		out.Reason = v1.ReasonPushFailed
		out.Message = "the build Pod could not check its first tag in the registry before building (the log tail says why)"
	case kaniko.FetchExitBadContext:
		// The named context's own fault: every request for it shares it.
	default:
		// Missing, or not fetched at all: this request's source, not the
		// content (a joiner with another source retries).
		if out.Reason != v1.ReasonDeadlineExceeded {
			out.Reason = v1.ReasonContextMissing
		}
	}
}

// failJobRe is the Job controller's message when a pod failure policy's
// FailJob rule matched a container's exit code (pkg/controller/job,
// pod_failure_policy.go).
var failJobRe = regexp.MustCompile(`^Container (\S+) for pod \S+ failed with exit code (\d+) matching FailJob rule`)

// fetchFailedJob is the fetch-context exit code a Job's failure condition
// names, if its pod failure policy failed it on one.
func fetchFailedJob(cond *batchv1.JobCondition) (int32, bool) {
	if cond == nil || cond.Reason != batchv1.JobReasonPodFailurePolicy {
		return 0, false
	}
	m := failJobRe.FindStringSubmatch(cond.Message)
	if len(m) != 3 || m[1] != kaniko.FetchContainerName {
		return 0, false
	}
	var code int32
	if _, err := fmt.Sscan(m[2], &code); err != nil || code == 0 {
		return 0, false
	}
	return code, true
}

// StripUsage cuts the flag reference kaniko prints after an error in its
// arguments or setup ("Error: …" then "Usage:" and a hundred lines of
// flags) down to what came before it. In a 2 KiB termination message the
// usage text is all there is; the caller then reads the log itself.
func StripUsage(log string) string {
	i := strings.Index(log, "Usage:\n  executor")
	if i < 0 {
		// Cut off at the front: the message starts inside the flag list.
		if !strings.Contains(log, "Use \"executor [command] --help\"") {
			return log
		}
		i = 0
	}
	return strings.TrimRight(log[:i], "\n")
}

// ClassifyLog picks a reason from the executor's log tail. kaniko reports
// everything through its log and exit code 1, so its wording is the only
// signal there is.
func ClassifyLog(tail string) string {
	reason, _ := ClassifyFailure(tail)
	return reason
}

// ClassifyFailure picks a reason from the executor's log tail, and for a
// base image that could not be pulled a message that says which image and
// why, in the registry's own words (message is "" otherwise: the Job's
// condition says enough).
func ClassifyFailure(tail string) (reason, message string) {
	if reason, message := classifyPlatform(tail); reason != "" {
		return reason, message
	}
	if reason, message := classifyBaseImage(tail); reason != "" {
		return reason, message
	}
	l := strings.ToLower(tail)
	switch {
	case strings.Contains(l, "error pushing image"), strings.Contains(l, "failed to push"),
		strings.Contains(l, "push access denied"), strings.Contains(l, "checking push permissions"),
		strings.Contains(l, "unauthorized"):
		return v1.ReasonPushFailed, ""
	case strings.Contains(l, "nosuchkey"), strings.Contains(l, "failed to get context"),
		strings.Contains(l, "error retrieving context"), strings.Contains(l, "context missing"):
		return v1.ReasonContextMissing, ""
	}
	return v1.ReasonBuildFailed, ""
}

// kaniko runs a RUN step's program on the node itself (no emulation of
// its own): on a node whose kernel cannot execute the platform's binaries
// starting it fails, and kaniko ends with (chainguard-dev/kaniko v1.25.0:
// pkg/commands/run.go "starting command", pkg/executor/build.go "failed
// to execute command" and "error building stage", cmd/executor/cmd/root.go
// "error building image")
//
//	error building image: error building stage: failed to execute command: starting command: fork/exec /bin/sh: exec format error
//
// Only that final line counts: a RUN step's own output saying "exec
// format error" (a script running a foreign binary, exit 126) is that
// step's failure, and kaniko's line then says "waiting for process to
// exit".
const execFormatError = "exec format error"

// classifyPlatform reads kaniko's final error line for a RUN step whose
// program the node could not execute; reason is "" otherwise.
func classifyPlatform(tail string) (reason, message string) {
	lines := strings.Split(tail, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if !strings.Contains(lines[i], "error building image:") {
			continue
		}
		line := strings.TrimSpace(lines[i])
		if !strings.Contains(line, execFormatError) {
			return "", ""
		}
		return v1.ReasonPlatformUnsupported, fmt.Sprintf(
			"a RUN step's program could not execute on the build's node: %q. The node does not run the requested platform's programs and has no emulation for them (binfmt_misc): build the platform on its own nodes (the default node selector), or name nodes that run it natively with the worker's --platform-node-selector", line)
	}
	return "", ""
}

// BuildPodEgressPolicy names what most often keeps a build Pod from a
// base image's registry: the build Pods' egress NetworkPolicy, which
// (as shipped in deploy/base) allows DNS, the push registry and the S3
// store only.
const BuildPodEgressPolicy = "the build Pods' egress NetworkPolicy (buildq-builds in namespace buildq-builds, shipped in deploy/base)"

// kaniko ends a failed build with one line on stderr, "error building
// image: <cause>"; a base image it could not get (FROM, COPY --from, an
// image's layers) is a cause in go-containerregistry's words, e.g.
// "GET https://r/v2/a/manifests/1: MANIFEST_UNKNOWN: manifest unknown",
// "… UNAUTHORIZED: authentication required", "unexpected status code 404
// Not Found", "dial tcp 1.2.3.4:443: i/o timeout". Before it, an info line
// "Retrieving image manifest <ref>" names the image being pulled. A
// failing instruction (RUN, ADD of a URL) is "… failed to execute
// command: …" and is not a base image's (its output comes on lines of
// its own, and is not looked at). The registry's error codes are matched
// as the registry spells them (upper case), so a "permission denied" of a
// file is not one.
var (
	retrievingRe = regexp.MustCompile(`Retrieving image (?:manifest )?(\S+)`)

	baseNotFound = []string{"MANIFEST_UNKNOWN", "NAME_UNKNOWN", "404 Not Found",
		"image not found on any configured mapped registries"}
	baseUnauthorized = []string{"UNAUTHORIZED", "DENIED", "401 Unauthorized", "403 Forbidden"}
	baseUnreachable  = []string{"dial tcp", "connection refused", "i/o timeout", "no route to host", "network is unreachable",
		"TLS handshake timeout", "connection reset by peer", "Client.Timeout exceeded", "context deadline exceeded"}
)

// classifyBaseImage reads kaniko's final error line for a base image it
// could not pull; reason is "" when the failure is something else.
func classifyBaseImage(tail string) (reason, message string) {
	lines := strings.Split(tail, "\n")
	at := -1
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], "error building image:") {
			at = i
			break
		}
	}
	if at < 0 || strings.Contains(lines[at], "failed to execute command") {
		return "", ""
	}
	words := strings.TrimSpace(lines[at])
	has := func(marks []string) bool {
		for _, m := range marks {
			if strings.Contains(words, m) {
				return true
			}
		}
		return false
	}
	image := "a base image"
	for i := at - 1; i >= 0; i-- {
		if m := retrievingRe.FindStringSubmatch(lines[i]); m != nil {
			image = "base image " + strings.Trim(m[1], `"`)
			break
		}
	}
	switch {
	case has(baseNotFound):
		return v1.ReasonBaseImageNotFound, fmt.Sprintf("%s does not exist in its registry; the registry answered: %s", image, words)
	case has(baseUnauthorized):
		return v1.ReasonBaseImageUnauthorized, fmt.Sprintf(
			"the registry refused %s to this build's credentials (its tenant's registry Secret, or none); the registry answered: %s", image, words)
	case has(baseUnreachable):
		return v1.ReasonBaseImageUnreachable, fmt.Sprintf(
			"the build Pod could not reach the registry of %s: %s. The likely cause is %s: allow that registry (or a pull-through mirror) there", image, words, BuildPodEgressPolicy)
	}
	return "", ""
}

func fetchTerminated(p *corev1.Pod) *corev1.ContainerStateTerminated {
	for _, cs := range p.Status.InitContainerStatuses {
		if cs.Name == kaniko.FetchContainerName && cs.State.Terminated != nil {
			return cs.State.Terminated
		}
	}
	return nil
}

func kanikoTerminated(p *corev1.Pod) *corev1.ContainerStateTerminated {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == kaniko.ContainerName && cs.State.Terminated != nil {
			return cs.State.Terminated
		}
	}
	return nil
}

// Tail keeps the last n bytes of s, cut at a line boundary where possible.
func Tail(s string, n int) string {
	s = strings.TrimRight(s, "\n")
	if len(s) <= n {
		return s
	}
	s = s[len(s)-n:]
	if i := strings.IndexByte(s, '\n'); i >= 0 && i < len(s)-1 {
		s = s[i+1:]
	}
	return s
}
