//go:build integration

package integration

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// TestDeployManifestsPassServerSideValidation sends every object of
// deploy/*.yaml to the API server as a dry run, in file order, as kubectl
// apply -f deploy/ would: the manifests are valid Kubernetes, not just YAML.
// The namespaces are created for real (and removed) so that the namespaced
// objects have somewhere to go.
func TestDeployManifestsPassServerSideValidation(t *testing.T) {
	ctx := context.Background()
	files, err := filepath.Glob("../deploy/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("deploy manifests: %v %v", files, err)
	}
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	kinds := map[string]int{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
		for {
			var raw runtime.RawExtension
			if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if len(bytes.TrimSpace(raw.Raw)) == 0 {
				continue
			}
			obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(raw.Raw, nil, nil)
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			c := shared.kube
			switch o := obj.(type) {
			case *corev1.Namespace:
				_, err = c.CoreV1().Namespaces().Create(ctx, o, metav1.CreateOptions{})
				if err == nil {
					t.Cleanup(func() { _ = c.CoreV1().Namespaces().Delete(context.Background(), o.Name, metav1.DeleteOptions{}) })
				}
			case *corev1.ServiceAccount:
				_, err = c.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, dry)
			case *corev1.LimitRange:
				_, err = c.CoreV1().LimitRanges(o.Namespace).Create(ctx, o, dry)
			case *corev1.ResourceQuota:
				_, err = c.CoreV1().ResourceQuotas(o.Namespace).Create(ctx, o, dry)
			case *networkingv1.NetworkPolicy:
				_, err = c.NetworkingV1().NetworkPolicies(o.Namespace).Create(ctx, o, dry)
			case *rbacv1.Role:
				_, err = c.RbacV1().Roles(o.Namespace).Create(ctx, o, dry)
			case *rbacv1.RoleBinding:
				_, err = c.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, dry)
			case *appsv1.Deployment:
				_, err = c.AppsV1().Deployments(o.Namespace).Create(ctx, o, dry)
			default:
				t.Fatalf("%s: no dry run for %T; add it here", f, obj)
			}
			if err != nil {
				t.Fatalf("%s: the API server refuses %T: %v", f, obj, err)
			}
			kinds[obj.GetObjectKind().GroupVersionKind().Kind]++
		}
	}
	for _, k := range []string{"Namespace", "LimitRange", "ResourceQuota", "NetworkPolicy", "Role", "Deployment"} {
		if kinds[k] == 0 {
			t.Errorf("deploy/ has no %s", k)
		}
	}

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
