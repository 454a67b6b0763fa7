package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/devstack"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker"
)

func newDevCmd() *cobra.Command {
	var c serveConfig
	var gw devGateway // the event gateway (gateway.go)
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the whole stack in one process: NATS, S3, a registry and a worker",
		Long: `Run buildq on a laptop or in CI, in one process, with nothing to install:

  - NATS with JetStream                 (--nats-addr, default 127.0.0.1:4222)
  - an S3-compatible store               (--s3-addr, default 127.0.0.1:9000)
  - an OCI registry, plain HTTP          (--registry-addr, default 127.0.0.1:5000)
  - the event gateway: CloudEvents over HTTP and push webhooks, as
    buildq gateway, without credentials  (--gateway-addr, default 127.0.0.1:8088)
  - a worker with the local executor: a daemonless, in-process builder that
    runs FROM, COPY/ADD, ENV, ARG, LABEL, WORKDIR, USER, EXPOSE, ENTRYPOINT,
    CMD and multi-stage builds, but not RUN. It builds git sources too
    (buildq submit --git URL --ref REF): it fetches from any host, loopback
    included, unless --allowed-git-host narrows that.

A tenant pushes only to its own part of the registry, as with a worker:
{registry}/{tenant}/** by default (submit without --image names
{registry}/{tenant}/{name}); --allowed-destination '{registry}/**' lets any
tenant push anywhere in it.

With --kubeconfig the worker launches kaniko Jobs on that cluster instead
(RUN works there). The build Pods must reach the S3 store and the registry,
and a cluster's Pods cannot reach this machine's 127.0.0.1 (kind and k3d
included): give --s3-addr and --registry-addr an address of this machine
that the Pods reach (for kind, the gateway of its "kind" docker network),
together with --unsafe-listen. That exposes both with NO authentication:
anyone who reaches those addresses can read and replace every context and
image. NATS always stays on loopback. Without --s3-credentials-secret, dev writes the
dev store's fixed keys into a Secret "buildq-dev-s3" of --namespace for the
Jobs to read.

Everything is kept under --data (a temporary directory when not given, removed
at exit): a second start on the same --data keeps the images and the dedupe
index. It prints one ready line with every endpoint; Ctrl-C stops it.

In another terminal:
  buildq submit ./examples/static-site --wait`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := bindEnv(cmd, nil); err != nil {
				return err
			}
			if err := c.Validate(); err != nil {
				return err
			}
			if err := gw.validate(); err != nil {
				return err
			}
			return runDev(cmd.Context(), cmd.ErrOrStderr(), &c, &gw)
		},
	}
	c.registerDev(cmd.Flags())
	groupedUsage(cmd)
	gw.register(cmd.Flags())
	return cmd
}

// devS3Secret holds the dev S3 store's fixed keys for the build Jobs.
const devS3Secret = "buildq-dev-s3"

// ensureDevS3Secret creates or updates devS3Secret in the Jobs' namespace.
func ensureDevS3Secret(ctx context.Context, rc *rest.Config, namespace string) error {
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return failed(fmt.Errorf("kubernetes client: %w", err))
	}
	sec := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: devS3Secret, Namespace: namespace, Labels: map[string]string{kaniko.LabelManagedBy: kaniko.ManagedByValue}},
		Type:       corev1.SecretTypeOpaque,
		Data:       map[string][]byte{"AWS_ACCESS_KEY_ID": []byte(devstack.DevAccessKey), "AWS_SECRET_ACCESS_KEY": []byte(devstack.DevSecretKey)},
	}
	secrets := client.CoreV1().Secrets(namespace)
	_, err = secrets.Create(ctx, sec, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		_, err = secrets.Update(ctx, sec, metav1.UpdateOptions{})
	}
	if err != nil {
		return failed(fmt.Errorf("secret %s/%s with the dev S3 keys (or pass --s3-credentials-secret): %w", namespace, devS3Secret, err))
	}
	return nil
}

// nonLoopback lists the addresses that are not on a loopback interface.
func nonLoopback(addrs ...string) []string {
	var out []string
	for _, a := range addrs {
		host, _, err := net.SplitHostPort(a)
		if ip := net.ParseIP(host); err != nil || ip == nil || !ip.IsLoopback() {
			out = append(out, a)
		}
	}
	return out
}

// runDev runs the stack and its worker from a validated configuration
// until ctx ends.
func runDev(ctx context.Context, stderr io.Writer, c *serveConfig, gw *devGateway) error {
	log, err := newLogger(c.logLevel, c.logFormat)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	if err := checkScanner(c.sbom.Path); err != nil {
		return usageErr("--sbom-scanner: %v", err)
	}
	var rc *rest.Config
	if c.kubeconfig != "" {
		// Before anything starts: a bad --kubeconfig stops dev at once.
		if rc, err = restConfig(c.kubeconfig); err != nil {
			return err
		}
	}

	dataDir, temporary := c.dev.data, false
	if dataDir == "" {
		dataDir, err = os.MkdirTemp("", "buildq-dev-")
		if err != nil {
			return failed(err)
		}
		temporary = true
		defer os.RemoveAll(dataDir)
	}
	if dataDir, err = filepath.Abs(dataDir); err != nil {
		return failed(err)
	}
	stack, err := devstack.Start(ctx, devstack.Options{
		DataDir: dataDir, NATSAddr: c.dev.natsAddr, S3Addr: c.dev.s3Addr, RegistryAddr: c.dev.registryAddr, Logger: log.Named("stack"),
		UnsafeListen: c.dev.unsafeListen,
	})
	if err != nil {
		return failed(err)
	}
	defer func() {
		if err := stack.Close(); err != nil {
			log.Warn("stopping the stack", zap.Error(err))
		}
	}()
	if exposed := nonLoopback(strings.TrimPrefix(stack.S3Endpoint, "http://"), stack.RegistryAddr); len(exposed) > 0 {
		fmt.Fprintf(stderr, "WARNING: --unsafe-listen: %s listen with NO authentication; anyone who reaches them can read and replace every context and image of this stack\n",
			strings.Join(exposed, " and "))
	}

	// Every build is attested with the data directory's key pair, made on
	// the first start; `buildq verify IMAGE --key <data>/signing.pub`.
	signer, _, err := attest.EnsureKeyPair(dataDir)
	if err != nil {
		return failed(err)
	}
	reg, err := registry.New(registry.Options{Insecure: []string{stack.RegistryAddr}})
	if err != nil {
		return failed(err)
	}
	store, err := s3store.New(s3store.Config{Endpoint: stack.S3Endpoint, AccessKey: stack.S3AccessKey, SecretKey: stack.S3SecretKey, Bucket: stack.Bucket})
	if err != nil {
		return failed(err)
	}

	var backend worker.Backend
	executor := "local (in-process; RUN needs --kubeconfig)"
	if c.kubeconfig != "" {
		kc := c.job
		if kc.S3Endpoint == "" {
			kc.S3Endpoint = stack.S3Endpoint
		}
		if kc.S3Secret == "" {
			// kaniko's S3 client needs keys; the dev store's are fixed and
			// public, so dev puts them in a Secret of its own.
			if err := ensureDevS3Secret(ctx, rc, kc.Namespace); err != nil {
				return err
			}
			kc.S3Secret = devS3Secret
		}
		var presign worker.Presigner
		if kc.FetchImage != "" {
			// The fetch-context init container reads the context
			// through a URL signed with the dev store's keys.
			presign = store.PresignGet
		}
		if len(kc.InsecureRegistries) == 0 && c.naming.Registry == "" {
			// The dev registry speaks plain HTTP.
			kc.InsecureRegistries = []string{stack.RegistryAddr}
		}
		kb, stopKube, err := kubeBackend(ctx, rc, float32(c.kubeQPS), c.kubeBurst, kc, log)
		if err != nil {
			return err
		}
		defer stopKube()
		backend = kb.WithPresigner(presign)
		executor = "kaniko Jobs in namespace " + kc.Namespace
	} else {
		work := filepath.Join(dataDir, "work")
		if err := os.MkdirAll(work, 0o755); err != nil {
			return failed(err)
		}
		backend = worker.NewLocalBackend(store, reg, work, contexttar.DefaultMaxBytes).WithAllowedRegistries(c.naming.Registries)
	}

	cfg := c.worker
	// The same destination policy as a worker's (np.AllowedPatterns): a
	// tenant pushes only to its own part of the registry, by default
	// {registry}/{tenant}/**, so the policy can be tried locally.
	// --allowed-destination '{registry}/**' lets any tenant push anywhere.
	cfg.Naming = c.naming
	if cfg.Naming.Registry == "" {
		cfg.Naming.Registry = stack.RegistryAddr
	}
	cfg.Registry = reg
	att := &worker.SigningAttestor{Signer: signer, BuilderID: c.builderID}
	cfg.Attestor = att
	if c.sbom.Path != "" {
		att.Scanner = &c.sbom
		cfg.SBOM = att
	}
	// Tenants are answered from one another's builds only for content
	// they hold, as with a worker.
	cfg.Contexts = store
	cfg.Logs.Archive = store
	cfg.GitSources = c.git.packer(store, true, "")
	cfg.Logger = log.Named("worker")
	nc, err := nats.Connect(stack.NATSURL, nats.Name("buildq-dev-worker"), nats.MaxReconnects(-1), nats.ReconnectBufSize(-1))
	if err != nil {
		return failed(err)
	}
	defer nc.Close()
	w, err := worker.New(nc, backend, cfg)
	if err != nil {
		return usageErr("%v", err)
	}
	if err := w.Setup(ctx); err != nil {
		return failed(err)
	}
	// The event gateway, publishing over dev's NATS (gateway.go).
	gwURL, stopGateway, err := gw.start(stack.NATSURL, log.Named("gateway"))
	if err != nil {
		return err
	}
	defer stopGateway()
	if gwURL != "" {
		gwURL = "  gateway=" + gwURL
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()

	keep := dataDir
	if temporary {
		keep += " (temporary; pass --data to keep images across restarts)"
	}
	fmt.Fprintf(stderr, "buildq dev ready  nats=%s  s3=%s (bucket %s)  registry=%s%s  executor=%s  data=%s  signing-key=%s\n",
		stack.NATSURL, stack.S3Endpoint, stack.Bucket, stack.RegistryAddr, gwURL, executor, keep, filepath.Join(dataDir, attest.PublicKeyFile))

	err = <-done
	fmt.Fprintln(stderr, "buildq dev stopping")
	if err != nil {
		return failed(err)
	}
	return nil
}
