package kube

import (
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"

	v1 "github.com/buildq/buildq/api/v1"
)

// kaniko's log of a build whose base image it could not get, as
// chainguard-dev/kaniko v1.25.0 prints it: info lines, then one error line
// on stderr (cmd/executor/cmd/root.go: "error building image: …";
// pkg/util/util.go RetryWithResult: "unable to complete operation after
// %d attempts, last error: %w"; the rest is go-containerregistry's
// transport.Error).
func kanikoBaseLog(cause string) string {
	return "\x1b[36mINFO\x1b[0m[0000] Retrieving image manifest 127.0.0.1:5000/acme/nope:1\n" +
		"\x1b[36mINFO\x1b[0m[0000] Retrieving image 127.0.0.1:5000/acme/nope:1 from registry 127.0.0.1:5000\n" +
		"error building image: unable to complete operation after 0 attempts, last error: " + cause + "\n"
}

// Issue 28: a base image that is missing or refused fails once with its
// own reason, the image and the registry's words in the message; one the
// build Pod cannot reach names the egress NetworkPolicy.
func TestBaseImageFailuresHaveTheirOwnReason(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, log, reason string
		message           []string
	}{
		{"missing tag", kanikoBaseLog("GET https://127.0.0.1:5000/v2/acme/nope/manifests/1: MANIFEST_UNKNOWN: manifest unknown; map[Tag:1]"),
			v1.ReasonBaseImageNotFound, []string{"127.0.0.1:5000/acme/nope:1", "MANIFEST_UNKNOWN: manifest unknown"}},
		{"missing repository", kanikoBaseLog("GET https://127.0.0.1:5000/v2/acme/nope/manifests/1: NAME_UNKNOWN: repository name not known to registry; map[name:acme/nope]"),
			v1.ReasonBaseImageNotFound, []string{"NAME_UNKNOWN: repository name not known to registry"}},
		{"404 without a body", kanikoBaseLog("GET https://r.example/v2/x/manifests/1: unexpected status code 404 Not Found (HEAD responses have no body, use GET for details)"),
			v1.ReasonBaseImageNotFound, []string{"404 Not Found"}},
		{"unauthorized", kanikoBaseLog("GET https://127.0.0.1:5000/v2/acme/nope/manifests/1: UNAUTHORIZED: authentication required; [map[Action:pull Class: Name:acme/nope Type:repository]]"),
			v1.ReasonBaseImageUnauthorized, []string{"127.0.0.1:5000/acme/nope:1", "UNAUTHORIZED: authentication required"}},
		{"denied", kanikoBaseLog("GET https://1.dkr.ecr.example/v2/x/manifests/1: DENIED: not authorized to perform: ecr:BatchGetImage"),
			v1.ReasonBaseImageUnauthorized, []string{"DENIED: not authorized"}},
		{"token endpoint 401", kanikoBaseLog("GET https://auth.example/token?scope=repository%3Ax%3Apull: unexpected status code 401 Unauthorized"),
			v1.ReasonBaseImageUnauthorized, []string{"401 Unauthorized"}},
		{"blocked by the network", kanikoBaseLog(`Get "https://registry-1.docker.io/v2/": dial tcp 44.208.254.194:443: i/o timeout`),
			v1.ReasonBaseImageUnreachable, []string{"i/o timeout", "NetworkPolicy", "buildq-builds"}},
		{"refused by the network", kanikoBaseLog(`Get "https://quay.io/v2/": dial tcp 3.1.2.3:443: connect: connection refused`),
			v1.ReasonBaseImageUnreachable, []string{"connection refused", "NetworkPolicy"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			o := JobOutcome(job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)), []*corev1.Pod{pod(1, "Error", c.log, 0)})
			if o.Reason != c.reason {
				t.Fatalf("reason %q, want %q (outcome %+v)", o.Reason, c.reason, o)
			}
			for _, m := range c.message {
				if !strings.Contains(o.Message, m) {
					t.Errorf("message %q does not say %q", o.Message, m)
				}
			}
			// The same from pods/log, when the termination message was
			// empty (KubeBackend.outcome).
			if r, m := ClassifyFailure(c.log); r != c.reason || m != o.Message {
				t.Errorf("ClassifyFailure = %q, %q; want %q, %q", r, m, c.reason, o.Message)
			}
		})
	}
}

// What must not be taken for a base image: a RUN that failed (even one
// that printed a registry's words, or could not connect), a push refused,
// a file's "permission denied".
func TestOtherFailuresAreNotBaseImageFailures(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, log, reason string }{
		{"RUN that printed network words", "MANIFEST_UNKNOWN\ndial tcp 1.2.3.4:443: connection refused\n" +
			"error building image: error building stage: failed to execute command: waiting for process to exit: exit status 7\n", v1.ReasonBuildFailed},
		{"ADD of an unreachable URL", `error building image: error building stage: failed to execute command: Get "http://10.0.0.1/x": dial tcp 10.0.0.1:80: connect: connection refused` + "\n",
			v1.ReasonBuildFailed},
		{"push refused", "error checking push permissions -- make sure you entered the correct tag name, and that you are authenticated correctly, and try again: " +
			`checking push permission for "r/x:y": POST https://r/v2/x/blobs/uploads/: UNAUTHORIZED: authentication required` + "\n", v1.ReasonPushFailed},
		{"push failed", "error pushing image: failed to push to destination r/x:y: DENIED: requested access to the resource is denied\n", v1.ReasonPushFailed},
		{"a file's permission denied", "error building image: error building stage: failed to get files used from context: lstat /x: permission denied\n", v1.ReasonBuildFailed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			if r, m := ClassifyFailure(c.log); r != c.reason || m != "" {
				t.Fatalf("ClassifyFailure = %q, %q; want %q and no message of its own", r, m, c.reason)
			}
		})
	}
}
