package main

import (
	"os"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/sbom"
	"github.com/buildq/buildq/worker"
)

// command is the command a serveConfig is for: a rule about a flag holds
// only for the commands that have the flag.
type command int

const (
	cmdWorker command = iota + 1 // buildq worker
	cmdDev                       // buildq dev
	cmdRender                    // buildq render: the Job-shaping flags only
)

// serveConfig is what `buildq worker` and `buildq dev` run from, and its
// Job-shaping part is what `buildq render` prints from. The commands' flags
// fill it (flags.go); Validate holds every rule between flags, so what one
// command refuses the others refuse too, with the same message; the running
// code (worker.go, dev.go) reads only a validated serveConfig.
type serveConfig struct {
	cmd command
	// configFile is worker's --config: flag values from a YAML file.
	configFile string

	// worker holds what the flags give worker.New: the worker's own flags,
	// or dev's fixed settings with --max-in-flight and the fair-queueing
	// flags. Validate sets its Storage, Naming and defaults.
	worker worker.Config
	// storage is --storage: file or memory.
	storage string
	nats    natsFlags

	// The Job-shaping flags (worker, render, and dev with --kubeconfig).
	kaniko      kaniko.Config
	naming      naming.Policy
	jobTemplate string
	// platformNodeSelectors is --platform-node-selector as given
	// (PLATFORM=KEY=VALUE[,KEY=VALUE]…), parsed into c.job by validateJobs.
	platformNodeSelectors []string
	// singleTenant accepts what is safe for one trusted tenant only (see
	// registerSingleTenant); dev always serves one user (oneTenant).
	singleTenant bool

	kubeconfig string
	kubeQPS    float64
	kubeBurst  int
	// registryConfig is the docker config.json of the worker's own
	// registry calls.
	registryConfig string
	// signingKey is the deployment's private key (PEM) that signs every
	// image's provenance; builderID is the provenance's builder id.
	signingKey string
	builderID  string
	// sbom is the SBOM scanner (Path empty: none).
	sbom sbom.Syft
	// tenantRegistryConfigs holds <tenant>/config.json, each tenant's own
	// registry credentials (--tenant-registry-secret's Secrets, mounted).
	tenantRegistryConfigs string
	// s3AccessKey and s3SecretKey sign the fetch-context URLs.
	s3AccessKey string
	s3SecretKey string

	logLevel    string
	logFormat   string
	metricsAddr string
	pprof       bool

	// git: git sources (worker and dev).
	git gitFlagsConfig

	// dev is the embedded stack of `buildq dev`.
	dev devStackFlags

	// job is set by Validate: kaniko with the --job-template applied and
	// the defaults set.
	job kaniko.Config
}

// devStackFlags are dev's own: where its NATS, S3 store and registry
// listen and keep their data.
type devStackFlags struct {
	data         string
	natsAddr     string
	s3Addr       string
	registryAddr string
	unsafeListen bool
}

// Validate checks every rule between the flags of c's command and, when
// they hold, completes c: c.worker gets its storage, naming policy and
// defaults, c.job the Job configuration. It reads the --job-template file
// and nothing else; every error is a usage error (exit 2).
func (c *serveConfig) Validate() error {
	if c.cmd != cmdRender {
		if err := c.validateProcess(); err != nil {
			return err
		}
		if err := checkBuildLogs(c.worker.Logs); err != nil {
			return err
		}
		if err := c.git.validate(); err != nil {
			return err
		}
	}
	switch {
	case c.launchesJobs():
		if err := c.validateJobs(); err != nil {
			return err
		}
	case c.jobTemplate != "":
		return usageErr("--job-template shapes kaniko Jobs: it needs --kubeconfig")
	case len(c.platformNodeSelectors) > 0:
		return usageErr("--platform-node-selector places kaniko Jobs: it needs --kubeconfig")
	}
	if c.cmd == cmdWorker {
		return c.validateWorkerCredentials()
	}
	return nil
}

// oneTenant tells whether c serves one trusted tenant, for which a
// multi-tenant worker's refusals guard nothing: a worker with
// --single-tenant, or dev, whose NATS, S3 store and registry have no
// authentication (whoever submits can read and replace everything).
func (c *serveConfig) oneTenant() bool { return c.singleTenant || c.cmd == cmdDev }

// launchesJobs tells whether c's command makes kaniko Jobs (dev does only
// with --kubeconfig; otherwise it builds in-process).
func (c *serveConfig) launchesJobs() bool { return c.cmd != cmdDev || c.kubeconfig != "" }

// validateProcess checks the flags of a process that runs a worker (worker
// and dev) and completes c.worker.
func (c *serveConfig) validateProcess() error {
	if _, err := parseLogFlags(c.logLevel, c.logFormat); err != nil {
		return err
	}
	if c.pprof && c.metricsAddr == "" {
		return usageErr("--pprof serves on the --metrics-addr address: set that too")
	}
	if c.kubeQPS <= 0 || c.kubeBurst <= 0 {
		return usageErr("--kube-api-qps and --kube-api-burst must be positive")
	}
	switch c.storage {
	case "file":
		c.worker.Storage = jetstream.FileStorage
	case "memory":
		c.worker.Storage = jetstream.MemoryStorage
	default:
		return usageErr("--storage must be file or memory, got %q", c.storage)
	}
	c.worker.Naming = c.namingToCheck()
	c.worker = c.worker.WithDefaults()
	if err := c.worker.Validate(); err != nil {
		return usageErr("%v", err)
	}
	if c.worker.ContextPrefix == "" {
		if !c.oneTenant() {
			return usageErr("--context-prefix is empty: a request could name any object of the bucket, another tenant's context among them, as its own; keep {tenant}/ in it (default contexts/{tenant}/), or pass --single-tenant for one trusted tenant")
		}
		if c.kaniko.FetchImage != "" {
			return usageErr("--context-prefix is empty: with --fetch-image the worker checks that a request's tenant holds its context, which needs the tenant's own prefix; keep {tenant}/ in it (default contexts/{tenant}/)")
		}
	}
	return nil
}

// namingToCheck is the naming policy the rules see. dev's registry is
// its own unless --registry names another, and has no address until it
// listens: the policy is checked with the address dev is told to listen
// on, and dev sets the real one once it does.
func (c *serveConfig) namingToCheck() naming.Policy {
	np := c.naming
	if c.cmd == cmdDev && np.Registry == "" {
		np.Registry = c.dev.registryAddr
	}
	return np
}

// validateJobs checks the Job-shaping flags (worker, render, dev
// --kubeconfig) and sets c.job; render runs them too, so it never prints
// a Job a worker would refuse to create.
func (c *serveConfig) validateJobs() error {
	kc := c.kaniko
	if kc.ExecutorImage == "" {
		return usageErr("--executor-image (or BUILDQ_EXECUTOR_IMAGE) is required: a kaniko executor image pinned by digest (repo@sha256:…)")
	}
	// The image is part of every build key: a moving tag would silently
	// change builds.
	if err := checkImageDigest("--executor-image", kc.ExecutorImage); err != nil {
		return err
	}
	kc, err := applyJobTemplate(kc, c.jobTemplate)
	if err != nil {
		return err
	}
	if kc.PlatformNodeSelectors, err = kaniko.ParsePlatformSelectors(c.platformNodeSelectors); err != nil {
		return usageErr("--platform-node-selector %v", err)
	}
	if kc.FetchImage != "" {
		if err := checkImageDigest("--fetch-image", kc.FetchImage); err != nil {
			return err
		}
	} else if !c.oneTenant() {
		return usageErr("--fetch-image (the buildq image, pinned by digest) is required: without it kaniko reads s3:// itself with --s3-credentials-secret's keys, which a RUN step can read, and nothing checks a context's bytes against its contextDigest, so one tenant can poison another's cached build; --single-tenant accepts that for one trusted tenant")
	}
	if kc.TenantRegistrySecret != "" {
		if !strings.Contains(kc.TenantRegistrySecret, "{tenant}") {
			return usageErr("--tenant-registry-secret %q must contain {tenant}", kc.TenantRegistrySecret)
		}
	} else if kc.RegistrySecret != "" && !c.oneTenant() {
		return usageErr("--registry-secret %s would be mounted into every tenant's build Pods, where a RUN step can read it and push anywhere it may: give each tenant its own Secret (--tenant-registry-secret buildq-registry-{tenant} with --tenant-registry-configs), or pass --single-tenant for one trusted tenant", kc.RegistrySecret)
	}
	if kc.CacheRepo != "" && !strings.Contains(kc.CacheRepo, "{tenant}") {
		switch {
		case kc.TenantRegistrySecret != "":
			// Whoever the tenants are: per-tenant Secrets that could all
			// push to one repository would share what they exist to keep
			// apart.
			return usageErr("--cache-repo %q must contain {tenant} with --tenant-registry-secret: each tenant's Secret pushes to that tenant's repositories only, and one cache repository for all would need a push right every tenant's build Pod holds, where a RUN step could poison the cache for all", kc.CacheRepo)
		case !c.oneTenant():
			return usageErr("--cache-repo %q must contain {tenant}: one cache repository for all would need a push right every tenant's build Pod holds, and a RUN step could poison the cache for all (--single-tenant accepts it for one trusted tenant)", kc.CacheRepo)
		}
	}
	if err := c.namingToCheck().Validate(); err != nil {
		return usageErr("%v", err)
	}
	kc = kc.Defaults()
	if err := kc.Validate(); err != nil {
		return usageErr("%v", err)
	}
	c.job = kc
	return nil
}

// validateWorkerCredentials checks the flags that give the worker its own
// credentials; dev's are its stack's.
func (c *serveConfig) validateWorkerCredentials() error {
	if (c.kaniko.TenantRegistrySecret == "") != (c.tenantRegistryConfigs == "") {
		return usageErr("--tenant-registry-secret and --tenant-registry-configs go together: the build Pods and the worker's own registry calls use the same per-tenant credentials")
	}
	if c.kaniko.FetchImage != "" && (c.kaniko.S3Endpoint == "" || c.s3AccessKey == "" || c.s3SecretKey == "") {
		return usageErr("--fetch-image needs --s3-endpoint (as the build Pods reach it) and --s3-access-key/--s3-secret-key (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY): the worker signs each context's URL")
	}
	if len(c.git.allowedHosts) > 0 && c.kaniko.FetchImage == "" {
		return usageErr("--allowed-git-host needs --fetch-image and the worker's S3 keys: the worker stores each packed git source as an S3 context, which the build Pods fetch and verify")
	}
	return nil
}

func checkImageDigest(flag, img string) error {
	if _, err := name.NewDigest(img, name.StrictValidation); err != nil {
		return usageErr("%s %q is not pinned by digest: use repo@sha256:<64 hex> (%v)", flag, img, err)
	}
	return nil
}

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

// parseLogFlags checks --log-level and --log-format.
func parseLogFlags(level, format string) (zapcore.Level, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return lvl, usageErr("--log-level: %v", err)
	}
	if format != "json" && format != "console" {
		return lvl, usageErr("--log-format must be json or console, got %q", format)
	}
	return lvl, nil
}
