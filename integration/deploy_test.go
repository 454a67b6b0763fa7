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
		obj, err := r.Map()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, &unstructured.Unstructured{Object: obj})
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

	base := kustomize(t, "../deploy/base")
	prod := kustomize(t, "../deploy/overlays/production")
	dev := kustomize(t, "../deploy/overlays/dev")
	kinds := map[string]int{}
	for _, o := range base {
		kinds[o.GetKind()]++
	}
	for _, k := range []string{"Namespace", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "LimitRange", "ResourceQuota"} {
		if kinds[k] == 0 {
			t.Errorf("deploy/base has no %s", k)
		}
	}
	t.Cleanup(func() {
		for _, ns := range []string{"buildq", "buildq-builds"} {
			_ = shared.kube.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
		}
	})
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
	switch {
	case d.Spec.Replicas == nil || *d.Spec.Replicas != 3:
		t.Errorf("production replicas %v, want 3", d.Spec.Replicas)
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
		{"", "list", "", "nodes", "", false},
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
