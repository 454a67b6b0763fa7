package kube

import (
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"

	v1 "github.com/buildq/buildq/api/v1"
)

// kaniko's log of a RUN whose program the node cannot execute, as
// chainguard-dev/kaniko v1.25.0 prints it for a linux/arm64 build on an
// amd64 node: info lines (stdout), then the final error on stderr.
func kanikoExecFormatLog(program string) string {
	return "\x1b[36mINFO\x1b[0m[0000] Retrieving image manifest 127.0.0.1:5000/base/busybox:arm64\n" +
		"\x1b[36mINFO\x1b[0m[0000] Retrieving image 127.0.0.1:5000/base/busybox:arm64 from registry 127.0.0.1:5000\n" +
		"\x1b[36mINFO\x1b[0m[0000] Built cross stage deps: map[]\n" +
		"\x1b[36mINFO\x1b[0m[0000] Executing 0 build triggers\n" +
		"\x1b[36mINFO\x1b[0m[0000] Building stage '127.0.0.1:5000/base/busybox:arm64' [idx: '0', base-idx: '-1']\n" +
		"\x1b[36mINFO\x1b[0m[0000] Unpacking rootfs as cmd RUN uname -m > /arch requires it.\n" +
		"\x1b[36mINFO\x1b[0m[0000] RUN uname -m > /arch\n" +
		"\x1b[36mINFO\x1b[0m[0000] Initializing snapshotter ...\n" +
		"\x1b[36mINFO\x1b[0m[0000] Taking snapshot of full filesystem...\n" +
		"\x1b[36mINFO\x1b[0m[0000] Cmd: /bin/sh\n" +
		"\x1b[36mINFO\x1b[0m[0000] Args: [-c uname -m > /arch]\n" +
		"\x1b[36mINFO\x1b[0m[0000] Running: [/bin/sh -c uname -m > /arch]\n" +
		"error building image: error building stage: failed to execute command: starting command: fork/exec " + program + ": exec format error\n"
}

// Issue 29: a RUN on a platform the node cannot execute fails with its
// own reason, the message quoting kaniko's line.
func TestExecFormatErrorIsPlatformUnsupported(t *testing.T) {
	t.Parallel()
	for _, program := range []string{"/bin/sh", "/hello"} {
		log := kanikoExecFormatLog(program)
		line := "error building image: error building stage: failed to execute command: starting command: fork/exec " + program + ": exec format error"
		o := JobOutcome(job(cond(batchv1.JobFailed, batchv1.JobReasonPodFailurePolicy)), []*corev1.Pod{pod(1, "Error", log, 0)})
		if o.Reason != v1.ReasonPlatformUnsupported {
			t.Fatalf("%s: reason %q, want %q (outcome %+v)", program, o.Reason, v1.ReasonPlatformUnsupported, o)
		}
		for _, want := range []string{line, "--platform-node-selector"} {
			if !strings.Contains(o.Message, want) {
				t.Errorf("%s: message %q does not say %q", program, o.Message, want)
			}
		}
		if !strings.Contains(o.LogTail, line) {
			t.Errorf("%s: log tail %q lost the line", program, o.LogTail)
		}
		// The same from pods/log (KubeBackend.outcome).
		if r, m := ClassifyFailure(log); r != o.Reason || m != o.Message {
			t.Errorf("%s: ClassifyFailure = %q, %q", program, r, m)
		}
	}
}

// A RUN step's own output saying "exec format error" (its script ran a
// foreign binary and exited 126) is that step's failure, not the node's.
func TestExecFormatErrorInARunsOutputIsABuildFailure(t *testing.T) {
	t.Parallel()
	log := "/bin/sh: ./tool: cannot execute binary file: Exec format error\n" +
		"sh: ./other: exec format error\n" +
		"error building image: error building stage: failed to execute command: waiting for process to exit: exit status 126\n"
	if r, m := ClassifyFailure(log); r != v1.ReasonBuildFailed || m != "" {
		t.Fatalf("ClassifyFailure = %q, %q; want BuildFailed", r, m)
	}
}
