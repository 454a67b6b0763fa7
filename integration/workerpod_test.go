//go:build integration

package integration

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
)

// testWorkerPodFromDeploy runs the worker the way a platform team would:
// the dev overlay of deploy/ applied with server-side apply, its
// Deployment running the image make image builds (node.images.buildq) on
// the real node under the package's ServiceAccount and RBAC. The test only
// fills in what a cluster would provide: the addresses the node's Pods
// reach (NATS, the API server, MinIO, the registry all forwarded on the
// bridge's gateway), the Secrets, the real node's toleration, and the
// ServiceAccount token volume with its kube-root-ca.crt ConfigMap (the
// suite's API server runs without the ServiceAccount admission plugin and
// its controller manager without the CA publisher). The Pod becomes Ready
// through its probes and carries a build end to end, authenticated as the
// package's ServiceAccount.
func testWorkerPodFromDeploy(t *testing.T, node *realNode) {
	ctx := context.Background()
	for _, ns := range []string{"buildq", "buildq-builds"} {
		eventually(t, 2*time.Minute, "namespace "+ns+" gone (another test's)", func() bool {
			_, err := shared.kube.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
	}
	s := newSuite(t, options{node: node})
	res := s.collect()

	natsAddr := node.forward(s.natsAddr)
	api, err := url.Parse(shared.restConfig.Host)
	if err != nil {
		t.Fatal(err)
	}
	apiAddr := node.forward(api.Host)
	apiHost, _, _ := strings.Cut(api.Host, ":")
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
  - name: suite
    cluster:
      server: https://%s
      tls-server-name: %s
      certificate-authority-data: %s
users:
  - name: buildq-worker
    user:
      tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
contexts:
  - name: suite
    context: {cluster: suite, user: buildq-worker}
current-context: suite
`, apiAddr, apiHost, base64.StdEncoding.EncodeToString(shared.restConfig.CAData))

	a := newApplier(t, shared.restConfig)
	objs := kustomize(t, "../deploy/overlays/dev")
	t.Cleanup(func() {
		if t.Failed() {
			dumpNamespace(t, "buildq")
			dumpNamespace(t, "buildq-builds")
			workerPodLogs(t)
		}
		for _, ns := range []string{"buildq", "buildq-builds"} {
			_ = shared.kube.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
		}
	})
	// Namespaces first, then what the cluster provides, then the rest.
	for _, o := range objs {
		if o.GetKind() == "Namespace" {
			if err := a.apply(ctx, o, false); err != nil {
				t.Fatalf("apply %s: %v", o.GetName(), err)
			}
		}
	}
	workerCfg, err := registry.DockerConfigJSON(node.registryHost, shared.registryUser, shared.registryPass)
	if err != nil {
		t.Fatal(err)
	}
	// The package gives each tenant its own push Secret (in the build
	// namespace for its Pods, in the worker's for its checks and copies);
	// the request below is acme's.
	acmeCfg, err := registry.DockerConfigJSON(node.registryHost, shared.acmeUser, shared.acmePass)
	if err != nil {
		t.Fatal(err)
	}
	for _, obj := range []any{
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-s3", Namespace: "buildq"},
			StringData: map[string]string{"AWS_ACCESS_KEY_ID": shared.minioUser, "AWS_SECRET_ACCESS_KEY": shared.minioPassword}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry", Namespace: "buildq"}, Type: corev1.SecretTypeDockerConfigJson,
			Data: map[string][]byte{corev1.DockerConfigJsonKey: workerCfg}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry-acme", Namespace: "buildq"}, Type: corev1.SecretTypeDockerConfigJson,
			Data: map[string][]byte{corev1.DockerConfigJsonKey: acmeCfg}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry-acme", Namespace: "buildq-builds"}, Type: corev1.SecretTypeDockerConfigJson,
			Data: map[string][]byte{corev1.DockerConfigJsonKey: acmeCfg}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-kubeconfig", Namespace: "buildq"},
			StringData: map[string]string{"config": kubeconfig}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "buildq-job-template", Namespace: "buildq"},
			Data: map[string]string{"job-template.yaml": nodeJobTemplate}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kube-root-ca.crt", Namespace: "buildq"},
			Data: map[string]string{"ca.crt": string(shared.restConfig.CAData)}},
	} {
		var err error
		switch o := obj.(type) {
		case *corev1.Secret:
			_, err = shared.kube.CoreV1().Secrets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *corev1.ConfigMap:
			_, err = shared.kube.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		}
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	for _, o := range objs {
		if o.GetKind() == "Namespace" {
			continue
		}
		if o.GetKind() == "Deployment" {
			onTheNode(t, o, node, map[string]string{
				"NATS_URL":                 "nats://" + natsAddr,
				"BUILDQ_EXECUTOR_IMAGE":    node.images.kaniko,
				"BUILDQ_FETCH_IMAGE":       node.images.buildq,
				"BUILDQ_S3_ENDPOINT":       node.minioEndpoint,
				"BUILDQ_REGISTRY":          node.registryHost,
				"BUILDQ_INSECURE_REGISTRY": node.registryHost,
				"BUILDQ_KUBECONFIG":        "/etc/buildq/kube/config",
				"BUILDQ_JOB_TEMPLATE":      "/etc/buildq/job/job-template.yaml",
			})
		}
		if err := a.apply(ctx, o, false); err != nil {
			t.Fatalf("apply %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}

	// Ready through its readiness probe (/readyz: streams set up, NATS
	// connected).
	var pod corev1.Pod
	eventually(t, 3*time.Minute, "the worker Pod Ready", func() bool {
		pods, err := shared.kube.CoreV1().Pods("buildq").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=buildq-worker"})
		if err != nil || len(pods.Items) != 1 {
			return false
		}
		pod = pods.Items[0]
		for _, c := range pod.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	if pod.Spec.ServiceAccountName != "buildq-worker" || pod.Spec.NodeName != nodeName {
		t.Fatalf("worker Pod runs as %q on %q", pod.Spec.ServiceAccountName, pod.Spec.NodeName)
	}
	if img := pod.Spec.Containers[0].Image; img != node.images.buildq {
		t.Fatalf("worker Pod image %s, want %s", img, node.images.buildq)
	}

	dir := contextDir(t, map[string]string{
		"Dockerfile": "ARG BASE\nFROM $BASE\nRUN echo built-by-a-worker-pod > /made\n",
	})
	req := s.submitWith(dir, "from-a-pod", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": node.images.base} })[0]
	r := res.wait(t, 1, 5*time.Minute)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded || !strings.HasPrefix(r.Data.Job, "buildq-") {
		t.Fatalf("result %s", mustJSON(r))
	}
	// Answered by the worker in the Pod (BUILDQ_ID is the Pod's name).
	if want := "/buildq/worker/" + pod.Name; r.Source != want {
		t.Fatalf("result from %s, want %s", r.Source, want)
	}
	files := imageFiles(t, r.Data.Image+"@"+r.Data.Digest)
	if f, ok := files["made"]; !ok || string(f.body) != "built-by-a-worker-pod\n" {
		t.Fatalf("the built image's /made: %+v", f)
	}

	// Its metrics, scraped as Prometheus would (the metrics port, on the
	// Pod's address): one Job created for the one build.
	var body string
	eventually(t, 30*time.Second, "the worker's metrics", func() bool {
		resp, err := http.Get("http://" + net.JoinHostPort(pod.Status.PodIP, "9090") + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return resp.StatusCode == http.StatusOK && strings.Contains(body, `buildq_results_total{origin="build",reason="",status="succeeded"} 1`)
	})
	var calls []string
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, "buildq_kube_requests_total{") {
			calls = append(calls, l)
		}
	}
	t.Logf("the worker's Kubernetes API requests for one build (watches aside):\n%s", strings.Join(calls, "\n"))
	if !strings.Contains(body, `buildq_kube_requests_total{resource="jobs",verb="create"} 1`) ||
		!strings.Contains(body, "buildq_worker_ready 1") {
		t.Fatalf("metrics: want one Job created and the worker ready:\n%s", strings.Join(calls, "\n"))
	}
}

// onTheNode fills the dev overlay's worker Deployment with what the suite's
// cluster provides: env values, the kubeconfig and job template mounts,
// and the real node's selector and toleration.
func onTheNode(t *testing.T, d *unstructured.Unstructured, node *realNode, env map[string]string) {
	t.Helper()
	spec := d.Object["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
	c := spec["containers"].([]any)[0].(map[string]any)
	c["image"] = node.images.buildq
	var out []any
	for _, e := range c["env"].([]any) {
		m := e.(map[string]any)
		if _, ok := env[m["name"].(string)]; !ok {
			out = append(out, m)
		}
	}
	for k, v := range env {
		out = append(out, map[string]any{"name": k, "value": v})
	}
	c["env"] = out
	c["volumeMounts"] = append(c["volumeMounts"].([]any),
		map[string]any{"name": "kubeconfig", "mountPath": "/etc/buildq/kube", "readOnly": true},
		map[string]any{"name": "job-template", "mountPath": "/etc/buildq/job", "readOnly": true},
		map[string]any{"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true})
	// The ServiceAccount's token, as the ServiceAccount admission plugin
	// would add it (envtest's API server runs without that plugin): the
	// kubelet asks the API server for a token of the Pod's ServiceAccount.
	spec["volumes"] = append(spec["volumes"].([]any),
		map[string]any{"name": "kubeconfig", "secret": map[string]any{"secretName": "buildq-kubeconfig"}},
		map[string]any{"name": "job-template", "configMap": map[string]any{"name": "buildq-job-template"}},
		map[string]any{"name": "kube-api-access", "projected": map[string]any{"sources": []any{
			map[string]any{"serviceAccountToken": map[string]any{"path": "token", "expirationSeconds": int64(3607)}},
			map[string]any{"configMap": map[string]any{"name": "kube-root-ca.crt", "items": []any{map[string]any{"key": "ca.crt", "path": "ca.crt"}}}},
		}}})
	spec["nodeSelector"] = map[string]any{nodeTaint: "true"}
	spec["tolerations"] = []any{map[string]any{"key": nodeTaint, "operator": "Exists", "effect": "NoSchedule"}}
}

// workerPodLogs logs the worker Pods' output, the previous run's too.
func workerPodLogs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods, err := shared.kube.CoreV1().Pods("buildq").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=buildq-worker"})
	if err != nil {
		return
	}
	for _, p := range pods.Items {
		for _, prev := range []bool{true, false} {
			b, err := shared.kube.CoreV1().Pods("buildq").GetLogs(p.Name, &corev1.PodLogOptions{Previous: prev}).DoRaw(ctx)
			t.Logf("worker Pod %s log (previous %v, %v):\n%s", p.Name, prev, err, tail(string(b), 4000))
		}
	}
}
