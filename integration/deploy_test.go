//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// Versions whose own CRD files the deploy test installs (from the Go
// module cache: go mod download fetches them like any module).
const (
	kedaModule     = "github.com/kedacore/keda/v2@v2.21.0"
	promOpModule   = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
	deployFieldMgr = "buildq-deploy-test"
)

// kustomize renders a kustomization as kubectl apply -k does.
func kustomize(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	var out []*unstructured.Unstructured
	for _, r := range m.Resources() {
		// Through JSON, as the API machinery decodes it: integers as
		// int64, so the unstructured helpers can read and copy them.
		b, err := r.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(b); err != nil {
			t.Fatal(err)
		}
		out = append(out, u)
	}
	return out
}

// moduleDir downloads a module version into the module cache and returns
// its directory.
func moduleDir(t *testing.T, modVersion string) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", modVersion)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	out, err := cmd.Output()
	var info struct{ Dir, Error string }
	if jerr := json.Unmarshal(out, &info); err != nil || jerr != nil || info.Dir == "" {
		t.Fatalf("go mod download %s: %v %s %s", modVersion, err, info.Error, out)
	}
	return info.Dir
}

// applier applies objects with server-side apply through the dynamic
// client, as kubectl apply --server-side does.
type applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newApplier(t *testing.T, cfg *rest.Config) *applier {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}
}

func (a *applier) apply(ctx context.Context, obj *unstructured.Unstructured, dryRun bool) error {
	gvk := obj.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		a.mapper.Reset() // a CRD applied a moment ago
		if m, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
			return err
		}
	}
	// As kubectl apply --server-side: unknown or duplicate fields are
	// errors, not warnings.
	opts := metav1.PatchOptions{FieldManager: deployFieldMgr, Force: ptr(true), FieldValidation: "Strict"}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	var ri dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		ri = a.dyn.Resource(m.Resource).Namespace(obj.GetNamespace())
	}
	data, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	_, err = ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, data, opts)
	return err
}

// readYAML decodes every document of a YAML file.
func readYAML(t *testing.T, path string) []*unstructured.Unstructured {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	var out []*unstructured.Unstructured
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			return out
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if obj != nil {
			out = append(out, &unstructured.Unstructured{Object: obj})
		}
	}
}

// installDeployCRDs applies the CRDs of the production overlay's
// components (KEDA's ScaledObject, the Prometheus Operator's
// ServiceMonitor and PrometheusRule) from their own modules and waits
// until they are established.
func installDeployCRDs(t *testing.T, a *applier) {
	t.Helper()
	ctx := context.Background()
	var crds []*unstructured.Unstructured
	crds = append(crds, readYAML(t, filepath.Join(moduleDir(t, kedaModule), "config/crd/bases/keda.sh_scaledobjects.yaml"))...)
	po := filepath.Join(moduleDir(t, promOpModule), "example/prometheus-operator-crd")
	crds = append(crds, readYAML(t, filepath.Join(po, "monitoring.coreos.com_servicemonitors.yaml"))...)
	crds = append(crds, readYAML(t, filepath.Join(po, "monitoring.coreos.com_prometheusrules.yaml"))...)
	for _, crd := range crds {
		if err := a.apply(ctx, crd, false); err != nil {
			t.Fatalf("apply CRD %s: %v", crd.GetName(), err)
		}
	}
	crdGVR := apiextv1.SchemeGroupVersion.WithResource("customresourcedefinitions")
	for _, crd := range crds {
		eventually(t, time.Minute, "CRD "+crd.GetName()+" established", func() bool {
			got, err := a.dyn.Resource(crdGVR).Get(ctx, crd.GetName(), metav1.GetOptions{})
			if err != nil {
				return false
			}
			conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, c := range conds {
				if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
					return true
				}
			}
			return false
		})
	}
	a.mapper.Reset()
}

// TestDeployPackageAppliesServerSide renders deploy/ (the base, both
// overlays, both components) with kustomize and applies it to the API
// server with server-side apply: KEDA's and the Prometheus Operator's CRDs
// from their own modules, then the production overlay for real (its
// Deployment has no node to run on here), and the dev overlay as a dry run.
// The worker's ServiceAccount may do what a build needs and no more,
// asked through SubjectAccessReview.
func TestDeployPackageAppliesServerSide(t *testing.T) {
	ctx := context.Background()
	a := newApplier(t, shared.restConfig)
	installDeployCRDs(t, a)

	base := kustomize(t, "../deploy/base")
	prod := kustomize(t, "../deploy/overlays/production")
	dev := kustomize(t, "../deploy/overlays/dev")
	kinds := map[string]int{}
	for _, o := range base {
		kinds[o.GetKind()]++
	}
	for _, k := range []string{"Namespace", "ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "LimitRange", "ResourceQuota"} {
		if kinds[k] == 0 {
			t.Errorf("deploy/base has no %s", k)
		}
	}
	// Every overlay renders with its shipped site values into manifests
	// without a placeholder: no REPLACE, no all-zero digest, no image
	// without a digest.
	for name, objs := range map[string][]*unstructured.Unstructured{"production": prod, "dev": dev} {
		for _, o := range objs {
			b, _ := json.Marshal(o.Object)
			if strings.Contains(string(b), "REPLACE") || strings.Contains(string(b), "sha256:"+strings.Repeat("0", 64)) {
				t.Errorf("%s overlay: %s %s holds a placeholder: %.300s", name, o.GetKind(), o.GetName(), b)
			}
			for _, path := range [][]string{{"spec", "template", "spec", "containers"}} {
				cs, _, _ := unstructured.NestedSlice(o.Object, path...)
				for _, c := range cs {
					if img, _ := c.(map[string]any)["image"].(string); !strings.Contains(img, "@sha256:") {
						t.Errorf("%s overlay: %s %s runs %q, not pinned by digest", name, o.GetKind(), o.GetName(), img)
					}
				}
			}
		}
	}

	t.Cleanup(func() { deleteDeployNamespaces(t) })
	for _, o := range prod {
		if err := a.apply(ctx, o, false); err != nil {
			t.Fatalf("production overlay: the API server refuses %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	for _, want := range []string{"ScaledObject", "ServiceMonitor", "PrometheusRule", "ConfigMap"} {
		found := false
		for _, o := range prod {
			found = found || o.GetKind() == want
		}
		if !found {
			t.Errorf("the production overlay has no %s", want)
		}
	}
	for _, o := range dev {
		if err := a.apply(ctx, o, true); err != nil {
			t.Fatalf("dev overlay: the API server refuses %s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}

	// What the production overlay says it does.
	d, err := shared.kube.AppsV1().Deployments("buildq").Get(ctx, "buildq-worker", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := d.Spec.Template.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	// KEDA alone owns the workers' replicas: the overlay sets none.
	for _, o := range prod {
		if o.GetKind() == "Deployment" && o.GetName() == "buildq-worker" {
			if r, found, _ := unstructured.NestedFieldNoCopy(o.Object, "spec", "replicas"); found {
				t.Errorf("the production overlay sets the worker's replicas (%v) and also has KEDA's ScaledObject: every apply would fight its HPA", r)
			}
		}
		if o.GetKind() == "ScaledObject" {
			lo, _, _ := unstructured.NestedInt64(o.Object, "spec", "minReplicaCount")
			hi, _, _ := unstructured.NestedInt64(o.Object, "spec", "maxReplicaCount")
			if lo < 2 || hi < lo {
				t.Errorf("ScaledObject min %d max %d", lo, hi)
			}
		}
		// Monitoring is selected by kube-prometheus-stack's default
		// selector (release=<its Helm release>), from the site values.
		if k := o.GetKind(); (k == "ServiceMonitor" || k == "PrometheusRule") && o.GetLabels()["release"] != "kube-prometheus-stack" {
			t.Errorf("%s labels %v, want release=kube-prometheus-stack", k, o.GetLabels())
		}
	}
	// NATS: three servers with routes in production, one in dev.
	for name, objs := range map[string][]*unstructured.Unstructured{"production": prod, "dev": dev} {
		want := map[string]int64{"production": 3, "dev": 1}[name]
		var replicas int64
		var conf string
		for _, o := range objs {
			switch {
			case o.GetKind() == "StatefulSet" && o.GetName() == "nats":
				replicas, _, _ = unstructured.NestedInt64(o.Object, "spec", "replicas")
			case o.GetKind() == "ConfigMap" && strings.HasPrefix(o.GetName(), "nats-config"):
				conf, _, _ = unstructured.NestedString(o.Object, "data", "cluster.conf")
			}
		}
		if replicas != want || (want > 1) != strings.Contains(conf, "routes: [") {
			t.Errorf("%s overlay: NATS StatefulSet replicas %d (want %d), cluster.conf %q", name, replicas, want, conf)
		}
	}

	switch {
	case d.Spec.Replicas == nil || *d.Spec.Replicas != 1:
		t.Errorf("production replicas %v, want the API server's default 1 until KEDA scales", d.Spec.Replicas)
	case c.StartupProbe == nil || c.StartupProbe.HTTPGet == nil || c.StartupProbe.PeriodSeconds*c.StartupProbe.FailureThreshold < 120:
		t.Errorf("startup probe %+v: want one that waits 2 minutes at least for the informers to sync", c.StartupProbe)
	case !strings.Contains(c.Image, "@sha256:"):
		t.Errorf("production image %q is not pinned by digest", c.Image)
	case env["BUILDQ_FETCH_IMAGE"] != c.Image:
		t.Errorf("BUILDQ_FETCH_IMAGE %q, want the worker's own image %q", env["BUILDQ_FETCH_IMAGE"], c.Image)
	case env["BUILDQ_REPLICAS"] != "3":
		t.Errorf("BUILDQ_REPLICAS %q, want 3 (JetStream replicas)", env["BUILDQ_REPLICAS"])
	case c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz":
		t.Errorf("readiness probe %+v, want /readyz", c.ReadinessProbe)
	case c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/healthz":
		t.Errorf("liveness probe %+v, want /healthz", c.LivenessProbe)
	case env["BUILDQ_METRICS_ADDR"] != ":9090":
		t.Errorf("BUILDQ_METRICS_ADDR %q, want :9090 (the probes' and the Service's port)", env["BUILDQ_METRICS_ADDR"])
	}
	if sa := d.Spec.Template.Spec.ServiceAccountName; sa != "buildq-worker" {
		t.Errorf("service account %q", sa)
	}

	// The ServiceAccount's rights: enough for a build, and no more.
	sa := "system:serviceaccount:buildq:buildq-worker"
	type access struct {
		ns, verb, group, resource, sub string
		allowed                        bool
	}
	for _, q := range []access{
		{"buildq-builds", "create", "batch", "jobs", "", true},
		{"buildq-builds", "watch", "batch", "jobs", "", true},
		{"buildq-builds", "delete", "batch", "jobs", "", true},
		{"buildq-builds", "list", "", "pods", "", true},
		{"buildq-builds", "get", "", "pods", "log", true},
		{"buildq-builds", "get", "", "secrets", "", false},
		{"buildq-builds", "list", "", "secrets", "", false},
		{"buildq", "get", "", "secrets", "", false},
		{"buildq-builds", "create", "", "pods", "", false},
		{"buildq-builds", "update", "batch", "jobs", "", false},
		{"default", "create", "batch", "jobs", "", false},
		{"kube-system", "list", "", "pods", "", false},
		// Nodes, read only: a platform no Ready node runs is refused at
		// once instead of left Pending.
		{"", "list", "", "nodes", "", true},
		{"", "watch", "", "nodes", "", true},
		{"", "update", "", "nodes", "", false},
		{"", "get", "", "nodes", "status", false},
		{"", "list", "", "namespaces", "", false},
		{"", "list", "batch", "jobs", "", false},
	} {
		r, err := shared.kube.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: sa, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:buildq"},
				ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: q.ns, Verb: q.verb, Group: q.group, Resource: q.resource, Subresource: q.sub}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Allowed != q.allowed {
			t.Errorf("buildq-worker %s %s/%s (%s) in %q: allowed %v, want %v", q.verb, q.resource, q.sub, q.group, q.ns, r.Status.Allowed, q.allowed)
		}
	}

	// The workers may open the API server's port only at the site's
	// address: every egress rule of their policies names where it goes.
	for _, o := range prod {
		if o.GetKind() != "NetworkPolicy" || o.GetNamespace() != "buildq" {
			continue
		}
		rules, _, _ := unstructured.NestedSlice(o.Object, "spec", "egress")
		for _, r := range rules {
			if to, _ := r.(map[string]any)["to"].([]any); len(to) == 0 {
				t.Errorf("NetworkPolicy %s: egress rule %v allows its ports to any address", o.GetName(), r)
			}
		}
		if o.GetName() == "buildq-worker-apiserver" {
			if cidr, _ := json.Marshal(rules); !strings.Contains(string(cidr), `"cidr":"192.0.2.1/32"`) {
				t.Errorf("buildq-worker-apiserver: %s, want the site value SITE_API_SERVER_CIDR", cidr)
			}
		}
	}

	// Started as the production Deployment starts it, with the shipped
	// site values, the worker stops at once, naming each value to set.
	var site []string
	for _, o := range prod {
		if o.GetKind() == "ConfigMap" && strings.HasPrefix(o.GetName(), "buildq-site") {
			data, _, _ := unstructured.NestedStringMap(o.Object, "data")
			for k, v := range data {
				site = append(site, k+"="+v)
			}
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			site = append(site, e.Name+"="+e.Value)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(wctx, filepath.Join(shared.bin, "buildq"), c.Args...)
	cmd.Env = append(os.Environ(), append(site, "AWS_ACCESS_KEY_ID=k", "AWS_SECRET_ACCESS_KEY=s", "BUILDQ_METRICS_ADDR=")...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Errorf("buildq worker with the shipped site values: %v, want exit 2\n%s", err, out)
	}
	for _, k := range []string{"SITE_WORKER_IMAGE", "SITE_NATS_IMAGE", "BUILDQ_EXECUTOR_IMAGE", "BUILDQ_S3_ENDPOINT", "BUILDQ_REGISTRY", "SITE_API_SERVER_CIDR", "SITE_BASE_IMAGE_CIDR"} {
		if !strings.Contains(string(out), k+"=") {
			t.Errorf("buildq worker with the shipped site values does not name %s:\n%s", k, out)
		}
	}

	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	// The build Pods buildq renders are admitted by the build namespace's
	// Pod Security level (baseline): Pod Security admission judges Pods,
	// so the Job's pod template goes in as a Pod, dry run.
	r := &v1.Request{APIVersion: v1.APIVersion, RequestID: "r1", Tenant: "acme", Name: "web",
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/acme/sha256/x.tar.gz"}},
		ContextDigest: "sha256:" + strings.Repeat("a", 64)}
	cfg := kaniko.Config{Namespace: "buildq-builds", ExecutorImage: executorImage, FetchImage: fetchImage,
		S3Endpoint: "http://minio.minio:9000", RegistrySecret: "buildq-registry"}.Defaults()
	job, err := kaniko.Job(kaniko.Spec{Request: r, Key: strings.Repeat("b", 64), Destinations: []string{"registry.example.com/acme/web:1"},
		ContextURL: "http://minio.minio:9000/buildq/x?X-Amz-Signature=s"}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "build-pod", Namespace: "buildq-builds", Labels: job.Spec.Template.Labels},
		Spec: job.Spec.Template.Spec}
	if _, err := shared.kube.CoreV1().Pods("buildq-builds").Create(ctx, pod, dry); err != nil {
		t.Fatalf("the build namespace refuses buildq's build Pod: %v", err)
	}
	// And it is what keeps a privileged Pod out.
	priv := pod.DeepCopy()
	priv.Spec.Containers[0].SecurityContext.Privileged = ptr(true)
	priv.Spec.Containers[0].SecurityContext.AllowPrivilegeEscalation = nil
	if _, err := shared.kube.CoreV1().Pods("buildq-builds").Create(ctx, priv, dry); err == nil || !strings.Contains(err.Error(), "violates PodSecurity") {
		t.Fatalf("a privileged Pod in the build namespace: %v, want a PodSecurity refusal", err)
	}
}

// deleteDeployNamespaces deletes the namespaces the overlays make, doing
// the part of the controllers the suite's controller manager does not
// run: the StatefulSet's volume claims keep the PVC-protection finalizer
// (no protection controller, no provisioner to bind them), and Pods bound
// to no running kubelet never finish terminating, so the namespaces would
// never go and the next test to apply deploy/ would wait for them.
func deleteDeployNamespaces(t *testing.T) {
	ctx := context.Background()
	nss := []string{"buildq", "buildq-builds", "nats"}
	for _, ns := range nss {
		_ = shared.kube.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})
	}
	eventually(t, 2*time.Minute, "the deploy test's namespaces gone", func() bool {
		gone := true
		for _, ns := range nss {
			if _, err := shared.kube.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); apierrors.IsNotFound(err) {
				continue
			}
			gone = false
			pvcs, err := shared.kube.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
			if err == nil {
				for _, c := range pvcs.Items {
					if len(c.Finalizers) > 0 {
						_, _ = shared.kube.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, c.Name, types.MergePatchType,
							[]byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
					}
				}
			}
			zero := int64(0)
			_ = shared.kube.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
		}
		return gone
	})
}
