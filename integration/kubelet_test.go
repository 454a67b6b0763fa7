//go:build integration

package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/localexec"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
)

// fault changes what the emulated kubelet does with a pod.
type fault struct {
	// hold keeps the container running until the channel is closed.
	hold <-chan struct{}
	// exitCode, when not zero, ends the container with it and message
	// instead of running the build.
	exitCode int32
	message  string
	// deletePod deletes the pod instead of running it.
	deletePod bool
	// duration is how long the build runs at least: the container stays
	// running that long before the build proper (the benchmarks'
	// configurable build time).
	duration time.Duration
}

// kubelet plays the node for one namespace. It binds buildq's pods and runs
// the kaniko container's contract faithfully: it parses the container's
// args, resolves secretKeyRef env and the mounted docker config from the
// Secrets, fetches the context from S3 with those credentials, builds with
// the local executor, pushes with those registry credentials, and writes
// the digest as the termination message — or exits 1 with kaniko-style log
// lines on failure.
type kubelet struct {
	t      *testing.T
	client kubernetes.Interface
	ns     string
	faults func(pod *corev1.Pod) fault

	mu      sync.Mutex
	started map[types.UID]bool
	runs    int
}

func startKubelet(t *testing.T, ns string, faults func(*corev1.Pod) fault) *kubelet {
	t.Helper()
	k := &kubelet{t: t, client: shared.kube, ns: ns, faults: faults, started: map[types.UID]bool{}}
	if k.faults == nil {
		k.faults = func(*corev1.Pod) fault { return fault{} }
	}
	ctx, cancel := context.WithCancel(context.Background())
	factory := informers.NewSharedInformerFactoryWithOptions(shared.kube, 0, informers.WithNamespace(ns),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = kaniko.ManagedBySelector }))
	inf := factory.Core().V1().Pods().Informer()
	var wg sync.WaitGroup
	handle := func(obj any) {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.DeletionTimestamp != nil || pod.Spec.NodeName != "" || pod.Status.Phase != "" && pod.Status.Phase != corev1.PodPending {
			return
		}
		k.mu.Lock()
		if k.started[pod.UID] {
			k.mu.Unlock()
			return
		}
		k.started[pod.UID] = true
		k.runs++
		k.mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			k.run(ctx, pod.DeepCopy())
		}()
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: handle, UpdateFunc: func(_, o any) { handle(o) }})
	factory.Start(ctx.Done())
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		factory.Shutdown()
	})
	return k
}

func (k *kubelet) podsRun() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.runs
}

func (k *kubelet) run(ctx context.Context, pod *corev1.Pod) {
	pods := k.client.CoreV1().Pods(k.ns)
	err := pods.Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: k.ns, UID: pod.UID},
		Target:     corev1.ObjectReference{Kind: "Node", Name: "emulated-node"},
	}, metav1.CreateOptions{})
	if err != nil {
		if ctx.Err() == nil && !apierrors.IsNotFound(err) {
			k.t.Logf("kubelet: bind %s: %v", pod.Name, err)
		}
		return
	}
	now := metav1.Now()
	k.setStatus(ctx, pod.Name, func(s *corev1.PodStatus) {
		s.Phase, s.StartTime = corev1.PodRunning, &now
		s.ContainerStatuses = []corev1.ContainerStatus{{Name: kaniko.ContainerName, Image: pod.Spec.Containers[0].Image,
			Started: ptr(true), State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}}}
	})

	f := k.faults(pod)
	if f.hold != nil {
		select {
		case <-f.hold:
		case <-ctx.Done():
			return
		}
	}
	if f.duration > 0 {
		select {
		case <-time.After(f.duration):
		case <-ctx.Done():
			return
		}
	}
	code, msg := f.exitCode, f.message
	// The fetch-context init container's contract, run first.
	fetched := ""
	if len(pod.Spec.InitContainers) > 0 && code == 0 && !f.deletePod {
		var icode int32
		var imsg string
		fetched, icode, imsg = k.fetchContext(ctx, pod, pod.Spec.InitContainers[0])
		if fetched != "" {
			defer os.RemoveAll(fetched)
		}
		if ctx.Err() != nil {
			return
		}
		if icode != 0 {
			end := metav1.Now()
			k.setStatus(ctx, pod.Name, func(s *corev1.PodStatus) {
				s.Phase = corev1.PodFailed
				s.InitContainerStatuses = []corev1.ContainerStatus{{Name: pod.Spec.InitContainers[0].Name, Image: pod.Spec.InitContainers[0].Image,
					State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: icode, Reason: "Error", Message: imsg, StartedAt: now, FinishedAt: end}}}}
				s.ContainerStatuses = []corev1.ContainerStatus{{Name: kaniko.ContainerName, Image: pod.Spec.Containers[0].Image,
					State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "PodInitializing"}}}}
			})
			return
		}
	}
	if f.deletePod {
		// Someone deletes the pod while it runs: the kubelet kills the
		// container (SIGTERM, exit 143) and reports the pod Failed, then
		// the pod object goes once the Job controller drops its finalizer.
		_ = pods.Delete(ctx, pod.Name, metav1.DeleteOptions{})
		code, msg = 143, "terminated: pod deleted"
	}
	if code == 0 && msg == "" {
		code, msg = k.execute(ctx, pod, fetched)
	}
	if ctx.Err() != nil {
		return
	}
	end := metav1.Now()
	k.setStatus(ctx, pod.Name, func(s *corev1.PodStatus) {
		s.Phase = corev1.PodSucceeded
		reason := "Completed"
		if code != 0 {
			s.Phase, reason = corev1.PodFailed, "Error"
		}
		s.ContainerStatuses = []corev1.ContainerStatus{{Name: kaniko.ContainerName, Image: pod.Spec.Containers[0].Image,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
				ExitCode: code, Reason: reason, Message: msg, StartedAt: now, FinishedAt: end,
			}}}}
	})
}

// setStatus writes the pod's status like a kubelet: it keeps trying
// through conflicts and an unreachable API server (a restart), and gives up
// only when the pod is gone.
func (k *kubelet) setStatus(ctx context.Context, name string, mutate func(*corev1.PodStatus)) {
	deadline := time.Now().Add(2 * time.Minute)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		cur, err := k.client.CoreV1().Pods(k.ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return
		}
		if err == nil {
			mutate(&cur.Status)
			_, err = k.client.CoreV1().Pods(k.ns).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
			if err == nil || apierrors.IsNotFound(err) {
				return
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// fetchContext runs the fetch-context init container's contract (buildq
// fetch-context, with its exit codes) into a new directory: the context,
// then the check that --absent holds no image, with the docker config the
// container mounts (and nothing else in its environment).
func (k *kubelet) fetchContext(ctx context.Context, pod *corev1.Pod, c corev1.Container) (string, int32, string) {
	onlyDockerConfig := len(c.Env) == 0 || (len(c.Env) == 1 && c.Env[0].Name == "DOCKER_CONFIG" && c.Env[0].Value == kaniko.DockerConfigDir && c.Env[0].ValueFrom == nil)
	if len(c.Args) == 0 || c.Args[0] != "fetch-context" || !onlyDockerConfig {
		return "", 1, fmt.Sprintf("error: init container %s: not the fetch-context contract: %v", c.Name, c.Args)
	}
	args := map[string]string{}
	var insecure []string
	for i := 1; i+1 < len(c.Args); i += 2 {
		if c.Args[i] == "--insecure-registry" {
			insecure = append(insecure, c.Args[i+1])
			continue
		}
		args[strings.TrimPrefix(c.Args[i], "--")] = c.Args[i+1]
	}
	dir, err := os.MkdirTemp("", "kubelet-context-")
	if err != nil {
		return "", 1, err.Error()
	}
	err = contexttar.Fetch(ctx, nil, args["url"], args["digest"], dir, 0)
	if err == nil && args["absent"] != "" {
		if code, msg := k.checkAbsent(ctx, pod, c, args["absent"], insecure); code != 0 {
			_ = contexttar.ClearDir(dir)
			return dir, code, msg
		}
	}
	switch {
	case err == nil:
		return dir, 0, ""
	case errors.Is(err, contexttar.ErrDigestMismatch):
		return dir, kaniko.FetchExitMismatch, "context mismatch: " + err.Error()
	case errors.Is(err, contexttar.ErrFetchRefused):
		return dir, kaniko.FetchExitRefused, "context missing: " + err.Error()
	case errors.Is(err, contexttar.ErrBadContext):
		return dir, kaniko.FetchExitBadContext, "context refused: " + err.Error()
	default:
		return dir, 1, err.Error()
	}
}

// checkAbsent is fetch-context's --absent check, with the registry
// credentials container c mounts: FetchExitTagTaken when ref holds an
// image, 0 when the registry has none.
func (k *kubelet) checkAbsent(ctx context.Context, pod *corev1.Pod, c corev1.Container, ref string, insecure []string) (int32, string) {
	work, err := os.MkdirTemp("", "kubelet-check-")
	if err != nil {
		return 1, err.Error()
	}
	defer os.RemoveAll(work)
	dockerConfig, err := k.mountedDockerConfig(ctx, pod, c, work)
	if err != nil {
		return 1, err.Error()
	}
	reg, err := registry.New(registry.Options{DockerConfig: dockerConfig, Insecure: insecure})
	if err != nil {
		return 1, err.Error()
	}
	d, err := reg.Head(ctx, ref)
	var terr *transport.Error
	switch {
	case err == nil:
		return kaniko.FetchExitTagTaken, "tag taken: " + ref + " holds " + d + " already; the build would push over it"
	case registry.IsNotFound(err):
		return 0, ""
	case errors.As(err, &terr) && terr.StatusCode >= 400 && terr.StatusCode < 500:
		// As fetch-context: a 4xx (credentials refused) fails the Job
		// at once; anything else is tried again.
		return kaniko.FetchExitRegistry, "checking that " + ref + " holds no image yet: the registry refused the check: " + err.Error()
	default:
		return kaniko.FetchExitRegistryDown, "checking that " + ref + " holds no image yet: " + err.Error()
	}
}

// mountedDockerConfig writes the docker config container c of pod mounts
// at /kaniko/.docker into dir and returns its path ("" when it mounts
// none).
func (k *kubelet) mountedDockerConfig(ctx context.Context, pod *corev1.Pod, c corev1.Container, dir string) (string, error) {
	dockerConfig := ""
	for _, m := range c.VolumeMounts {
		if m.MountPath != kaniko.DockerConfigDir {
			continue
		}
		for _, v := range pod.Spec.Volumes {
			if v.Name != m.Name || v.Secret == nil {
				continue
			}
			sec, err := k.client.CoreV1().Secrets(k.ns).Get(ctx, v.Secret.SecretName, metav1.GetOptions{})
			if err != nil {
				return "", fmt.Errorf("MountVolume.SetUp failed: secret %q: %w", v.Secret.SecretName, err)
			}
			for _, it := range v.Secret.Items {
				if it.Path == "config.json" {
					dockerConfig = filepath.Join(dir, "config.json")
					if err := os.WriteFile(dockerConfig, sec.Data[it.Key], 0o600); err != nil {
						return "", err
					}
				}
			}
		}
	}
	return dockerConfig, nil
}

// execute runs the kaniko contract and returns the exit code and the
// termination message (the digest, or the end of the log). fetched is the
// directory the init container unpacked the context into, if any.
func (k *kubelet) execute(ctx context.Context, pod *corev1.Pod, fetched string) (int32, string) {
	c := pod.Spec.Containers[0]
	args := map[string][]string{}
	for _, a := range c.Args {
		name, val, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		args[name] = append(args[name], val)
	}
	one := func(n string) string {
		if v := args[n]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
	if one("digest-file") != "/dev/termination-log" || c.TerminationMessagePath != "/dev/termination-log" {
		return 1, "error: the digest does not go to the termination log"
	}
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			sec, err := k.client.CoreV1().Secrets(k.ns).Get(ctx, ref.Name, metav1.GetOptions{})
			if err != nil {
				return 1, fmt.Sprintf("CreateContainerConfigError: secret %q: %v", ref.Name, err)
			}
			env[e.Name] = string(sec.Data[ref.Key])
		default:
			env[e.Name] = e.Value
		}
	}
	work, err := os.MkdirTemp("", "kubelet-")
	if err != nil {
		return 1, err.Error()
	}
	defer os.RemoveAll(work)

	// The docker config the pod mounts at /kaniko/.docker.
	dockerConfig, err := k.mountedDockerConfig(ctx, pod, c, work)
	if err != nil {
		return 1, err.Error()
	}

	if one("context") == "dir://"+kaniko.ContextDir {
		if fetched == "" {
			return 1, "error: a dir:// context without the fetch-context init container"
		}
		for n := range env {
			if strings.HasPrefix(n, "AWS_") || strings.HasPrefix(n, "S3_") {
				return 1, "error: the build container holds " + n
			}
		}
		return k.build(ctx, args, fetched, dockerConfig)
	}

	// The context, with the pod's own S3 credentials.
	bucket, key, ok := strings.Cut(strings.TrimPrefix(one("context"), "s3://"), "/")
	if !ok || !strings.HasPrefix(one("context"), "s3://") {
		return 1, "error: only s3:// contexts are emulated, got " + one("context")
	}
	if env["S3_FORCE_PATH_STYLE"] != "true" {
		return 1, "error retrieving context: S3_FORCE_PATH_STYLE is not set"
	}
	store, err := s3store.New(s3store.Config{Endpoint: env["S3_ENDPOINT"], Region: env["AWS_REGION"],
		AccessKey: env["AWS_ACCESS_KEY_ID"], SecretKey: env["AWS_SECRET_ACCESS_KEY"], Bucket: bucket})
	if err != nil {
		return 1, "error retrieving context: " + err.Error()
	}
	rc, err := store.Open(ctx, bucket, key)
	if err != nil {
		if errors.Is(err, s3store.ErrNotFound) {
			return 1, "error: failed to get context: NoSuchKey: " + key
		}
		return 1, "error retrieving context: " + err.Error()
	}
	dir := filepath.Join(work, "context")
	err = os.Mkdir(dir, 0o755)
	if err == nil {
		err = contexttar.Extract(ctx, rc, dir, 0)
	}
	rc.Close()
	if err != nil {
		return 1, "error retrieving context: " + err.Error()
	}
	return k.build(ctx, args, dir, dockerConfig)
}

// build is the build and push half of the kaniko contract.
func (k *kubelet) build(ctx context.Context, args map[string][]string, dir, dockerConfig string) (int32, string) {
	one := func(n string) string {
		if v := args[n]; len(v) > 0 {
			return v[0]
		}
		return ""
	}
	buildArgs := map[string]string{}
	for _, a := range args["build-arg"] {
		k, v, _ := strings.Cut(a, "=")
		buildArgs[k] = v
	}
	labels := map[string]string{}
	for _, a := range args["label"] {
		k, v, _ := strings.Cut(a, "=")
		labels[k] = v
	}
	reg, err := registry.New(registry.Options{DockerConfig: dockerConfig, Insecure: args["insecure-registry"]})
	if err != nil {
		return 1, "error: docker config: " + err.Error()
	}
	img, err := localexec.Build(ctx, localexec.Options{
		ContextDir: dir, Dockerfile: one("dockerfile"), BuildArgs: buildArgs, Target: one("target"),
		Platform: one("custom-platform"), Labels: labels, Remote: reg.RemoteOptions(ctx),
	})
	if err != nil {
		return 1, "INFO[0000] Retrieving image manifest\nerror building image: " + err.Error()
	}
	digest, err := reg.Push(ctx, img, args["destination"])
	if err != nil {
		return 1, "INFO[0001] Pushing image to " + args["destination"][0] + "\nerror pushing image: failed to push to destination " + args["destination"][0] + ": " + err.Error()
	}
	return 0, digest
}

func ptr[T any](v T) *T { return &v }

// eventually polls cond (test code only) until it holds.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
