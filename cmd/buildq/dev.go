package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/devstack"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker"
)

// devFlags configure `buildq dev`.
type devFlags struct {
	data         string
	natsAddr     string
	s3Addr       string
	registryAddr string
	inFlight     int
	kubeconfig   string
	jobTemplate  string
	unsafeListen bool
	kaniko       kaniko.Config
	namingPol    naming.Policy
	logLevel     string
	logFormat    string
	fair         worker.FairConfig
}

func newDevCmd() *cobra.Command {
	var f devFlags
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the whole stack in one process: NATS, S3, a registry and a worker",
		Long: `Run buildq on a laptop or in CI, in one process, with nothing to install:

  - NATS with JetStream                 (--nats-addr, default 127.0.0.1:4222)
  - an S3-compatible store               (--s3-addr, default 127.0.0.1:9000)
  - an OCI registry, plain HTTP          (--registry-addr, default 127.0.0.1:5000)
  - a worker with the local executor: a daemonless, in-process builder that
    runs FROM, COPY/ADD, ENV, ARG, LABEL, WORKDIR, USER, EXPOSE, ENTRYPOINT,
    CMD and multi-stage builds, but not RUN.

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
image. NATS always stays on loopback. Without --s3-secret, dev writes the
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
			return runDev(cmd.Context(), cmd.ErrOrStderr(), &f)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.data, "data", "", "directory for NATS, S3 and registry data (default: a temporary directory, removed at exit)")
	fs.StringVar(&f.natsAddr, "nats-addr", "127.0.0.1:4222", "NATS listen address")
	fs.StringVar(&f.s3Addr, "s3-addr", "127.0.0.1:9000", "S3 listen address")
	fs.StringVar(&f.registryAddr, "registry-addr", "127.0.0.1:5000", "registry listen address")
	fs.IntVar(&f.inFlight, "max-in-flight", 4, "builds run at once")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "launch kaniko Jobs on this cluster instead of building in-process")
	fs.StringVar(&f.jobTemplate, "job-template", "", "with --kubeconfig: "+jobTemplateHelp)
	fs.BoolVar(&f.unsafeListen, "unsafe-listen", false, "let --s3-addr and --registry-addr be non-loopback addresses a cluster's Pods can reach; both have no authentication")
	registerKaniko(fs, &f.kaniko, &f.namingPol)
	registerFair(fs, &f.fair)
	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&f.logFormat, "log-format", "console", "log format: console or json")
	return cmd
}

// devS3Secret holds the dev S3 store's fixed keys for the build Jobs.
const devS3Secret = "buildq-dev-s3"

// ensureDevS3Secret creates or updates devS3Secret in the Jobs' namespace.
func ensureDevS3Secret(ctx context.Context, kubeconfig, namespace string) error {
	rc, err := restConfig(kubeconfig)
	if err != nil {
		return failed(fmt.Errorf("kubernetes config: %w", err))
	}
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
		return failed(fmt.Errorf("secret %s/%s with the dev S3 keys (or pass --s3-secret): %w", namespace, devS3Secret, err))
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

func runDev(ctx context.Context, stderr io.Writer, f *devFlags) error {
	log, err := newLogger(f.logLevel, f.logFormat)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	if f.jobTemplate != "" && f.kubeconfig == "" {
		return usageErr("--job-template shapes kaniko Jobs: it needs --kubeconfig")
	}

	dataDir, temporary := f.data, false
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
		DataDir: dataDir, NATSAddr: f.natsAddr, S3Addr: f.s3Addr, RegistryAddr: f.registryAddr, Logger: log.Named("stack"),
		UnsafeListen: f.unsafeListen,
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
	if f.kubeconfig != "" {
		kc := f.kaniko
		if err := checkExecutorImage(kc.ExecutorImage); err != nil {
			return err
		}
		if kc, err = applyJobTemplate(kc, f.jobTemplate); err != nil {
			return err
		}
		if kc.S3Endpoint == "" {
			kc.S3Endpoint = stack.S3Endpoint
		}
		if kc.S3Secret == "" {
			// kaniko's S3 client needs keys; the dev store's are fixed and
			// public, so dev puts them in a Secret of its own.
			if err := ensureDevS3Secret(ctx, f.kubeconfig, kc.Namespace); err != nil {
				return err
			}
			kc.S3Secret = devS3Secret
		}
		if len(kc.InsecureRegistries) == 0 && f.namingPol.Registry == "" {
			// The dev registry speaks plain HTTP.
			kc.InsecureRegistries = []string{stack.RegistryAddr}
		}
		kb, stopKube, err := kubeBackend(ctx, f.kubeconfig, defaultKubeQPS, defaultKubeBurst, kc, log)
		if err != nil {
			return err
		}
		defer stopKube()
		backend = kb.WithDigestResolver(reg.Head)
		executor = "kaniko Jobs in namespace " + kc.Namespace
	} else {
		work := filepath.Join(dataDir, "work")
		if err := os.MkdirAll(work, 0o755); err != nil {
			return failed(err)
		}
		backend = worker.NewLocalBackend(store, reg, work, contexttar.DefaultMaxBytes).WithAllowedRegistries(f.namingPol.Registries)
	}

	np := f.namingPol
	if np.Registry == "" {
		np.Registry = stack.RegistryAddr
	}
	// The same destination policy as a worker's (np.AllowedPatterns): a
	// tenant pushes only to its own part of the registry, by default
	// {registry}/{tenant}/**, so the policy can be tried locally.
	// --allowed-destination '{registry}/**' lets any tenant push anywhere.
	nc, err := nats.Connect(stack.NATSURL, nats.Name("buildq-dev-worker"), nats.MaxReconnects(-1))
	if err != nil {
		return failed(err)
	}
	defer nc.Close()
	cfg := worker.Config{
		ID: "dev", MaxInFlight: f.inFlight, Storage: jetstream.FileStorage, Naming: np, Registry: reg,
		ContextPrefix: "contexts/{tenant}/", Fair: f.fair,
		// dev's NATS has no authentication: every client is trusted, and
		// third-party tools (nats req) may use any inbox.
		AnyReply: true,
		// Tenants are answered from one another's builds only for content
		// they hold, as with a worker.
		Contexts: store,
		Logger:   log.Named("worker"), ShutdownTimeout: 5 * time.Second,
	}
	w, err := worker.New(nc, backend, cfg)
	if err != nil {
		return usageErr("%v", err)
	}
	if err := w.Setup(ctx); err != nil {
		return failed(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()

	keep := dataDir
	if temporary {
		keep += " (temporary; pass --data to keep images across restarts)"
	}
	fmt.Fprintf(stderr, "buildq dev ready  nats=%s  s3=%s (bucket %s)  registry=%s  executor=%s  data=%s\n",
		stack.NATSURL, stack.S3Endpoint, stack.Bucket, stack.RegistryAddr, executor, keep)

	err = <-done
	fmt.Fprintln(stderr, "buildq dev stopping")
	if err != nil {
		return failed(err)
	}
	return nil
}
