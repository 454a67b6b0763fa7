//go:build e2e

// Package e2e is buildq's Docker-host end-to-end suite (build tag e2e,
// run by `make e2e`). The stack runs in a Docker engine from images the
// project builds itself and loads pinned by digest (hack/docker/images):
// NATS with JetStream, MinIO, the distribution registry (htpasswd) and
// `buildq worker`. Kubernetes is the integration suite's own control plane
// (envtest's kube-apiserver and etcd, kube-controller-manager) and real
// node (containerd, runc, a CNI bridge, kubelet, kube-scheduler), reached
// by the worker container through a kubeconfig; its Jobs run the real
// kaniko executor, which fetches contexts from MinIO and pushes to the
// registry. Nothing is pulled from the internet.
//
// make e2e installs and starts the engine (hack/docker/install.sh,
// start.sh), loads the images and sets:
//
//	DOCKER_HOST            the engine (unix socket of hack/docker/start.sh)
//	BUILDQ_WORKER_IMAGE    buildq, repo@sha256:…
//	BUILDQ_NATS_IMAGE      nats-server, repo@sha256:…
//	BUILDQ_MINIO_IMAGE     MinIO, repo@sha256:…
//	BUILDQ_REGISTRY_IMAGE  the distribution registry, repo@sha256:…
//	BUILDQ_E2E_REQUIRE=1   fail, not skip, when any of it is missing
//
// A plain `go test -tags e2e` without them skips with one line.
package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kwait "k8s.io/apimachinery/pkg/util/wait"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/integration/internal/realnode"
	"github.com/buildq/buildq/internal/contexttar"
)

const tenant = "e2e"

// scenarioTimeout bounds one scenario.
const scenarioTimeout = 10 * time.Minute

func TestE2E(t *testing.T) {
	requireDocker(t)
	im := stackImages(t)
	s := startStack(t, im)

	t.Run("with-run", func(t *testing.T) {
		t.Parallel()
		s.scenarioWithRun(t)
	})
	t.Run("syntax-error", func(t *testing.T) {
		t.Parallel()
		s.scenarioSyntaxError(t)
	})
	t.Run("cache", func(t *testing.T) {
		t.Parallel()
		s.scenarioCache(t)
	})
}

// scenarioWithRun builds examples/with-run (a Dockerfile with RUN) and
// checks the result against the registry, then runs the image on the node.
func (s *stack) scenarioWithRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), scenarioTimeout)
	defer cancel()
	d := s.build(ctx, t, filepath.Join("..", "..", "examples", "with-run"), "with-run", map[string]string{"BASE": s.node.Images.Base})
	requireSucceeded(t, d)
	if d.Origin != v1.OriginBuild {
		t.Errorf("origin = %q, want %q", d.Origin, v1.OriginBuild)
	}
	if d.Job == "" {
		t.Errorf("result names no job")
	}
	repo := s.registryHost + "/" + tenant + "/with-run"
	if !strings.HasPrefix(d.Image, repo+":") {
		t.Errorf("image = %q, want %s:<tag>", d.Image, repo)
	}
	if want := repo + "@" + d.Digest; d.ImageRef != want {
		t.Errorf("imageRef = %q, want %q", d.ImageRef, want)
	}
	if got := s.servedDigest(ctx, t, d.Image); got != d.Digest {
		t.Errorf("the registry serves %s for %s; the result says %s", got, d.Image, d.Digest)
	}

	t.Run("runs-on-the-node", func(t *testing.T) {
		out := s.runImage(ctx, t, d.ImageRef)
		if !strings.Contains(out, "hello from an image built by kaniko via buildq") {
			t.Errorf("the image printed %q, want the greeting of examples/with-run/hello.sh", out)
		}
	})
}

// scenarioSyntaxError builds a Dockerfile kaniko cannot parse.
func (s *stack) scenarioSyntaxError(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), scenarioTimeout)
	defer cancel()
	dir := t.TempDir()
	writeTo(t, dir, "Dockerfile", "FROM "+s.node.Images.Base+"\nNOTANINSTRUCTION this is not a Dockerfile\n")
	d := s.build(ctx, t, dir, "syntax-error", nil)
	if d.Status != v1.StatusFailed {
		t.Fatalf("status = %q, want %q (%s: %s)", d.Status, v1.StatusFailed, d.Reason, d.Message)
	}
	if d.Reason != v1.ReasonBuildFailed {
		t.Errorf("reason = %q, want %q (%s)\nlog tail:\n%s", d.Reason, v1.ReasonBuildFailed, d.Message, d.LogTail)
	}
	if strings.TrimSpace(d.LogTail) == "" {
		t.Fatalf("logTail is empty (%s: %s)", d.Reason, d.Message)
	}
	// The failure must be the parse error, not an infrastructure problem
	// that happens to be classified BuildFailed.
	if !strings.Contains(strings.ToLower(d.LogTail), "unknown instruction") {
		t.Errorf("logTail does not show the parse error:\n%s", d.LogTail)
	}
	if d.Digest != "" || d.ImageRef != "" {
		t.Errorf("a failed build reports image %q digest %q", d.ImageRef, d.Digest)
	}
}

// scenarioCache submits the same build twice: the second request is
// answered from the dedupe index.
func (s *stack) scenarioCache(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), scenarioTimeout)
	defer cancel()
	dir := t.TempDir()
	writeTo(t, dir, "Dockerfile", "FROM "+s.node.Images.Base+"\nCOPY stamp.txt /stamp.txt\n")
	writeTo(t, dir, "stamp.txt", "buildq e2e: the cache scenario\n")

	first := s.build(ctx, t, dir, "cache", nil)
	requireSucceeded(t, first)
	if first.Origin != v1.OriginBuild {
		t.Errorf("first request: origin = %q, want %q", first.Origin, v1.OriginBuild)
	}
	second := s.build(ctx, t, dir, "cache", nil)
	requireSucceeded(t, second)
	if second.RequestID == first.RequestID {
		t.Fatalf("both results carry request %s", first.RequestID)
	}
	if second.Origin != v1.OriginCache {
		t.Errorf("second request: origin = %q, want %q", second.Origin, v1.OriginCache)
	}
	if second.Key != first.Key || second.Digest != first.Digest || second.Image != first.Image {
		t.Errorf("second request: key %s image %s digest %s; first: key %s image %s digest %s",
			second.Key, second.Image, second.Digest, first.Key, first.Image, first.Digest)
	}
	if got := s.servedDigest(ctx, t, second.Image); got != second.Digest {
		t.Errorf("the registry serves %s for %s; the result says %s", got, second.Image, second.Digest)
	}
}

// build uploads dir to MinIO, publishes a request for tenant/name and
// waits for its result.
func (s *stack) build(ctx context.Context, t *testing.T, dir, buildName string, args map[string]string) *v1.ResultData {
	t.Helper()
	up, err := s.store.ForTenant(tenant).UploadContext(ctx, dir, contexttar.Options{}, nil)
	if err != nil {
		t.Fatalf("upload %s: %v", dir, err)
	}
	req := &v1.Request{
		Tenant:        tenant,
		Name:          buildName,
		Source:        v1.Source{S3: &v1.S3Source{Bucket: up.Bucket, Key: up.Key}},
		ContextDigest: up.Digest,
		BuildArgs:     args,
	}
	since := time.Now().Add(-time.Minute)
	if _, err := s.pub.Publish(ctx, req); err != nil {
		t.Fatalf("publish %s/%s: %v", tenant, buildName, err)
	}
	t.Logf("published %s/%s as request %s (context %s, upload skipped: %v)", tenant, buildName, req.RequestID, up.Digest, up.Skipped)
	res, err := s.pub.Wait(ctx, tenant, buildName, req.RequestID, since)
	if err != nil {
		t.Fatalf("no result for request %s: %v", req.RequestID, err)
	}
	d := res.Data
	t.Logf("result of %s: %s origin=%s reason=%s job=%s image=%s digest=%s", req.RequestID, d.Status, d.Origin, d.Reason, d.Job, d.Image, d.Digest)
	if res.ID != req.RequestID || d.RequestID != req.RequestID {
		t.Errorf("result id %q / data.requestId %q, want %q", res.ID, d.RequestID, req.RequestID)
	}
	return &d
}

func requireSucceeded(t *testing.T, d *v1.ResultData) {
	t.Helper()
	if d.Status != v1.StatusSucceeded {
		t.Fatalf("status = %q, want %q (%s: %s)\nlog tail:\n%s", d.Status, v1.StatusSucceeded, d.Reason, d.Message, d.LogTail)
	}
	if !strings.HasPrefix(d.Digest, "sha256:") || d.Image == "" {
		t.Fatalf("succeeded without image or digest: image %q digest %q", d.Image, d.Digest)
	}
}

// servedDigest asks the registry, independently of the worker, for the
// digest of ref (a reference under the registry the results name).
func (s *stack) servedDigest(ctx context.Context, t *testing.T, ref string) string {
	t.Helper()
	r, err := name.ParseReference(ref, name.StrictValidation)
	if err != nil {
		t.Fatalf("result reference %q: %v", ref, err)
	}
	if got := r.Context().RegistryStr(); got != s.registryHost {
		t.Fatalf("result reference %q is in registry %s, want %s", ref, got, s.registryHost)
	}
	d, err := s.reg.Head(ctx, ref)
	if err != nil {
		t.Fatalf("HEAD %s: %v", ref, err)
	}
	return d
}

// runImage runs image as a pod on the real node (its containerd pulls it
// from the registry with the suite's credentials) and returns its log.
func (s *stack) runImage(ctx context.Context, t *testing.T, image string) string {
	t.Helper()
	pods := s.kube.CoreV1().Pods(namespace)
	noToken := false
	pod, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "run-with-run-"},
		Spec: corev1.PodSpec{
			RestartPolicy:                corev1.RestartPolicyNever,
			AutomountServiceAccountToken: &noToken,
			NodeSelector:                 map[string]string{realnode.Taint: "true"},
			Tolerations:                  []corev1.Toleration{{Key: realnode.Taint, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
			Containers:                   []corev1.Container{{Name: "app", Image: image}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod: %v", err)
	}
	t.Cleanup(func() {
		_ = pods.Delete(context.Background(), pod.Name, metav1.DeleteOptions{})
	})
	var last *corev1.Pod
	err = kwait.PollUntilContextTimeout(ctx, 2*time.Second, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := pods.Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // a failed Get is polled again until the timeout
		}
		last = p
		return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed, nil
	})
	if err != nil || last.Status.Phase != corev1.PodSucceeded {
		state := "unknown"
		if last != nil {
			state = string(last.Status.Phase)
			for _, cs := range last.Status.ContainerStatuses {
				if w := cs.State.Waiting; w != nil {
					state += " (" + w.Reason + ": " + w.Message + ")"
				}
				if x := cs.State.Terminated; x != nil {
					state += " (" + x.Reason + ": " + x.Message + ")"
				}
			}
		}
		t.Fatalf("pod %s running %s did not succeed: %s %v", pod.Name, image, state, err)
	}
	out, err := pods.GetLogs(pod.Name, &corev1.PodLogOptions{Container: "app"}).DoRaw(ctx)
	if err != nil {
		t.Fatalf("logs of pod %s: %v", pod.Name, err)
	}
	return string(out)
}

func writeTo(t *testing.T, dir, file, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, file), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
