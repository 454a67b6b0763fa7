// Package kaniko turns a build request into the kaniko Job that runs it
// (DESIGN §5). It is a pure function of the request and the worker's
// configuration: no client calls, so the manifest can be rendered offline
// (`buildq render`) and golden-tested.
package kaniko

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
)

// Labels and annotations buildq puts on its Jobs and their Pods.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedByValue = "buildq"
	LabelKey       = "buildq.dev/key"
	LabelTenant    = "buildq.dev/tenant"
	LabelName      = "buildq.dev/name"

	AnnotationKey = "buildq.dev/key"
	// BuildArgFlag is how a build argument is passed to the executor.
	BuildArgFlag        = "--build-arg="
	AnnotationRequestID = "buildq.dev/request-id"
	// AnnotationRun names the run of the build key this Job belongs to:
	// a worker adopts a Job only when it is its own run's.
	AnnotationRun           = "buildq.dev/run"
	AnnotationImage         = "buildq.dev/image"
	AnnotationContextDigest = "buildq.dev/context-digest"
	AnnotationSource        = "buildq.dev/source"
	// AnnotationSecretBuildArgs names the build arguments whose values
	// the build's log masks (comma-separated names, never values).
	AnnotationSecretBuildArgs = "buildq.dev/secret-build-args"

	// ContainerName is the name of the kaniko container.
	ContainerName = "kaniko"
	// DockerConfigDir is where kaniko reads registry credentials.
	DockerConfigDir = "/kaniko/.docker"
	// FetchContainerName is the init container that downloads an S3
	// context (`buildq fetch-context`) when Config.FetchImage is set;
	// ContextDir is the emptyDir it unpacks into and kaniko reads with
	// dir://.
	FetchContainerName = "fetch-context"
	ContextDir         = "/kaniko/buildcontext"
	// TerminationLog is where kaniko writes the pushed digest.
	TerminationLog = "/dev/termination-log"

	// KeyPrefixLen is how many hex digits of the build key go into Job names
	// and labels: 128 bits, far from any collision, and short enough for
	// the 63-character limits.
	KeyPrefixLen = 32
)

// Exit codes of `buildq fetch-context` that fail the Job at once (the pod
// failure policy): the context's bytes do not match its digest, the
// object is gone (or its URL expired), the context the digest names is
// itself unusable (contexttar.ErrBadContext), or the tag the build must
// not overwrite holds an image already (Spec.Absent). Any other failure
// is retried. The registry refusing that check outright (its
// credentials refused: 401, 403, another 4xx) is FetchExitRegistry and
// fails the Job at once too; a registry that cannot answer now (5xx,
// unreachable) is FetchExitRegistryDown, retried (1 is anything else,
// most often the download).
const (
	FetchExitMismatch     = 3
	FetchExitRefused      = 4
	FetchExitBadContext   = 5
	FetchExitTagTaken     = 6
	FetchExitRegistry     = 7
	FetchExitRegistryDown = 8
)

// ManagedBySelector selects every object buildq manages.
const ManagedBySelector = LabelManagedBy + "=" + ManagedByValue

// Config is the part of the worker's configuration that shapes Jobs.
type Config struct {
	// Namespace the Jobs are created in.
	Namespace string
	// ExecutorImage is the kaniko executor image, pinned by digest.
	ExecutorImage string
	// S3Endpoint is the S3 endpoint with scheme (http://minio:9000).
	S3Endpoint string
	// S3Region is passed as AWS_REGION (default us-east-1).
	S3Region string
	// S3Secret names the Secret that holds the S3 keys, read through
	// secretKeyRef only; S3AccessKeyField and S3SecretKeyField are its keys
	// (default AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY).
	S3Secret         string
	S3AccessKeyField string
	S3SecretKeyField string
	// RegistrySecret names a kubernetes.io/dockerconfigjson Secret mounted
	// as kaniko's docker config. Empty: anonymous push.
	RegistrySecret string
	// TenantRegistrySecret, when set, names each tenant's own push Secret
	// instead, "{tenant}" standing for the request's tenant (for example
	// "buildq-registry-{tenant}"): a build Pod holds only its tenant's
	// registry rights.
	TenantRegistrySecret string
	// InsecureRegistries are pushed to over plain HTTP (kaniko
	// --insecure-registry); for development registries only.
	InsecureRegistries []string
	// DefaultTimeout applies to requests without a timeout (default 30m);
	// MaxTimeout caps every request (default 2h).
	DefaultTimeout time.Duration
	MaxTimeout     time.Duration
	// BackoffLimit is the Job's retry budget for pod failures that the pod
	// failure policy counts (default 2).
	BackoffLimit int32
	// TTLAfterFinished is the safety-net ttlSecondsAfterFinished (default
	// 1h); the worker deletes finished Jobs itself.
	TTLAfterFinished time.Duration
	// PushRetry is kaniko's --push-retry (default 2).
	PushRetry int
	// CacheRepo enables kaniko's layer cache in that repository;
	// CacheTTL bounds the age of cached layers (kaniko's default: 2 weeks).
	CacheRepo string
	CacheTTL  time.Duration
	// Resources of the kaniko container (default DefaultResources; the
	// job template replaces them).
	Resources corev1.ResourceRequirements
	// FetchImage is the buildq image (pinned by digest) whose
	// `fetch-context` init container downloads an S3 context through a
	// presigned URL (Spec.ContextURL), checks its digest and unpacks it
	// for kaniko: the build container then holds no S3 key. Empty: kaniko
	// reads s3:// itself with the keys of S3Secret (legacy).
	FetchImage string
	// PlatformNodeSelectors replaces, per platform, the node selector a
	// one-platform build gets by default (kubernetes.io/os and
	// kubernetes.io/arch of the platform): --platform-node-selector,
	// e.g. linux/386 on kubernetes.io/arch=amd64 nodes, which run 386
	// programs without emulation (platform.go).
	PlatformNodeSelectors PlatformSelectors
	// Template fields copied into the pod spec.
	NodeSelector       map[string]string
	Tolerations        []corev1.Toleration
	PriorityClassName  string
	ServiceAccountName string
	ImagePullSecrets   []string
}

// Defaults fills unset fields with their documented defaults.
func (c Config) Defaults() Config {
	if c.Namespace == "" {
		c.Namespace = "default"
	}
	if c.S3Region == "" {
		c.S3Region = "us-east-1"
	}
	if c.S3AccessKeyField == "" {
		c.S3AccessKeyField = "AWS_ACCESS_KEY_ID"
	}
	if c.S3SecretKeyField == "" {
		c.S3SecretKeyField = "AWS_SECRET_ACCESS_KEY"
	}
	if c.DefaultTimeout == 0 {
		c.DefaultTimeout = 30 * time.Minute
	}
	if c.MaxTimeout == 0 {
		c.MaxTimeout = 2 * time.Hour
	}
	if c.BackoffLimit == 0 {
		c.BackoffLimit = 2
	}
	if c.TTLAfterFinished == 0 {
		c.TTLAfterFinished = time.Hour
	}
	if c.PushRetry == 0 {
		c.PushRetry = 2
	}
	if len(c.Resources.Requests) == 0 && len(c.Resources.Limits) == 0 {
		c.Resources = DefaultResources()
	}
	return c
}

// DefaultResources are the kaniko container's resources when the job
// template sets none: an untrusted build gets a bounded share of the node
// — memory and scratch disk capped, CPU requested but not limited (a CPU
// limit only throttles, it protects no one).
func DefaultResources() corev1.ResourceRequirements {
	return corev1.ResourceRequirements{
		Requests: corev1.ResourceList{
			corev1.ResourceCPU:              resource.MustParse("500m"),
			corev1.ResourceMemory:           resource.MustParse("1Gi"),
			corev1.ResourceEphemeralStorage: resource.MustParse("2Gi"),
		},
		Limits: corev1.ResourceList{
			corev1.ResourceMemory:           resource.MustParse("4Gi"),
			corev1.ResourceEphemeralStorage: resource.MustParse("20Gi"),
		},
	}
}

// Validate reports configuration that would produce unusable Jobs.
func (c Config) Validate() error {
	var errs []error
	if c.ExecutorImage == "" {
		errs = append(errs, errors.New("executor image is required"))
	}
	if c.S3Endpoint != "" && !strings.Contains(c.S3Endpoint, "://") {
		errs = append(errs, fmt.Errorf("S3 endpoint %q needs a scheme (http:// or https://)", c.S3Endpoint))
	}
	if c.MaxTimeout > 0 && c.DefaultTimeout > c.MaxTimeout {
		errs = append(errs, fmt.Errorf("default timeout %s exceeds the maximum %s", c.DefaultTimeout, c.MaxTimeout))
	}
	return errors.Join(errs...)
}

// Spec is one build: the request that started it, its key and where the
// image goes.
type Spec struct {
	Request *v1.Request
	Key     string
	// Destinations are full references (repo:tag); the first is the
	// primary one.
	Destinations []string
	// Run names the attempt of the build key the Job is for (empty when
	// only rendering).
	Run string
	// ContextURL is the presigned GET URL of the S3 context, for the
	// fetch-context init container (Config.FetchImage).
	ContextURL string
	// Absent, when set, is a reference (repo:tag) that must hold no
	// image when the build starts: the fetch-context init container asks
	// the registry for it after unpacking the context, with the build
	// Pod's own registry credentials, and exits FetchExitTagTaken if it
	// is there, before kaniko runs (no tag overwritten). Only with
	// fetch-context (an S3 context and Config.FetchImage).
	Absent string
}

// JobName is the deterministic Job name for a build key: every worker that
// sees the key computes the same name, so a second create gets
// AlreadyExists and adopts the first Job.
func JobName(key string) string {
	if len(key) > KeyPrefixLen {
		key = key[:KeyPrefixLen]
	}
	return "buildq-" + key
}

// KeyLabel is the label value of a build key.
func KeyLabel(key string) string {
	if len(key) > KeyPrefixLen {
		return key[:KeyPrefixLen]
	}
	return key
}

// Timeout is the build deadline for a request under cfg: the request's
// timeout or the default, capped at the maximum.
func Timeout(r *v1.Request, cfg Config) time.Duration {
	t := r.Timeout.Duration
	if t == 0 {
		t = cfg.DefaultTimeout
	}
	if cfg.MaxTimeout > 0 && t > cfg.MaxTimeout {
		t = cfg.MaxTimeout
	}
	return t
}

// Job builds the kaniko Job for spec. cfg should have had Defaults applied.
func Job(spec Spec, cfg Config) (*batchv1.Job, error) {
	r := spec.Request
	if r == nil || spec.Key == "" || len(spec.Destinations) == 0 {
		return nil, errors.New("kaniko job: request, key and destination are required")
	}
	labels := map[string]string{
		LabelManagedBy: ManagedByValue,
		LabelKey:       KeyLabel(spec.Key),
		LabelTenant:    r.Tenant,
		LabelName:      r.Name,
	}
	annotations := map[string]string{
		AnnotationKey:       spec.Key,
		AnnotationRequestID: r.RequestID,
		AnnotationImage:     spec.Destinations[0],
	}
	if r.ContextDigest != "" {
		annotations[AnnotationContextDigest] = r.ContextDigest
	}
	if len(r.SecretBuildArgs) > 0 {
		annotations[AnnotationSecretBuildArgs] = strings.Join(r.SecretBuildArgs, ",")
	}
	if spec.Run != "" {
		annotations[AnnotationRun] = spec.Run
	}

	args, err := Args(spec, cfg)
	if err != nil {
		return nil, err
	}
	fetch := r.Source.S3 != nil && cfg.FetchImage != ""
	if fetch && (spec.ContextURL == "" || r.ContextDigest == "") {
		return nil, errors.New("kaniko job: fetching the context needs its presigned URL and the request's contextDigest")
	}
	env := []corev1.EnvVar{}
	if r.Source.S3 != nil && !fetch {
		env = append(env,
			corev1.EnvVar{Name: "S3_ENDPOINT", Value: cfg.S3Endpoint},
			corev1.EnvVar{Name: "S3_FORCE_PATH_STYLE", Value: "true"},
			corev1.EnvVar{Name: "AWS_REGION", Value: cfg.S3Region},
		)
		if cfg.S3Secret != "" {
			env = append(env,
				secretEnv("AWS_ACCESS_KEY_ID", cfg.S3Secret, cfg.S3AccessKeyField),
				secretEnv("AWS_SECRET_ACCESS_KEY", cfg.S3Secret, cfg.S3SecretKeyField),
			)
		}
	}
	env = append(env, corev1.EnvVar{Name: "DOCKER_CONFIG", Value: DockerConfigDir})

	if spec.Absent != "" && !fetch {
		return nil, errors.New("kaniko job: checking that a tag is absent needs the fetch-context init container (--fetch-image and an S3 context)")
	}
	registrySecret := cfg.RegistrySecretFor(r.Tenant)
	var volumes []corev1.Volume
	var mounts []corev1.VolumeMount
	var initContainers []corev1.Container
	if fetch {
		fetchMounts := []corev1.VolumeMount{{Name: "context", MountPath: ContextDir}}
		var fetchEnv []corev1.EnvVar
		if spec.Absent != "" && registrySecret != "" {
			// The tag is asked for with the build's own push
			// credentials: the same Secret, read-only, nothing more.
			fetchMounts = append(fetchMounts, corev1.VolumeMount{Name: "docker-config", MountPath: DockerConfigDir, ReadOnly: true})
			fetchEnv = []corev1.EnvVar{{Name: "DOCKER_CONFIG", Value: DockerConfigDir}}
		}
		// The context arrives as a directory: the build container gets
		// neither S3 keys nor a URL, and sees only bytes whose digest
		// fetch-context checked against the request.
		volumes = append(volumes, corev1.Volume{Name: "context", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
		mounts = append(mounts, corev1.VolumeMount{Name: "context", MountPath: ContextDir})
		initContainers = append(initContainers, corev1.Container{
			Name:         FetchContainerName,
			Image:        cfg.FetchImage,
			Args:         fetchArgs(spec, cfg),
			Env:          fetchEnv,
			VolumeMounts: fetchMounts,
			Resources: corev1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
				Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
			},
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
			ImagePullPolicy:          corev1.PullIfNotPresent,
			// uid 0 with no capability at all: the files it unpacks must
			// belong to root, because kaniko's COPY keeps the context
			// file's owner (Docker's is always 0:0); as any other user a
			// COPY without --chown would put that uid into the image.
			SecurityContext: &corev1.SecurityContext{
				RunAsUser:                ptr(int64(0)),
				RunAsGroup:               ptr(int64(0)),
				AllowPrivilegeEscalation: ptr(false),
				ReadOnlyRootFilesystem:   ptr(true),
				Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			},
		})
	}
	if secret := registrySecret; secret != "" {
		volumes = append(volumes, corev1.Volume{
			Name: "docker-config",
			VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
				SecretName: secret,
				Items:      []corev1.KeyToPath{{Key: corev1.DockerConfigJsonKey, Path: "config.json"}},
			}},
		})
		mounts = append(mounts, corev1.VolumeMount{Name: "docker-config", MountPath: DockerConfigDir, ReadOnly: true})
	}

	deadline := int64(Timeout(r, cfg) / time.Second)
	ttl := int32(cfg.TTLAfterFinished / time.Second)
	backoff := cfg.BackoffLimit
	var pullSecrets []corev1.LocalObjectReference
	for _, s := range cfg.ImagePullSecrets {
		pullSecrets = append(pullSecrets, corev1.LocalObjectReference{Name: s})
	}

	// kaniko builds for --custom-platform without emulation: run it on a
	// node that runs the platform's programs (platform.go).
	nodeSelector := NodeSelector(r, cfg)

	rules := []batchv1.PodFailurePolicyRule{}
	if fetch {
		// A context that does not match its digest, or is gone, stays
		// so: fail at once.
		rules = append(rules, batchv1.PodFailurePolicyRule{
			Action: batchv1.PodFailurePolicyActionFailJob,
			OnExitCodes: &batchv1.PodFailurePolicyOnExitCodesRequirement{
				ContainerName: ptr(FetchContainerName),
				Operator:      batchv1.PodFailurePolicyOnExitCodesOpIn,
				Values:        []int32{FetchExitMismatch, FetchExitRefused, FetchExitBadContext, FetchExitTagTaken, FetchExitRegistry},
			},
		})
	}
	job := &batchv1.Job{
		TypeMeta: metav1.TypeMeta{APIVersion: "batch/v1", Kind: "Job"},
		ObjectMeta: metav1.ObjectMeta{
			Name:        JobName(spec.Key),
			Namespace:   cfg.Namespace,
			Labels:      labels,
			Annotations: annotations,
		},
		Spec: batchv1.JobSpec{
			BackoffLimit:            &backoff,
			ActiveDeadlineSeconds:   &deadline,
			TTLSecondsAfterFinished: &ttl,
			PodFailurePolicy: &batchv1.PodFailurePolicy{Rules: append(rules, []batchv1.PodFailurePolicyRule{
				// A node drain or preemption is not the build's fault:
				// retry without counting it against the backoff limit.
				// Before the kaniko exit-code rule, so that a disrupted
				// Pod is never judged by its exit code (the fetch-context
				// rule before it matches only codes a kill never gives).
				{
					Action: batchv1.PodFailurePolicyActionIgnore,
					OnPodConditions: []batchv1.PodFailurePolicyOnPodConditionsPattern{
						{Type: corev1.DisruptionTarget, Status: corev1.ConditionTrue},
					},
				},
				// kaniko exits 1 on a Dockerfile, build or push error and
				// with a RUN command's own exit code when that fails: the
				// same build would fail again, so fail the Job at once.
				// The exceptions are retried within the backoff limit:
				// 128, the runtime could not start the container, and 137
				// and 143, the executor itself was killed (its Pod deleted,
				// the node shutting down, an OOM kill) — a RUN command
				// killed by a signal makes kaniko exit 255, not 128+n.
				{
					Action: batchv1.PodFailurePolicyActionFailJob,
					OnExitCodes: &batchv1.PodFailurePolicyOnExitCodesRequirement{
						ContainerName: ptr(ContainerName),
						Operator:      batchv1.PodFailurePolicyOnExitCodesOpNotIn,
						Values:        RetriedExitCodes(),
					},
				},
			}...)},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: maps.Clone(labels), Annotations: map[string]string{AnnotationKey: spec.Key}},
				Spec: corev1.PodSpec{
					RestartPolicy:                 corev1.RestartPolicyNever,
					AutomountServiceAccountToken:  ptr(false),
					EnableServiceLinks:            ptr(false),
					ServiceAccountName:            cfg.ServiceAccountName,
					PriorityClassName:             cfg.PriorityClassName,
					NodeSelector:                  nodeSelector,
					Tolerations:                   slices.Clone(cfg.Tolerations),
					ImagePullSecrets:              pullSecrets,
					TerminationGracePeriodSeconds: ptr(int64(10)),
					// The sandbox's pause process is PID 1, not kaniko. As
					// PID 1, kaniko (a Go program without a SIGTERM
					// handler) cannot die of the SIGTERM that deleting its
					// Pod sends, and the Go runtime exits 2 instead: a code
					// a failing RUN also has. Not PID 1, it dies of the
					// signal, exit 143, which the Job retries.
					ShareProcessNamespace: ptr(true),
					SecurityContext: &corev1.PodSecurityContext{
						SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
					},
					InitContainers: initContainers,
					Containers: []corev1.Container{{
						Name:                     ContainerName,
						Image:                    cfg.ExecutorImage,
						Args:                     args,
						Env:                      env,
						VolumeMounts:             mounts,
						Resources:                cfg.Resources,
						TerminationMessagePath:   TerminationLog,
						TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
						ImagePullPolicy:          corev1.PullIfNotPresent,
						SecurityContext: &corev1.SecurityContext{
							// kaniko unpacks images as root inside its own
							// container; it needs no privilege escalation.
							AllowPrivilegeEscalation: ptr(false),
							Capabilities: &corev1.Capabilities{
								Drop: []corev1.Capability{"ALL"},
								Add:  []corev1.Capability{"CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID"},
							},
						},
					}},
					Volumes: volumes,
				},
			},
		},
	}
	return job, nil
}

// RegistrySecretFor is the registry Secret a build Pod of tenant mounts:
// the tenant's own (TenantRegistrySecret) or the shared RegistrySecret.
func (c Config) RegistrySecretFor(tenant string) string {
	if c.TenantRegistrySecret != "" {
		return strings.ReplaceAll(c.TenantRegistrySecret, "{tenant}", tenant)
	}
	return c.RegistrySecret
}

// RetriedExitCodes are the kaniko container's exit codes the Job retries
// (within its backoff limit) instead of failing at once: 0 (not a failure),
// 128 (the container could not start), 137 and 143 (the executor was
// killed from outside).
func RetriedExitCodes() []int32 { return []int32{0, 128, 137, 143} }

// Args are the kaniko executor arguments for spec, in a stable order.
func Args(spec Spec, cfg Config) ([]string, error) {
	r := spec.Request
	var args []string
	switch {
	case r.Source.S3 != nil && cfg.FetchImage != "":
		args = append(args, "--context=dir://"+ContextDir)
	case r.Source.S3 != nil:
		args = append(args, "--context=s3://"+r.Source.S3.Bucket+"/"+r.Source.S3.Key)
	case r.Source.Git != nil:
		// The worker packs a git source into an S3 context first: a
		// build Pod never fetches git, nor holds a git credential.
		return nil, errors.New("kaniko job: a git source must be packed into an S3 context by the worker first")
	default:
		return nil, errors.New("kaniko job: request has no source")
	}
	args = append(args, "--dockerfile="+r.DockerfileOrDefault())
	for _, d := range spec.Destinations {
		args = append(args, "--destination="+d)
	}
	args = append(args, "--digest-file="+TerminationLog)
	for _, k := range slices.Sorted(maps.Keys(r.BuildArgs)) {
		args = append(args, BuildArgFlag+k+"="+r.BuildArgs[k])
	}
	// The platform's predefined build arguments (BuildKit's TARGETPLATFORM
	// and the rest, platform.go), after the request's own.
	for _, a := range PlatformBuildArgs(r, cfg) {
		args = append(args, BuildArgFlag+a)
	}
	if r.Target != "" {
		args = append(args, "--target="+r.Target)
	}
	for _, k := range slices.Sorted(maps.Keys(r.Labels)) {
		args = append(args, "--label="+k+"="+r.Labels[k])
	}
	if p := Platform(r); p != "" {
		args = append(args, "--custom-platform="+p)
	}
	if cfg.CacheRepo != "" {
		args = append(args, "--cache=true", "--cache-repo="+strings.ReplaceAll(cfg.CacheRepo, "{tenant}", r.Tenant))
		if cfg.CacheTTL > 0 {
			args = append(args, "--cache-ttl="+cfg.CacheTTL.String())
		}
	}
	for _, reg := range cfg.InsecureRegistries {
		args = append(args, "--insecure-registry="+reg)
	}
	args = append(args, fmt.Sprintf("--push-retry=%d", cfg.PushRetry), "--reproducible")
	return args, nil
}

// fetchArgs are the fetch-context init container's arguments for spec.
func fetchArgs(spec Spec, cfg Config) []string {
	r := spec.Request
	args := []string{"fetch-context", "--url", spec.ContextURL, "--digest", r.ContextDigest, "--dest", ContextDir,
		"--timeout", Timeout(r, cfg).String()}
	if spec.Absent != "" {
		args = append(args, "--absent", spec.Absent)
		for _, reg := range cfg.InsecureRegistries {
			args = append(args, "--insecure-registry", reg)
		}
	}
	return args
}

func secretEnv(name, secret, key string) corev1.EnvVar {
	return corev1.EnvVar{Name: name, ValueFrom: &corev1.EnvVarSource{
		SecretKeyRef: &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: secret}, Key: key},
	}}
}

func ptr[T any](v T) *T { return &v }

// SecretValues returns the values of the build arguments job's annotation
// names as secret, from the kaniko container's arguments (to mask them).
func SecretValues(job *batchv1.Job) []string {
	names := job.Annotations[AnnotationSecretBuildArgs]
	if names == "" {
		return nil
	}
	secret := map[string]bool{}
	for _, n := range strings.Split(names, ",") {
		secret[n] = true
	}
	var out []string
	for _, c := range job.Spec.Template.Spec.Containers {
		if c.Name != ContainerName {
			continue
		}
		for _, a := range c.Args {
			kv, ok := strings.CutPrefix(a, BuildArgFlag)
			if !ok {
				continue
			}
			if k, v, ok := strings.Cut(kv, "="); ok && secret[k] && v != "" {
				out = append(out, v)
			}
		}
	}
	return out
}
