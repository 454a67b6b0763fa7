//go:build integration

package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// TestJobsPassServerSideValidation has the real API server validate (dry
// run) the Jobs of representative requests, every option and the pod
// template included: what the golden files pin, the server accepts.
func TestJobsPassServerSideValidation(t *testing.T) {
	ns := "it-jobspec"
	ctx := context.Background()
	if _, err := shared.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	digest := strings.Repeat("a", 64)
	s3 := func() *v1.Request {
		return &v1.Request{APIVersion: v1.APIVersion, RequestID: "req:1", Tenant: "acme", Name: "web",
			Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/sha256/" + digest + ".tar.gz"}},
			ContextDigest: "sha256:" + digest}
	}
	base := kaniko.Config{Namespace: ns, ExecutorImage: executorImage, S3Endpoint: "http://minio:9000", S3Secret: "buildq-s3", RegistrySecret: "buildq-registry"}
	full := base
	full.CacheRepo, full.CacheTTL = "registry.example.com/cache", 24*time.Hour
	full.InsecureRegistries = []string{"registry.dev:5000"}
	full.Resources = corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("1Gi")},
		Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("4Gi")},
	}
	full.NodeSelector = map[string]string{"pool": "builds"}
	full.Tolerations = []corev1.Toleration{{Key: "builds", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
	full.ServiceAccountName = "default"
	full.ImagePullSecrets = []string{"ghcr-pull"}
	fetch := full
	fetch.FetchImage = fetchImage

	cases := map[string]struct {
		req func() *v1.Request
		cfg kaniko.Config
	}{
		"minimal": {s3, base},
		"every option": {func() *v1.Request {
			r := s3()
			r.Dockerfile, r.Target, r.Platforms = "build/Dockerfile.prod", "runtime", []string{"linux/arm64"}
			r.BuildArgs = map[string]string{"VERSION": "1.2.3", "NOTE": "spaces and = signs"}
			r.Labels = map[string]string{"org.opencontainers.image.source": "https://example.com/acme/web"}
			r.Tags = []string{"v1", "latest"}
			r.Timeout = v1.Duration{Duration: 90 * time.Minute}
			return r
		}, full},
		"fetch-context": {s3, fetch},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			r := c.req()
			key := v1.BuildKey(r, "kaniko@"+executorImage)
			dests := []string{"registry.example.com/acme/web:" + v1.DefaultTag(key)}
			for _, tag := range r.Tags {
				dests = append(dests, "registry.example.com/acme/web:"+tag)
			}
			job, err := kaniko.Job(kaniko.Spec{Request: r, Key: key, Destinations: dests,
				ContextURL: "http://minio:9000/buildq/contexts/x?X-Amz-Signature=s"}, c.cfg.Defaults())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := shared.kube.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
				t.Fatalf("the API server refuses the Job: %v", err)
			}
		})
	}
}
