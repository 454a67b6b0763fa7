package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

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
	kaniko       kaniko.Config
	namingPol    naming.Policy
	logLevel     string
	logFormat    string
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

With --kubeconfig the worker launches kaniko Jobs on that cluster instead
(RUN works there); the cluster must reach the S3 store and the registry
(pass --s3-endpoint and --registry as the cluster sees them).

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
	registerKaniko(fs, &f.kaniko, &f.namingPol)
	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&f.logFormat, "log-format", "console", "log format: console or json")
	return cmd
}

func runDev(ctx context.Context, stderr io.Writer, f *devFlags) error {
	log, err := newLogger(f.logLevel, f.logFormat)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()

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
	})
	if err != nil {
		return failed(err)
	}
	defer func() {
		if err := stack.Close(); err != nil {
			log.Warn("stopping the stack", zap.Error(err))
		}
	}()

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
		if kc.S3Endpoint == "" {
			kc.S3Endpoint = stack.S3Endpoint
		}
		if len(kc.InsecureRegistries) == 0 && f.namingPol.Registry == "" {
			// The dev registry speaks plain HTTP.
			kc.InsecureRegistries = []string{stack.RegistryAddr}
		}
		kb, stopKube, err := kubeBackend(ctx, f.kubeconfig, kc, log)
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
		backend = worker.NewLocalBackend(store, reg, work, contexttar.DefaultMaxBytes)
	}

	np := f.namingPol
	if np.Registry == "" {
		np.Registry = stack.RegistryAddr
	}
	if len(np.Allowed) == 0 {
		// One user on a laptop: any repository of the dev registry. A
		// multi-tenant worker confines each tenant (buildq worker).
		np.Allowed = []string{"{registry}/**"}
	}
	nc, err := nats.Connect(stack.NATSURL, nats.Name("buildq-dev-worker"), nats.MaxReconnects(-1))
	if err != nil {
		return failed(err)
	}
	defer nc.Close()
	cfg := worker.Config{
		ID: "dev", MaxInFlight: f.inFlight, Storage: jetstream.FileStorage, Naming: np, Registry: reg,
		ContextPrefix: "contexts/{tenant}/",
		Logger:        log.Named("worker"), ShutdownTimeout: 5 * time.Second,
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
