//go:build integration

package integration

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kretry "k8s.io/client-go/util/retry"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/natsconf"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/publisher"
)

// testWorkerPodFromDeploy runs the worker the way a platform team would,
// once per overlay of deploy/ (dev: one worker and one NATS server;
// production: KEDA's minimum of workers and a 3-node JetStream cluster):
// the overlay's site.env filled in with the suite's values as an operator
// fills it in, rendered with kustomize and applied with server-side apply
// to the suite's API server; the images are the project's own (buildq as
// make image builds it, nats-server built from its Go module), pushed to
// the suite's registry and run by the real node's kubelet under the
// package's ServiceAccount and RBAC. The worker Pods become Ready through
// their probes, reach NATS by its Service name, and carry a build end to
// end, submitted by tenant acme with its own nkey.
//
// The test only adds what a one-node test cluster lacks (onTheNode,
// deploy_cluster_test.go): the node's selector and toleration, cluster
// DNS, a storage provisioner, the API
// server's address, the ServiceAccount token volume with its
// kube-root-ca.crt ConfigMap (the suite's API server runs without the
// ServiceAccount admission plugin and its controller manager without the
// CA publisher), and KEDA's first scale (no KEDA runs here: the Deployment
// is scaled to the ScaledObject's minReplicaCount as KEDA would). The
// production overlay's spread constraints are ScheduleAnyway, so its Pods
// schedule on one node unpatched.
func testWorkerPodFromDeploy(t *testing.T, node *realNode) {
	startClusterDNS(t)
	for _, overlay := range []string{"dev", "production"} {
		if !t.Run(overlay, func(t *testing.T) { testOverlayOnNode(t, node, overlay) }) {
			return
		}
	}
}

// deployNamespaces are the namespaces deploy/'s overlays make.
var deployNamespaces = []string{"buildq", "buildq-builds", "nats"}

func testOverlayOnNode(t *testing.T, node *realNode, overlay string) {
	ctx := context.Background()
	start := time.Now()
	for _, ns := range deployNamespaces {
		eventually(t, 2*time.Minute, "namespace "+ns+" gone (another test's)", func() bool {
			_, err := shared.kube.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
	}
	s := newSuite(t, options{node: node})

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

	// The site values, as an operator sets them: every shipped example
	// replaced (the worker refuses to start with one left).
	_, apiPort, _ := net.SplitHostPort(apiAddr)
	_, regPort, _ := net.SplitHostPort(node.registryHost)
	dir := copyDeploy(t)
	setSiteValues(t, filepath.Join(dir, "overlays", overlay, "site.env"), map[string]string{
		"SITE_WORKER_IMAGE":        node.images.buildq,
		"SITE_NATS_IMAGE":          node.images.nats,
		"BUILDQ_EXECUTOR_IMAGE":    node.images.kaniko,
		"BUILDQ_S3_ENDPOINT":       node.minioEndpoint,
		"BUILDQ_REGISTRY":          node.registryHost,
		"BUILDQ_INSECURE_REGISTRY": node.registryHost,
		"SITE_API_SERVER_CIDR":     nodeGateway + "/32",
		"SITE_API_SERVER_PORT":     apiPort,
		"SITE_BASE_IMAGE_CIDR":     nodeGateway + "/32",
		"SITE_BASE_IMAGE_PORT":     regPort,
	})
	objs := kustomize(t, filepath.Join(dir, "overlays", overlay))

	a := newApplier(t, shared.restConfig)
	if overlay == "production" {
		installDeployCRDs(t, a)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, ns := range deployNamespaces {
				dumpNamespace(t, ns)
			}
			workerPodLogs(t)
			podLogs(t, "nats", "app.kubernetes.io/name=nats")
		}
		for _, ns := range deployNamespaces {
			_ = shared.kube.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
		}
	})
	// Namespaces first, then what the operator creates (Secrets), then
	// the rest: NATS before the workers, whose first start needs it (they
	// would restart until NATS answers).
	for _, o := range objs {
		if o.GetKind() == "Namespace" {
			if err := a.apply(ctx, o, false); err != nil {
				t.Fatalf("apply %s: %v", o.GetName(), err)
			}
		}
	}
	keys, err := natsconf.NewUserKeys(natsconf.Users([]string{"acme", "globex"}))
	if err != nil {
		t.Fatal(err)
	}
	nkeys, seeds := map[string]string{}, map[string][]byte{}
	for _, k := range keys {
		nkeys[natsconf.NKeyVar(k.User)] = k.Public
		seeds[k.User] = k.Seed
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
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "nats-nkeys", Namespace: "nats"}, StringData: nkeys},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-nats", Namespace: "buildq"},
			Data: map[string][]byte{"worker.seed": seeds[natsconf.WorkerKey]}},
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
	var worker, natsSts *unstructured.Unstructured
	for _, o := range objs {
		switch {
		case o.GetKind() == "Namespace":
			continue
		case o.GetKind() == "Deployment" && o.GetName() == "buildq-worker":
			worker = o
			onTheNode(t, o, "buildq")
			workerOnTheNode(o)
			continue
		case o.GetKind() == "StatefulSet" && o.GetName() == "nats":
			natsSts = o
			onTheNode(t, o, "nats")
			withoutClaims(t, o)
		}
		if err := a.apply(ctx, o, false); err != nil {
			t.Fatalf("apply %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	if worker == nil || natsSts == nil {
		t.Fatalf("the %s overlay has no worker Deployment or no NATS StatefulSet", overlay)
	}
	natsPods := waitPodsReady(t, "nats", "app.kubernetes.io/name=nats", map[string]int{"dev": 1, "production": 3}[overlay], 3*time.Minute)
	t.Logf("%s: %d NATS server(s) ready after %s", overlay, len(natsPods), time.Since(start).Round(time.Second))
	if err := a.apply(ctx, worker, false); err != nil {
		t.Fatalf("apply the worker Deployment: %v", err)
	}
	wantWorkers := 1
	if overlay == "production" {
		// KEDA's part: the ScaledObject's minimum.
		for _, o := range objs {
			if o.GetKind() == "ScaledObject" {
				n, _, _ := unstructured.NestedInt64(o.Object, "spec", "minReplicaCount")
				wantWorkers = int(n)
			}
		}
		// The deployment controller writes the just-applied Deployment
		// too: a scale read before its write conflicts, so read it again.
		err := kretry.RetryOnConflict(kretry.DefaultRetry, func() error {
			sc, err := shared.kube.AppsV1().Deployments("buildq").GetScale(ctx, "buildq-worker", metav1.GetOptions{})
			if err != nil {
				return err
			}
			sc.Spec.Replicas = int32(wantWorkers)
			_, err = shared.kube.AppsV1().Deployments("buildq").UpdateScale(ctx, "buildq-worker", sc, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			t.Fatalf("scale the worker Deployment to %d: %v", wantWorkers, err)
		}
	}
	// Ready through the readiness probe (/readyz: informers synced, NATS
	// connected, streams set up).
	workers := waitPodsReady(t, "buildq", "app.kubernetes.io/name=buildq-worker", wantWorkers, 4*time.Minute)
	t.Logf("%s: %d worker(s) ready after %s", overlay, len(workers), time.Since(start).Round(time.Second))
	byName := map[string]corev1.Pod{}
	for _, p := range workers {
		if p.Spec.ServiceAccountName != "buildq-worker" || p.Spec.NodeName != nodeName || p.Spec.Containers[0].Image != node.images.buildq {
			t.Fatalf("worker Pod %s runs as %q on %q with %s", p.Name, p.Spec.ServiceAccountName, p.Spec.NodeName, p.Spec.Containers[0].Image)
		}
		byName[p.Name] = p
	}

	// The streams have as many replicas as the overlay's NATS servers.
	natsURL := "nats://" + net.JoinHostPort(natsPods[0].Status.PodIP, "4222")
	admin := natsConn(t, natsURL, seeds[natsconf.AdminKey])
	js, err := jetstream.New(admin)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, v1.RequestsStream)
	if err != nil {
		t.Fatal(err)
	}
	if info, err := st.Info(ctx); err != nil || info.Config.Replicas != len(natsPods) {
		t.Fatalf("stream %s: %v, replicas %d, want %d (BUILDQ_REPLICAS of the %s overlay)", v1.RequestsStream, err, info.Config.Replicas, len(natsPods), overlay)
	}

	// One build, submitted by tenant acme through its own account.
	pub, err := publisher.New(natsConn(t, natsURL, seeds["acme"]))
	if err != nil {
		t.Fatal(err)
	}
	src := contextDir(t, map[string]string{
		"Dockerfile": "ARG BASE\nFROM $BASE\nRUN echo built-by-a-worker-pod > /made\n",
	})
	up, err := s.store.ForTenant("acme").UploadContext(ctx, src, contexttar.Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	req := &v1.Request{Tenant: "acme", Name: "from-" + overlay, BuildArgs: map[string]string{"BASE": node.images.base},
		Source: v1.Source{S3: &v1.S3Source{Bucket: up.Bucket, Key: up.Key}}, ContextDigest: up.Digest}
	if _, err := pub.Publish(ctx, req); err != nil {
		t.Fatalf("publish as acme: %v", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	r, err := pub.Wait(wctx, "acme", req.Name, req.RequestID, time.Time{})
	if err != nil {
		t.Fatalf("wait as acme: %v", err)
	}
	if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded || !strings.HasPrefix(r.Data.Job, "buildq-") {
		t.Fatalf("result %s", mustJSON(r))
	}
	// Answered by a worker in a Pod (BUILDQ_ID is the Pod's name).
	pod, ok := byName[strings.TrimPrefix(r.Source, "/buildq/worker/")]
	if !ok {
		t.Fatalf("result from %s, want one of the worker Pods %v", r.Source, slices.Sorted(maps.Keys(byName)))
	}
	files := imageFiles(t, r.Data.Image+"@"+r.Data.Digest)
	if f, ok := files["made"]; !ok || string(f.body) != "built-by-a-worker-pod\n" {
		t.Fatalf("the built image's /made: %+v", f)
	}
	t.Logf("%s: built through the overlay after %s", overlay, time.Since(start).Round(time.Second))

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

// waitPodsReady waits until n Pods of ns match selector and are Ready.
func waitPodsReady(t *testing.T, ns, selector string, n int, timeout time.Duration) []corev1.Pod {
	t.Helper()
	var ready []corev1.Pod
	eventually(t, timeout, fmt.Sprintf("%d Pods %s of %s Ready", n, selector, ns), func() bool {
		pods, err := shared.kube.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return false
		}
		ready = ready[:0]
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil && podReady(&p) {
				ready = append(ready, p)
			}
		}
		return len(ready) >= n
	})
	return ready
}

// natsConn connects to url with a user's nkey seed.
func natsConn(t *testing.T, url string, seed []byte) *nats.Conn {
	t.Helper()
	kp, err := nkeys.FromSeed(seed)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(url, nats.Nkey(pub, kp.Sign), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// copyDeploy copies deploy/ into a temporary directory, where the test
// writes its site values as an operator writes them into a clone.
func copyDeploy(t *testing.T) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "deploy")
	err := filepath.WalkDir("../deploy", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel("../deploy", p)
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

// setSiteValues rewrites the KEY=VALUE lines of a site.env named in vals
// and appends those it lacks.
func setSiteValues(t *testing.T, path string, vals map[string]string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	done := map[string]bool{}
	var out []string
	for _, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if k, _, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(l, "#") {
			if v, set := vals[k]; set {
				l, done[k] = k+"="+v, true
			}
		}
		out = append(out, l)
	}
	for k, v := range vals {
		if !done[k] {
			out = append(out, k+"="+v)
		}
	}
	if err := os.WriteFile(path, []byte(strings.Join(out, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// onTheNode adds to a pod template what the suite's node needs: its
// selector and toleration (the node is tainted) and the test's cluster
// DNS (the node's Pods have no resolver).
func onTheNode(t *testing.T, o *unstructured.Unstructured, ns string) {
	t.Helper()
	spec := podSpecOf(o)
	spec["nodeSelector"] = map[string]any{nodeTaint: "true"}
	spec["tolerations"] = []any{map[string]any{"key": nodeTaint, "operator": "Exists", "effect": "NoSchedule"}}
	useClusterDNS(spec, ns)
}

// workerOnTheNode gives the worker what the suite's cluster does not: the
// API server's address (a kubeconfig: the in-cluster "kubernetes" Service
// has no proxy behind it here), the ServiceAccount token volume, and a job
// template that puts the build Pods on the tainted node.
func workerOnTheNode(d *unstructured.Unstructured) {
	spec := podSpecOf(d)
	c := spec["containers"].([]any)[0].(map[string]any)
	c["env"] = append(c["env"].([]any),
		map[string]any{"name": "BUILDQ_KUBECONFIG", "value": "/etc/buildq/kube/config"},
		map[string]any{"name": "BUILDQ_JOB_TEMPLATE", "value": "/etc/buildq/job/job-template.yaml"})
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

// podLogs logs the output of the Pods of ns that match selector.
func podLogs(t *testing.T, ns, selector string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods, err := shared.kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return
	}
	for _, p := range pods.Items {
		b, err := shared.kube.CoreV1().Pods(ns).GetLogs(p.Name, &corev1.PodLogOptions{}).DoRaw(ctx)
		t.Logf("Pod %s/%s log (%v):\n%s", ns, p.Name, err, tail(string(b), 3000))
	}
}
