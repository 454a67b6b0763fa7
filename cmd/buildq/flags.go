package main

import (
	"fmt"
	"os"
	"time"

	"github.com/spf13/pflag"

	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/sbom"
	"github.com/buildq/buildq/worker"
)

// The flags of the commands that run from a serveConfig. They only fill
// it: every rule between them is serveConfig.Validate's.

// The worker's client-side rate limit. Each build costs about two
// requests (create and delete its Job; the informers watch the rest), so
// 50/s carries a few dozen builds a second while a runaway loop still
// cannot flood the API server.
const (
	defaultKubeQPS   = 50
	defaultKubeBurst = 100
)

// registerWorker registers `buildq worker`'s flags.
func (c *serveConfig) registerWorker(fs *pflag.FlagSet) {
	c.cmd = cmdWorker
	w := &c.worker
	fs.StringVar(&c.configFile, "config", "", configFileHelp)
	c.nats.register(fs)
	fs.StringVar(&w.ID, "id", "", "worker id in claims, events and logs (default: hostname-pid)")
	fs.IntVar(&w.MaxInFlight, "max-in-flight", 4, "requests this worker holds at once")
	fs.DurationVar(&w.AckWait, "ack-wait", 30*time.Second, "AckWait of the shared consumer (raised to it, never lowered: lower it with nats consumer edit); heartbeats go every third of the shorter of it and the consumer's")
	fs.IntVar(&w.MaxDeliver, "max-deliver", 5, "transient failures after which a request gets a failed result and a dead-letter copy (counted per request; hand-backs and crashes do not count, and the consumer itself redelivers without limit)")
	fs.DurationVar(&w.ResultsMaxAge, "results-max-age", 7*24*time.Hour, "how long result events (and the request ledger) are kept")
	fs.StringVar(&w.ContextPrefix, "context-prefix", "contexts/{tenant}/", "S3 key prefix a tenant's contexts must have, {tenant} standing for the tenant as a whole path segment (the CLI and SDK upload there); empty: any key, which only a --single-tenant worker accepts")
	registerSingleTenant(fs, &c.singleTenant)
	fs.StringVar(&w.ContextBucket, "context-bucket", "", "the only S3 bucket a request's context may be in (empty: any the worker's keys reach)")
	fs.DurationVar(&w.IndexTTL, "index-ttl", 30*24*time.Hour, "how long a build record stays in buildq-builds after its last write; an expired key is built again when asked for (at least 1h and 3 × --lease: a running build's record must not age out)")
	fs.BoolVar(&w.RecordFirst, "record-first", false, "record each decision before publishing its result, as workers before publish-first did (results a little later); set it on every worker while upgrading a fleet from such a version, then roll out again without it")
	fs.DurationVar(&w.Lease, "lease", 30*time.Second, "build claim lease; a dead worker's builds are taken over after it")
	fs.StringVar(&c.storage, "storage", "file", "JetStream storage of streams and the KV buckets: file or memory")
	fs.IntVar(&w.Replicas, "replicas", 1, "JetStream replicas of streams and the KV buckets")
	fs.DurationVar(&w.QueueTTL, "queue-ttl", 0, "requests that waited longer than this in the queue fail with reason Expired instead of being built (0: no limit)")
	fs.DurationVar(&w.HoldAtIntake, "hold-at-intake", 2*time.Minute, "how long intake holds a request whose key is being built for another request of its tenant (or queued to be built by one at its priority or higher), to answer it from the cache when the build ends, before it queues it instead; negative: never hold (every such request is queued)")
	registerFair(fs, &w.Fair)
	fs.BoolVar(&w.KeepJobs, "keep-jobs", false, "leave finished Jobs to ttlSecondsAfterFinished instead of deleting them")

	fs.StringVar(&c.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, then $KUBECONFIG and ~/.kube/config)")
	fs.Float64Var(&c.kubeQPS, "kube-api-qps", defaultKubeQPS, "sustained Kubernetes API requests per second of the worker's client (client-go's default of 5 would hold a busy worker back)")
	fs.IntVar(&c.kubeBurst, "kube-api-burst", defaultKubeBurst, "Kubernetes API requests the worker's client may send in a burst above --kube-api-qps")
	fs.StringVar(&c.jobTemplate, "job-template", "", jobTemplateHelp)
	fs.StringVar(&c.tenantRegistryConfigs, "tenant-registry-configs", "", "with --tenant-registry-secret: directory holding <tenant>/config.json, each tenant's Secret mounted; the worker's checks and copies for a tenant's request use those credentials, a changed file from the next request on")
	fs.StringVar(&c.s3AccessKey, "s3-access-key", "", "with --fetch-image: S3 access key that signs the context URLs (also AWS_ACCESS_KEY_ID); only the worker holds it")
	fs.StringVar(&c.s3SecretKey, "s3-secret-key", "", "with --fetch-image: S3 secret key (also AWS_SECRET_ACCESS_KEY)")
	fs.StringVar(&c.registryConfig, "registry-config", "", "docker config.json the worker checks and tags images with: the same credentials as --registry-secret (mount that Secret); empty: anonymous")
	registerKaniko(fs, &c.kaniko, &c.naming, &c.platformNodeSelectors)
	fs.StringVar(&c.signingKey, "signing-key", "", "PEM private key (ECDSA P-256 or Ed25519, unencrypted; mount it from a Secret) that signs the SLSA provenance attached to every image built; empty: images are not attested")
	registerBuilderID(fs, &c.builderID)
	registerSBOM(fs, &c.sbom)
	c.git.register(fs, false)
	registerBuildLogs(fs, &w.Logs)

	fs.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.logFormat, "log-format", "json", "log format: json or console")
	fs.StringVar(&c.metricsAddr, "metrics-addr", "", "serve /metrics (Prometheus), /healthz and /readyz on this address, e.g. :9090 (default: off)")
	fs.BoolVar(&c.pprof, "pprof", false, "with --metrics-addr: also serve Go's profiles under /debug/pprof/ (CPU, heap, goroutines; not the command line)")
}

// registerDev registers `buildq dev`'s flags and sets what dev fixes:
// its worker's id, storage, context prefix and Kubernetes client limits.
func (c *serveConfig) registerDev(fs *pflag.FlagSet) {
	c.cmd = cmdDev
	c.worker = worker.Config{
		ID: "dev", ContextPrefix: "contexts/{tenant}/",
		// dev's NATS has no authentication: every client is trusted, and
		// third-party tools (nats req) may use any inbox.
		AnyReply:        true,
		ShutdownTimeout: 5 * time.Second,
	}
	c.storage = "file"
	c.kubeQPS, c.kubeBurst = defaultKubeQPS, defaultKubeBurst

	fs.StringVar(&c.dev.data, "data", "", "directory for NATS, S3 and registry data (default: a temporary directory, removed at exit)")
	fs.StringVar(&c.dev.natsAddr, "nats-addr", "127.0.0.1:4222", "NATS listen address")
	fs.StringVar(&c.dev.s3Addr, "s3-addr", "127.0.0.1:9000", "S3 listen address")
	fs.StringVar(&c.dev.registryAddr, "registry-addr", "127.0.0.1:5000", "registry listen address")
	fs.IntVar(&c.worker.MaxInFlight, "max-in-flight", 4, "builds run at once")
	fs.StringVar(&c.kubeconfig, "kubeconfig", "", "launch kaniko Jobs on this cluster instead of building in-process")
	fs.StringVar(&c.jobTemplate, "job-template", "", "with --kubeconfig: "+jobTemplateHelp)
	fs.BoolVar(&c.dev.unsafeListen, "unsafe-listen", false, "let --s3-addr and --registry-addr be non-loopback addresses a cluster's Pods can reach; both have no authentication")
	registerKaniko(fs, &c.kaniko, &c.naming, &c.platformNodeSelectors)
	registerFair(fs, &c.worker.Fair)
	registerBuilderID(fs, &c.builderID)
	registerSBOM(fs, &c.sbom)
	c.git.register(fs, true)
	registerBuildLogs(fs, &c.worker.Logs)
	fs.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.logFormat, "log-format", "console", "log format: console or json")
}

// registerRender registers the Job-shaping flags of `buildq render`.
func (c *serveConfig) registerRender(fs *pflag.FlagSet) {
	c.cmd = cmdRender
	registerKaniko(fs, &c.kaniko, &c.naming, &c.platformNodeSelectors)
	fs.StringVar(&c.jobTemplate, "job-template", "", jobTemplateHelp)
	registerSingleTenant(fs, &c.singleTenant)
}

// registerFair adds the fair-queueing flags (worker and dev).
func registerFair(fs *pflag.FlagSet, f *worker.FairConfig) {
	fs.StringToIntVar(&f.Weights, "tenant-weight", nil, "tenant=weight,...: each tenant's share of the build slots while tenants have work waiting (default 1; * sets every tenant not named)")
	fs.StringToIntVar(&f.Concurrency, "tenant-concurrency", nil, "tenant=n,...: at most n of the tenant's builds run at once across all workers (a request each; an image index one per platform it builds at once); more wait (0 or absent: no limit; * sets every tenant not named)")
	fs.StringToIntVar(&f.QueueLimit, "tenant-queue-limit", nil, "tenant=n,...: a request arriving while n of the tenant's are queued or running fails with reason QuotaExceeded, unless intake answers it from the cache at once (built, nothing to copy, no --queue-ttl) (0 or absent: no limit; * sets every tenant not named)")
}

// registerSingleTenant adds --single-tenant (worker and render) and its
// first name, --allow-unverified-contexts.
func registerSingleTenant(fs *pflag.FlagSet, v *bool) {
	fs.BoolVar(v, "single-tenant", false, "serve one trusted tenant: allow a shared --registry-secret (every build Pod, and so every RUN step, holds its push rights), a --cache-repo without {tenant}, and running without --fetch-image (kaniko reads s3:// with --s3-credentials-secret's keys, which a RUN step can read, and no context is checked against its contextDigest); a multi-tenant worker refuses all three")
	fs.BoolVar(v, "allow-unverified-contexts", false, "the first name of --single-tenant")
	_ = fs.MarkDeprecated("allow-unverified-contexts", "use --single-tenant")
}

// jobTemplateHelp is the --job-template flag's help (worker, dev, render).
const jobTemplateHelp = "YAML file with the build pods' resources (default: requests 500m CPU, 1Gi memory, 2Gi ephemeral storage; limits 4Gi memory, 20Gi ephemeral storage), nodeSelector, tolerations, priorityClassName, serviceAccountName and imagePullSecrets"

// registerKaniko registers the flags that shape Jobs and image names; the
// worker, dev --kubeconfig and render share them.
func registerKaniko(fs *pflag.FlagSet, kc *kaniko.Config, np *naming.Policy, platformSelectors *[]string) {
	fs.StringVar(&kc.Namespace, "namespace", "default", "namespace of the build Jobs")
	fs.StringVar(&kc.ExecutorImage, "executor-image", "", "kaniko executor image, pinned by digest (repo@sha256:…)")
	fs.StringVar(&kc.S3Endpoint, "s3-endpoint", "", "S3 endpoint for kaniko, with scheme (http://minio.minio:9000)")
	fs.StringVar(&kc.S3Region, "s3-region", "us-east-1", "S3 region (AWS_REGION in the Job)")
	fs.StringVar(&kc.S3Secret, "s3-credentials-secret", "", "name of the Secret holding the S3 keys, read by the Job through secretKeyRef (only without --fetch-image)")
	fs.StringVar(&kc.FetchImage, "fetch-image", "", "buildq image, pinned by digest, whose fetch-context init container downloads each S3 context through a presigned URL and checks its digest: the build container holds no S3 key")
	fs.StringVar(&kc.S3AccessKeyField, "s3-credentials-access-key-field", "AWS_ACCESS_KEY_ID", "the field of --s3-credentials-secret holding the access key")
	fs.StringVar(&kc.S3SecretKeyField, "s3-credentials-secret-key-field", "AWS_SECRET_ACCESS_KEY", "the field of --s3-credentials-secret holding the secret key")
	// The first names, kept for one release: --s3-secret-key (the
	// worker's own key) read as its neighbour --s3-secret (a Secret's name).
	renameFlag(fs, "s3-secret", "s3-credentials-secret")
	renameFlag(fs, "s3-access-key-field", "s3-credentials-access-key-field")
	renameFlag(fs, "s3-secret-key-field", "s3-credentials-secret-key-field")
	fs.StringVar(&kc.RegistrySecret, "registry-secret", "", "kubernetes.io/dockerconfigjson Secret mounted as kaniko's docker config, shared by every tenant (see --tenant-registry-secret)")
	fs.StringVar(&kc.TenantRegistrySecret, "tenant-registry-secret", "", "each tenant's own kubernetes.io/dockerconfigjson Secret, {tenant} standing for the tenant (buildq-registry-{tenant}): a build Pod holds only its tenant's push rights; replaces --registry-secret")
	fs.StringSliceVar(&kc.InsecureRegistries, "insecure-registry", nil, "registries kaniko pushes to over plain HTTP (development only)")
	fs.DurationVar(&kc.DefaultTimeout, "default-timeout", 30*time.Minute, "build timeout of requests without one")
	fs.DurationVar(&kc.MaxTimeout, "max-timeout", 2*time.Hour, "cap on any request's build timeout")
	fs.Int32Var(&kc.BackoffLimit, "backoff-limit", 2, "pod retries for failures the pod failure policy counts")
	fs.DurationVar(&kc.TTLAfterFinished, "ttl-after-finished", time.Hour, "ttlSecondsAfterFinished of the Jobs (safety net)")
	fs.IntVar(&kc.PushRetry, "push-retry", 2, "kaniko --push-retry")
	fs.StringVar(&kc.CacheRepo, "cache-repo", "", "enable kaniko's layer cache in this repository, {tenant} standing for the request's tenant (required with --tenant-registry-secret: a shared cache repository needs a push right every tenant's build Pod holds)")
	fs.DurationVar(&kc.CacheTTL, "cache-ttl", 0, "maximum age of cached layers (kaniko --cache-ttl; default kaniko's)")
	fs.StringVar(&kc.ServiceAccountName, "service-account", "", "service account of the build pods")
	fs.StringArrayVar(platformSelectors, "platform-node-selector", nil, "PLATFORM=KEY=VALUE[,KEY=VALUE]: the node selector of that platform's builds, replacing the default kubernetes.io/os and kubernetes.io/arch of the platform, for nodes that run its programs natively, e.g. linux/386=kubernetes.io/arch=amd64 (repeatable; kept together with --job-template's nodeSelector)")

	fs.StringVar(&np.Registry, "registry", "", "default registry host[:port] for requests that name no image")
	fs.StringVar(&np.Mode, "naming-mode", naming.ModeProject, "naming policy: project ({registry}/{tenant}/{name}) or flat ({registry}/{prefix}{tenant}_{name})")
	fs.StringVar(&np.Project, "naming-project", "", "project mode: one fixed project for every tenant; images go to {registry}/{project}/{tenant}/{name}")
	fs.StringVar(&np.Prefix, "naming-prefix", "", "flat mode: prefix before the tenant")
	fs.BoolVar(&np.Harbor, "harbor", false, "the registry is Harbor: create each project (the tenant, or --naming-project) on demand")
	fs.StringSliceVar(&np.Registries, "allowed-registry", nil, "the only registries (host[:port]) a request may make the worker contact: destinations, and base images of the local executor (buildq dev); others are InvalidRequest (default: any a destination pattern allows)")
	fs.StringSliceVar(&np.Allowed, "allowed-destination", nil, "repositories a tenant may push to, as patterns with {registry}, {tenant} and {project}; * matches within a path segment, ** across (default: {registry}/{tenant}/** in project mode, {registry}/{project}/{tenant}/** with --naming-project, {registry}/{prefix}{tenant}_* in flat mode)")
}

// registerBuilderID is the provenance's builder id flag.
func registerBuilderID(fs *pflag.FlagSet, id *string) {
	fs.StringVar(id, "builder-id", attest.DefaultBuilderID, "builder id (a URI naming this deployment) in the SLSA provenance of every image built")
}

// registerSBOM are the SBOM flags.
func registerSBOM(fs *pflag.FlagSet, s *sbom.Syft) {
	fs.StringVar(&s.Path, "sbom-scanner", "", "syft binary that makes the SPDX SBOM of an image for the requests that ask for one (submit --sbom); run as its own process on the image alone, never reaching a network; empty: requests that ask for an SBOM are refused")
	fs.DurationVar(&s.Timeout, "sbom-timeout", sbom.DefaultTimeout, "bound on one image's SBOM scan")
	fs.Int64Var(&s.MaxBytes, "sbom-max-bytes", sbom.DefaultMaxBytes, "largest image (compressed layers) the worker copies to its disk for an SBOM scan; a larger one fails its request with SBOMFailed")
}

// checkScanner says why path (--sbom-scanner) cannot be run as the SBOM
// scanner; "" is no scanner.
func checkScanner(path string) error {
	if path == "" {
		return nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", path)
	}
	return nil
}
