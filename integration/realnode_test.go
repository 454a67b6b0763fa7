//go:build integration

package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/kaniko"
)

// TestRealNode runs builds through the production path: the kaniko
// executor in Pods that a real kubelet starts on containerd and runc, with
// the Job and securityContext buildq renders. The node comes up once for
// all its subtests (node_test.go); each subtest has its own namespace,
// NATS server and workers.
func TestRealNode(t *testing.T) {
	node := startRealNode(t)
	base := map[string]string{"BASE": node.images.base}

	t.Run("Dockerfile with RUN, USER, WORKDIR, ARG and COPY --from", func(t *testing.T) {
		keys := t.TempDir()
		if _, _, err := attest.EnsureKeyPair(keys); err != nil {
			t.Fatal(err)
		}
		s := newSuite(t, options{node: node, workerArgs: []string{"--keep-jobs", "--signing-key", filepath.Join(keys, attest.PrivateKeyFile)}})
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{
			"Dockerfile": `ARG BASE
FROM $BASE AS builder
ARG GREETING=unset
RUN mkdir -p /out && echo "$GREETING" > /out/greeting && chown 1000:1000 /out/greeting && \
    grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status > /out/status-root && \
    cat /kaniko/.docker/config.json > /out/docker-config
FROM $BASE
COPY --from=builder /out/ /opt/out/
WORKDIR /home/app
RUN chown 1000:1000 /home/app
USER app
RUN id -u > uid && echo written-by-app > made && grep -E '^(CapEff|NoNewPrivs):' /proc/self/status > status-app
USER root
# What a hostile RUN step would look for: S3 keys in any process's
# environment (the worker gives them to no build Pod).
RUN (cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -E '^(AWS_|S3_)' || true) > /aws-vars
USER app
COPY hello.txt /srv/hello.txt
`,
			"hello.txt": "hello from the context\n",
		})
		start := time.Now()
		req := s.submitWith(dir, "full", 1, func(r *v1.Request) {
			r.BuildArgs = map[string]string{"BASE": node.images.base, "GREETING": "buildq-on-a-real-node"}
		})[0]
		r := res.wait(t, 1, 5*time.Minute)[0]
		if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(r))
		}
		t.Logf("built on the real node in %s", time.Since(start).Round(100*time.Millisecond))

		// One digest: the result's, the registry's, the Pod's
		// termination message.
		d, err := s.regClient.Head(context.Background(), r.Data.Image)
		if err != nil || d != r.Data.Digest {
			t.Fatalf("registry has %s (%v), result says %s", d, err, r.Data.Digest)
		}
		pods := s.jobPods(r.Data.Job)
		if len(pods) != 1 {
			t.Fatalf("%d pods for job %s, want 1", len(pods), r.Data.Job)
		}
		term := kanikoTermination(pods[0])
		if term == nil || term.ExitCode != 0 || strings.TrimSpace(term.Message) != r.Data.Digest {
			t.Fatalf("kaniko container terminated %+v, want exit 0 with message %s", term, r.Data.Digest)
		}

		// Issue 30: the signed provenance names the base image kaniko
		// built on, by the digest it pulled: the built image's layers
		// begin with that image's.
		checkRealNodeProvenance(t, s, r.Data, filepath.Join(keys, attest.PublicKeyFile), node.images.base)

		files := imageFiles(t, r.Data.Image+"@"+r.Data.Digest)
		want := map[string]struct {
			uid     int
			content string
		}{
			"opt/out/greeting": {1000, "buildq-on-a-real-node\n"},
			"home/app/uid":     {1000, "1000\n"},
			"home/app/made":    {1000, "written-by-app\n"},
			"srv/hello.txt":    {0, "hello from the context\n"},
			"aws-vars":         {0, "0\n"},
		}
		for p, w := range want {
			f, ok := files[p]
			if !ok {
				t.Errorf("%s is not in the image", p)
				continue
			}
			if f.hdr.Uid != w.uid || string(f.body) != w.content {
				t.Errorf("%s: uid %d, content %q; want uid %d, %q", p, f.hdr.Uid, f.body, w.uid, w.content)
			}
		}

		// The hardening, measured inside a RUN step: exactly the five
		// capabilities the Job adds (CHOWN, DAC_OVERRIDE, FOWNER, SETGID,
		// SETUID = 0xcb), no privilege escalation, RuntimeDefault seccomp.
		root := procStatus(files["opt/out/status-root"].body)
		for k, v := range map[string]string{"CapEff": "00000000000000cb", "CapPrm": "00000000000000cb", "CapBnd": "00000000000000cb", "NoNewPrivs": "1", "Seccomp": "2"} {
			if root[k] != v {
				t.Errorf("RUN as root: %s = %q, want %q (all: %v)", k, root[k], v, root)
			}
		}
		// What a RUN step finds in its docker config: tenant acme's own
		// account, not the shared one.
		var dcfg struct {
			Auths map[string]struct{ Username, Auth string } `json:"auths"`
		}
		if err := json.Unmarshal(files["opt/out/docker-config"].body, &dcfg); err != nil || len(dcfg.Auths) == 0 {
			t.Errorf("docker config in the build: %v\n%s", err, files["opt/out/docker-config"].body)
		}
		for host, a := range dcfg.Auths {
			user, _ := base64.StdEncoding.DecodeString(a.Auth)
			if a.Username != shared.acmeUser || !strings.HasPrefix(string(user), shared.acmeUser+":") {
				t.Errorf("the docker config a RUN step reads has %s for %s, want only tenant acme's own account %s", a.Username, host, shared.acmeUser)
			}
		}
		app := procStatus(files["home/app/status-app"].body)
		if app["CapEff"] != "0000000000000000" || app["NoNewPrivs"] != "1" {
			t.Errorf("RUN after USER app: %v, want no effective capabilities and NoNewPrivs 1", app)
		}
	})

	t.Run("wrong registry password is PushFailed", func(t *testing.T) {
		s := newSuite(t, options{node: node, registryPassword: "not-the-password"})
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "x"})
		s.submit(dir, "denied", 1)
		r := res.wait(t, 1, 5*time.Minute)[0]
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonPushFailed {
			t.Fatalf("result %s, want failed/%s", mustJSON(r), v1.ReasonPushFailed)
		}
	})

	// Issue 28: kaniko's own words for a FROM image the registry does not
	// have ("error building image: … MANIFEST_UNKNOWN / NAME_UNKNOWN")
	// make a BaseImageNotFound failure: one Pod, one attempt, at once, no
	// dead letter.
	t.Run("a base image missing from the registry is BaseImageNotFound, once", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		pods := s.podsCreated()
		s.startWorker("w1")
		res := s.collect()
		ref, err := name.ParseReference(node.images.base)
		if err != nil {
			t.Fatal(err)
		}
		missing := ref.Context().RegistryStr() + "/acme/no-such-base:1"
		dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nCOPY f /f\n", "f": "x"})
		start := time.Now()
		s.submitWith(dir, "nobase", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": missing} })
		r := res.wait(t, 1, 5*time.Minute)[0]
		took := time.Since(start)
		d := r.Data
		if d.Status != v1.StatusFailed || d.Reason != v1.ReasonBaseImageNotFound || d.Attempts != 1 {
			t.Fatalf("result %s, want failed/%s after 1 attempt", mustJSON(r), v1.ReasonBaseImageNotFound)
		}
		if !strings.Contains(d.Message, "acme/no-such-base") || !(strings.Contains(d.Message, "NAME_UNKNOWN") || strings.Contains(d.Message, "MANIFEST_UNKNOWN")) {
			t.Errorf("message %q: want the image and the registry's words", d.Message)
		}
		if n := pods(); n != 1 {
			t.Errorf("%d pods ran, want 1", n)
		}
		if n := streamMsgs(context.Background(), t, s.js(), v1.DeadLetterStream); n != 0 {
			t.Errorf("%d dead letters, want none", n)
		}
		t.Logf("answered %s in %s: %s", d.Reason, took.Round(100*time.Millisecond), d.Message)
		if took > time.Minute {
			t.Errorf("answered after %s: want one quick attempt", took)
		}
	})

	t.Run("RUN exit 3 fails once with the command's output", func(t *testing.T) {
		s := newSuite(t, options{node: node, workerArgs: []string{"--keep-jobs"}})
		pods := s.podsCreated()
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN echo 'step output before the failure' && exit 3\n"})
		s.submitWith(dir, "exit3", 1, func(r *v1.Request) { r.BuildArgs = base })
		r := res.wait(t, 1, 5*time.Minute)[0]
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonBuildFailed {
			t.Fatalf("result %s, want failed/%s", mustJSON(r), v1.ReasonBuildFailed)
		}
		if !strings.Contains(r.Data.LogTail, "step output before the failure") {
			t.Errorf("log tail does not carry the command's output:\n%s", r.Data.LogTail)
		}
		// The pod failure policy fails the Job at kaniko's exit 1: no
		// retry, one Pod.
		if n := pods(); n != 1 {
			t.Errorf("%d pods ran, want 1 (no retry past the pod failure policy)", n)
		}
	})

	t.Run("a tag pushed before the build Pod starts is never pushed over", func(t *testing.T) { testTagTakenOnRealNode(t, node) })

	t.Run("fetch-context refuses replaced bytes", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		pods := s.podsCreated()
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nARG V\nCOPY f /f\n", "f": "the requested bytes"})
		// The worker shows once that acme holds these bytes (and keeps
		// that proof); the genuine build runs.
		s.submitWith(dir, "poisoned", 1, nil)
		if r := res.wait(t, 1, 5*time.Minute)[0]; r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("the genuine build: %s", mustJSON(r))
		}
		before := pods()
		// Replaced afterwards, for another build of the same context:
		// the worker does not read it again; the build Pod's
		// fetch-context init container does, and refuses it.
		s.submitWith(dir, "poisoned", 1, func(r *v1.Request) {
			r.BuildArgs = map[string]string{"V": "2"}
			replaceContext(t, s, r)
		})
		r := res.wait(t, 2, 5*time.Minute)[1]
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMismatch || r.Data.Job == "" {
			t.Fatalf("result %s, want failed/%s from the build Pod", mustJSON(r), v1.ReasonContextMismatch)
		}
		if n := pods() - before; n != 1 {
			t.Errorf("%d pods ran, want 1 (a mismatch is not retried)", n)
		}
	})

	t.Run("a RUN past the timeout is stopped", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN sleep 3031\n"})
		s.submitWith(dir, "slow", 1, func(r *v1.Request) {
			r.BuildArgs = base
			r.Timeout = v1.Duration{Duration: v1.MinTimeout}
		})
		eventually(t, 3*time.Minute, "the RUN step to start", func() bool { return len(hostProcs("sleep", "3031")) > 0 })
		r := res.wait(t, 1, 3*time.Minute)[0]
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonDeadlineExceeded {
			t.Fatalf("result %s, want failed/%s", mustJSON(r), v1.ReasonDeadlineExceeded)
		}
		s.waitNoPods(time.Minute)
		eventually(t, time.Minute, "the RUN step's process to end", func() bool { return len(hostProcs("sleep", "3031")) == 0 })
	})

	t.Run("cancel during a RUN stops the container", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN sleep 3032\n"})
		req := s.submitWith(dir, "long", 1, func(r *v1.Request) { r.BuildArgs = base })[0]
		eventually(t, 3*time.Minute, "the RUN step to start", func() bool { return len(hostProcs("sleep", "3032")) > 0 })
		out, err := exec.Command(filepath.Join(shared.bin, "buildq"), "cancel", "--tenant", req.Tenant, "--nats-url", s.natsURL, req.RequestID).CombinedOutput()
		if err != nil {
			t.Fatalf("buildq cancel: %v\n%s", err, out)
		}
		r := res.wait(t, 1, time.Minute)[0]
		if r.Data.Status != v1.StatusCanceled {
			t.Fatalf("result %s, want canceled", mustJSON(r))
		}
		s.waitNoPods(time.Minute)
		eventually(t, time.Minute, "the RUN step's process to end", func() bool { return len(hostProcs("sleep", "3032")) == 0 })
	})

	t.Run("a Pod deleted during a RUN is replaced", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		pods := s.podsCreated()
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN sleep 3 && echo done > /done # 3033\n"})
		s.submitWith(dir, "replaced", 1, func(r *v1.Request) { r.BuildArgs = base })
		eventually(t, 3*time.Minute, "the RUN step to start", func() bool { return len(hostProcs("sleep", "3033")) > 0 })
		// The executor is killed (exit 143), not the build's fault: the Job
		// starts another Pod, which builds.
		list, err := shared.kube.CoreV1().Pods(s.ns).List(context.Background(), metav1.ListOptions{})
		if err != nil || len(list.Items) != 1 {
			t.Fatalf("pods: %v, %v", list, err)
		}
		if err := shared.kube.CoreV1().Pods(s.ns).Delete(context.Background(), list.Items[0].Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		r := res.wait(t, 1, 5*time.Minute)[0]
		if r.Data.Status != v1.StatusSucceeded || pods() != 2 {
			t.Fatalf("result %s after %d pods, want succeeded after 2", mustJSON(r), pods())
		}
		// The build's log shows the second Pod as a second attempt.
		text, err := s.buildqLogs(t, r.Data.Tenant, r.Data.RequestID)
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`(?m)^\[buildq\] attempt 2: pod \S+`).MatchString(text) || !strings.Contains(text, "[buildq] build succeeded") {
			t.Errorf("the log of a build whose Pod was replaced:\n%s", text)
		}
	})

	t.Run("5 identical requests over 2 workers build once", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		jobs, pods := s.jobsCreated(), s.podsCreated()
		s.startWorker("w1")
		s.startWorker("w2")
		res := s.collect()
		dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN sleep 2 && echo once > /once\n"})
		s.submitWith(dir, "dedupe", 5, func(r *v1.Request) { r.BuildArgs = base })
		got := res.wait(t, 5, 5*time.Minute)
		digests := map[string]bool{}
		for _, r := range got {
			if r.Data.Status != v1.StatusSucceeded {
				t.Fatalf("result %s", mustJSON(r))
			}
			digests[r.Data.Digest] = true
		}
		if len(digests) != 1 || jobs() != 1 || pods() != 1 {
			t.Fatalf("%d digests, %d jobs, %d pods; want 1 of each", len(digests), jobs(), pods())
		}
	})

	t.Run("buildq logs -f follows a RUN through a worker's death; the archive holds the same lines", func(t *testing.T) { testLogsOnRealNode(t, node) })

	t.Run("50 MiB of build output are capped with a marker", func(t *testing.T) { testLogCapOnRealNode(t, node) })

	t.Run("buildq dev --kubeconfig builds examples/with-run", func(t *testing.T) { testDevOnRealNode(t, node) })

	t.Run("a GitHub push through buildq gateway builds the pushed commit", func(t *testing.T) { testGitPushOnRealNode(t, node) })

	t.Run("a worker Pod from deploy/ carries a build", func(t *testing.T) { testWorkerPodFromDeploy(t, node) })

	// Issue 29: where a platform's build runs.
	t.Run("an arm64 RUN on the amd64 node is PlatformUnsupported", func(t *testing.T) { testPlatformUnsupportedOnRealNode(t, node) })

	t.Run("a 386 build runs on the amd64 node by --platform-node-selector", func(t *testing.T) { test386OnAmd64RealNode(t, node) })

	t.Run("a platform no node runs is refused at once", func(t *testing.T) { testPlatformWithoutNodeRefusedOnRealNode(t, node) })

	t.Run("an image index of linux/amd64 and linux/386, each built where it runs", func(t *testing.T) { testImageIndexOnRealNode(t, node) })

	t.Run("layer cache reuses the RUN layer", func(t *testing.T) {
		s := newSuite(t, options{node: node, workerArgs: []string{"--keep-jobs", "--cache-repo", node.registryHost + "/cache/{tenant}/layers"}})
		s.startWorker("w1")
		res := s.collect()
		var took []time.Duration
		var last v1.Result
		for i, content := range []string{"first", "second"} {
			dir := contextDir(t, map[string]string{
				"Dockerfile": "ARG BASE\nFROM $BASE\nRUN sleep 3 && echo expensive > /expensive\nCOPY last /last\n",
				"last":       content,
			})
			s.submitWith(dir, "cached", 1, func(r *v1.Request) { r.BuildArgs = base })
			last = res.wait(t, i+1, 5*time.Minute)[i]
			if last.Data.Status != v1.StatusSucceeded {
				t.Fatalf("build %d: %s", i+1, mustJSON(last))
			}
			took = append(took, time.Duration(last.Data.Timings.BuildMs)*time.Millisecond)
		}
		t.Logf("build times: cold %s, with the cached RUN layer %s", took[0].Round(100*time.Millisecond), took[1].Round(100*time.Millisecond))
		// The second build's log, read as buildq reads a log tail:
		// pods/log through the API server and the kubelet.
		pods := s.jobPods(last.Data.Job)
		if len(pods) != 1 {
			t.Fatalf("%d pods for job %s", len(pods), last.Data.Job)
		}
		raw, err := shared.kube.CoreV1().Pods(s.ns).GetLogs(pods[0].Name, &corev1.PodLogOptions{Container: kaniko.ContainerName}).DoRaw(context.Background())
		if err != nil {
			t.Fatalf("pods/log: %v", err)
		}
		if !strings.Contains(string(raw), "Using caching version of cmd: RUN sleep 3") {
			t.Fatalf("kaniko did not reuse the cached RUN layer; its log:\n%s", tail(string(raw), 3000))
		}
	})
}

func (s *suite) jobPods(job string) []corev1.Pod {
	s.t.Helper()
	list, err := shared.kube.CoreV1().Pods(s.ns).List(context.Background(), metav1.ListOptions{LabelSelector: "job-name=" + job})
	if err != nil {
		s.t.Fatal(err)
	}
	return list.Items
}

// podsCreated counts the distinct Pods that ever existed in the namespace.
func (s *suite) podsCreated() func() int {
	s.t.Helper()
	return s.countAdded(func(ctx context.Context) (watch.Interface, error) {
		return shared.kube.CoreV1().Pods(s.ns).Watch(ctx, metav1.ListOptions{})
	})
}

func (s *suite) waitNoPods(timeout time.Duration) {
	s.t.Helper()
	eventually(s.t, timeout, "the build's Pods to be gone", func() bool {
		list, err := shared.kube.CoreV1().Pods(s.ns).List(context.Background(), metav1.ListOptions{})
		return err == nil && len(list.Items) == 0
	})
}

func kanikoTermination(p corev1.Pod) *corev1.ContainerStateTerminated {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == kaniko.ContainerName {
			return cs.State.Terminated
		}
	}
	return nil
}

type imageFile struct {
	hdr  *tar.Header
	body []byte
}

// imageFiles reads an image's flattened filesystem from the registry.
func imageFiles(t *testing.T, ref string) map[string]imageFile {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r, remote.WithAuth(&authn.Basic{Username: shared.registryUser, Password: shared.registryPass}))
	if err != nil {
		t.Fatalf("pull %s: %v", ref, err)
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	files := map[string]imageFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatalf("read %s: %v", ref, err)
		}
		var body []byte
		if h.Typeflag == tar.TypeReg && h.Size < 1<<20 {
			body, _ = io.ReadAll(tr)
		}
		files[strings.TrimPrefix(h.Name, "/")] = imageFile{hdr: h, body: body}
	}
}

// procStatus parses "Key:\tvalue" lines of /proc/<pid>/status.
func procStatus(b []byte) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// hostProcs lists the pids of this machine whose command line contains
// each of words: a container's processes are processes of the node.
func hostProcs(words ...string) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		all := true
		for _, w := range words {
			all = all && bytes.Contains(b, []byte(w))
		}
		if all {
			pids = append(pids, pid)
		}
	}
	return pids
}
