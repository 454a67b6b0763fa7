package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/buildq/buildq/internal/gateway"
)

// gatewayFlags are `buildq gateway`'s flags.
type gatewayFlags struct {
	config          string
	addr            string
	metricsAddr     string
	natsURL         string
	natsTLSCA       string
	tlsCert         string
	tlsKey          string
	tlsClientCA     string
	maxEventBytes   int64
	maxWebhookBytes int64
	publishTimeout  time.Duration
	shutdownTimeout time.Duration
	maxInFlight     int
	maxConnections  int
	logLevel        string
	logFormat       string
}

func newGatewayCmd() *cobra.Command {
	var g gatewayFlags
	cmd := &cobra.Command{
		Use:   "gateway --config FILE",
		Short: "Take build requests over HTTP: CloudEvents and GitHub/GitLab push webhooks",
		Long: `Run the event ingress: a stateless HTTP service that publishes build
requests for producers that cannot speak NATS. Run any number of replicas.

  POST /                       a CloudEvent, binary or structured mode, of type
                               dev.buildq.build.requested.v1 whose data is a build
                               request (api/v1.Request JSON)
  POST /hooks/github/<tenant>  a GitHub webhook (X-Hub-Signature-256)
  POST /hooks/gitlab/<tenant>  a GitLab webhook (X-Gitlab-Token)
  GET  /healthz, /readyz, /metrics

A request is answered 202 with its request id once JetStream has stored it.
A CloudEvent needs a tenant's bearer token (Authorization: Bearer ...) or
client certificate, and may only name that tenant (403 otherwise). Webhook
pushes become one request per matching trigger of the tenant, pinned to the
pushed ref and commit. Redelivered events and webhooks store nothing new:
request ids and Nats-Msg-Id headers are derived from the event (source and
id) or the push itself (repository, ref, before, after; never a delivery
header, which no webhook signature covers), and JetStream drops the
duplicate. A requestId starting with gh- or gl- (the webhooks' prefixes) is
refused (422).

--max-in-flight caps the POST requests handled at once (503 with
Retry-After beyond, the body unread) and --max-connections the connections
open at once (more wait to be accepted): request bodies in flight take at
most --max-in-flight x --max-webhook-bytes of memory.

--config is a YAML file listing the tenants: their tokens (SHA-256 hashes)
or certificate subjects, webhook secret files, triggers, and each tenant's
own NATS identity (credsFile, nkeySeedFile, or user and passwordFile): each
tenant's requests go over its own connection, so its NATS account's
permissions hold. See README.md ("Event gateway") for the format.

Every flag can also be set as BUILDQ_<FLAG>; --nats-url also reads NATS_URL.`,
		Example: `  buildq gateway --config /etc/buildq/gateway/gateway.yaml --nats-url nats://nats:4222
  buildq gateway --config gateway.yaml --addr :8443 --tls-cert tls.crt --tls-key tls.key --tls-client-ca clients.crt`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := bindEnv(cmd, natsEnv); err != nil {
				return err
			}
			s, tlsConf, err := g.validate()
			if err != nil {
				return err
			}
			return runGateway(cmd.Context(), &g, s, tlsConf)
		},
	}
	g.register(cmd.Flags())
	return cmd
}

func (g *gatewayFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&g.config, "config", "", "the gateway's configuration file (YAML): tenants, their credentials, webhook secrets, triggers and NATS identities")
	fs.StringVar(&g.addr, "addr", ":8080", "listen address of the gateway's HTTP (HTTPS with --tls-cert) server")
	fs.StringVar(&g.metricsAddr, "metrics-addr", "", "also serve /metrics, /healthz and /readyz, plain HTTP, on this address, e.g. :9090 for probes and scrapes (default: off; --addr serves them too)")
	fs.StringVar(&g.natsURL, "nats-url", defaultNATSURL, "NATS server URL(s), comma-separated (also NATS_URL)")
	fs.StringVar(&g.natsTLSCA, "nats-tls-ca", "", "CA certificate to verify the NATS server")
	fs.StringVar(&g.tlsCert, "tls-cert", "", "serve HTTPS with this certificate (PEM)")
	fs.StringVar(&g.tlsKey, "tls-key", "", "the key of --tls-cert (PEM)")
	fs.StringVar(&g.tlsClientCA, "tls-client-ca", "", "CA certificates (PEM) that client certificates are verified against; a verified certificate whose subject a tenant lists acts as that tenant")
	fs.Int64Var(&g.maxEventBytes, "max-event-bytes", gateway.DefaultMaxEventBytes, "largest CloudEvent body accepted (413 beyond)")
	fs.Int64Var(&g.maxWebhookBytes, "max-webhook-bytes", gateway.DefaultMaxWebhookBytes, "largest webhook body accepted (413 beyond)")
	fs.DurationVar(&g.publishTimeout, "publish-timeout", gateway.DefaultPublishTimeout, "how long to wait for JetStream's acknowledgement before answering 503")
	fs.DurationVar(&g.shutdownTimeout, "shutdown-timeout", 25*time.Second, "on SIGTERM, how long requests in flight may take to finish")
	fs.IntVar(&g.maxInFlight, "max-in-flight", gateway.DefaultMaxInFlight, "most CloudEvents and webhooks handled at once (503 with Retry-After beyond); bodies in flight take at most this times --max-webhook-bytes of memory")
	fs.IntVar(&g.maxConnections, "max-connections", defaultMaxConnections, "most connections open at once on --addr; more wait to be accepted")
	fs.StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&g.logFormat, "log-format", "json", "log format: json or console")
}

// validate checks the flags and loads the configuration and the TLS
// material; every problem is a usage error (exit 2).
func (g *gatewayFlags) validate() (*gateway.Settings, *tls.Config, error) {
	if g.config == "" {
		return nil, nil, usageErr("--config is required: the YAML file that lists the tenants (see buildq gateway --help)")
	}
	if _, err := parseLogFlags(g.logLevel, g.logFormat); err != nil {
		return nil, nil, err
	}
	if (g.tlsCert == "") != (g.tlsKey == "") {
		return nil, nil, usageErr("--tls-cert and --tls-key go together")
	}
	if g.tlsClientCA != "" && g.tlsCert == "" {
		return nil, nil, usageErr("--tls-client-ca needs --tls-cert and --tls-key: client certificates come over TLS")
	}
	if g.maxEventBytes <= 0 || g.maxWebhookBytes <= 0 || g.publishTimeout <= 0 || g.shutdownTimeout < 0 {
		return nil, nil, usageErr("--max-event-bytes, --max-webhook-bytes and --publish-timeout must be positive, --shutdown-timeout not negative")
	}
	if g.maxInFlight <= 0 || g.maxConnections <= 0 {
		return nil, nil, usageErr("--max-in-flight and --max-connections must be positive")
	}
	s, err := gateway.Load(g.config)
	if err != nil {
		return nil, nil, usageErr("--config %s:\n%v", g.config, err)
	}
	if err := s.ProductionProblems(); err != nil {
		return nil, nil, usageErr("--config %s:\n%v", g.config, err)
	}
	if s.HasClientCertSubjects() && g.tlsClientCA == "" {
		return nil, nil, usageErr("--config %s: tenants authenticate by client certificate (auth.clientCertSubjects): give --tls-cert, --tls-key and --tls-client-ca", g.config)
	}
	if g.tlsCert == "" {
		return s, nil, nil
	}
	cert, err := tls.LoadX509KeyPair(g.tlsCert, g.tlsKey)
	if err != nil {
		return nil, nil, usageErr("--tls-cert/--tls-key: %v", err)
	}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if g.tlsClientCA != "" {
		pem, err := os.ReadFile(g.tlsClientCA)
		if err != nil {
			return nil, nil, usageErr("--tls-client-ca: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, nil, usageErr("--tls-client-ca %s holds no PEM certificate", g.tlsClientCA)
		}
		// A certificate is optional (tokens work over TLS too); one that
		// is given must verify.
		tc.ClientAuth, tc.ClientCAs = tls.VerifyClientCertIfGiven, pool
	}
	return s, tc, nil
}

// runGateway serves the gateway until ctx ends, then drains the requests
// in flight (up to --shutdown-timeout) and closes the NATS connections.
func runGateway(ctx context.Context, g *gatewayFlags, s *gateway.Settings, tlsConf *tls.Config) error {
	log, err := newLogger(g.logLevel, g.logFormat)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	var natsOpts []nats.Option
	if g.natsTLSCA != "" {
		natsOpts = append(natsOpts, nats.RootCAs(g.natsTLSCA))
	}
	links := map[string]*gateway.Link{}
	defer func() {
		for _, l := range links {
			l.Close()
		}
	}()
	names := make([]string, 0, len(s.Tenants))
	for _, t := range s.Tenants {
		l, err := gateway.DialTenant(g.natsURL, t, log.Named("nats"), natsOpts...)
		if err != nil {
			return failed(err)
		}
		links[t.Name] = l
		names = append(names, t.Name)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	gw, err := gateway.New(gateway.Options{
		Tenants: s.Tenants, Links: links, MsgIDKey: s.MsgIDKey, Registry: reg, Logger: log.Named("gateway"),
		MaxEventBytes: g.maxEventBytes, MaxWebhookBytes: g.maxWebhookBytes, PublishTimeout: g.publishTimeout,
		MaxInFlight: g.maxInFlight,
	})
	if err != nil {
		return failed(err)
	}

	servers := []*serving{{name: "--addr", addr: g.addr, handler: gw, tls: tlsConf, maxConns: g.maxConnections}}
	if g.metricsAddr != "" {
		ops := http.NewServeMux()
		for _, p := range []string{"GET /metrics", "GET /healthz", "GET /readyz"} {
			ops.Handle(p, gw)
		}
		servers = append(servers, &serving{name: "--metrics-addr", addr: g.metricsAddr, handler: ops})
	}
	errc := make(chan error, len(servers))
	for _, sv := range servers {
		if err := sv.listen(log, g.publishTimeout); err != nil {
			for _, o := range servers {
				o.close()
			}
			return failed(err)
		}
		go func() { errc <- sv.serve() }()
	}
	log.Info("buildq gateway serving", zap.String("addr", servers[0].url()), zap.Strings("tenants", names),
		zap.String("nats", g.natsURL), zap.Bool("tls", tlsConf != nil), zap.Bool("clientCerts", tlsConf != nil && tlsConf.ClientCAs != nil))

	select {
	case <-ctx.Done():
	case err := <-errc:
		for _, o := range servers {
			o.close()
		}
		return failed(err)
	}
	log.Info("shutting down: finishing the requests in flight", zap.Duration("timeout", g.shutdownTimeout))
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), g.shutdownTimeout)
	defer cancel()
	var errs []error
	for _, sv := range servers {
		if err := sv.srv.Shutdown(sctx); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", sv.name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		log.Warn("requests still in flight at the shutdown timeout were cut off", zap.Error(err))
	}
	return nil
}

// serving is one of the gateway's HTTP servers.
type serving struct {
	name    string
	addr    string
	handler http.Handler
	tls     *tls.Config
	// maxConns caps the connections open at once (0: no cap).
	maxConns int
	ln       net.Listener
	srv      *http.Server
}

// defaultMaxConnections is --max-connections' default: with the headers
// of each (at most 64 KiB while they are read, for up to
// ReadHeaderTimeout), about 64 MiB.
const defaultMaxConnections = 1024

func (sv *serving) listen(log *zap.Logger, publishTimeout time.Duration) error {
	ln, err := net.Listen("tcp", sv.addr)
	if err != nil {
		return fmt.Errorf("%s %s: %w", sv.name, sv.addr, err)
	}
	if sv.maxConns > 0 {
		ln = gateway.LimitListener(ln, sv.maxConns)
	}
	sv.ln = ln
	sv.srv = &http.Server{
		Handler:           sv.handler,
		TLSConfig:         sv.tls,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       time.Minute,
		WriteTimeout:      publishTimeout + time.Minute,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          zap.NewStdLog(log.Named("http")),
	}
	return nil
}

func (sv *serving) serve() error {
	var err error
	if sv.tls != nil {
		err = sv.srv.ServeTLS(sv.ln, "", "")
	} else {
		err = sv.srv.Serve(sv.ln)
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("%s: %w", sv.name, err)
}

func (sv *serving) close() {
	if sv.srv != nil {
		_ = sv.srv.Close()
	} else if sv.ln != nil {
		_ = sv.ln.Close()
	}
}

func (sv *serving) url() string {
	scheme := "http"
	if sv.tls != nil {
		scheme = "https"
	}
	return scheme + "://" + sv.ln.Addr().String()
}

// devGateway is `buildq dev`'s gateway (--gateway-addr, --gateway-config):
// on loopback only, publishing over dev's own NATS, and taking CloudEvents
// without credentials for the tenant the request names.
type devGateway struct {
	addr     string
	config   string
	settings *gateway.Settings
	// optional: the address is the default one, so dev goes on without a
	// gateway when it is taken.
	optional bool
}

// defaultDevGatewayAddr is where `buildq dev` serves the gateway (DESIGN §3).
const defaultDevGatewayAddr = "127.0.0.1:8088"

func (g *devGateway) register(fs *pflag.FlagSet) {
	fs.StringVar(&g.addr, "gateway-addr", defaultDevGatewayAddr, "the event gateway's listen address (loopback only): CloudEvents need no credentials here; empty: no gateway")
	fs.StringVar(&g.config, "gateway-config", "", "the gateway's configuration file (as buildq gateway --config): its tenants' webhooks and triggers (and tokens, checked when given); requests go over dev's NATS")
}

// validate checks the flags and loads --gateway-config.
func (g *devGateway) validate() error {
	if g.addr == "" {
		if g.config != "" {
			return usageErr("--gateway-config needs --gateway-addr")
		}
		return nil
	}
	host, _, err := net.SplitHostPort(g.addr)
	if err != nil {
		return usageErr("--gateway-addr %s: %v", g.addr, err)
	}
	if host != "localhost" && len(nonLoopback(g.addr)) > 0 {
		return usageErr("--gateway-addr %s: dev's gateway takes CloudEvents without credentials, so it listens on a loopback address only (127.0.0.1:8088); run buildq gateway for a reachable one", g.addr)
	}
	g.optional = g.addr == defaultDevGatewayAddr
	if g.config != "" {
		if g.settings, err = gateway.Load(g.config); err != nil {
			return usageErr("--gateway-config %s:\n%v", g.config, err)
		}
	}
	return nil
}

// start serves the gateway over dev's NATS at natsURL until stop is
// called. url is "" when the gateway is off. When the default address is
// taken (another buildq dev, another program), dev goes on without a
// gateway and says so; an address given otherwise must be free.
func (g *devGateway) start(natsURL string, log *zap.Logger) (url string, stop func(), err error) {
	if g.addr == "" {
		return "", func() {}, nil
	}
	sv := &serving{name: "--gateway-addr", addr: g.addr}
	if err := sv.listen(log, gateway.DefaultPublishTimeout); err != nil {
		if g.optional && errors.Is(err, syscall.EADDRINUSE) {
			log.Warn("no event gateway: its address is in use; pass --gateway-addr ADDR (or '' for none)", zap.String("addr", g.addr))
			return "", func() {}, nil
		}
		return "", nil, failed(err)
	}
	shared, err := gateway.Dial(natsURL, "buildq-dev-gateway", log)
	if err != nil {
		sv.close()
		return "", nil, failed(err)
	}
	key := make([]byte, 32)
	if _, err := io.ReadFull(rand.Reader, key); err != nil {
		sv.close()
		shared.Close()
		return "", nil, failed(err)
	}
	opts := gateway.Options{Shared: shared, Open: true, MsgIDKey: key, Logger: log}
	if g.settings != nil {
		opts.Tenants = g.settings.Tenants
		if g.settings.MsgIDKey != nil {
			opts.MsgIDKey = g.settings.MsgIDKey
		}
	}
	gw, err := gateway.New(opts)
	if err != nil {
		sv.close()
		shared.Close()
		return "", nil, failed(err)
	}
	sv.srv.Handler = gw
	go func() {
		if err := sv.serve(); err != nil {
			log.Error("gateway", zap.Error(err))
		}
	}()
	return sv.url(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = sv.srv.Shutdown(ctx)
		shared.Close()
	}, nil
}
