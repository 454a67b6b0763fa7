package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/zapr"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker"
)

// workerFlags configure a worker; `buildq dev` reuses most of them.
type workerFlags struct {
	nats       natsFlags
	id         string
	inFlight   int
	ackWait    time.Duration
	maxDeliver int
	resultsAge time.Duration
	indexTTL   time.Duration
	// contextPrefix is where a tenant's S3 contexts must live.
	contextPrefix string
	contextBucket string
	// singleTenant accepts what is safe for one trusted tenant only (see
	// registerSingleTenant).
	singleTenant bool
	lease        time.Duration
	storage      string
	replicas     int
	keepJobs     bool
	queueTTL     time.Duration

	kubeconfig     string
	kubeQPS        float64
	kubeBurst      int
	registryConfig string
	jobTemplate    string
	// tenantRegistryConfigs holds <tenant>/config.json, each tenant's own
	// registry credentials (--tenant-registry-secret's Secrets, mounted).
	tenantRegistryConfigs string
	// s3AccessKey and s3SecretKey sign the fetch-context URLs.
	s3AccessKey string
	s3SecretKey string
	kaniko      kaniko.Config
	namingPol   naming.Policy

	logLevel    string
	logFormat   string
	metricsAddr string
	pprof       bool

	fair worker.FairConfig
}

func (f *workerFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	f.nats.register(fs)
	fs.StringVar(&f.id, "id", "", "worker id in claims, events and logs (default: hostname-pid)")
	fs.IntVar(&f.inFlight, "max-in-flight", 4, "requests this worker holds at once")
	fs.DurationVar(&f.ackWait, "ack-wait", 30*time.Second, "AckWait of the shared consumer; heartbeats go every third of it")
	fs.IntVar(&f.maxDeliver, "max-deliver", 5, "transient failures after which a request gets a failed result and a dead-letter copy (counted per request; hand-backs and crashes do not count, and the consumer itself redelivers without limit)")
	fs.DurationVar(&f.resultsAge, "results-max-age", 7*24*time.Hour, "how long result events (and the request ledger) are kept")
	fs.StringVar(&f.contextPrefix, "context-prefix", "contexts/{tenant}/", "S3 key prefix a tenant's contexts must have, {tenant} standing for the tenant as a whole path segment (the CLI and SDK upload there); empty: any key, which only a --single-tenant worker accepts")
	registerSingleTenant(fs, &f.singleTenant)
	fs.StringVar(&f.contextBucket, "context-bucket", "", "the only S3 bucket a request's context may be in (empty: any the worker's keys reach)")
	fs.DurationVar(&f.indexTTL, "index-ttl", 30*24*time.Hour, "how long a build record stays in buildq-builds after its last write; an expired key is built again when asked for (at least 1h and 3 × --lease: a running build's record must not age out)")
	fs.DurationVar(&f.lease, "lease", 30*time.Second, "build claim lease; a dead worker's builds are taken over after it")
	fs.StringVar(&f.storage, "storage", "file", "JetStream storage of streams and the KV buckets: file or memory")
	fs.IntVar(&f.replicas, "replicas", 1, "JetStream replicas of streams and the KV buckets")
	fs.DurationVar(&f.queueTTL, "queue-ttl", 0, "requests that waited longer than this in the queue fail with reason Expired instead of being built (0: no limit)")
	registerFair(fs, &f.fair)
	fs.BoolVar(&f.keepJobs, "keep-jobs", false, "leave finished Jobs to ttlSecondsAfterFinished instead of deleting them")

	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, then $KUBECONFIG and ~/.kube/config)")
	fs.Float64Var(&f.kubeQPS, "kube-api-qps", defaultKubeQPS, "sustained Kubernetes API requests per second of the worker's client (client-go's default of 5 would hold a busy worker back)")
	fs.IntVar(&f.kubeBurst, "kube-api-burst", defaultKubeBurst, "Kubernetes API requests the worker's client may send in a burst above --kube-api-qps")
	fs.StringVar(&f.jobTemplate, "job-template", "", jobTemplateHelp)
	fs.StringVar(&f.tenantRegistryConfigs, "tenant-registry-configs", "", "with --tenant-registry-secret: directory holding <tenant>/config.json, each tenant's Secret mounted; the worker's checks and copies for a tenant's request use those credentials")
	fs.StringVar(&f.s3AccessKey, "s3-access-key", "", "with --fetch-image: S3 access key that signs the context URLs (also AWS_ACCESS_KEY_ID); only the worker holds it")
	fs.StringVar(&f.s3SecretKey, "s3-secret-key", "", "with --fetch-image: S3 secret key (also AWS_SECRET_ACCESS_KEY)")
	fs.StringVar(&f.registryConfig, "registry-config", "", "docker config.json the worker checks and tags images with: the same credentials as --registry-secret (mount that Secret); empty: anonymous")
	registerKaniko(fs, &f.kaniko, &f.namingPol)

	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&f.logFormat, "log-format", "json", "log format: json or console")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve /metrics (Prometheus), /healthz and /readyz on this address, e.g. :9090 (default: off)")
	fs.BoolVar(&f.pprof, "pprof", false, "with --metrics-addr: also serve Go's profiles under /debug/pprof/ (CPU, heap, goroutines; not the command line)")
}

func (f *workerFlags) config(log *zap.Logger) (worker.Config, error) {
	cfg := worker.Config{
		ID: f.id, MaxInFlight: f.inFlight, AckWait: f.ackWait, MaxDeliver: f.maxDeliver,
		ResultsMaxAge: f.resultsAge, IndexTTL: f.indexTTL, ContextPrefix: f.contextPrefix, ContextBucket: f.contextBucket, Lease: f.lease, Replicas: f.replicas, KeepJobs: f.keepJobs, QueueTTL: f.queueTTL,
		Naming: f.namingPol, Logger: log, Fair: f.fair,
	}
	switch f.storage {
	case "file":
		cfg.Storage = jetstream.FileStorage
	case "memory":
		cfg.Storage = jetstream.MemoryStorage
	default:
		return cfg, usageErr("--storage must be file or memory, got %q", f.storage)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return cfg, usageErr("%v", err)
	}
	return cfg, nil
}

// registerFair adds the fair-queueing flags (worker and dev).
func registerFair(fs *pflag.FlagSet, f *worker.FairConfig) {
	fs.StringToIntVar(&f.Weights, "tenant-weight", nil, "tenant=weight,...: each tenant's share of the build slots while tenants have work waiting (default 1; * sets every tenant not named)")
	fs.StringToIntVar(&f.Concurrency, "tenant-concurrency", nil, "tenant=n,...: at most n of the tenant's requests run at once across all workers; more wait (0 or absent: no limit; * sets every tenant not named)")
	fs.StringToIntVar(&f.QueueLimit, "tenant-queue-limit", nil, "tenant=n,...: a request arriving while n of the tenant's are queued or running fails with reason QuotaExceeded (0 or absent: no limit; * sets every tenant not named)")
}

// checkExecutorImage requires a kaniko image pinned by digest: the image is
// part of every build key, so a moving tag would silently change builds.
func checkExecutorImage(img string) error {
	if img == "" {
		return usageErr("--executor-image (or BUILDQ_EXECUTOR_IMAGE) is required: a kaniko executor image pinned by digest (repo@sha256:…)")
	}
	return checkImageDigest("--executor-image", img)
}

func checkImageDigest(flag, img string) error {
	if _, err := name.NewDigest(img, name.StrictValidation); err != nil {
		return usageErr("%s %q is not pinned by digest: use repo@sha256:<64 hex> (%v)", flag, img, err)
	}
	return nil
}

// jobTemplateHelp is the --job-template flag's help (worker and dev).
const jobTemplateHelp = "YAML file with the build pods' resources (default: requests 500m CPU, 1Gi memory, 2Gi ephemeral storage; limits 4Gi memory, 20Gi ephemeral storage), nodeSelector, tolerations, priorityClassName, serviceAccountName and imagePullSecrets"

// applyJobTemplate applies the --job-template file, when one is given.
func applyJobTemplate(kc kaniko.Config, path string) (kaniko.Config, error) {
	if path == "" {
		return kc, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return kc, usageErr("--job-template: %v", err)
	}
	tpl, err := kaniko.ParseTemplate(b)
	if err != nil {
		return kc, usageErr("--job-template %s: %v", path, err)
	}
	return kc.Apply(tpl), nil
}

// registerKaniko registers the flags that shape Jobs and image names; the
// worker, dev --kubeconfig and render share them.
func registerKaniko(fs *pflag.FlagSet, kc *kaniko.Config, np *naming.Policy) {
	fs.StringVar(&kc.Namespace, "namespace", "default", "namespace of the build Jobs")
	fs.StringVar(&kc.ExecutorImage, "executor-image", "", "kaniko executor image, pinned by digest (repo@sha256:…)")
	fs.StringVar(&kc.S3Endpoint, "s3-endpoint", "", "S3 endpoint for kaniko, with scheme (http://minio.minio:9000)")
	fs.StringVar(&kc.S3Region, "s3-region", "us-east-1", "S3 region (AWS_REGION in the Job)")
	fs.StringVar(&kc.S3Secret, "s3-secret", "", "Secret with the S3 keys, read by the Job through secretKeyRef (only without --fetch-image)")
	fs.StringVar(&kc.FetchImage, "fetch-image", "", "buildq image, pinned by digest, whose fetch-context init container downloads each S3 context through a presigned URL and checks its digest: the build container holds no S3 key")
	fs.StringVar(&kc.S3AccessKeyField, "s3-access-key-field", "AWS_ACCESS_KEY_ID", "key of the access key in --s3-secret")
	fs.StringVar(&kc.S3SecretKeyField, "s3-secret-key-field", "AWS_SECRET_ACCESS_KEY", "key of the secret key in --s3-secret")
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

	fs.StringVar(&np.Registry, "registry", "", "default registry host[:port] for requests that name no image")
	fs.StringVar(&np.Mode, "naming-mode", naming.ModeProject, "naming policy: project ({registry}/{tenant}/{name}) or flat ({registry}/{prefix}{tenant}_{name})")
	fs.StringVar(&np.Project, "naming-project", "", "project mode: one fixed project for every tenant; images go to {registry}/{project}/{tenant}/{name}")
	fs.StringVar(&np.Prefix, "naming-prefix", "", "flat mode: prefix before the tenant")
	fs.BoolVar(&np.Harbor, "harbor", false, "the registry is Harbor: create each project (the tenant, or --naming-project) on demand")
	fs.StringSliceVar(&np.Registries, "allowed-registry", nil, "the only registries (host[:port]) a request may make the worker contact: destinations, and base images of the local executor (buildq dev); others are InvalidRequest (default: any a destination pattern allows)")
	fs.StringSliceVar(&np.Allowed, "allowed-destination", nil, "repositories a tenant may push to, as patterns with {registry}, {tenant} and {project}; * matches within a path segment, ** across (default: {registry}/{tenant}/** in project mode, {registry}/{project}/{tenant}/** with --naming-project, {registry}/{prefix}{tenant}_* in flat mode)")

}

// newLogger builds the zap logger and routes client-go's klog into it.
func newLogger(level, format string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, usageErr("--log-level: %v", err)
	}
	var zc zap.Config
	switch format {
	case "json":
		zc = zap.NewProductionConfig()
	case "console":
		zc = zap.NewDevelopmentConfig()
		zc.DisableStacktrace = true
	default:
		return nil, usageErr("--log-format must be json or console, got %q", format)
	}
	zc.Level = zap.NewAtomicLevelAt(lvl)
	log, err := zc.Build()
	if err != nil {
		return nil, err
	}
	// klog is process-global: route it once, to the first logger built.
	klogOnce.Do(func() { klog.SetLogger(zapr.NewLogger(log.Named("client-go"))) })
	return log, nil
}

var klogOnce sync.Once

func newWorkerCmd() *cobra.Command {
	var f workerFlags
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a production worker: take requests, launch kaniko Jobs, publish results",
		Long: `Run a buildq worker against a NATS JetStream server and a Kubernetes cluster.

Any number of workers share the "buildq-workers" consumer. Each creates or
updates the streams, the consumers and the KV buckets at start, admits new
requests into per-tenant queues (BUILDQ_QUEUE), fills its free slots from
them fairly between tenants (--tenant-weight, --tenant-concurrency,
--tenant-queue-limit; a request's "priority" orders its tenant's own queue),
builds every unique build key once as a kaniko Job, watches Jobs and Pods
through informers, and publishes one result per request. SIGTERM hands held
requests back at once. Give every worker the same fair-queueing flags.

Every flag can also be set as BUILDQ_<FLAG> (e.g. BUILDQ_EXECUTOR_IMAGE);
--nats-url also reads NATS_URL.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := bindEnv(cmd, mergeEnv(natsEnv, map[string]string{"s3-access-key": "AWS_ACCESS_KEY_ID", "s3-secret-key": "AWS_SECRET_ACCESS_KEY"})); err != nil {
				return err
			}
			return runWorker(cmd.Context(), &f)
		},
	}
	f.register(cmd)
	return cmd
}

// registerSingleTenant adds --single-tenant (worker and render) and its
// first name, --allow-unverified-contexts.
func registerSingleTenant(fs *pflag.FlagSet, v *bool) {
	fs.BoolVar(v, "single-tenant", false, "serve one trusted tenant: allow a shared --registry-secret (every build Pod, and so every RUN step, holds its push rights), a --cache-repo without {tenant}, and running without --fetch-image (kaniko reads s3:// with --s3-secret's keys, which a RUN step can read, and no context is checked against its contextDigest); a multi-tenant worker refuses all three")
	fs.BoolVar(v, "allow-unverified-contexts", false, "the first name of --single-tenant")
	_ = fs.MarkDeprecated("allow-unverified-contexts", "use --single-tenant")
}

// checkJobConfig holds the checks on the Job-shaping flags that a worker
// runs at start; render runs the same ones, so it never prints a Job a
// worker would refuse to create. It returns kc with the --job-template
// applied and the defaults set.
func checkJobConfig(kc kaniko.Config, np naming.Policy, jobTemplate string, singleTenant bool) (kaniko.Config, error) {
	if err := checkExecutorImage(kc.ExecutorImage); err != nil {
		return kc, err
	}
	kc, err := applyJobTemplate(kc, jobTemplate)
	if err != nil {
		return kc, err
	}
	if kc.FetchImage != "" {
		if err := checkImageDigest("--fetch-image", kc.FetchImage); err != nil {
			return kc, err
		}
	} else if !singleTenant {
		return kc, usageErr("--fetch-image (the buildq image, pinned by digest) is required: without it kaniko reads s3:// itself with --s3-secret's keys, which a RUN step can read, and nothing checks a context's bytes against its contextDigest, so one tenant can poison another's cached build; --single-tenant accepts that for one trusted tenant")
	}
	if kc.TenantRegistrySecret != "" {
		if !strings.Contains(kc.TenantRegistrySecret, "{tenant}") {
			return kc, usageErr("--tenant-registry-secret %q must contain {tenant}", kc.TenantRegistrySecret)
		}
	} else if kc.RegistrySecret != "" && !singleTenant {
		return kc, usageErr("--registry-secret %s would be mounted into every tenant's build Pods, where a RUN step can read it and push anywhere it may: give each tenant its own Secret (--tenant-registry-secret buildq-registry-{tenant} with --tenant-registry-configs), or pass --single-tenant for one trusted tenant", kc.RegistrySecret)
	}
	if kc.CacheRepo != "" && !strings.Contains(kc.CacheRepo, "{tenant}") && !singleTenant {
		return kc, usageErr("--cache-repo %q must contain {tenant}: one cache repository for all would need a push right every tenant's build Pod holds, and a RUN step could poison the cache for all (--single-tenant accepts it for one trusted tenant)", kc.CacheRepo)
	}
	if err := np.Validate(); err != nil {
		return kc, usageErr("%v", err)
	}
	kc = kc.Defaults()
	if err := kc.Validate(); err != nil {
		return kc, usageErr("%v", err)
	}
	return kc, nil
}

func runWorker(ctx context.Context, f *workerFlags) error {
	log, err := newLogger(f.logLevel, f.logFormat)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	if f.pprof && f.metricsAddr == "" {
		return usageErr("--pprof serves on the --metrics-addr address: set that too")
	}
	if f.kubeQPS <= 0 || f.kubeBurst <= 0 {
		return usageErr("--kube-api-qps and --kube-api-burst must be positive")
	}
	cfg, err := f.config(log)
	if err != nil {
		return err
	}
	if f.kaniko, err = checkJobConfig(f.kaniko, f.namingPol, f.jobTemplate, f.singleTenant); err != nil {
		return err
	}
	if f.contextPrefix == "" && !f.singleTenant {
		return usageErr("--context-prefix is empty: a request could name any object of the bucket, another tenant's context among them, as its own; keep {tenant}/ in it (default contexts/{tenant}/), or pass --single-tenant for one trusted tenant")
	}
	reg, err := registry.New(registry.Options{DockerConfig: f.registryConfig, Insecure: f.kaniko.InsecureRegistries})
	if err != nil {
		return usageErr("%v", err)
	}
	cfg.Registry = reg
	if (f.kaniko.TenantRegistrySecret == "") != (f.tenantRegistryConfigs == "") {
		return usageErr("--tenant-registry-secret and --tenant-registry-configs go together: the build Pods and the worker's own registry calls use the same per-tenant credentials")
	}
	if f.kaniko.TenantRegistrySecret != "" {
		cfg.RegistryFor = tenantRegistries(reg, f.tenantRegistryConfigs, f.kaniko)
	}
	var presign worker.Presigner
	if f.kaniko.FetchImage != "" {
		if f.kaniko.S3Endpoint == "" || f.s3AccessKey == "" || f.s3SecretKey == "" {
			return usageErr("--fetch-image needs --s3-endpoint (as the build Pods reach it) and --s3-access-key/--s3-secret-key (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY): the worker signs each context's URL")
		}
		store, err := s3store.New(s3store.Config{Endpoint: f.kaniko.S3Endpoint, Region: f.kaniko.S3Region, AccessKey: f.s3AccessKey, SecretKey: f.s3SecretKey})
		if err != nil {
			return usageErr("--s3-endpoint: %v", err)
		}
		presign = store.PresignGet
		// The same keys read a tenant's own context object when it is to
		// be answered from another tenant's build (possession).
		cfg.Contexts = store
	} else {
		log.Warn("--single-tenant without --fetch-image: build Pods read S3 contexts with the keys of --s3-secret, which a RUN step can read, and contexts are not checked against their digest; set --fetch-image for untrusted tenants")
	}
	if f.kaniko.TenantRegistrySecret == "" && f.kaniko.RegistrySecret != "" {
		log.Warn("--single-tenant with --registry-secret: every build Pod mounts the shared push Secret; give each tenant its own with --tenant-registry-secret for untrusted tenants")
	}
	var promReg *prometheus.Registry
	if f.metricsAddr != "" {
		promReg = prometheus.NewRegistry()
		// Before the first Kubernetes client: every API request counts.
		kube.NewRequestMetrics(promReg).Install()
	}
	backend, stopKube, err := kubeBackend(ctx, f.kubeconfig, float32(f.kubeQPS), f.kubeBurst, f.kaniko, log)
	if err != nil {
		return err
	}
	defer stopKube()
	backend.WithDigestResolver(reg.Head).WithPresigner(presign)

	var running atomic.Pointer[worker.Worker]
	if f.metricsAddr != "" {
		reg := promReg
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		cfg.Metrics = worker.NewMetrics(reg)
		ready := func() error {
			if w := running.Load(); w != nil {
				return w.Ready()
			}
			return errors.New("not taking requests: connecting to NATS")
		}
		stop, err := serveMetrics(f.metricsAddr, reg, ready, f.pprof, log)
		if err != nil {
			return failed(err)
		}
		defer stop()
	}
	f.nats.name = "buildq-worker " + cfg.ID
	nc, err := f.nats.connect(nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	w, err := worker.New(nc, backend, cfg)
	if err != nil {
		return usageErr("%v", err)
	}
	running.Store(w)
	if err := w.Run(ctx); err != nil {
		return failed(err)
	}
	return nil
}

// serveMetrics serves Prometheus metrics and health endpoints: /healthz
// (liveness) answers while the process serves HTTP; /readyz (readiness)
// answers 503 with the reason until the worker takes requests, and while
// its NATS connection is down.
//
// With withPprof it also serves net/http/pprof's profiles — but not
// /debug/pprof/cmdline, which would show flags such as --s3-secret-key.
func serveMetrics(addr string, reg *prometheus.Registry, ready func() error, withPprof bool, log *zap.Logger) (func(), error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	ok := func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) }
	mux.HandleFunc("/healthz", ok)
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		ok(w, r)
	})
	if withPprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server", zap.Error(err))
		}
	}()
	log.Info("serving metrics", zap.String("addr", ln.Addr().String()))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}

// The worker's client-side rate limit. Each build costs about two
// requests (create and delete its Job; the informers watch the rest), so
// 50/s carries a few dozen builds a second while a runaway loop still
// cannot flood the API server.
const (
	defaultKubeQPS   = 50
	defaultKubeBurst = 100
)

// kubeBackend connects to the cluster, starts the label-filtered informers
// and waits for their caches.
func kubeBackend(ctx context.Context, kubeconfig string, qps float32, burst int, kc kaniko.Config, log *zap.Logger) (*worker.KubeBackend, func(), error) {
	rc, err := restConfig(kubeconfig)
	if err != nil {
		return nil, nil, failed(fmt.Errorf("kubernetes config: %w", err))
	}
	rc.UserAgent = "buildq-worker"
	rc.QPS, rc.Burst = qps, burst
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, nil, failed(fmt.Errorf("kubernetes client: %w", err))
	}
	factory := kube.NewInformerFactory(client, kc.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		return nil, nil, failed(err)
	}
	backend, err := worker.NewKubeBackend(client, watcher, kc)
	if err != nil {
		return nil, nil, usageErr("%v", err)
	}
	stop := make(chan struct{})
	factory.Start(stop)
	log.Info("waiting for the Job and Pod caches", zap.String("namespace", kc.Namespace))
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if !watcher.WaitForSync(sctx) {
		close(stop)
		factory.Shutdown()
		return nil, nil, failed(fmt.Errorf("the Job and Pod informers of namespace %s did not sync: check the cluster and the worker's RBAC (list/watch jobs and pods)", kc.Namespace))
	}
	return backend, func() { close(stop); factory.Shutdown() }, nil
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		return clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if rc, err := rest.InClusterConfig(); err == nil {
		return rc, nil
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if clientcmd.IsEmptyConfig(err) {
		return nil, errors.New("no cluster configured: pass --kubeconfig, set KUBECONFIG, or run the worker in a cluster")
	}
	return rc, err
}

// tenantRegistries gives a tenant's registry client: its own credentials
// from dir/<tenant>/config.json for everything written into its
// repositories, the worker's (shared) for reading the source of a copy.
func tenantRegistries(shared *registry.Client, dir string, kc kaniko.Config) func(string) (worker.Registry, error) {
	return func(tenant string) (worker.Registry, error) {
		p := filepath.Join(dir, tenant, "config.json")
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("tenant %q has no registry credentials: %s is missing (create the Secret %s in the build namespace and mount it there)", tenant, p, kc.RegistrySecretFor(tenant))
		}
		own, err := registry.New(registry.Options{DockerConfig: p, Insecure: kc.InsecureRegistries})
		if err != nil {
			return nil, fmt.Errorf("tenant %q registry credentials: %w", tenant, err)
		}
		return tenantRegistry{shared: shared, own: own}, nil
	}
}

// tenantRegistry is worker.Registry for one tenant's requests.
type tenantRegistry struct{ shared, own *registry.Client }

func (t tenantRegistry) Head(ctx context.Context, ref string) (string, error) {
	return t.own.Head(ctx, ref)
}

func (t tenantRegistry) Copy(ctx context.Context, src, dst string) (string, error) {
	return t.shared.CopyTo(ctx, src, dst, t.own)
}

// EnsureHarborProject needs an administrator: the worker's credentials.
func (t tenantRegistry) EnsureHarborProject(ctx context.Context, reg, project string) error {
	return t.shared.EnsureHarborProject(ctx, reg, project)
}
