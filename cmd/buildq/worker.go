package main

import (
	"context"
	"errors"
	"os"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker"
)

func newWorkerCmd() *cobra.Command {
	var c serveConfig
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a production worker: take requests, launch kaniko Jobs, publish results",
		Long: `Run a buildq worker against a NATS JetStream server and a Kubernetes cluster.

Any number of workers share the "buildq-workers" consumer. Each creates or
updates the streams, the consumers and the KV buckets at start, admits new
requests into per-tenant queues (BUILDQ_QUEUE) — or, with a slot free and
nothing queued it could take, runs one at once — fills its free slots from
them fairly between tenants (--tenant-weight, --tenant-concurrency,
--tenant-queue-limit; a request's "priority" orders its tenant's own queue),
builds every unique build key once as a kaniko Job, watches Jobs and Pods
through informers, and publishes one result per request. SIGTERM hands held
requests back at once. Give every worker the same fair-queueing flags.

Every flag can also be set as BUILDQ_<FLAG> (e.g. BUILDQ_EXECUTOR_IMAGE);
--nats-url also reads NATS_URL. --config reads them from a YAML file, in
sections named as the groups below:

  nats:
    nats-url: nats://nats.buildq:4222
    replicas: 3
  kubernetes:
    namespace: buildq-builds
    executor-image: gcr.io/kaniko-project/executor@sha256:…
  tenants:
    tenant-weight: {acme: 2, "*": 1}

A flag on the command line wins over its variable, and both over the file.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := c.loadWorker(cmd); err != nil {
				return err
			}
			if err := c.Validate(); err != nil {
				return err
			}
			return runWorker(cmd.Context(), &c)
		},
	}
	c.registerWorker(cmd.Flags())
	groupedUsage(cmd)
	return cmd
}

// loadWorker completes worker's flags from the environment and --config:
// the command line wins over BUILDQ_* variables, and both over the file.
func (c *serveConfig) loadWorker(cmd *cobra.Command) error {
	fromEnv, err := bindEnvTracked(cmd, mergeEnv(natsEnv, map[string]string{"s3-access-key": "AWS_ACCESS_KEY_ID", "s3-secret-key": "AWS_SECRET_ACCESS_KEY"}))
	if err != nil {
		return err
	}
	if c.configFile == "" {
		return nil
	}
	return applyConfigFile(cmd.Flags(), c.configFile, fromEnv)
}

// runWorker runs a worker from a validated configuration until ctx ends.
func runWorker(ctx context.Context, c *serveConfig) error {
	// deploy/'s site values (the worker's environment): an example value
	// left in place stops the worker here, named, before it connects to
	// anything.
	if err := checkSiteValues(os.Environ()); err != nil {
		return usageErr("%v", err)
	}
	log, err := newLogger(c.logLevel, c.logFormat)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	cfg := c.worker
	cfg.Logger = log
	reg, err := registry.New(registry.Options{DockerConfig: c.registryConfig, Insecure: c.job.InsecureRegistries})
	if err != nil {
		return usageErr("%v", err)
	}
	cfg.Registry = reg
	if c.sbom.Path != "" && c.signingKey == "" {
		return usageErr("--sbom-scanner needs --signing-key: SBOMs are signed with the deployment's key")
	}
	if err := checkScanner(c.sbom.Path); err != nil {
		return usageErr("--sbom-scanner: %v", err)
	}
	if c.signingKey != "" {
		signer, err := attest.LoadSigner(c.signingKey)
		if err != nil {
			return usageErr("--signing-key: %v", err)
		}
		att := &worker.SigningAttestor{Signer: signer, BuilderID: c.builderID}
		cfg.Attestor = att
		if c.sbom.Path != "" {
			att.Scanner = &c.sbom
			cfg.SBOM = att
		}
	} else {
		log.Warn("no --signing-key: the images this worker builds carry no signed provenance")
	}
	if c.job.TenantRegistrySecret != "" {
		cfg.RegistryFor = tenantRegistries(reg, c.tenantRegistryConfigs, c.job)
	}
	var presign worker.Presigner
	if c.job.FetchImage != "" {
		// Packed git sources go to --context-bucket (default buildq).
		store, err := s3store.New(s3store.Config{Endpoint: c.job.S3Endpoint, Region: c.job.S3Region, AccessKey: c.s3AccessKey, SecretKey: c.s3SecretKey, Bucket: c.worker.ContextBucket})
		if err != nil {
			return usageErr("--s3-endpoint: %v", err)
		}
		presign = store.PresignGet
		// The same keys read a tenant's own context object when it is to
		// be answered from another tenant's build (possession), and
		// store the packed git sources.
		cfg.Contexts = store
		cfg.GitSources = c.git.packer(store, false, "")
		// Finished build logs are archived under logs/ in the same bucket.
		cfg.Logs.Archive = store
	} else {
		log.Warn("--single-tenant without --fetch-image: build Pods read S3 contexts with the keys of --s3-credentials-secret, which a RUN step can read, and contexts are not checked against their digest; set --fetch-image for untrusted tenants")
	}
	if c.job.TenantRegistrySecret == "" && c.job.RegistrySecret != "" {
		log.Warn("--single-tenant with --registry-secret: every build Pod mounts the shared push Secret; give each tenant its own with --tenant-registry-secret for untrusted tenants")
	}
	// Health is served from here on: /healthz answers at once (the
	// process works), /readyz names what the worker still waits for —
	// the Job and Pod caches (up to 2 minutes), then NATS and its streams
	// — until it takes requests.
	var (
		running atomic.Pointer[worker.Worker]
		waiting atomic.Pointer[string]
	)
	setWaiting := func(what string) { waiting.Store(&what) }
	setWaiting("not taking requests: waiting for the Job and Pod caches")
	if c.metricsAddr != "" {
		promReg := prometheus.NewRegistry()
		// Before the first Kubernetes client: every API request counts.
		kube.NewRequestMetrics(promReg).Install()
		promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		cfg.Metrics = worker.NewMetrics(promReg)
		ready := func() error {
			if w := running.Load(); w != nil {
				return w.Ready()
			}
			return errors.New(*waiting.Load())
		}
		stop, err := serveMetrics(c.metricsAddr, promReg, ready, c.pprof, log)
		if err != nil {
			return failed(err)
		}
		defer stop()
	}
	rc, err := restConfig(c.kubeconfig)
	if err != nil {
		return err
	}
	backend, stopKube, err := kubeBackend(ctx, rc, float32(c.kubeQPS), c.kubeBurst, c.job, log)
	if err != nil {
		return err
	}
	defer stopKube()
	backend.WithPresigner(presign)
	setWaiting("not taking requests: connecting to NATS")

	c.nats.name = "buildq-worker " + cfg.ID
	// No reconnect buffer: a publish made while the connection is down
	// fails at once rather than going out whenever it is back (worker.New).
	nc, err := c.nats.connect(nats.MaxReconnects(-1), nats.ReconnectBufSize(-1))
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
