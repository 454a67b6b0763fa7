package kaniko

import (
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	v1 "github.com/buildq/buildq/api/v1"
)

var update = flag.Bool("update", false, "rewrite the golden files")

var baseConfig = Config{
	Namespace:          "builds",
	ExecutorImage:      "ghcr.io/example/kaniko-executor@sha256:" + strings.Repeat("1", 64),
	S3Endpoint:         "http://minio.minio:9000",
	S3Secret:           "buildq-s3",
	RegistrySecret:     "buildq-registry",
	InsecureRegistries: nil,
}

func s3Request() *v1.Request {
	d := strings.Repeat("a", 64)
	return &v1.Request{
		APIVersion: v1.APIVersion, RequestID: "req-1", Tenant: "acme", Name: "web",
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
	}
}

func TestJobGolden(t *testing.T) {
	t.Parallel()
	key := strings.Repeat("0123456789abcdef", 4)
	cases := []struct {
		name   string
		req    func() *v1.Request
		cfg    func(c Config) Config
		dest   []string
		url    string
		absent string
	}{
		{
			name: "s3-minimal",
			req:  s3Request,
			dest: []string{"registry.example.com/acme/web:0123456789ab"},
		},
		{
			name: "s3-all-options",
			req: func() *v1.Request {
				r := s3Request()
				r.Dockerfile = "build/Dockerfile.prod"
				r.BuildArgs = map[string]string{"VERSION": "1.2.3", "A_FIRST": "x"}
				r.Target = "runtime"
				r.Platforms = []string{"linux/arm64"}
				r.Labels = map[string]string{"team": "platform"}
				r.Timeout = v1.Duration{Duration: 5 * time.Hour}
				return r
			},
			cfg: func(c Config) Config {
				c.CacheRepo = "registry.example.com/cache"
				c.InsecureRegistries = []string{"registry.dev:5000"}
				c.NodeSelector = map[string]string{"kubernetes.io/arch": "arm64"}
				c.Tolerations = []corev1.Toleration{{Key: "builds", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
				c.PriorityClassName = "batch-low"
				c.ServiceAccountName = "buildq-builder"
				c.ImagePullSecrets = []string{"ghcr-pull"}
				c.Resources = corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("1Gi")},
					Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("4Gi")},
				}
				return c
			},
			dest: []string{"registry.example.com/acme/web:0123456789ab", "registry.example.com/acme/web:v1"},
		},
		{
			// The context through fetch-context: no S3 key and no URL in
			// the kaniko container.
			name: "s3-fetch-context",
			req:  s3Request,
			cfg: func(c Config) Config {
				c.FetchImage = "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("f", 64)
				return c
			},
			url:  "http://minio.minio:9000/buildq/contexts/acme/sha256/abc.tar.gz?X-Amz-Signature=sig",
			dest: []string{"registry.example.com/acme/web:0123456789ab"},
		},
		{
			// fetch-context also checks that the first tag holds no
			// image yet, with the Pod's own registry credentials.
			name: "s3-fetch-context-absent",
			req:  s3Request,
			cfg: func(c Config) Config {
				c.FetchImage = "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("f", 64)
				c.InsecureRegistries = []string{"registry.dev:5000"}
				return c
			},
			url:    "http://minio.minio:9000/buildq/contexts/acme/sha256/abc.tar.gz?X-Amz-Signature=sig",
			dest:   []string{"registry.dev:5000/acme/web:0123456789ab", "registry.dev:5000/acme/web:v1"},
			absent: "registry.dev:5000/acme/web:0123456789ab",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cfg := baseConfig
			if c.cfg != nil {
				cfg = c.cfg(cfg)
			}
			job, err := Job(Spec{Request: c.req(), Key: key, Destinations: c.dest, ContextURL: c.url, Absent: c.absent}, cfg.Defaults())
			if err != nil {
				t.Fatal(err)
			}
			got, err := yaml.Marshal(job)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join("testdata", c.name+".golden.yaml")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test ./internal/kaniko -update to create it)", err)
			}
			if string(got) != string(want) {
				t.Errorf("job differs from %s (go test ./internal/kaniko -update rewrites it):\n%s", path, got)
			}
		})
	}
}

func TestJobContract(t *testing.T) {
	t.Parallel()
	key := strings.Repeat("f", 64)
	r := s3Request()
	r.Timeout = v1.Duration{Duration: 5 * time.Hour}
	job, err := Job(Spec{Request: r, Key: key, Destinations: []string{"r.example.com/a/b:ffffffffffff"}}, baseConfig.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	if len(job.Name) > 63 || job.Name != "buildq-"+key[:32] {
		t.Errorf("name %q", job.Name)
	}
	for k, v := range job.Labels {
		if len(v) > 63 {
			t.Errorf("label %s=%q longer than 63", k, v)
		}
	}
	if job.Annotations[AnnotationKey] != key || job.Annotations[AnnotationRequestID] != "req-1" {
		t.Errorf("annotations %v", job.Annotations)
	}
	if got := *job.Spec.ActiveDeadlineSeconds; got != int64((2 * time.Hour).Seconds()) {
		t.Errorf("activeDeadlineSeconds %d: the request's 5h must be capped at the 2h maximum", got)
	}
	pod := job.Spec.Template.Spec
	if pod.RestartPolicy != corev1.RestartPolicyNever || pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("pod must not restart and must not mount a service account token")
	}
	if pod.SecurityContext.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("seccomp RuntimeDefault missing")
	}
	if !slices.Equal(pod.Containers[0].Args[:1], []string{"--context=s3://buildq/" + r.Source.S3.Key}) {
		t.Errorf("args %q", pod.Containers[0].Args)
	}
	for _, e := range pod.Containers[0].Env {
		if strings.HasPrefix(e.Name, "AWS_") && e.Name != "AWS_REGION" && (e.Value != "" || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil) {
			t.Errorf("credential %s must come from a secretKeyRef only", e.Name)
		}
	}
	if job.Spec.Template.Labels[LabelManagedBy] != ManagedByValue {
		t.Error("pods must carry the managed-by label the informer filters on")
	}
}

func TestJobRefusesIncompleteSpec(t *testing.T) {
	t.Parallel()
	if _, err := Job(Spec{Request: s3Request(), Key: "k"}, baseConfig.Defaults()); err == nil {
		t.Error("no destination accepted")
	}
	git := s3Request()
	git.Source, git.ContextDigest = v1.Source{Git: &v1.GitSource{URL: "https://github.com/acme/web.git", Commit: strings.Repeat("c", 40)}}, ""
	if _, err := Job(Spec{Request: git, Key: "k", Destinations: []string{"r.example.com/a/b:x"}}, baseConfig.Defaults()); err == nil || !strings.Contains(err.Error(), "packed into an S3 context") {
		t.Errorf("a Job for an unpacked git source: %v, want it refused (a build Pod never fetches git)", err)
	}
	if err := (Config{}).Validate(); err == nil {
		t.Error("empty config accepted")
	}
	if err := (Config{ExecutorImage: "x", S3Endpoint: "minio:9000"}).Validate(); err == nil {
		t.Error("endpoint without scheme accepted")
	}
}

func TestTemplate(t *testing.T) {
	t.Parallel()
	tpl, err := ParseTemplate([]byte(`
resources:
  requests: {cpu: 500m, memory: 1Gi}
  limits: {memory: 4Gi}
nodeSelector: {pool: builds}
tolerations:
  - {key: builds, operator: Exists, effect: NoSchedule}
priorityClassName: batch-low
serviceAccountName: buildq-builder
imagePullSecrets: [ghcr-pull]
`))
	if err != nil {
		t.Fatal(err)
	}
	cfg := baseConfig.Apply(tpl).Defaults()
	job, err := Job(Spec{Request: s3Request(), Key: strings.Repeat("a", 64), Destinations: []string{"r.example.com/a/b:x"}}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	pod := job.Spec.Template.Spec
	if pod.Containers[0].Resources.Limits.Memory().String() != "4Gi" || pod.NodeSelector["pool"] != "builds" ||
		len(pod.Tolerations) != 1 || pod.PriorityClassName != "batch-low" || pod.ServiceAccountName != "buildq-builder" ||
		len(pod.ImagePullSecrets) != 1 || pod.ImagePullSecrets[0].Name != "ghcr-pull" {
		t.Fatalf("template not applied: %+v", pod)
	}
	if _, err := ParseTemplate([]byte("nodeSelectr: {a: b}\n")); err == nil {
		t.Error("a misspelt field was accepted")
	}
}

func TestFetchContextKeepsKeysOutOfThePod(t *testing.T) {
	t.Parallel()
	cfg := baseConfig
	cfg.S3Secret = "buildq-s3" // configured, and still not used
	cfg.FetchImage = "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("f", 64)
	cfg = cfg.Defaults()
	spec := Spec{Request: s3Request(), Key: strings.Repeat("k", 64), Destinations: []string{"r.example/acme/web:1"}}
	if _, err := Job(spec, cfg); err == nil || !strings.Contains(err.Error(), "presigned URL") {
		t.Fatalf("Job without a context URL: %v", err)
	}
	spec.ContextURL = "https://s3.example/b/k?X-Amz-Signature=s"
	job, err := Job(spec, cfg)
	if err != nil {
		t.Fatal(err)
	}
	pod := job.Spec.Template.Spec
	for _, c := range append(pod.InitContainers, pod.Containers...) {
		for _, e := range c.Env {
			if strings.HasPrefix(e.Name, "AWS_") || strings.HasPrefix(e.Name, "S3_") || e.ValueFrom != nil {
				t.Errorf("container %s has env %s", c.Name, e.Name)
			}
		}
		if len(c.EnvFrom) > 0 {
			t.Errorf("container %s has envFrom", c.Name)
		}
	}
	for _, a := range pod.Containers[0].Args {
		if strings.Contains(a, "X-Amz") || strings.HasPrefix(a, "--context=s3://") {
			t.Errorf("kaniko arg %q", a)
		}
	}
	if len(pod.InitContainers) != 1 {
		t.Fatalf("init containers %+v", pod.InitContainers)
	}
	sc := pod.InitContainers[0].SecurityContext
	if sc == nil || sc.Capabilities == nil || len(sc.Capabilities.Add) > 0 || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("fetch-context security context %+v: want every capability dropped, no escalation, a read-only root", sc)
	}
}

// The tag check lives in fetch-context: a Job that would have to check a
// tag without it is refused, never made without the check.
func TestAbsentTagNeedsFetchContext(t *testing.T) {
	t.Parallel()
	spec := Spec{Request: s3Request(), Key: strings.Repeat("k", 64), Destinations: []string{"r.example/acme/web:1"}, Absent: "r.example/acme/web:1"}
	if _, err := Job(spec, baseConfig.Defaults()); err == nil || !strings.Contains(err.Error(), "fetch-context") {
		t.Fatalf("Job with Absent and no fetch image: %v", err)
	}
	cfg := baseConfig
	cfg.FetchImage = "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("f", 64)
	cfg.RegistrySecret = ""
	spec.ContextURL = "https://s3.example/b/k?X-Amz-Signature=s"
	job, err := Job(spec, cfg.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	// Anonymous pushes: the check is anonymous too, with nothing mounted.
	init := job.Spec.Template.Spec.InitContainers[0]
	if len(init.VolumeMounts) != 1 || len(init.Env) != 0 || !slices.Contains(init.Args, "--absent") {
		t.Fatalf("anonymous fetch-context: mounts %+v env %+v args %q", init.VolumeMounts, init.Env, init.Args)
	}
}

func TestTenantRegistrySecret(t *testing.T) {
	t.Parallel()
	cfg := baseConfig
	cfg.RegistrySecret = "buildq-registry"
	cfg.TenantRegistrySecret = "buildq-registry-{tenant}"
	job, err := Job(Spec{Request: s3Request(), Key: strings.Repeat("k", 64), Destinations: []string{"r.example/acme/web:1"}}, cfg.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	var secrets []string
	for _, v := range job.Spec.Template.Spec.Volumes {
		if v.Secret != nil {
			secrets = append(secrets, v.Secret.SecretName)
		}
	}
	if want := "buildq-registry-" + s3Request().Tenant; len(secrets) != 1 || secrets[0] != want {
		t.Fatalf("the build Pod mounts %v, want only %s", secrets, want)
	}
	if got := (Config{RegistrySecret: "shared"}).RegistrySecretFor("acme"); got != "shared" {
		t.Errorf("without a tenant pattern: %q", got)
	}
}
